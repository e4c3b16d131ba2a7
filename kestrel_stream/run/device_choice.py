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


def gpu_count() -> int:
    """The GPUs this machine has (0 without a usable GPU or without the CUDA layer); never raises."""
    try:
        from kestrel_stream.cuda import driver
    except ImportError:
        return 0
    return driver.device_count()


def split_device(device: str) -> tuple[str, int]:
    """(kind, ordinal) of a device name: "cuda:N" is GPU N; auto, cpu and cuda (GPU 0) have ordinal 0."""
    kind, colon, number = device.partition(":")
    if not colon:
        return device, 0
    if kind != "cuda" or not number.isdigit():
        raise DeviceError(f"unknown device {device!r}; expected auto, cpu, cuda or cuda:N (N: a GPU's ordinal)")
    return kind, int(number)


def check_ordinal(ordinal: int) -> None:
    """DeviceError unless GPU `ordinal` exists here."""
    count = gpu_count()
    if ordinal >= count:
        raise DeviceError(f"device cuda:{ordinal} does not exist: this machine has {count} GPU(s)"
                          + (f" (cuda:0..cuda:{count - 1})" if count else ""))


def parse_mode(mode: str) -> str:
    """The canonical spelling of a mode (scheduler.parse_mode is the one parser); DeviceError if unknown."""
    import scheduler
    try:
        kind, count = scheduler.parse_mode(mode)
    except ValueError:
        raise DeviceError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}, layers=N or "
                          "layers=N+head") from None
    return scheduler.mode_name(kind, count)


def resolve_device(device: str, mode: str, announce: bool = True) -> tuple[str, str]:
    """Pick (device, mode) from what was asked and what this machine has; "cuda:N" is a GPU like "cuda" (the
    ordinal is split_device's)."""
    device = split_device(device)[0]
    if device not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"unknown device {device!r}; expected auto, cpu, cuda or cuda:N")
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
