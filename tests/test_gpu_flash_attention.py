"""kernels_ptx/flash_attention.cu against numpy on awkward shapes (run on a GPU; skipped without one):
lengths not a multiple of the tiles, GQA groups 1/2/4/8, head dims 64 and 128, chunks continuing a
cached prefix, several sessions in one launch (tiles spanning two), a sliding window; the paged f16
pool through shuffled block tables.  The split kernel on the same inputs agrees as well."""
import numpy as np
import pytest

from kestrel_stream.cuda import driver
from kestrel_stream.cuda import flash_attention as fa

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not driver.gpu_available(), reason=f"{driver.detect()}")]

LAYERS, LAYER, BLOCK_SHIFT, SPLITS = 2, 1, 4, 16
SCENARIOS = {                                   # (start position, query tokens) per session; window
    "fresh prefill": ([(0, 77)], 0),
    "continuing a prefix": ([(45, 100)], 0),
    "three sessions": ([(0, 5), (17, 40), (130, 33)], 0),
    "sliding window": ([(10, 50), (0, 19)], 24),
}


class Harness:
    def __init__(self):
        from kestrel_stream.cuda.kernels import KernelSet
        self.device = driver.Device(0)
        self.kernels = KernelSet(self.device)
        self.arena = driver.Arena(1 << 30)
        self.stream = driver.Stream()

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


@pytest.fixture(scope="module")
def gpu():
    return Harness()


def paged_step(gpu, rng, sessions, n_kv: int, D: int):
    """Each session's K/V [positions, n_kv, D] f16 in shuffled pool blocks, and the step's rows:
    (tables ptr, table_row int64 [T], pos int32 [T], caches)."""
    bs = 1 << BLOCK_SHIFT
    lengths = [start + n for start, n in sessions]
    width = max(-(-n // bs) for n in lengths)
    n_blocks = sum(-(-n // bs) for n in lengths)
    block_elems = bs * LAYERS * 2 * n_kv * D
    pool = rng.standard_normal((n_blocks, bs, LAYERS, 2, n_kv, D)).astype(np.float16)
    order = rng.permutation(n_blocks)
    table = np.zeros((len(sessions), width), np.uint64)
    caches, used = [], 0
    for s, length in enumerate(lengths):
        ids = order[used:used + -(-length // bs)]
        used += len(ids)
        caches.append(pool[ids].reshape(-1, LAYERS, 2, n_kv, D)[:length, LAYER].astype(np.float64))
        table[s, :len(ids)] = ids
    pool_ptr = gpu.put(pool)
    table = (pool_ptr + table * (block_elems * 2)).astype(np.uint64)
    table_row = np.concatenate([np.full(n, s * width, np.int64) for s, (_, n) in enumerate(sessions)])
    pos = np.concatenate([np.arange(start, start + n, dtype=np.int32) for start, n in sessions])
    return gpu.put(table), table_row, pos, caches


def reference(q, sessions, caches, window: int, scale: float):
    """Exact softmax attention in float64 over the f16 caches: [T, n_heads, D]."""
    T, n_heads, D = q.shape
    out, t = np.empty_like(q, dtype=np.float64), 0
    for (start, n), cache in zip(sessions, caches):
        n_kv = cache.shape[2]
        for i in range(n):
            p = start + i
            first = max(p - window + 1, 0) if window else 0
            k, v = cache[first:p + 1, 0], cache[first:p + 1, 1]                 # [keys, n_kv, D]
            qt = q[t].reshape(n_kv, n_heads // n_kv, D).astype(np.float64) * scale
            s = np.einsum("hgd,phd->hgp", qt, k)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            out[t] = (np.einsum("hgp,phd->hgd", w, v) / w.sum(axis=-1, keepdims=True)).reshape(n_heads, D)
            t += 1
    return out


def step_inputs(gpu, rng, sessions, group: int, D: int, window: int):
    """A step over `sessions` with 2 kv heads: (n_kv, n_heads, T, q [T, n_heads, D], scale, numpy's answer, the
    tables' and the q, table-row and position arrays' device pointers)."""
    n_kv = 2
    n_heads = n_kv * group
    tables, table_row, pos, caches = paged_step(gpu, rng, sessions, n_kv, D)
    T = len(pos)
    q = rng.standard_normal((T, n_heads, D)).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    want = reference(q, sessions, caches, window, scale)
    return n_kv, n_heads, T, q, scale, want, tables, gpu.put(q), gpu.put(table_row), gpu.put(pos)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_matches_numpy_and_the_split_kernel(gpu, D, group, scenario):
    from kestrel_stream.cuda.kernels import paged_attention_launch
    sessions, window = SCENARIOS[scenario]
    n_kv, n_heads, T, q, scale, want, tables, q_ptr, row_ptr, pos_ptr = step_inputs(
        gpu, np.random.default_rng(D * 100 + group), sessions, group, D, window)
    out = gpu.arena.alloc(q.nbytes)
    flash = fa.flash_attention_launch(gpu.kernels, q_ptr, tables, row_ptr, pos_ptr, out, T, LAYER, LAYERS,
                                      n_heads, n_kv, D, BLOCK_SHIFT, window, scale)
    for _ in range(2):                    # twice: nothing carries over between launches
        driver.h2d_sync(out, np.full(q.shape, np.nan, np.float32))
        flash.enqueue(gpu.stream)
        got = gpu.get(out, q.shape)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 3e-3, f"{scenario}: relative error {err:.2e}"
    partials = gpu.arena.alloc(T * n_heads * SPLITS * (D + 2) * 4)
    counters = gpu.put(np.zeros(T * n_kv, np.uint32))
    split_out = gpu.arena.alloc(q.nbytes)
    gpu_split = paged_attention_launch(gpu.kernels, q_ptr, tables, row_ptr, pos_ptr, split_out, partials, counters,
                                       T, LAYER, LAYERS, n_heads, n_kv, D, SPLITS, BLOCK_SHIFT, "f16",
                                       window=window, scale=scale)
    gpu_split.enqueue(gpu.stream)
    split = gpu.get(split_out, q.shape)
    assert np.abs(split - got).max() / np.abs(want).max() < 3e-3


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("D", [64, 128])
def test_a_serving_step_splits_between_the_kernels(gpu, D, group):
    """Two decodes and a 70-token prompt in one step (AttentionChoice: the decodes' rows on the split kernel, the
    prompt's on the flash kernel from its own row on, its pointers moved past the decodes): numpy's numbers."""
    from kestrel_stream.cuda.kernels import paged_attention_launch
    sessions = [(40, 1), (17, 1), (0, 70)]
    n_kv, n_heads, T, q, scale, want, tables, q_ptr, row_ptr, pos_ptr = step_inputs(
        gpu, np.random.default_rng(D + group), sessions, group, D, 0)
    table_row = np.concatenate([np.full(n, s, np.int64) for s, (_, n) in enumerate(sessions)])   # the runs
    out = gpu.arena.alloc(q.nbytes)
    partials = gpu.arena.alloc(T * n_heads * SPLITS * (D + 2) * 4)
    counters = gpu.put(np.zeros(T * n_kv, np.uint32))
    tree = gpu.put(np.zeros((T, 4), np.int32))

    def split_rows(d: int):
        return paged_attention_launch(gpu.kernels, q_ptr, tables, row_ptr, pos_ptr, out, partials, counters, d,
                                      LAYER, LAYERS, n_heads, n_kv, D, SPLITS, BLOCK_SHIFT, "f16", scale=scale,
                                      tree=tree)
    step = fa.StepChoice(lambda: table_row, D)
    choice = fa.attention_choice(gpu.kernels, split_rows(T), step, q=q_ptr, tables=tables, table_row=row_ptr,
                                 pos=pos_ptr, out=out, tokens=T, layer=LAYER, n_layers=LAYERS, n_heads=n_heads,
                                 n_kv=n_kv, head_dim=D, block_shift=BLOCK_SHIFT, kv_dtype="f16", window=0,
                                 scale=scale, tree=tree, split_rows=split_rows, tree_row_bytes=16)
    step.decide()
    assert step.head == 2 and not step.flash
    launches = choice.chosen(gpu.stream)
    assert [launch.name.split("_")[0] for launch in launches] == ["attention", "flash"]
    for _ in range(2):
        driver.h2d_sync(out, np.full(q.shape, np.nan, np.float32))
        choice.enqueue(gpu.stream)
        got = gpu.get(out, q.shape)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 3e-3, f"relative error {err:.2e}"
