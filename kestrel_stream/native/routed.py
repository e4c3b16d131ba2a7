"""ctypes bindings of a routed (mixture-of-experts) layer's two ops (host_moe.c), each bound once as
Linear is: its settings and weights fixed in a C struct, a call passes the step's rows alone.

    router = Router(kernels, router_weights, norm, eps, k, softmax_first, normalize, counts)
    route = router(x)                          # [T, 2k]: each token's k expert ids (as floats), weights
    experts = Experts(kernels, gate_ups, downs, norm, eps, k)   # bound Linears per expert (None: not ours)
    used = experts(x, route, moe_out)          # x += the chosen experts' weighted sum (+ moe_out)

The same structs are what host_program.c's op list points at (`spec_address`).
"""
from __future__ import annotations

import ctypes

import numpy as np

from kestrel_stream.native.kernels import HostKernels, Linear

_i, _f, _p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
MAX_CHOICES = 64        # host_kernels.h: KS_MAX_CHOICES


class _RouterSpec(ctypes.Structure):
    """host_kernels.h's ks_router_t."""
    _fields_ = [("E", _i), ("H", _i), ("k", _i), ("softmax_first", _i), ("normalize", _i), ("threads", _i),
                ("router", _p), ("norm", _p), ("eps", _f), ("counts", _p)]


class LinkSpec(ctypes.Structure):
    """host_kernels.h's ks_link_t: a routed layer's link share (run/device/expert_link.py)."""
    _fields_ = [("count", _i), ("armed", _i), ("item", ctypes.c_uint32), ("groups", _p), ("table", _p), ("out", _p),
                ("ready", _p), ("done", _p), ("shared", _i), ("calls", _i), ("ns", ctypes.c_longlong),
                ("max_tokens", _i), ("scratch", _p), ("route", _p)]


class _ExpertsSpec(ctypes.Structure):
    """host_kernels.h's ks_experts_t."""
    _fields_ = [("E", _i), ("H", _i), ("I", _i), ("k", _i), ("gate_up", _p), ("down", _p), ("norm", _p),
                ("eps", _f), ("threads", _i), ("used", _i), ("link", _p)]


class Router:
    """x [T, H] -> route [T, 2k]: rmsnorm(x, norm) onto the experts by `router` [E, H] float32, the top k
    as run/host/arithmetic.route chooses them, each choice counted into `counts` [E] int64 (or None)."""

    def __init__(self, kernels: HostKernels, router: np.ndarray, norm: np.ndarray, eps: float, k: int,
                 softmax_first: bool, normalize: bool, counts: np.ndarray | None):
        self.router = np.ascontiguousarray(router, np.float32)
        self.norm = np.ascontiguousarray(norm, np.float32)
        experts, hidden = self.router.shape
        assert 0 < k <= min(MAX_CHOICES, experts) and self.norm.shape == (hidden,)
        assert counts is None or (counts.dtype == np.int64 and counts.shape == (experts,) and counts.flags.c_contiguous)
        self.counts, self.width = counts, 2 * k
        self._spec = _RouterSpec(experts, hidden, k, int(softmax_first), int(normalize), kernels.threads,
                                 self.router.ctypes.data, self.norm.ctypes.data, eps,
                                 None if counts is None else counts.ctypes.data)
        self.spec_address = ctypes.addressof(self._spec)
        self._call = kernels._lib.ks_route

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty((x.shape[0], self.width), np.float32)
        if self._call(self.spec_address, x.ctypes.data, x.shape[1], x.shape[0], out.ctypes.data, self.width) != 0:
            raise MemoryError(f"host kernels: no memory for the router's {x.shape[0]} rows")
        return out


class Experts:
    """A routed layer's experts: gate_ups[e] a bound gate|up Linear with the SiLU·mul epilogue and downs[e]
    its down Linear, or None for an expert another side computes.  `experts(x, route, moe_out)` adds into
    x [T, H] (in place) each token's chosen experts' outputs, weighted, and moe_out [T, H] when given;
    returns how many experts it ran."""

    def __init__(self, kernels: HostKernels, gate_ups: list[Linear | None], downs: list[Linear | None],
                 norm: np.ndarray, eps: float, k: int):
        assert len(gate_ups) == len(downs) and all((g is None) == (d is None) for g, d in zip(gate_ups, downs))
        mine = [(g, d) for g, d in zip(gate_ups, downs) if g is not None]
        assert mine and all(g.glu and not d.glu and g.width == d.weight.cols for g, d in mine)
        hidden, inter = mine[0][0].weight.cols, mine[0][0].width
        self.norm = np.ascontiguousarray(norm, np.float32)
        self.linears = mine                                        # what the pointer tables point into
        n = len(gate_ups)
        self._gate_up = (_p * n)(*[None if g is None else g.spec_address for g in gate_ups])
        self._down = (_p * n)(*[None if d is None else d.spec_address for d in downs])
        self._spec = _ExpertsSpec(n, hidden, inter, k, ctypes.addressof(self._gate_up), ctypes.addressof(self._down),
                                  self.norm.ctypes.data, eps, kernels.threads, 0)
        self.spec_address = ctypes.addressof(self._spec)
        self._call = kernels._lib.ks_experts
        self.link = None

    @property
    def used(self) -> int:
        """The experts the last call ran."""
        return self._spec.used

    def share_link(self, link: LinkSpec | None) -> None:
        """Give (None: take back) this layer's link share (host_kernels.h's ks_link_t); `link` must live as
        long as it is given."""
        self.link = link
        self._spec.link = None if link is None else ctypes.addressof(link)

    def __call__(self, x: np.ndarray, route: np.ndarray, moe_out: np.ndarray | None = None) -> int:
        t, hidden = x.shape
        assert x.dtype == np.float32 and x.flags.c_contiguous and hidden == self._spec.H
        route = np.ascontiguousarray(route, np.float32)
        assert route.shape == (t, 2 * self._spec.k)
        if moe_out is not None:
            moe_out = np.ascontiguousarray(moe_out, np.float32)
            assert moe_out.shape == x.shape
        status = self._call(self.spec_address, x.ctypes.data, hidden, t, route.ctypes.data, route.shape[1],
                            None if moe_out is None else moe_out.ctypes.data, hidden)
        if status != 0:
            raise MemoryError(f"host kernels: no memory for the experts of {t} rows")
        return self._spec.used
