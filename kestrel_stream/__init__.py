"""kestrel-stream: an asynchronous, stream-pipelined offload scheduler for LLM decode.

    import kestrel_stream as ks
    eng = ks.load(path, device="auto", mode="auto")
    s = eng.new_session()
    logits = s.prefill([1, 2, 3])      # float32 [3, vocab]
    logits = s.decode(42)              # float32 [vocab]
"""
from __future__ import annotations

from kestrel_stream.api import load
from kestrel_stream.model.config import ConfigError, ModelConfig
from kestrel_stream.run.engine import Engine, GenerateResult, Session, resolve_device
from kestrel_stream.errors import CapacityError, DeviceError, InvalidTokenError, KestrelError, SessionClosedError

__version__ = "0.1.0"


def __getattr__(name):
    # The daemon clients pull in anyio and sockets; import them only when asked for.
    if name in ("Client", "AsyncClient", "connect"):
        from kestrel_stream import client
        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["load", "Engine", "Session", "GenerateResult", "ModelConfig", "ConfigError", "KestrelError",
           "InvalidTokenError", "CapacityError", "SessionClosedError", "DeviceError"]
