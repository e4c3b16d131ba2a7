"""Split-K q8_mma launches (kernels_ptx/q8_mma.cu, gridDim.z > 1) against numpy on awkward shapes.

Each case runs on the emulated device (fake_kernels.q8_mma: CI) and, marked `gpu`, on a real one.
Reference: fake_kernels.mma_product with the same split of K (runs of blocks summed in order) to
1e-5, the unsplit product and fp32 activations to 1e-4; then the epilogues.  A replayed graph
proves each launch's last split resets the tickets it took.
"""
from __future__ import annotations

import numpy as np
import pytest

import fake_cuda
from fake_kernels import mma_product
from kestrel_stream.cuda import gemv_variants, driver, mma_variants
from kestrel_stream.model.quant import quantize
from kestrel_stream.run.host import silu_mul

GPU = [pytest.mark.gpu, pytest.mark.skipif(not driver.gpu_available(), reason="no GPU")]
DEVICES = ["emulated", pytest.param("gpu", marks=GPU)]
TOKENS = (9, 17, 63, 64)
N, K = 96, 1056            # multiples of 32, not of 128: a partial last K stage for every BK
SPLITS = (2, 3, 5)
EPILOGUES = ("plain", "rmsnorm", "silu_pairs", "residual_xn_rms")
# the GPU runs every (tokens, tile, splits, epilogue); the emulated device (numpy, CI) every tile, split and
# epilogue with the token counts taken in turn
SPLIT_TILES = [name for name, tile in mma_variants.TILES.items() if tile.splits_k]
SPLIT_CASES = ([pytest.param("gpu", t, tile, s, e, marks=GPU)
                for t in TOKENS for tile in SPLIT_TILES for s in SPLITS for e in EPILOGUES]
               + [("emulated", TOKENS[i % len(TOKENS)], tile, s, e)
                  for i, (tile, s, e) in enumerate((tile, s, e) for tile in SPLIT_TILES for s in SPLITS
                                                   for e in EPILOGUES)])
# q8_mma_pipe.cu's tiles unsplit too, on a K of several x chunks with a partial last stage
PIPE_TILES = [name for name, tile in mma_variants.TILES.items() if tile.pipelined]
PIPE_K = 1568
PIPE_CASES = ([pytest.param("gpu", t, tile, e, marks=GPU) for t in TOKENS for tile in PIPE_TILES for e in EPILOGUES]
              + [("emulated", TOKENS[i % len(TOKENS)], tile, EPILOGUES[i % len(EPILOGUES)])
                 for i, tile in enumerate(PIPE_TILES)])


class Harness:
    def __init__(self, kind: str, monkeypatch):
        if kind == "emulated":
            fake_cuda.install(monkeypatch)
        from kestrel_stream.cuda import kernels
        self.kernels_module = kernels
        self.kernels = kernels.KernelSet(driver.Device(0))
        self.arena = driver.Arena(64 << 20)
        self.stream = driver.Stream()

    def put(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        ptr = self.arena.alloc(max(array.nbytes, 16))
        driver.h2d_sync(ptr, array)
        return ptr

    def get(self, ptr: int, shape, dtype=np.float32) -> np.ndarray:
        out = np.empty(shape, dtype)
        driver.d2h_async(out, ptr, out.nbytes, self.stream)
        self.stream.synchronize()
        return out

    def scratch(self, tokens: int, rows: int, variant: str) -> mma_variants.SplitScratch:
        floats, tickets = mma_variants.scratch_floats(tokens, rows, *mma_variants.parse_variant(variant))
        return mma_variants.SplitScratch(self.put(np.full(floats, np.nan, np.float32)), floats,
                                         self.put(np.zeros(tickets, np.uint32)), tickets)


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    """The twins' many small float64 products: one BLAS thread (threads only contend on a busy machine)."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(params=DEVICES)
def dev(request, monkeypatch):
    h = Harness(request.param, monkeypatch)
    yield h
    h.arena.release()


def rel_err(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


class Case:
    """One weight, input and epilogue arguments, with the numpy results for a split of K."""

    def __init__(self, tokens: int, n: int, k: int, epilogue: str, seed: int):
        rng = np.random.default_rng(seed)
        self.tokens, self.n, self.k, self.epilogue = tokens, n, k, epilogue
        self.w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
        self.x = rng.standard_normal((tokens, k)).astype(np.float32)
        self.x[0, :32] = 0.0                                   # an all-zero block: scale 0
        self.inv_rms_in = (0.5 + rng.random(tokens)).astype(np.float32)
        self.cols = n // 2 if epilogue == "silu_pairs" else n
        self.res = rng.standard_normal((tokens, self.cols)).astype(np.float32)
        self.normw_out = (1 + 0.1 * rng.standard_normal(self.cols)).astype(np.float32)

    def finish(self, s: np.ndarray) -> np.ndarray:
        if self.epilogue in ("rmsnorm", "silu_pairs"):
            s = s * self.inv_rms_in[:, None]
        out = silu_mul(s[:, 0::2], s[:, 1::2]) if self.epilogue == "silu_pairs" else s
        return out + self.res if self.epilogue == "residual_xn_rms" else out

    def want(self, blocks_per_split: int | None) -> np.ndarray:
        return self.finish(mma_product(self.x, self.w.qs, self.w.scales, blocks_per_split))

    def upload(self, dev: Harness) -> dict:
        """Device buffers and gemv_launch's epilogue keywords; y starts as the residual it is added to."""
        y = dev.put(self.res if self.epilogue == "residual_xn_rms" else np.zeros((self.tokens, self.cols), np.float32))
        bufs = {"qw": dev.kernels_module.QWeight(dev.put(self.w.qs), dev.put(self.w.scales), self.n, self.k),
                "x": dev.put(self.x), "y": y, "xn": dev.put(np.zeros((self.tokens, self.cols), np.float32)),
                "inv_rms_out": dev.put(np.zeros(self.tokens, np.float32)), "counter": dev.put(np.zeros(16, np.uint32))}
        bufs["extra"] = {
            "plain": {}, "rmsnorm": {"inv_rms_in": dev.put(self.inv_rms_in)},
            "silu_pairs": {"inv_rms_in": dev.put(self.inv_rms_in), "silu_pairs": True},
            "residual_xn_rms": {"res": y, "normw_out": dev.put(self.normw_out), "xn_out": bufs["xn"],
                                "inv_rms_out": bufs["inv_rms_out"], "counter": bufs["counter"]}}[self.epilogue]
        return bufs

    def launch(self, dev: Harness, bufs: dict, variant: str, scratch):
        return dev.kernels_module.gemv_launch(dev.kernels, bufs["qw"], bufs["x"], self.k, bufs["y"], self.cols,
                                              self.tokens, variant=variant, split_scratch=scratch, **bufs["extra"])

    def check_epilogue_outputs(self, dev: Harness, bufs: dict, got: np.ndarray) -> None:
        if self.epilogue != "residual_xn_rms":
            return
        np.testing.assert_allclose(dev.get(bufs["xn"], (self.tokens, self.cols)), got * self.normw_out, rtol=1e-6)
        np.testing.assert_allclose(dev.get(bufs["inv_rms_out"], (self.tokens,)),
                                   1 / np.sqrt(np.mean(got * got, axis=1) + 1e-6), rtol=1e-5)
        assert not dev.get(bufs["counter"], (16,), np.uint32)[:8].any(), "inv_rms tickets zeroed for the next launch"


@pytest.mark.parametrize("dev,tokens,tile,splits,epilogue", SPLIT_CASES, indirect=["dev"])
def test_split_k_matches_numpy(dev, tokens, tile, splits, epilogue):
    case = Case(tokens, N, K, epilogue, seed=tokens + splits)
    variant = mma_variants.variant_name(tile, splits)
    tile_shape = mma_variants.TILES[tile]
    assert mma_variants.split_is_valid(K, tile_shape, splits), f"{variant}: K={K} must give every split a stage"
    bufs, scratch = case.upload(dev), dev.scratch(tokens, N, variant)
    launch = case.launch(dev, bufs, variant, scratch)
    assert launch.name == mma_variants.kernel_name(tile, epilogue == "silu_pairs") and launch.grid[2] == splits
    launch.enqueue(dev.stream)
    got = dev.get(bufs["y"], (tokens, case.cols))
    assert rel_err(got, case.want(mma_variants.blocks_per_split(K, tile_shape, splits))) < 1e-5
    assert rel_err(got, case.want(None)) < 1e-4, "a split changes only the order of fp32 sums"
    assert rel_err(got, case.finish(case.x @ case.w.dequantize().T)) < 1e-4
    case.check_epilogue_outputs(dev, bufs, got)
    assert not dev.get(scratch.tickets, (scratch.ticket_count,), np.uint32).any(), "the last splits reset the tickets"


@pytest.mark.parametrize("dev,tokens,tile,epilogue", PIPE_CASES, indirect=["dev"])
def test_pipelined_tile_unsplit_matches_numpy(dev, tokens, tile, epilogue):
    """... with the fp16 scales at an address of 2 mod 4 (a row slice of a weight of odd K / 32 starts
    there; the kernel copies the scales by 4-byte words from the aligned one below)."""
    case = Case(tokens, N, PIPE_K, epilogue, seed=7 * tokens)
    bufs = case.upload(dev)
    shifted = dev.put(np.concatenate([np.zeros(1, np.float16), case.w.scales.ravel()])) + 2
    bufs["qw"] = dev.kernels_module.QWeight(bufs["qw"].qs, shifted, case.n, case.k)
    launch = case.launch(dev, bufs, tile, None)
    assert launch.name == mma_variants.kernel_name(tile, epilogue == "silu_pairs") and launch.grid[2] == 1
    launch.enqueue(dev.stream)
    got = dev.get(bufs["y"], (tokens, case.cols))
    assert rel_err(got, case.want(None)) < 1e-5
    assert rel_err(got, case.finish(case.x @ case.w.dequantize().T)) < 1e-4
    case.check_epilogue_outputs(dev, bufs, got)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("rows,k", [(1056, 2048), (544, 4096)])
def test_chosen_split_runs_in_the_device_states_scratch(dev, tokens, rows, k):
    """choose_variant's split of a decode-sized shape, in a scratch of mma_variants.scratch_bound's size
    (what DeviceState.allocate gives a step of up to 64 tokens)."""
    case = Case(tokens, rows, k, "residual_xn_rms", seed=rows + tokens)
    variant = mma_variants.choose_variant(tokens, rows, k)
    tile, splits = mma_variants.parse_variant(variant)
    assert splits > 1, f"{tokens} x {rows} x {k}: a latency-bound shape gets split ({variant})"
    floats, tickets = mma_variants.scratch_bound(64)
    scratch = mma_variants.SplitScratch(dev.put(np.zeros(floats, np.float32)), floats,
                                        dev.put(np.zeros(tickets, np.uint32)), tickets)
    bufs = case.upload(dev)
    # up to 16 tokens a step takes q8_gemv_hmma.cu by default: the split GEMM is then asked for by name
    launch = case.launch(dev, bufs, variant if tokens <= gemv_variants.HMMA_MAX_TOKENS else None, scratch)
    assert launch.grid[2] == splits
    launch.enqueue(dev.stream)
    got = dev.get(bufs["y"], (tokens, rows))
    assert rel_err(got, case.want(mma_variants.blocks_per_split(k, mma_variants.TILES[tile], splits))) < 1e-5
    case.check_epilogue_outputs(dev, bufs, got)


@pytest.mark.parametrize("variants", [["16x32k256s3", "16x64s5", "16x64k128s2", "16x16k256s5"],
                                      ["16x64k128p3c512s3", "32x64k64p4c256s5", "16x128k64p3c256s2", "64x64k64p4c128s5"]])
def test_graph_replays_twice_with_tickets_reset(dev, variants):
    """A graph of split launches sharing one scratch -- every epilogue, the residual one in place --
    replayed twice: equal results both times (each last split reset its tickets), tickets zero after."""
    cases = [Case(tokens, N, K, epilogue, seed=i) for i, (tokens, epilogue) in enumerate(zip(TOKENS, EPILOGUES))]
    scratch_floats = max(mma_variants.scratch_floats(c.tokens, N, *mma_variants.parse_variant(v))[0]
                         for c, v in zip(cases, variants))
    tickets = max(mma_variants.scratch_floats(c.tokens, N, *mma_variants.parse_variant(v))[1]
                  for c, v in zip(cases, variants))
    scratch = mma_variants.SplitScratch(dev.put(np.zeros(scratch_floats, np.float32)), scratch_floats,
                                        dev.put(np.zeros(tickets, np.uint32)), tickets)
    bufs = [c.upload(dev) for c in cases]
    launches = [c.launch(dev, b, v, scratch) for c, b, v in zip(cases, bufs, variants)]
    with driver.capture(dev.stream) as captured:
        for launch in launches:
            launch.enqueue(dev.stream)
    for replay in range(2):
        for c, b in zip(cases, bufs):            # the residual case adds into y: start it over
            if c.epilogue == "residual_xn_rms":
                driver.h2d_sync(b["y"], c.res)
        captured.graph.launch(dev.stream)
        dev.stream.synchronize()
        for c, b, v in zip(cases, bufs, variants):
            tile, splits = mma_variants.parse_variant(v)
            got = dev.get(b["y"], (c.tokens, c.cols))
            want = c.want(mma_variants.blocks_per_split(K, mma_variants.TILES[tile], splits))
            assert rel_err(got, want) < 1e-5, f"replay {replay}: {v}, {c.epilogue}"
            c.check_epilogue_outputs(dev, b, got)
        assert not dev.get(scratch.tickets, (tickets,), np.uint32).any(), f"replay {replay} left tickets set"
    captured.graph.destroy()
