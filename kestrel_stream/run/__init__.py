"""Running steps: the engine and sessions, the executors, the residency window, greedy chaining."""
