"""Launches of the 4/6-bit block-format kernels (kernels_ptx/q4_gemv.cu, q4_mma.cu) and their weights.

A block-format QWeight points at its image's qs and meta parts (model/quant4.image_layout);
a weight whose last rows are in a second format (a fused QKV with Q6_K v rows) carries them as
its `tail`.  Kernel names: <fmt>[_<tail fmt>]_gemv_m<M>[_<layout>][_silu] for 1..8 tokens (M = 1,
2, 4, 8: the next one up; layouts: cuda/q4_gemv_variants.py), <fmt>[_<tail fmt>]_mma[_silu] beyond;
embed_<fmt> for the embedding gather.
"""
from __future__ import annotations

from kestrel_stream.cuda import q4_gemv_variants
from kestrel_stream.cuda.device_weight import QWeight
from scheduler.ops import BLOCK_FORMATS

# kernels.GEMV_SIGNATURE + qs_b, meta_b, rows_a (kernels.py dispatches here: this module must not import it)
BLOCK_GEMV_SIGNATURE = "pppippipppppfiii" + "ppi"
GEMV_MAX_TOKENS = 8                               # kernels.GEMV_MAX_TOKENS
GEMV_TOKENS = q4_gemv_variants.GEMV_TOKENS       # the GEMV kernels' M
MMA_ROWS, MMA_TOKENS, MMA_THREADS = 64, 64, 128   # q4_mma.cu's QM_BN, QM_BM, QM_THREADS
# format → (qs bytes, meta bytes) per block (model/quant4.SPLITS)
PART_BYTES = {"Q8_0": (32, 2), "Q4_0": (16, 2), "Q4_K": (128, 16), "Q6_K": (192, 18)}
# the (format, tail format) pairs the kernels are built for
KERNEL_FORMATS = (("Q4_0", None), ("Q4_K", None), ("Q6_K", None), ("Q4_K", "Q6_K"))


gemv_rows = q4_gemv_variants.legacy_rows     # kept importable: rows per block of q4_gemv.cu's kernel
gemv_m = q4_gemv_variants.gemv_m


def _code(w: QWeight) -> str:
    return w.fmt.lower() + (f"_{w.tail.fmt.lower()}" if w.tail is not None else "")


def weight_bytes(w: QWeight) -> int:
    parts = [w] if w.tail is None else [w, w.tail]
    rows = [w.rows - (w.tail.rows if w.tail else 0)] + ([w.tail.rows] if w.tail else [])
    return sum(n * (w.cols // BLOCK_FORMATS[p.fmt][0]) * BLOCK_FORMATS[p.fmt][1] for p, n in zip(parts, rows))


def block_gemv_launch(kernels, w: QWeight, x: int, ldx: int, y: int, ldy: int, tokens: int, *,
                      silu_pairs: bool = False, inv_rms_in: int = 0, res: int = 0, normw_out: int = 0,
                      xn_out: int = 0, inv_rms_out: int = 0, counter: int = 0, eps: float = 1e-6,
                      variant: str | None = None):
    """kernels.gemv_launch for a block-format weight (same contract); `kernels`: a KernelSet.  variant: a
    GEMV layout of q4_gemv_variants.variants(M) for 1..8 tokens (default: q4_gemv_variants.choose, which
    takes the kernel set's gemv_block, KESTREL_GEMV_BLOCK, where it fits)."""
    tail = w.tail
    assert (w.fmt, tail.fmt if tail else None) in KERNEL_FORMATS, f"no kernel for {w.fmt} then {tail and tail.fmt}"
    assert not (silu_pairs and tail), "gate/up rows share one format"
    head_rows = w.rows - (tail.rows if tail else 0)
    args = [w.qs, w.scales, x, ldx, inv_rms_in, y, ldy, res, normw_out, xn_out, inv_rms_out, counter, eps,
            w.rows, w.cols, tokens, (tail or w).qs, (tail or w).scales, head_rows]
    silu = "_silu" if silu_pairs else ""
    if tokens > GEMV_MAX_TOKENS:
        blocks = -(-head_rows // MMA_ROWS) + -(-(w.rows - head_rows) // MMA_ROWS)
        launch = kernels.launch(f"{_code(w)}_mma{silu}", (blocks, -(-tokens // MMA_TOKENS)), (MMA_THREADS,),
                                BLOCK_GEMV_SIGNATURE, args)
    else:
        m, code = gemv_m(tokens), _code(w)
        name = q4_gemv_variants.choose(code, w.fmt, w.rows, w.cols, tokens, silu_pairs, variant,
                                       kernels.gemv_block)
        layout = q4_gemv_variants.variants(m)[name]
        shared = q4_gemv_variants.dp4a_shared_bytes(code, w.cols) if q4_gemv_variants.is_dp4a(name) else 0
        sm_count = kernels.device.sm_count if layout.blocks_per_sm else 0   # the d layouts' grid cap
        launch = kernels.launch(q4_gemv_variants.kernel_name(code, m, name, silu_pairs),
                                (q4_gemv_variants.grid_blocks(layout, head_rows, w.rows - head_rows, sm_count),),
                                (layout.threads,), BLOCK_GEMV_SIGNATURE, args, shared)
    return launch.label(flops=2 * w.rows * w.cols * tokens, bytes=weight_bytes(w))


def embed_kernel(w: QWeight) -> str:
    """The embedding gather kernel for a table in w's format (elementwise.cu's embed_q8 for Q8_0)."""
    assert w.tail is None
    return "embed_q8" if w.fmt == "Q8_0" else f"embed_{w.fmt.lower()}"


def qweight_rows(w: QWeight, lo: int, hi: int) -> QWeight:
    """Rows [lo, hi) of a device weight as a weight of its own (views: rows are independent)."""
    assert 0 <= lo < hi <= w.rows
    head_rows = w.rows - (w.tail.rows if w.tail else 0)
    if lo >= head_rows:
        return qweight_rows(QWeight(w.tail.qs, w.tail.scales, w.tail.rows, w.cols, w.tail.fmt), lo - head_rows,
                            hi - head_rows)
    elements = BLOCK_FORMATS[w.fmt][0]
    qs_row, meta_row = (b * (w.cols // elements) for b in PART_BYTES[w.fmt])
    top = min(hi, head_rows)
    head = QWeight(w.qs + lo * qs_row, w.scales + lo * meta_row, top - lo, w.cols, w.fmt)
    if hi <= head_rows:
        return head
    tail = qweight_rows(QWeight(w.tail.qs, w.tail.scales, w.tail.rows, w.cols, w.tail.fmt), 0, hi - head_rows)
    return QWeight(head.qs, head.scales, hi - lo, w.cols, w.fmt, tail=tail)
