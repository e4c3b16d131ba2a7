"""Observability: the trace recorder, the per-stage profile table, trace summaries and the timeline."""
