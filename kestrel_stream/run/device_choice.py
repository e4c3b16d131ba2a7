"""Which device and mode an engine gets: what was asked for, and what this machine has."""
from __future__ import annotations

import sys

from kestrel_stream.errors import DeviceError

MODES = ("auto", "cpu", "gated", "gpu", "offload")


def gpu_status() -> tuple[bool, str]:
    """(available, reason): never raises, never hangs without a driver."""
    try:
        from kestrel_stream.cuda import driver
    except ImportError as e:          # the CUDA layer itself is missing
        return False, f"CUDA layer unavailable ({e})"
    return driver.gpu_status()


def parse_mode(mode: str) -> str:
    """The canonical spelling of a mode (scheduler.parse_mode is the one parser); DeviceError if unknown."""
    import scheduler
    try:
        kind, count = scheduler.parse_mode(mode)
    except ValueError:
        raise DeviceError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)} or layers=N") from None
    return f"layers={count}" if kind == "layers" else kind


def resolve_device(device: str, mode: str, announce: bool = True) -> tuple[str, str]:
    """Pick (device, mode) from what was asked and what this machine has."""
    if device not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"unknown device {device!r}; expected auto, cpu or cuda")
    mode = parse_mode(mode)
    if device == "cpu" or (device == "auto" and mode == "cpu"):
        if mode not in ("auto", "cpu"):
            raise DeviceError(f"mode {mode} needs a GPU, but device=cpu was asked for")
        return "cpu", "cpu"
    available, reason = gpu_status()
    if not available:
        if device == "cuda" or mode != "auto":
            raise DeviceError(f"no usable GPU: {reason}")
        if announce:        # one short line: the reason (often a long driver message) is gpu_status()'s
            print("kestrel-stream: no GPU found; using the CPU engine (details: "
                  "kestrel_stream.run.device_choice.gpu_status())", file=sys.stderr)
        return "cpu", "cpu"
    return "cuda", ("gpu" if mode == "auto" else mode)
