"""Every kernel against its numpy twin on awkward shapes (run on a GPU; skipped without one)."""
import numpy as np
import pytest

from kestrel_stream.cpu import apply_rope, attention, rmsnorm, rope_tables, silu_mul
from kestrel_stream.cuda import driver
from kestrel_stream.quant import quantize

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")]


class Gpu:
    """A small harness: one device, kernels, an arena, a stream; upload/download numpy arrays."""

    def __init__(self):
        from kestrel_stream.cuda.executor import gemv_launch
        from kestrel_stream.cuda.kernels import KernelSet
        self.device = driver.Device(0)
        self.kernels = KernelSet(self.device)
        self.arena = driver.Arena(512 << 20)
        self.stream = driver.Stream()
        self.gemv_launch = gemv_launch

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

    def run(self, launch) -> None:
        launch.enqueue(self.stream)
        self.stream.synchronize()


@pytest.fixture(scope="module")
def gpu():
    return Gpu()


def rel_err(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("n,k,tokens", [(37, 96, 1), (100, 160, 3), (257, 544, 5), (64, 2080, 8),
                                        (129, 320, 13), (1000, 1056, 2), (75, 224, 7)])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("with_residual", [False, True])
def test_q8_gemv_matches_numpy(gpu, n, k, tokens, mode, with_residual):
    from kestrel_stream.cuda.executor import QWeight
    rng = np.random.default_rng(n * 7 + k + tokens + mode)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
    width = 2 * k if mode == 2 else k
    x = rng.standard_normal((tokens, width)).astype(np.float32)
    normw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    res = rng.standard_normal((tokens, n)).astype(np.float32)
    xin = {0: x, 1: rmsnorm(x, normw, 1e-6), 2: silu_mul(x[:, :k], x[:, k:])}[mode]
    want = xin @ w.dequantize().T + (res if with_residual else 0)
    qw = QWeight(gpu.put(w.qs), gpu.put(w.scales), n, k)
    y = gpu.put(res if with_residual else np.zeros((tokens, n), np.float32))
    gpu.run(gpu.gemv_launch(gpu.kernels, qw, gpu.put(x), width, mode, gpu.put(normw) if mode == 1 else 0,
                            1e-6, y, n, y if with_residual else 0, tokens))
    assert rel_err(gpu.get(y, (tokens, n)), want) < 1e-5


def kv_address(base, p, layer, n_layers, which, n_kv, d):
    return base + ((p * n_layers + layer) * 2 + which) * n_kv * d


@pytest.mark.parametrize("n_heads,n_kv,d,qk_norm", [(4, 4, 64, True), (8, 4, 128, False),
                                                    (8, 2, 128, True), (16, 2, 64, False), (8, 1, 256, True)])
def test_qkv_norm_rope_append(gpu, n_heads, n_kv, d, qk_norm):
    rng = np.random.default_rng(d + n_heads)
    layers, layer, capacity = 3, 1, 40
    positions = np.array([0, 5, 6, 31], np.int32)
    bases = np.array([0, capacity * layers * 2 * n_kv * d] * 2, np.int64)   # two sessions
    t = len(positions)
    qkv = rng.standard_normal((t, (n_heads + 2 * n_kv) * d)).astype(np.float32)
    q_norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    k_norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    theta = 1e6
    inv_freq = (1.0 / (theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(np.float32)
    pool_floats = 2 * capacity * layers * 2 * n_kv * d
    pool = gpu.put(np.zeros(pool_floats, np.float32))
    q_out = gpu.arena.alloc(t * n_heads * d * 4)
    gpu.run(gpu.kernels.launch("qkv_norm_rope_append", (n_heads + 2 * n_kv, t), (32,), "ppppppppfiiiii",
                               [gpu.put(qkv), q_out, pool, gpu.put(bases), gpu.put(positions),
                                gpu.put(q_norm) if qk_norm else 0, gpu.put(k_norm) if qk_norm else 0,
                                gpu.put(inv_freq), 1e-6, layer, layers, n_heads, n_kv, d]))
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
@pytest.mark.parametrize("d", [64, 128])
def test_attention_gqa_matches_reference(gpu, group, d):
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
    gpu.run(gpu.kernels.launch(f"attention_gqa_d{d}", (n_kv, t), (128,), "pppppiiiiif",
                               [gpu.put(q), gpu.put(pool), gpu.put(bases), gpu.put(positions), out,
                                layer, layers, n_heads, n_kv, d, 1.0 / np.sqrt(d)]))
    got = gpu.get(out, (t, n_heads * d))
    for i, (s, p) in enumerate(queries):
        k, v = caches[s]
        want = attention(q[i:i + 1], k[:p + 1], v[:p + 1], p)
        assert rel_err(got[i:i + 1], want) < 1e-5, (s, p)


def test_embed_q8_and_argmax(gpu):
    rng = np.random.default_rng(3)
    vocab, hidden = 1003, 160
    table = quantize(rng.standard_normal((vocab, hidden)).astype(np.float32))
    ids = np.array([0, 1002, 17, 17, 500], np.int32)
    out = gpu.arena.alloc(len(ids) * hidden * 4)
    gpu.run(gpu.kernels.launch("embed_q8", (len(ids),), (256,), "ppppi",
                               [gpu.put(table.qs), gpu.put(table.scales), gpu.put(ids), out, hidden]))
    np.testing.assert_array_equal(gpu.get(out, (len(ids), hidden)), table.dequantize_rows(ids))

    logits = rng.standard_normal((3, 151936)).astype(np.float32)
    logits[1, [5, 99999]] = 50.0        # a tie: the first index wins, as in numpy
    result = gpu.arena.alloc(3 * 4)
    gpu.run(gpu.kernels.launch("argmax_rows", (3,), (1024,), "pip", [gpu.put(logits), 151936, result]))
    np.testing.assert_array_equal(gpu.get(result, (3,), np.int32), logits.argmax(axis=1))


def test_graph_replay_reads_step_values_from_device(gpu):
    """One captured graph serves every step: its H2D node copies whatever the pinned block holds."""
    staging = driver.PinnedBuffer(16)
    values = staging.view(np.int32, (4,))
    table = quantize(np.arange(8 * 32, dtype=np.float32).reshape(8, 32))
    ids, out = gpu.arena.alloc(16), gpu.arena.alloc(4 * 32 * 4)
    embed = gpu.kernels.launch("embed_q8", (4,), (32,), "ppppi",
                               [gpu.put(table.qs), gpu.put(table.scales), ids, out, 32])
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
