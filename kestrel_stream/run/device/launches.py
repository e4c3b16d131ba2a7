"""The launch list of a `gpu` mode step: the step program's ops (scheduler/ops.py) as device launches.

Every op of the program with a launch of its own, in program order, through
the device backend (ops.py): per layer (6) fused QKV GEMV; q/k norm +
RoPE + KV append; split-key attention (merged by its last block), or for
prefill chunks the tensor-core flash kernel (cuda/flash_attention.py); O GEMV +
residual; fused gate/up GEMV with SiLU·mul in its epilogue; down GEMV +
residual.  Embed before, lm_head after (on the rows whose logits are wanted).
A one-token step has 5 per layer: attention does the rope op as its prologue
(scheduler/ops.py fuse_rope).

On sm_90 and later the kernels after the first are launched with programmatic
stream serialization: a kernel is scheduled while its predecessor finishes,
issues its first weight loads (weights are constant), and only then waits for
the predecessor's results (kernels_ptx/common.cuh).  Launch latency and the
tail of one kernel hide the DRAM latency of the next.
"""
from __future__ import annotations

from scheduler.ops import fuse_rope, step_ops
from kestrel_stream.cuda.kernels import GEMV_MAX_TOKENS, Launch



def step_launches(x, tokens: int, lm_rows: tuple[int, int] | None = None) -> list[Launch]:
    """The kernels of one step over `tokens` tokens of GpuExecutor `x`, in order, with their arguments.

    lm_rows = (first, count): lm_head runs on token rows first..first+count-1 only, into logits rows
    0..count-1 (None: every row).  count 0 leaves lm_head out, unless the weights are streamed: the
    window streams lm_head in ring order whatever the step wants, so one row is computed then."""
    first, count = lm_rows if lm_rows is not None else (0, tokens)
    if count == 0 and x.window.streamed:
        first, count = tokens - 1, 1
    ops = step_ops(x.config, tokens)
    if x.rope_fused:                   # one-token steps: rope runs as attention's prologue
        ops = fuse_rope(ops, tokens)
    out = [launch for op in ops if op.launches and (count or op.group != "lm_head")
           for launch in x.device_ops.launches(op, tokens, (first, count))]
    # programmatic dependent launch: each kernel after the first may be scheduled while its
    # predecessor runs and prefetch its weights.  Decode-sized steps only (the GEMV path): with
    # the tiled matmul of prefill chunks it measured slower (1066 vs 1572 tok/s for 64-token
    # steps, bench/results/2026-11-30-h200-step-variants.md).  Not with streamed weights, whose
    # slot copies order kernels through events.
    for launch in out[1:]:
        launch.programmatic = (x.programmatic and tokens <= GEMV_MAX_TOKENS and not x.window.streamed
                               and int(x.device.arch.removeprefix("sm_")) >= 90)
    return out


def argmax_launch(x, tokens: int, programmatic: bool) -> Launch:
    """Each of `tokens` logits rows' argmax into x.token_outputs.argmax_out: the greedy step's last kernel."""
    o, T = x.token_outputs, x.max_tokens
    launch = x.kernels.launch(
        "argmax_split", (o.argmax_splits, tokens), (256,), "pipppp",
        [x.logits.ptr, x.config.vocab_size, o.argmax_partials.ptr,
         o.argmax_partials.ptr + 4 * T * o.argmax_splits, o.argmax_counters.ptr, o.argmax_out.ptr])
    launch.label(op="argmax")
    launch.programmatic = programmatic
    return launch
