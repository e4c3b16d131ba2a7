"""The offload gate: does a fused projection group run faster on the GPU or the host?

The seed hard-coded `2·M·N·K < 1e7 FLOP stays on host` because its ~100 us
round trip was measured on one machine. Here the default is a cost model over
a measured DeviceProfile:

    gpu_us  = round trip + H2D(inputs) + upload(weights not resident)
              + max(weight bytes / gpu_weight_GBps, FLOPs / gpu_gflops) + D2H(outputs)
    host_us = max(FLOPs / host_gflops, bytes read / host_weight_GBps)

judged per fused group (Q,K,V together; gate,up together), because a group
pays one round trip however many projections it holds. KESTREL_MINFLOP (or an
explicit minflop) brings back the seed's per-projection threshold instead.
"""
from __future__ import annotations

from dataclasses import dataclass

MINFLOP_ENV = "KESTREL_MINFLOP"


def _us(amount: float, per_second_in_billions: float) -> float:
    """Microseconds to move `amount` bytes (or FLOPs) at a rate in GB/s (or GFLOP/s)."""
    return amount / (per_second_in_billions * 1e3)


def host_time_us(op, profile) -> float:
    """Predicted host time of an op: compute- or memory-bound, whichever is slower."""
    bytes_read = op.active_weight_bytes + op.input_bytes + op.output_bytes
    return max(_us(op.flops, profile.host_gflops), _us(bytes_read, profile.host_weight_GBps))


def gpu_compute_us(op, profile) -> float:
    """Kernel time of an op whose weights are already resident (launch cost not included)."""
    bytes_read = op.active_weight_bytes if op.weights else op.input_bytes + op.output_bytes
    return max(_us(op.flops, profile.gpu_gflops), _us(bytes_read, profile.gpu_weight_GBps))


@dataclass(frozen=True)
class GpuCost:
    round_trip_us: float  # fixed: first launch + sync + copy latencies
    launch_us: float      # launches beyond the first in the segment
    h2d_us: float
    upload_us: float      # weights not resident, streamed in this step
    compute_us: float
    d2h_us: float

    @property
    def total_us(self) -> float:
        return (self.round_trip_us + self.launch_us + self.h2d_us + self.upload_us
                + self.compute_us + self.d2h_us)

    def breakdown(self) -> str:
        parts = [f"round trip {self.round_trip_us:.1f}", f"h2d {self.h2d_us:.1f}"]
        if self.launch_us:
            parts.append(f"launches {self.launch_us:.1f}")
        if self.upload_us:
            parts.append(f"upload {self.upload_us:.1f}")
        parts += [f"compute {self.compute_us:.1f}", f"d2h {self.d2h_us:.1f}"]
        return " + ".join(parts)


def gpu_segment_cost(ops, h2d_bytes: int, d2h_bytes: int, profile,
                     upload_bytes: int = 0) -> GpuCost:
    """Predicted time of a run of GPU ops with one H2D in, one D2H out and one sync."""
    return GpuCost(
        round_trip_us=profile.round_trip_us,
        launch_us=profile.gpu_launch_us * max(0, len(ops) - 1),
        h2d_us=_us(h2d_bytes, profile.h2d_GBps),
        upload_us=_us(upload_bytes, profile.h2d_GBps),
        compute_us=sum(gpu_compute_us(op, profile) for op in ops),
        d2h_us=_us(d2h_bytes, profile.d2h_GBps),
    )


@dataclass(frozen=True)
class GateDecision:
    on_gpu: bool
    reason: str
    gpu_us: float | None = None
    host_us: float | None = None

    @property
    def side(self) -> str:
        return "gpu" if self.on_gpu else "cpu"


class Gate:
    """Decides, per projection op, which of its weights run on the GPU.

    profile: DeviceProfile for the cost model. minflop: the seed's per-projection
    threshold; when given it replaces the cost model. resident_weights: names
    already on the device (None: all of them); the others pay an upload.
    """

    def __init__(self, profile=None, minflop: float | None = None, resident_weights=None):
        if profile is None and minflop is None:
            raise ValueError("the gate needs a device profile (run `kestrel-stream calibrate`) "
                             f"or a plain threshold ({MINFLOP_ENV}=<flops>)")
        self.profile = profile
        self.minflop = minflop
        self.resident_weights = None if resident_weights is None else set(resident_weights)

    def upload_bytes(self, op) -> int:
        if self.resident_weights is None:
            return 0
        return sum(w.nbytes for w in op.weights if w.name not in self.resident_weights)

    def decide(self, op) -> dict:
        """{weight name: GateDecision} for a projection op."""
        assert op.is_projection, op.name
        if self.minflop is not None:
            return {w.name: self._by_threshold(w) for w in op.weights}
        decision = self._by_cost(op)
        return {w.name: decision for w in op.weights}

    def _by_threshold(self, weight) -> GateDecision:
        rows, cols = weight.shape
        wins = weight.flops >= self.minflop
        relation = ">=" if wins else "<"
        return GateDecision(wins, f"minflop: 2*M*{rows}*{cols} = {weight.flops:.3g} FLOP "
                                  f"{relation} {self.minflop:.3g}")

    def _by_cost(self, op) -> GateDecision:
        cost = gpu_segment_cost([op], op.input_bytes, op.output_bytes, self.profile,
                                self.upload_bytes(op))
        host_us = host_time_us(op, self.profile)
        wins = cost.total_us < host_us
        members = len(op.weights)
        what = f"fused {op.group} x{members}" if members > 1 else op.group
        verdict = "gpu wins" if wins else "host wins"
        reason = (f"{what}: gpu {cost.total_us:.1f} us ({cost.breakdown()}) vs host "
                  f"{host_us:.1f} us ({op.weight_bytes / 1e6:.2f} MB, {op.flops:.3g} FLOP) "
                  f"-> {verdict}")
        return GateDecision(wins, reason, cost.total_us, host_us)
