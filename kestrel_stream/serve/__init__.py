"""The daemon: connections, the step thread and the batcher glue; the socket protocol it speaks is wire/."""
