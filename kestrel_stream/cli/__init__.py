"""The ``kestrel-stream`` command line."""
from kestrel_stream.cli.main import main

__all__ = ["main"]
