"""``serve --devices``: the devices the daemon runs an engine on, one replica each, and loading them.

``--devices 0,1`` (or ``cuda:0,cuda:1``) is one replica per GPU;
``--devices cpu,cpu`` two CPU engines (the router's tests run on those).  A
list is checked where it enters, each error naming the flag and the value:
no device, a GPU named twice, a GPU this machine does not have, a word that
is neither, CPU engines and GPUs mixed, or a ``--device`` that says
otherwise.  The engines load one after the other; one that fails stops the
daemon with that replica's error, and those loaded before it are closed
first, so nothing is left running.  Then each is made ready: its prefix
cache, its plan logged, its draft's pass times measured.  Without ``--devices`` the daemon is the one
engine of ``--device`` it always was.
"""
from __future__ import annotations

from kestrel_stream.errors import DeviceError


def parse_devices(text: str) -> list[str]:
    """``--devices`` as device names ("cpu" or "cuda:N"), in order; ValueError naming the flag and the value."""
    words = [word.strip().lower() for word in text.split(",")]
    if not text.strip() or not all(words):
        raise ValueError(f"--devices {text!r}: expected a comma-separated list of GPU ordinals (0,1) or cpu "
                         f"(cpu,cpu), one replica each")
    devices = []
    for word in words:
        number = word.removeprefix("cuda:")
        if word == "cpu":
            devices.append("cpu")
        elif number.isdigit():
            devices.append(f"cuda:{int(number)}")
        else:
            raise ValueError(f"--devices {text!r}: {word!r} is neither a GPU ordinal (0, 1, cuda:1) nor cpu")
    gpus = [d for d in devices if d != "cpu"]
    if gpus and len(gpus) != len(devices):
        raise ValueError(f"--devices {text!r}: mixes CPU engines and GPUs; give GPUs (0,1) or CPU engines (cpu,cpu)")
    twice = next((d for i, d in enumerate(gpus) if d in gpus[:i]), None)
    if twice is not None:
        raise ValueError(f"--devices {text!r}: {twice} is named twice; one replica per GPU")
    return devices


def device_kind(devices: list[str]) -> str:
    return "cpu" if devices[0] == "cpu" else "cuda"


def serve_devices(args) -> list[str] | None:
    """The replicas' devices of ``serve --devices`` (None without it: one engine of --device), checked against
    --device and this machine; --device becomes their kind.  Before anything loads; ValueError or DeviceError
    naming the flag and the value."""
    if args.devices is None:
        return None
    from kestrel_stream.run.device_choice import gpu_count, gpu_status
    devices = parse_devices(args.devices)
    kind = device_kind(devices)
    if args.device not in ("auto", kind):
        raise ValueError(f"--devices {args.devices!r} names {'CPU engines' if kind == 'cpu' else 'GPUs'} but "
                         f"--device is {args.device}; leave --device out")
    if kind == "cuda":
        check_devices_exist(args.devices, devices, gpu_count(), gpu_status()[1])
    args.device = kind
    return devices


def check_devices_exist(text: str, devices: list[str], gpu_count: int, why_none: str = "") -> None:
    """DeviceError naming the flag and the value when a GPU of ``devices`` is not one of this machine's."""
    for device in devices:
        if device != "cpu" and int(device.partition(":")[2]) >= gpu_count:
            have = (f"this machine has {gpu_count} GPU(s), 0..{gpu_count - 1}" if gpu_count else
                    f"this machine has no usable GPU ({why_none}); --devices cpu,cpu runs CPU engines")
            raise DeviceError(f"--devices {text!r}: {device} does not exist: {have}")


def load_replicas(load_one, devices: list[str], text: str | None) -> list:
    """``load_one(device)`` for each device in turn.  One that raises closes the engines loaded before it, then
    raises that replica's error (a DeviceError naming it and the flag; with one device, the error as it is)."""
    engines = []
    try:
        for index, device in enumerate(devices):
            try:
                engines.append(load_one(device))
            except Exception as e:
                if len(devices) == 1:
                    raise
                raise DeviceError(f"--devices {text!r}: replica {index} ({device}) did not load: "
                                  f"{type(e).__name__}: {e}") from e
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


def make_ready(engines: list, devices: list[str] | None, prefix_positions: int, log) -> None:
    """Each engine's prefix cache (``prefix_positions``), its plan and preload logged (named by replica where
    there are several), and its draft's pass times measured now, before any request waits for them."""
    for index, engine in enumerate(engines):
        where = f"replica {index} ({devices[index]}) " if devices and len(devices) > 1 else ""
        engine.enable_prefix_cache(prefix_positions)
        log(f"{where}plan: {engine.plan_summary()}")
        if engine.executor.preload_line:
            log(where + engine.executor.preload_line)
        if engine.speculation is not None:
            engine.speculation.measure(engine)
            log(where + engine.speculation.describe())
