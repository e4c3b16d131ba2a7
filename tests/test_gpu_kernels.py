"""Every kernel against its numpy twin on awkward shapes (run on a GPU; skipped without one)."""
import numpy as np
import pytest

from kestrel_stream.run.host import apply_rope, attention, rmsnorm, rope_tables, silu_mul
from kestrel_stream.cuda import driver
from kestrel_stream.cuda import gemv_variants, mma_variants
from kestrel_stream.cuda.kernels import GEMV_COUNTER_BYTES, ROPE_SIGNATURE, QWeight
from kestrel_stream.model.quant import quantize
from fake_kernels import mma_product

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")]


class Gpu:
    """A small harness: one device, kernels, an arena, a stream; upload/download numpy arrays."""

    def __init__(self):
        from kestrel_stream.cuda.kernels import KernelSet, attention_launch, gemv_launch
        self.device = driver.Device(0)
        self.kernels = KernelSet(self.device)
        self.arena = driver.Arena(2 << 30)
        self.stream = driver.Stream()
        self.gemv_launch = gemv_launch
        self.attention_launch = attention_launch

    def put(self, array) -> int:
        array = np.ascontiguousarray(array)
        ptr = self.arena.alloc(array.nbytes)
        driver.h2d_sync(ptr, array)
        return ptr

    def get(self, ptr: int, shape, dtype=np.float32) -> np.ndarray:
        out = np.empty(shape, dtype)
        driver.d2h_async(out, ptr, out.nbytes, self.stream)
        self.stream.synchronize()
        return out

    def run(self, launches) -> None:
        for launch in np.atleast_1d(launches):
            launch.enqueue(self.stream)
        self.stream.synchronize()


@pytest.fixture(scope="module")
def gpu_harness():
    return Gpu()


@pytest.fixture
def gpu(gpu_harness):
    """The module's harness; what a test allocated in its arena is given back after it."""
    before = set(gpu_harness.arena._live)
    yield gpu_harness
    gpu_harness.stream.synchronize()
    for offset in set(gpu_harness.arena._live) - before:
        gpu_harness.arena.free(gpu_harness.arena.base + offset)


def rel_err(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


GEMV_SHAPES = [(38, 96, 1), (100, 160, 3), (258, 544, 5), (64, 2080, 8), (130, 320, 13), (1000, 1056, 2),
               (76, 224, 7), (2048, 6144, 1), (6144, 2048, 1), (130, 288, 70), (64, 96, 9)]
# every single-token variant on the single-token shapes, every 2..8-token one on those shapes
GEMV_CASES = [(n, k, tokens, variant) for n, k, tokens in GEMV_SHAPES
              for variant in (gemv_variants.VARIANTS if tokens == 1 else
                              gemv_variants.MULTI_VARIANTS if tokens <= 8 else ["simt"])]


def check_gemv(gpu, n, k, tokens, variant, epilogue, seed: int, launches: int = 1):
    """One GEMV launch (run `launches` times) with `epilogue` against numpy to 1e-5, n even (gate/up pairs);
    after it the ticket and every per-token sum are zero; the launch back."""
    rng = np.random.default_rng(seed)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    inv_rms_in = (0.5 + rng.random(tokens)).astype(np.float32)
    res = rng.standard_normal((tokens, n)).astype(np.float32)
    normw_out = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    s = x @ w.dequantize().T
    if epilogue in ("rmsnorm", "silu_pairs"):
        s = s * inv_rms_in[:, None]
    want = silu_mul(s[:, 0::2], s[:, 1::2]) if epilogue == "silu_pairs" else s
    if epilogue == "residual_xn_rms":   # y aliases res: each launch adds the products once more
        want = res + launches * s
    cols = want.shape[1]
    qw = QWeight(gpu.put(w.qs), gpu.put(w.scales), n, k)
    y = gpu.put(res if epilogue == "residual_xn_rms" else np.zeros((tokens, cols), np.float32))
    xn, inv_rms_out = gpu.put(np.zeros((tokens, n), np.float32)), gpu.put(np.zeros(tokens, np.float32))
    counter = gpu.put(np.zeros(GEMV_COUNTER_BYTES // 4, np.uint32))   # ticket + the per-token sums of squares
    extra = {"plain": {}, "rmsnorm": {"inv_rms_in": gpu.put(inv_rms_in)},
             "silu_pairs": {"inv_rms_in": gpu.put(inv_rms_in), "silu_pairs": True},
             "residual_xn_rms": {"res": y, "normw_out": gpu.put(normw_out), "xn_out": xn,
                                 "inv_rms_out": inv_rms_out, "counter": counter}}[epilogue]
    launch = gpu.gemv_launch(gpu.kernels, qw, gpu.put(x), k, y, cols, tokens, variant=variant, **extra)
    for _ in range(launches):
        gpu.run(launch)
    got = gpu.get(y, (tokens, cols))
    assert rel_err(got, want) < 1e-5
    if epilogue == "residual_xn_rms":
        np.testing.assert_allclose(gpu.get(xn, (tokens, n)), got * normw_out, rtol=1e-6)
        np.testing.assert_allclose(gpu.get(inv_rms_out, (tokens,)),
                                   1 / np.sqrt(np.mean(got * got, axis=1) + 1e-6), rtol=1e-5)
        scratch = gpu.get(counter, (GEMV_COUNTER_BYTES // 4,), np.uint32)
        assert scratch[0] == 0 and not scratch[8:].any(), "ticket and sums are zeroed for the next launch"
    return launch


@pytest.mark.parametrize("n,k,tokens,variant", GEMV_CASES)
@pytest.mark.parametrize("epilogue", ["plain", "rmsnorm", "silu_pairs", "residual_xn_rms"])
def test_q8_gemv_and_matmul_match_numpy(gpu, n, k, tokens, variant, epilogue):
    """n even (gate/up pairs), K a multiple of 32 not of 256, token counts through GEMV and matmul."""
    check_gemv(gpu, n, k, tokens, variant, epilogue, seed=n * 7 + k + tokens)


MMA_TOKENS = (9, 17, 63, 64, 65, 200, 511)
MMA_SHAPES = [(96, 160), (1056, 544)]      # N and K multiples of 32, not of 128


@pytest.mark.parametrize("tokens", MMA_TOKENS)
@pytest.mark.parametrize("n,k", MMA_SHAPES)
@pytest.mark.parametrize("tile", list(mma_variants.TILES) + [None])
@pytest.mark.parametrize("epilogue", ["plain", "rmsnorm", "silu_pairs", "residual_xn_rms"])
def test_q8_mma_matches_numpy(gpu, n, k, tokens, tile, epilogue):
    """The tensor-core GEMM against its twin (fake_kernels.mma_product: the same two-level int8
    activations) to 1e-5, and against fp32 activations to 1e-4, with every epilogue."""
    rng = np.random.default_rng(n + k + tokens)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    x[0, :32] = 0.0                                             # an all-zero block: scale 0
    inv_rms_in = (0.5 + rng.random(tokens)).astype(np.float32)
    res = rng.standard_normal((tokens, n)).astype(np.float32)
    normw_out = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def finish(s):
        if epilogue in ("rmsnorm", "silu_pairs"):
            s = s * inv_rms_in[:, None]
        out = silu_mul(s[:, 0::2], s[:, 1::2]) if epilogue == "silu_pairs" else s
        return out + res if epilogue == "residual_xn_rms" else out

    twin, exact = finish(mma_product(x, w.qs, w.scales)), finish(x @ w.dequantize().T)
    cols = twin.shape[1]
    qw = QWeight(gpu.put(w.qs), gpu.put(w.scales), n, k)
    y = gpu.put(res if epilogue == "residual_xn_rms" else np.zeros((tokens, cols), np.float32))
    xn, inv_rms_out = gpu.put(np.zeros((tokens, n), np.float32)), gpu.put(np.zeros(tokens, np.float32))
    counter = gpu.put(np.zeros(16, np.uint32))
    extra = {"plain": {}, "rmsnorm": {"inv_rms_in": gpu.put(inv_rms_in)},
             "silu_pairs": {"inv_rms_in": gpu.put(inv_rms_in), "silu_pairs": True},
             "residual_xn_rms": {"res": y, "normw_out": gpu.put(normw_out), "xn_out": xn,
                                 "inv_rms_out": inv_rms_out, "counter": counter}}[epilogue]
    if tile is None and mma_variants.uses_f16(tokens):   # the default there is q8_mma_f16_ws.cu (test_gpu_f16mma.py)
        tile = mma_variants.choose_tile(tokens, n)
    if tile is None and tokens <= gemv_variants.HMMA_MAX_TOKENS:   # there q8_gemv_hmma.cu (test_q8_hmma_matches_numpy)
        tile = mma_variants.choose_tile(tokens, n)
    launch = gpu.gemv_launch(gpu.kernels, qw, gpu.put(x), k, y, cols, tokens, variant=tile, **extra)
    assert launch.name.startswith("q8_mma_")
    gpu.run(launch)
    got = gpu.get(y, (tokens, cols))
    assert rel_err(got, twin) < 1e-5
    assert rel_err(got, exact) < 1e-4
    if epilogue == "residual_xn_rms":
        np.testing.assert_allclose(gpu.get(xn, (tokens, n)), got * normw_out, rtol=1e-6)
        np.testing.assert_allclose(gpu.get(inv_rms_out, (tokens,)),
                                   1 / np.sqrt(np.mean(got * got, axis=1) + 1e-6), rtol=1e-5)
        assert not gpu.get(counter, (16,), np.uint32)[:8].any(), "the tickets are zeroed for the next launch"


@pytest.mark.parametrize("variant", ["", "w32r2u4"])
def test_programmatic_chain_keeps_dependencies(gpu, variant):
    """A chain of dependent GEMVs launched with programmatic stream serialization, in a graph replayed
    back to back: each reads what the previous wrote (and the residual it overwrites), so an early
    read would show.  x_{i+1} = x_i + W_i (x_i * 1/rms(x_i)), the rms from the previous epilogue."""
    rng = np.random.default_rng(7)
    n, steps = 2048, 12
    weights = [quantize(rng.standard_normal((n, n)).astype(np.float32) / np.sqrt(n)) for _ in range(steps)]
    x0 = rng.standard_normal((1, n)).astype(np.float32)
    want, inv = x0.copy(), 1 / np.sqrt(np.mean(x0 * x0) + 1e-6)
    for w in weights:
        want = want + (want @ w.dequantize().T) * inv
        inv = 1 / np.sqrt(np.mean(want * want) + 1e-6)
    x, xn = gpu.put(x0), [gpu.put(x0), gpu.put(x0)]   # xn ping-pongs: a GEMV reads one, writes the other
    rms, counter, ones = gpu.put(np.zeros(2, np.float32)), gpu.put(np.zeros(16, np.uint32)), gpu.put(np.ones(n, np.float32))
    launches = [gpu.gemv_launch(gpu.kernels, QWeight(gpu.put(w.qs), gpu.put(w.scales), n, n), xn[i % 2], n, x, n,
                                1, inv_rms_in=rms + 4 * (i % 2), res=x, normw_out=ones, xn_out=xn[1 - i % 2],
                                inv_rms_out=rms + 4 * (1 - i % 2), counter=counter, variant=variant)
                for i, w in enumerate(weights)]
    for launch in launches[1:]:
        launch.programmatic = True
    reset = [(x, x0), (xn[0], x0), (rms, np.array([1 / np.sqrt(np.mean(x0 * x0) + 1e-6), 0], np.float32))]
    for replay in range(3):
        for ptr, value in reset:
            driver.h2d_sync(ptr, value)
        with driver.capture(gpu.stream) as captured:
            for launch in launches:
                launch.enqueue(gpu.stream)
        captured.graph.launch(gpu.stream)
        gpu.stream.synchronize()
        captured.graph.destroy()
        assert rel_err(gpu.get(x, (1, n)), want) < 1e-4, f"replay {replay}"
    for ptr, value in reset:   # eagerly too
        driver.h2d_sync(ptr, value)
    gpu.run(launches)
    assert rel_err(gpu.get(x, (1, n)), want) < 1e-4, "eager"
    assert gpu.get(counter, (16,), np.uint32)[0] == 0


def kv_address(base, p, layer, n_layers, which, n_kv, d):
    return base + ((p * n_layers + layer) * 2 + which) * n_kv * d


@pytest.mark.parametrize("n_heads,n_kv,d,qk_norm,bias", [
    (4, 4, 64, True, False), (8, 4, 128, False, False), (8, 2, 128, True, False), (16, 2, 64, False, False),
    (8, 1, 256, True, False), (4, 2, 32, False, True), (2, 1, 80, False, False), (4, 2, 96, True, True),
    (4, 2, 160, False, True)])
def test_qkv_norm_rope_append(gpu, n_heads, n_kv, d, qk_norm, bias):
    rng = np.random.default_rng(d + n_heads)
    layers, layer, capacity = 3, 1, 40
    positions = np.array([0, 5, 6, 31], np.int32)
    bases = np.array([0, capacity * layers * 2 * n_kv * d] * 2, np.int64)   # two sessions
    t = len(positions)
    qkv = rng.standard_normal((t, (n_heads + 2 * n_kv) * d)).astype(np.float32)
    q_norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    k_norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    qkv_bias = (0.1 * rng.standard_normal((n_heads + 2 * n_kv) * d)).astype(np.float32)
    theta = 1e6
    inv_freq = (1.0 / (theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(np.float32)
    pool_floats = 2 * capacity * layers * 2 * n_kv * d
    pool = gpu.put(np.zeros(pool_floats, np.float32))
    q_out = gpu.arena.alloc(t * n_heads * d * 4)
    gpu.run(gpu.kernels.launch("qkv_norm_rope_append", (n_heads + 2 * n_kv, t), (32,), ROPE_SIGNATURE,
                               [gpu.put(qkv), q_out, pool, gpu.put(bases), gpu.put(positions),
                                gpu.put(q_norm) if qk_norm else 0, gpu.put(k_norm) if qk_norm else 0,
                                gpu.put(inv_freq), gpu.put(qkv_bias) if bias else 0, 1e-6, layer, layers,
                                n_heads, n_kv, d]))
    if bias:
        qkv = qkv + qkv_bias
    q = qkv[:, :n_heads * d].reshape(t, n_heads, d)
    k = qkv[:, n_heads * d:(n_heads + n_kv) * d].reshape(t, n_kv, d)
    v = qkv[:, (n_heads + n_kv) * d:].reshape(t, n_kv, d)
    if qk_norm:
        q, k = rmsnorm(q, q_norm, 1e-6), rmsnorm(k, k_norm, 1e-6)
    cos, sin = rope_tables(positions, d, theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert rel_err(gpu.get(q_out, (t, n_heads, d)), q) < 1e-5
    got_pool = gpu.get(pool, (pool_floats,))
    for i in range(t):
        at_k = kv_address(bases[i], positions[i], layer, layers, 0, n_kv, d)
        at_v = kv_address(bases[i], positions[i], layer, layers, 1, n_kv, d)
        assert rel_err(got_pool[at_k:at_k + n_kv * d].reshape(n_kv, d), k[i]) < 1e-5
        np.testing.assert_array_equal(got_pool[at_v:at_v + n_kv * d].reshape(n_kv, d), v[i])


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("window", [0, 5, 50])
def test_attention_gqa_matches_reference(gpu, group, d, splits, window):
    rng = np.random.default_rng(group * d)
    n_kv, layers, layer = 2, 2, 1
    n_heads = n_kv * group
    lengths = [1, 7, 130]      # keys per session: one, a few, more than a block's warps many times
    capacity = max(lengths)
    session_floats = capacity * layers * 2 * n_kv * d
    pool = np.zeros(len(lengths) * session_floats, np.float32)
    caches = []
    for s, length in enumerate(lengths):
        k = rng.standard_normal((length, n_kv, d)).astype(np.float32)
        v = rng.standard_normal((length, n_kv, d)).astype(np.float32)
        for p in range(length):
            at = kv_address(s * session_floats, p, layer, layers, 0, n_kv, d)
            pool[at:at + n_kv * d] = k[p].ravel()
            at = kv_address(s * session_floats, p, layer, layers, 1, n_kv, d)
            pool[at:at + n_kv * d] = v[p].ravel()
        caches.append((k, v))
    # one query token per session at the last position, plus a prefill-like query mid-sequence
    queries = [(0, 0), (1, 6), (2, 129), (2, 64)]
    t = len(queries)
    q = rng.standard_normal((t, n_heads, d)).astype(np.float32)
    bases = np.array([s * session_floats for s, _ in queries], np.int64)
    positions = np.array([p for _, p in queries], np.int32)
    out = gpu.arena.alloc(t * n_heads * d * 4)
    partials = gpu.arena.alloc(t * n_heads * splits * (d + 2) * 4)
    counters = gpu.put(np.zeros(t * n_kv, np.uint32))
    launch = gpu.attention_launch(gpu.kernels, gpu.put(q), gpu.put(pool), gpu.put(bases), gpu.put(positions),
                                  out, partials, counters, t, layer, layers, n_heads, n_kv, d, splits,
                                  window=window)
    gpu.run([launch, launch])   # twice: the tickets must be back at zero after each launch
    got = gpu.get(out, (t, n_heads * d))
    for i, (s, p) in enumerate(queries):
        k, v = caches[s]
        want = attention(q[i:i + 1], k[:p + 1], v[:p + 1], p, window or None)
        assert rel_err(got[i:i + 1], want) < 1e-5, (s, p)
    assert not gpu.get(counters, (t * n_kv,), np.uint32).any()


def test_embed_q8_and_argmax(gpu):
    rng = np.random.default_rng(3)
    vocab, hidden = 1003, 160
    table = quantize(rng.standard_normal((vocab, hidden)).astype(np.float32))
    ids = np.array([0, 1002, 17, 17, 500], np.int32)
    out, inv_rms = gpu.arena.alloc(len(ids) * hidden * 4), gpu.arena.alloc(len(ids) * 4)
    xn, normw = gpu.arena.alloc(len(ids) * hidden * 4), rng.random(hidden).astype(np.float32)
    gpu.run(gpu.kernels.launch("embed_q8", (len(ids),), (256,), "pppppppfi",
                               [gpu.put(table.qs), gpu.put(table.scales), gpu.put(ids), out, xn, gpu.put(normw),
                                inv_rms, 1e-6, hidden]))
    want = table.dequantize_rows(ids)
    np.testing.assert_array_equal(gpu.get(out, (len(ids), hidden)), want)
    np.testing.assert_allclose(gpu.get(xn, (len(ids), hidden)), want * normw, rtol=1e-6)
    np.testing.assert_allclose(gpu.get(inv_rms, (len(ids),)), 1 / np.sqrt(np.mean(want * want, axis=1) + 1e-6),
                               rtol=1e-5)

    logits = rng.standard_normal((3, 151936)).astype(np.float32)
    logits[1, [5, 99999]] = 50.0        # a tie: the first index wins, as in numpy
    result = gpu.arena.alloc(3 * 4)
    gpu.run(gpu.kernels.launch("argmax_rows", (3,), (1024,), "pip", [gpu.put(logits), 151936, result]))
    np.testing.assert_array_equal(gpu.get(result, (3,), np.int32), logits.argmax(axis=1))


@pytest.mark.parametrize("vocab,splits", [(151936, 64), (1000, 7), (37, 64)])
def test_argmax_split_matches_numpy(gpu, vocab, splits):
    """Ties across slices (first index wins), a row of -inf (index 0, as numpy), repeated launches
    (the per-row tickets reset themselves), more splits than elements."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    logits[1, [3, vocab - 2]] = 50.0
    logits[2, :] = -np.inf
    logits[3, vocab // 2:] = 9.0
    partials, counters = gpu.arena.alloc(2 * 5 * splits * 4), gpu.put(np.zeros(5, np.uint32))
    result, data = gpu.arena.alloc(5 * 4), gpu.put(logits)
    launch = gpu.kernels.launch("argmax_split", (splits, 5), (256,), "pipppp",
                                [data, vocab, partials, partials + 5 * splits * 4, counters, result])
    for _ in range(3):
        gpu.run(launch)
        np.testing.assert_array_equal(gpu.get(result, (5,), np.int32), logits.argmax(axis=1))
    assert not gpu.get(counters, (5,), np.uint32).any()


def test_graph_replay_reads_step_values_from_device(gpu):
    """One captured graph serves every step: its H2D node copies whatever the pinned block holds."""
    staging = driver.PinnedBuffer(16)
    values = staging.view(np.int32, (4,))
    table = quantize(np.arange(8 * 32, dtype=np.float32).reshape(8, 32))
    ids, out, inv_rms = gpu.arena.alloc(16), gpu.arena.alloc(4 * 32 * 4), gpu.arena.alloc(16)
    xn = gpu.arena.alloc(4 * 32 * 4)
    embed = gpu.kernels.launch("embed_q8", (4,), (32,), "pppppppfi",
                               [gpu.put(table.qs), gpu.put(table.scales), ids, out, xn,
                                gpu.put(np.ones(32, np.float32)), inv_rms, 1e-6, 32])
    with driver.capture(gpu.stream) as captured:
        driver.h2d_async(ids, staging, 16, gpu.stream)
        embed.enqueue(gpu.stream)
    for step in range(3):
        values[:] = [step, 7 - step, step + 1, 0]
        captured.graph.launch(gpu.stream)
        gpu.stream.synchronize()
        np.testing.assert_array_equal(gpu.get(out, (4, 32)), table.dequantize_rows(values.copy()))
    captured.graph.destroy()
    staging.free()


def test_arena_reuses_freed_blocks_and_accounts_bytes():
    arena = driver.Arena(1 << 20)
    a, b = arena.alloc(1000), arena.alloc(5000)
    assert arena.used_bytes == 1024 + 5120
    arena.free(a)
    assert arena.alloc(512) == a and arena.used_bytes == 512 + 5120
    with pytest.raises(driver.CudaError, match="arena full"):
        arena.alloc(2 << 20)
    arena.release()


def test_sample_candidates_then_finish_draw_the_reference_tokens(gpu):
    """The two-launch sampler against the reference sampler row by row: top_k inside the candidates'
    range (1, 40, 64), outside it (0, 65: the whole row), logits rounded to quarters (ties), and 100
    ties at the top of one slice, which leaves some of them out (the whole row again); every token is one the filters keep, nearly
    all equal the reference's draw (float32 sums on the device), and each row's Philox step advances."""
    from kestrel_stream.run.device.sampler import SAMPLE_CAP, candidate_splits, pack_state
    from kestrel_stream.text.sampling import SamplingParams, filter_threshold, sample_logits
    rng, V, T = np.random.default_rng(14), 151936, 60
    logits = (3 * rng.standard_normal((T, V))).astype(np.float32)
    logits[T // 2:] = np.round(logits[T // 2:] * 4) / 4
    logits[T - 5:, 100:200] = 20.0      # 100 ties at the top inside slice 0: it keeps top_k of them
    params = [SamplingParams(temperature=0.8, top_k=[1, 40, 64, 0, 65][t % 5], top_p=0.95, min_p=0.01)
              for t in range(T)]
    state = np.stack([pack_state(p, 7, 1000 + t) for t, p in enumerate(params)])
    S = candidate_splits(V)
    data, state_ptr = gpu.put(logits), gpu.put(state)
    cand, result = gpu.arena.alloc(T * S * (2 * SAMPLE_CAP + 4) * 4), gpu.arena.alloc(T * 4)
    gpu.run([gpu.kernels.launch("sample_candidates", (S, T), (256,), "pipp", [data, V, state_ptr, cand]),
             gpu.kernels.launch("sample_finish", (T,), (1024,), "pippip", [data, V, state_ptr, cand, S, result])])
    tokens = gpu.get(result, (T,), np.int32)
    want = [sample_logits(logits[t], params[t], 7, 1000 + t) for t in range(T)]
    for t in range(T):
        assert logits[t, tokens[t]] >= filter_threshold(logits[t], params[t]), f"row {t}: token {tokens[t]}"
    assert sum(int(a == b) for a, b in zip(tokens, want)) >= T - 1
    steps = gpu.get(state_ptr, (T, 8), np.uint32)[:, 6]
    np.testing.assert_array_equal(steps, 1001 + np.arange(T))
