"""The daemon: connections, the socket protocol, the step thread and the batcher glue."""
