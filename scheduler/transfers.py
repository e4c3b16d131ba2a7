"""What a placed step moves between host and device, and when the host waits: the plan's H2D, D2H and syncs.

The rules are the executor's (kestrel_stream/run/mixed.py follows them through
`segment_inputs`), applied to the state each op of the step program declares:

- the step starts with no state anywhere; a device op of the KV cache or embed
  needs the step's params (token id, position, KV row: 16 bytes per token),
  uploaded once before the first device segment;
- entering a host segment downloads, with one sync, the state its ops read
  before writing it that only the device holds (`segment_inputs`);
- a device op uploads (without a sync) each state it reads that the device
  lacks; a projection whose prologue is a norm reads xn (x * norm weight and
  1/rms per token), written by the device epilogue that prepared this norm, or
  else computed on the host from x (downloaded first if only the device has
  it) and uploaded;
- the host waits for an upload still reading a pinned buffer before it
  rewrites that buffer (one sync), and the step ends with the logits on the
  host.

Counts go to the device segment current at the time (the first one for the
params); a streamed weight (the residency window) adds its image to its op's
segment's H2D.
"""
from __future__ import annotations

from .ops import FLOAT32_BYTES, FUSED_KINDS, PARAMS_BYTES_PER_TOKEN, STATE_FLOATS

DEVICE_ONLY = {"gpu"}


def host_reads(op) -> tuple:
    """The state a host op reads; the host part of a split group also reads the output it completes."""
    partial = op.full_rows and sum(w.shape[0] for w in op.weights) < op.full_rows
    return tuple(name for name in op.reads if name != "q") + (op.writes if partial else ())


def segment_inputs(ops) -> list:
    """The state a host segment reads before its own ops write it, sorted (what entering it downloads)."""
    needed, written = set(), set()
    for op in ops:
        needed.update(name for name in host_reads(op) if name not in written)
        written.update(op.writes)
    return sorted(needed)


def count_transfers(segments, config, tokens: int, streamed=frozenset()) -> None:
    """Set each segment's h2d_bytes, d2h_bytes and syncs by the rules above.  streamed: op names whose
    weights the residency window copies every step."""
    width = {name: floats(config) * FLOAT32_BYTES * tokens for name, floats in STATE_FLOATS.items()}
    held = {name: set() for name in width}      # the sides holding each state's current value
    in_flight: set = set()                      # pinned buffers an upload may still read
    xn_norm = None                              # the norm whose xn the device holds
    device_segments = [s for s in segments if s.side == "gpu"]
    for segment in segments:
        segment.h2d_bytes = segment.d2h_bytes = segment.syncs = 0
    if not device_segments:
        return
    current = device_segments[0]
    if any("params" in op.device_reads() for s in device_segments for op in s.ops):
        current.h2d_bytes += PARAMS_BYTES_PER_TOKEN * tokens

    def sync() -> None:
        current.syncs += 1
        in_flight.clear()

    def download(names) -> None:
        pending = [name for name in names if held[name] == DEVICE_ONLY]
        if pending:
            current.d2h_bytes += sum(width[name] for name in pending)
            for name in pending:
                held[name].add("cpu")
            sync()

    def upload(name: str) -> None:
        current.h2d_bytes += width[name]
        in_flight.add(name)

    for segment in segments:
        if segment.side == "cpu":
            download(segment_inputs(segment.ops))
            for op in segment.ops:
                for name in op.writes:
                    if name in in_flight:
                        sync()
                    held[name] = {"cpu"}
                    xn_norm = None if name == "x" else xn_norm
            continue
        current = segment
        for op in segment.ops:
            if op.kind in FUSED_KINDS:
                continue
            for name in op.device_reads():
                if name == "xn" and xn_norm != op.prologue:
                    download(["x"])
                    if "xn" in in_flight:
                        sync()
                    upload("xn")
                    xn_norm = op.prologue
                elif name not in ("xn", "params", "q") and "gpu" not in held[name]:
                    upload(name)
                    held[name].add("gpu")
            if op.name in streamed:
                segment.h2d_bytes += op.image_bytes()
            for name in op.writes:
                held[name] = {"gpu"}
            xn_norm = op.prepares or xn_norm
    download(["logits"])
