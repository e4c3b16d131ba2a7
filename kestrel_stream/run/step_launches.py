"""The launch list of a `gpu` mode step: which kernels, in what order, on which buffers.

Launches per layer (6): fused QKV GEMV; q/k norm + RoPE + KV append; split-key
attention (merged by its last block), or for prefill chunks the tensor-core flash
kernel (cuda/flash_attention.py); O GEMV + residual; fused gate/up GEMV with
SiLU·mul in its epilogue (gate and up rows interleaved at load); down GEMV +
residual.  Then lm_head.  RMSNorm never costs a launch or a re-read: the
kernel that writes the residual stream x (embedding, O and down epilogues) also
writes xn = x * next norm weight and, from its last block, 1/rms(x) per token;
the consuming GEMV multiplies its dot products by that scale.

On sm_90 and later the kernels after the first are launched with programmatic
stream serialization: a kernel is scheduled while its predecessor finishes,
issues its first weight loads (weights are constant), and only then waits for
the predecessor's results (kernels_ptx/common.cuh).  Launch latency and the
tail of one kernel hide the DRAM latency of the next.
"""
from __future__ import annotations

from kestrel_stream.cuda.kernels import (GEMV_MAX_TOKENS, ROPE_PAGED_SIGNATURE, Launch, gemv_launch,
                                         paged_attention_launch)
from kestrel_stream.cuda.block_kernels import embed_kernel
from kestrel_stream.cuda.flash_attention import StepChoice, attention_choice
from kestrel_stream.model import rope

LAYER_OPS = ("qkv", "rope", "attention", "o", "gate_up", "down")   # launches per layer, in order


def step_launches(x, tokens: int, lm_rows: tuple[int, int] | None = None) -> list[Launch]:
    """The kernels of one step over `tokens` tokens of GpuExecutor `x`, in order, with their arguments.

    lm_rows = (first, count): lm_head runs on token rows first..first+count-1 only, into logits rows
    0..count-1 (None: every row).  count 0 leaves lm_head out, unless the weights are streamed: the
    window streams lm_head in ring order whatever the step wants, so one row is computed then."""
    first, count = lm_rows if lm_rows is not None else (0, tokens)
    if count == 0 and x.window.streamed:
        first, count = tokens - 1, 1
    c, k, T = x.config, x.kernels, x.max_tokens
    eps, L = c.rms_norm_eps, c.num_hidden_layers
    kvbase, ids, pos = x.params.ptr, x.params.ptr + 8 * T, x.params.ptr + 12 * T
    H, QKV, I = c.hidden_size, c.q_size + 2 * c.kv_size, c.intermediate_size
    xp, xn, inv_rms, counter = x.x.ptr, x.xn.ptr, x.inv_rms.ptr, x.counter.ptr
    norm_after = [lw["mlp_norm"] for lw in x.layers]                 # what O's epilogue prepares
    norm_after_down = [lw["attn_norm"] for lw in x.layers[1:]] + [x.final_norm]
    attention_kernel = StepChoice(lambda: x.staged_kvbase[:tokens], c.head_dim)   # flash or split, per step
    out = [k.launch(embed_kernel(x.embed), (tokens,), (256,), "pppppppfi",
                    [x.embed.qs, x.embed.scales, ids, xp, xn, x.layers[0]["attn_norm"], inv_rms,
                     eps, H])]
    for li, lw in enumerate(x.layers):
        out.append(gemv_launch(k, lw["wqkv"], xn, H, x.qkv.ptr, QKV, tokens, inv_rms_in=inv_rms))
        # KV through the session's block table (kvbase = its table row, kv_paged.py)
        out.append(k.launch(f"qkv_rope_append_paged_{x.kv_dtype}", (c.num_attention_heads + 2 * c.num_key_value_heads,
                                                                    tokens), (32,), ROPE_PAGED_SIGNATURE,
                            [x.qkv.ptr, x.q.ptr, x.kv.table_ptr, kvbase, pos, lw["q_norm"],
                             lw["k_norm"], x.inv_freq, lw["qkv_bias"], eps, li, L, c.num_attention_heads,
                             c.num_key_value_heads, c.head_dim, x.kv.block_shift]))
        split = paged_attention_launch(k, x.q.ptr, x.kv.table_ptr, kvbase, pos, x.attn.ptr,
                                       x.partials.ptr, x.attention_counters.ptr, tokens, li, L,
                                       c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                       x.attention_splits, x.kv.block_shift, x.kv_dtype,
                                       window=c.sliding_window or 0, scale=rope.softmax_scale(c))
        # prefill chunks: the tensor-core flash kernel, picked per step from the staged rows
        out.append(attention_choice(k, split, attention_kernel, q=x.q.ptr, tables=x.kv.table_ptr,
                                    table_row=kvbase, pos=pos, out=x.attn.ptr, tokens=tokens, layer=li,
                                    n_layers=L, n_heads=c.num_attention_heads, n_kv=c.num_key_value_heads,
                                    head_dim=c.head_dim, block_shift=x.kv.block_shift, kv_dtype=x.kv_dtype,
                                    window=c.sliding_window or 0, scale=rope.softmax_scale(c)))
        out.append(gemv_launch(k, lw["wo"], x.attn.ptr, c.q_size, xp, H, tokens, res=xp,
                               normw_out=norm_after[li], xn_out=xn, inv_rms_out=inv_rms, counter=counter,
                               eps=eps))
        out.append(gemv_launch(k, lw["w_gate_up"], xn, H, x.act.ptr, I, tokens, silu_pairs=True,
                               inv_rms_in=inv_rms))
        out.append(gemv_launch(k, lw["w_down"], x.act.ptr, I, xp, H, tokens, res=xp,
                               normw_out=norm_after_down[li], xn_out=xn, inv_rms_out=inv_rms,
                               counter=counter, eps=eps))
    if count:
        out.append(gemv_launch(k, x.lm_head, xn + 4 * H * first, H, x.logits.ptr, c.vocab_size, count,
                               inv_rms_in=inv_rms + 4 * first))
    ops = [("embed", None)] + [(op, li) for li in range(L) for op in LAYER_OPS] + [("lm_head", None)] * bool(count)
    assert len(ops) == len(out), "LAYER_OPS names each launch of a layer"
    for launch, (op, layer) in zip(out, ops):
        launch.label(op=op, layer=layer)
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
    """Each of `tokens` logits rows' argmax into x.argmax_out: the greedy step's last kernel."""
    S, T = x.argmax_splits, x.max_tokens
    launch = x.kernels.launch(
        "argmax_split", (S, tokens), (256,), "pipppp",
        [x.logits.ptr, x.config.vocab_size, x.argmax_partials.ptr,
         x.argmax_partials.ptr + 4 * T * S, x.argmax_counters.ptr, x.argmax_out.ptr])
    launch.label(op="argmax")
    launch.programmatic = programmatic
    return launch
