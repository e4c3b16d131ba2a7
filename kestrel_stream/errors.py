"""Errors a user of kestrel-stream can meet; every one says what and where."""


class KestrelError(Exception):
    """Base of kestrel-stream's own errors."""
    code = "error"


class InvalidTokenError(KestrelError, ValueError):
    code = "invalid_token"


class CapacityError(KestrelError):
    """A session's KV cache (max_seq_len) or the engine's session/batch limit would be exceeded."""
    code = "capacity"


class SessionClosedError(KestrelError):
    code = "session_closed"


class DeviceError(KestrelError):
    """The requested device or mode cannot run here (no GPU, unsupported mode, budget too small)."""
    code = "device"


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor and the file."""
