"""A mixture-of-experts model on one GPU beside llama.cpp in one run: every expert in VRAM, and the experts
outside VRAM but for the most chosen.

    python3 -m bench.make_gguf --preset qwen3-30b-a3b --mix q8_0 --vocab PATH/ggml-vocab-qwen2.gguf -o /tmp/q30a3b.gguf
    python3 -m bench.moe_offload /tmp/q30a3b.gguf [--budgets all experts:0.1 attention 0.5] [--threads 16]
        [--sessions 16] [--prompt 512] [--stream off auto] [--stream-chunk 512] [--link-experts 0 2 3] [--residency]
        [--bias-router 3]
        [--llama-bench PATH/llama-bench] [--llama-batched-bench PATH/llama-batched-bench] [--ncmoe N ...] [--out DIR]

Budgets: `all`, gpu mode with no budget (every weight and expert in VRAM); `experts:F`, mode offload with a
--vram-budget holding every non-expert weight (each layer's qkv and o, lm_head), the routers and a fraction F
of the experts (as many slots; the most chosen resident, the rest computed on the host by the native host
kernels, --threads), on top of mode offload's KV pool (one session of --max-seq-len) and activations;
`attention`, the non-expert weights alone (every expert on the host); a number, that fraction of them.
Each row: greedy decode after one token (medians of --repeats after a warm-up), a --prompt-token prefill
(the last row's logits; in gpu mode with the kernels its routed layers' experts ran on: the grouped tensor-core
GEMM moe_mma_* from cuda/moe_kernels.mma_min_tokens tokens a step, or KESTREL_MOE_MMA_MIN_TOKENS, else the
moe_experts_* GEMVs) and --sessions sessions decoding together.  Offload rows add the placement (A: qkv
and o resident, the MLP on the host; M: qkv and o streamed; H: all on the host), the predicted step and the
host roofline of the row: the expert bytes a token reads that are not resident (the routers' choice at the
resident share expected) ÷ the host memory pool's best rate (calibrated at the start: scheduler/step_sim
PoolRates), with the measured decode as a share of it, and the host's experts op at one token (host_experts_us,
a layer's call; link_wait_us: of that, the wait for the device's link share after the host's own choices) and,
where a decode step runs as one graph with host items, a step's host items (host_items_ms) and the library
thread's waits for the device's word between them (device_waits_ms: the device's segments and the hand-offs).
--host-nodes 1 0: each offload row without a link share once per value (0: the step segment by segment, one
host wait a host segment, where 1 runs it as one graph with host items).
--link-experts N ...: each offload row once per value (run/device/expert_link.py: at one token, N of a token's
host-side expert choices read by the GPU from pinned images over PCIe while the host computes the rest -- beside
an experts' ring, the ring's images;
auto: the counts scheduler/link_tuner.py keeps after trying them while decoding, in link_kept as
tokens:count for each step size, "?" where still trying; defer: none over the link, only the resident experts
run during the host's).
--stream: each offload budget once per KESTREL_STREAM_EXPERTS value (off: every non-resident expert on the host,
today's rows; auto: the experts' ring where the cost model predicts it pays and the budget holds it; on: a ring
or the budget refused).  A row with a ring ("experts:F ring auto") runs offload steps of up to --stream-chunk
tokens (a prompt chunk streams each routed layer's experts once for all its tokens) and adds the ring, the
placement and predicted time of a prompt chunk (E: the layer's experts streamed to the GPU), and the expert
bytes a --prompt-token prompt streamed.
--residency: in each offload row with experts resident, the choice blind to routing (uniform) against the
choice by the routing of a calibration prompt (frequency): each one's hit rate on later prompts (the share
of their experts' selections found resident) and decode tok/s.  --bias-router S first skews the routers of
a Q8_0 file (bench/synthetic.bias_router: an eighth of each layer's experts get about S added to their
logits): a random GGUF routes nearly uniformly.
llama.cpp: `llama-bench -m FILE -ngl 99` (all in VRAM, where `all` is a budget) and `-ngl 99 -ncmoe N` for
each N of --ncmoe (default: every layer, and for each experts:F budget the N leaving F of the layers'
experts in VRAM), with -t T -p PROMPT -n NEW -r 3; llama-batched-bench with the same flags and -npl S.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

from kestrel_stream.cli.bench import environment

from .offload import batch_rate, decode_rate
from .report import write_results


def non_expert_bytes(config) -> int:
    """VRAM of every weight but the routers and experts: each layer's projections and lm_head."""
    from scheduler import offload
    per_layer, _, head_bytes = offload._layer_items(config)
    return sum(sum(groups.values()) for groups in per_layer) + head_bytes


def expert_bytes(config, fraction: float) -> int:
    """VRAM of the routers and `fraction` of the experts in mode offload's expert pool."""
    from kestrel_stream.run.device import expert_pool
    slots = int(fraction * expert_pool.all_experts(config))
    return expert_pool.router_bytes(config) + 2 * 256 + slots * expert_pool.pool_layout(config).slot_bytes


def offload_budget(config, weight_bytes: int, max_seq_len: int, max_batch: int, profile) -> int:
    """The --vram-budget leaving `weight_bytes` for weights after mode offload's KV pool and activations."""
    from kestrel_stream.run.device.budget import ALIGN, plan_offload_memory, weight_items
    from kestrel_stream.run.step_executor import DEFAULTS
    needs = plan_offload_memory(config, budget_bytes=1 << 50, free_bytes=1 << 51, profile=profile,
                                max_tokens=max(max_batch, DEFAULTS[False][2]), max_sessions=256,
                                max_seq_len=max_seq_len, attention_splits=16, max_batch=max_batch).needs
    return needs.total + 2 * ALIGN * (len(weight_items(config)) + 8) + weight_bytes


def budget_of(which: str, config, args, profile, max_batch: int | None = None) -> tuple[int | None, int]:
    """(--vram-budget, its weight part) of a budget kind; `all`: (None, every weight); max_batch: the engine's
    (default --max-batch), whose step buffers the budget holds besides."""
    if which == "all":
        return None, non_expert_bytes(config) + expert_bytes(config, 1.0)
    if which.startswith("experts:"):
        weight_bytes = non_expert_bytes(config) + expert_bytes(config, float(which.split(":", 1)[1]))
    else:
        weight_bytes = int((1.0 if which == "attention" else float(which)) * non_expert_bytes(config))
    return offload_budget(config, weight_bytes, args.max_seq_len, max_batch or args.max_batch, profile), weight_bytes


def matching_ncmoe(config, fraction: float) -> int:
    """llama.cpp's --n-cpu-moe N keeping `fraction` of the layers' experts in VRAM (the first N on the CPU)."""
    return config.num_hidden_layers - round(fraction * config.num_hidden_layers)


def prefill_rate(engine, tokens: int, repeats: int) -> float:
    """Median tokens/s of a `tokens`-token prefill (the last row's logits), after a warm-up (repeats + 1 runs)."""
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, engine.config.vocab_size, tokens)]
    rates = []
    for r in range(repeats + 1):
        with engine.new_session() as s:
            t0 = time.perf_counter()
            s.prefill(prompt, logits="last")
            elapsed = time.perf_counter() - t0
        if r:
            rates.append(tokens / elapsed)
    return float(np.median(rates))


def resident_choices(engine, calibration: list[int], prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Mode offload's resident experts chosen blind (uniform) and by the calibration prompt's routing
    (frequency): per choice its expected resident share, the hit rate of `prompts` (each prefilled, then
    `new_tokens` greedy tokens: the share of their experts' selections found resident) and their decode tok/s."""
    from scheduler import expert_residency
    x = engine.executor
    with engine.new_session() as s:
        s.prefill(calibration, logits="last")
    counts = x.routing_counts()
    layers = [i for i in range(engine.config.num_hidden_layers) if engine.config.moe_layer(i)]
    rows = []
    for policy in ("uniform", "frequency"):
        choice = x.place_experts(policy, counts)
        before, decode_s, decoded = x.routing_counts(), 0.0, 0
        for prompt in prompts:
            with engine.new_session() as s:
                token = int(np.argmax(s.prefill(prompt, logits="last")[-1]))
                t0 = time.perf_counter()
                for _ in range(new_tokens):
                    token = s.decode_greedy(token)
                decode_s += time.perf_counter() - t0
                decoded += new_tokens
        hits = expert_residency.hit_rate(x.routing_counts() - before, layers, choice.experts)
        rows.append({"policy": policy, "resident": choice.used_slots, "expected_share": round(choice.expected_share, 3),
                     "hit_rate": round(hits, 3), "tok_s": round(decoded / decode_s, 2)})
    return rows


def llama_bench(binary: str, path: str, ncmoe: int | None, threads: int, prompt: int, new_tokens: int
                ) -> tuple[float, float]:
    """(pp tok/s, tg tok/s) of llama-bench -ngl 99 [-ncmoe N]."""
    flags = ["-ncmoe", str(ncmoe)] if ncmoe is not None else []
    out = subprocess.run([binary, "-m", path, "-ngl", "99", *flags, "-t", str(threads), "-p", str(prompt), "-n",
                          str(new_tokens), "-r", "3", "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    pp = next(float(r["avg_ts"]) for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(float(r["avg_ts"]) for r in rows if r["n_gen"] and not r["n_prompt"])
    return round(pp, 1), round(tg, 2)


def llama_batched(binary: str, path: str, ncmoe: int | None, threads: int, sessions: int) -> float:
    flags = ["-ncmoe", str(ncmoe)] if ncmoe is not None else []
    out = subprocess.run([binary, "-m", path, "-ngl", "99", *flags, "-t", str(threads), "-c", str(sessions * 80),
                          "-npp", "32", "-ntg", "32", "-npl", str(sessions)], capture_output=True, text=True, check=True)
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith("|") and re.search(r"\d", line)]
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    return float(cells[7])          # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...


def experts_kernels(weights, options, tokens: int) -> str:
    """The kernels a `tokens`-token step runs the routed layers' gate_up and down on (moe_kernels'
    choice, KESTREL_MOE_MMA_MIN_TOKENS / _TILE as the engine reads them)."""
    from kestrel_stream.cuda.moe_kernels import experts_kernel
    from kestrel_stream.run.device.expert_store import weight_formats
    c = weights.config
    shape = dict(experts=c.num_experts, chosen=c.num_experts_per_tok, tokens=tokens)
    names = {experts_kernel(options, fmt, **shape) for formats in weight_formats(weights).values() for fmt in formats}
    return " ".join(sorted(names))


def link_count(text: str) -> int | str:
    """--link-experts: a count of choices, auto or defer."""
    if text in ("auto", "defer"):
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a number of choices >= 0, auto or defer")
    return int(text)


def native_kernels(engine):
    """The loaded host kernels (their process-wide counters), or None where numpy runs the host's ops."""
    from kestrel_stream.native import NativeUnavailable, load
    try:
        return load(engine.options)
    except NativeUnavailable:
        return None


def engine_for(weights, which: str, budget: int | None, args, stream: str = "off", max_batch: int | None = None,
               link: int = 0, host_nodes: bool = True, reads_images: bool = False):
    from kestrel_stream.options import Options
    from kestrel_stream.run.engine import Engine
    options = Options.from_env(vram_budget=budget, host_threads=args.threads, stream_experts=stream,
                               link_experts=link, host_nodes=host_nodes, host_reads_images=reads_images)
    return Engine(weights, device="cuda", mode="gpu" if which == "all" else "offload", max_seq_len=args.max_seq_len,
                  max_batch=max_batch or args.max_batch, options=options)


def ours(path: str, weights, which: str, args, profile, stream: str = "off", link: int = 0,
         host_nodes: bool = True, reads_images: bool = False) -> list[dict]:
    """The row of one budget (and its residency rows); stream: KESTREL_STREAM_EXPERTS (offload budgets; off:
    today's rows, named by the budget alone)."""
    from scheduler.offload import HOME_LETTERS, PoolRates
    config = weights.config
    ringed = which != "all" and stream != "off"
    max_batch = max(args.max_batch, args.stream_chunk) if ringed else args.max_batch
    budget, weight_bytes = budget_of(which, config, args, profile, max_batch)
    engine = engine_for(weights, which, budget, args, stream, max_batch, link, host_nodes, reads_images)
    x = engine.executor
    host_kernels = native_kernels(engine) if x.mode == "offload" else None
    if host_kernels is not None:
        host_kernels.times(reset=True)
    rate, step_ms = decode_rate(engine, args.new_tokens, args.repeats)
    times = host_kernels.times(reset=True) if host_kernels is not None else None
    streamed_before = x.stats.get("streamed_bytes") or 0
    pp_rate = prefill_rate(engine, args.prompt, 1)
    pp_streamed = ((x.stats.get("streamed_bytes") or 0) - streamed_before) / 2        # per prompt (2 runs)
    row = {"file": os.path.basename(path), "budget": which + (f" ring {stream}" if ringed else "") +
           (f" link {link}" if link else "") + (" host reads images" if reads_images else "") +
           ("" if host_nodes else " segment by segment"), "mode": x.mode,
           "weight_MB": round(weight_bytes / 1e6, 1),
           "budget_MB": round(budget / 1e6, 1) if budget else "free VRAM", "ours_tg_tok_s": round(rate, 2),
           "step_ms": round(step_ms, 3), "ours_pp_tok_s": round(pp_rate, 1)}
    if x.mode == "gpu":        # a prompt's steps: chunks of step_rows' tokens
        from kestrel_stream.run.device.budget import step_rows
        step = min(args.prompt, step_rows(args.max_batch)[0])
        row["pp_experts_kernels"] = experts_kernels(weights, engine.options, step)
    if args.sessions:
        share = getattr(getattr(x.steps, "item_graphs", None), "link", None)
        for _ in range(8 if share is not None and share.tuners else 0):
            batch_rate(engine, args.sessions, 32)   # auto: the sessions' step size tunes its share first, on fresh
            tuner = share.tuners.get(args.sessions)  # sessions each round (the KV pool holds one round's tokens)
            if tuner is not None and tuner.settled:
                break
        row["ours_batch_tok_s"] = round(batch_rate(engine, args.sessions, 32), 1)
    resident = x.resident_experts
    if x.mode == "offload":
        p = x.placement
        share = resident.expected_share if resident is not None else 0.0
        off_bytes = p.routed_read_bytes * (1.0 - share)        # a token's expert bytes read on the host
        roofline_tok_s = 1e6 / max(PoolRates.of(profile).best_us(off_bytes), 1e-9)
        row.update(placement="".join(HOME_LETTERS[h] for h in p.homes) + f" head {p.head}",
                   resident_experts=f"{resident.used_slots} ({share:.0%} expected)" if resident else 0,
                   predicted_ms=round(p.predicted.total_us / 1e3, 3), experts_off_MB=round(off_bytes / 1e6, 3),
                   host_roofline_tok_s=round(roofline_tok_s, 1), of_host_roofline=round(rate / roofline_tok_s, 3))
        share = x.steps.item_graphs.link if hasattr(x.steps, "item_graphs") else None
        if share is not None and share.tuner is not None:   # auto: the counts kept (or being tried) by step size
            row["link_kept"] = " ".join(f"{t}:{tuner.count}" + ("" if tuner.settled else "?")
                                        for t, tuner in sorted(share.tuners.items()))
        if x.stats.get("expert_image_build_ms") is not None:     # the link's (or ring's) pinned images, at load
            row["images_build_s"] = round(x.stats["expert_image_build_ms"] / 1e3, 2)
        if times and times["steps"]:                     # a decode step as one graph: its host items, the waits
            row["host_items_ms"] = round(times["items_us"] / 1e3, 3)
            row["device_waits_ms"] = round(times["waits_us"] / 1e3, 3)
        if times and times["calls"]:                     # a decode token's routed layers on the host
            row["host_experts_us"] = round(times["us"], 1)
            if times["linked"]:
                row["link_wait_us"] = round(times["link_wait_us"], 1)
        if ringed:         # the experts' ring, and what a prompt chunk placed and streamed
            chunk = x.placement_for(min(args.prompt, x.steps.max_tokens))
            row.update(experts_ring=(f"{p.expert_slot_count} x {p.expert_slot_bytes / 1e6:.1f} MB"
                                     if p.expert_slot_count else "none"),
                       pp_placement=f"M={chunk.tokens} " + "".join(HOME_LETTERS[h] for h in chunk.homes),
                       pp_predicted_ms=round(chunk.predicted.total_us / 1e3, 3),
                       pp_streamed_GB=round(pp_streamed / 1e9, 3))
    rows = [row]
    if args.residency and not ringed and x.mode == "offload" and resident is not None:
        rng = np.random.default_rng(3)
        prompt = lambda n: [int(t) for t in rng.integers(0, config.vocab_size, n)]   # noqa: E731
        for choice in resident_choices(engine, prompt(args.prompt), [prompt(32) for _ in range(3)], args.new_tokens):
            rows.append({"file": row["file"], "budget": f"{which} resident by {choice['policy']}", "mode": x.mode,
                         "resident_experts": f"{choice['resident']} ({choice['expected_share']:.0%} expected)",
                         "hit_rate": choice["hit_rate"], "ours_tg_tok_s": choice["tok_s"]})
    engine.close()
    return rows


def theirs(path: str, config, args) -> list[dict]:
    rows = []
    runs = ([None] if "all" in args.budgets else []) + (args.ncmoe or sorted(
        {config.num_hidden_layers} | {matching_ncmoe(config, float(b.split(":", 1)[1]))
                                      for b in args.budgets if b.startswith("experts:")}, reverse=True))
    for ncmoe in runs:
        pp, tg = llama_bench(args.llama_bench, path, ncmoe, args.threads, args.prompt, args.new_tokens)
        flags = "-ngl 99" + (f" -ncmoe {ncmoe}" if ncmoe is not None else "")
        row = {"file": os.path.basename(path), "budget": f"llama.cpp {flags}", "llama_pp_tok_s": pp, "llama_tg_tok_s": tg}
        if args.sessions and args.llama_batched_bench:
            row["llama_batch_tok_s"] = llama_batched(args.llama_batched_bench, path, ncmoe, args.threads,
                                                     args.sessions)
        rows.append(row)
    return rows


COLUMNS = ["file", "budget", "mode", "weight_MB", "budget_MB", "placement", "resident_experts", "hit_rate",
           "ours_tg_tok_s", "llama_tg_tok_s", "ours_pp_tok_s", "llama_pp_tok_s", "ours_batch_tok_s",
           "llama_batch_tok_s", "step_ms", "predicted_ms", "experts_off_MB", "host_roofline_tok_s", "of_host_roofline",
           "host_experts_us", "link_wait_us", "link_kept", "host_items_ms", "device_waits_ms", "images_build_s",
           "experts_ring", "pp_placement", "pp_predicted_ms", "pp_streamed_GB"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--budgets", nargs="*", default=["all", "experts:0.1"],
                        help="all (gpu mode), experts:F (non-expert weights + F of the experts), attention (the "
                             "non-expert weights) or a fraction of them; none: llama.cpp alone")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=32, help="tokens of an offload step: max(this, 64)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--host-nodes", nargs="+", type=int, default=[1], choices=[0, 1],
                        help="each offload row without a link share once per value: 1, a step as one graph with host "
                             "items (run/item_graphs.py); 0, segment by segment (KESTREL_HOST_NODES)")
    parser.add_argument("--link-experts", nargs="+", type=link_count, default=[0],
                        help="each offload row once per value: a token's host-side expert choices the GPU reads over "
                             "PCIe beside the host's (KESTREL_LINK_EXPERTS; 0: none; beside a ring, its images)")
    parser.add_argument("--host-reads-images", nargs="+", type=int, default=[0], choices=[0, 1],
                        help="each link row once per value: the host's experts reading the link's pinned images (1) "
                             "or their own copies (0) (KESTREL_HOST_READS_IMAGES)")
    parser.add_argument("--stream", nargs="+", default=["off", "auto"], choices=["off", "auto", "on"],
                        help="KESTREL_STREAM_EXPERTS of each offload budget's rows (the experts' ring)")
    parser.add_argument("--stream-chunk", type=int, default=512,
                        help="tokens of an offload step in the rows with a ring (prompt chunks)")
    parser.add_argument("--residency", action="store_true", help="uniform against frequency resident experts")
    parser.add_argument("--bias-router", type=float, default=0.0,
                        help="add about this to an eighth of the experts' router logits (a Q8_0 file)")
    parser.add_argument("--ncmoe", type=int, nargs="+", default=[],
                        help="llama.cpp's layers with experts on the CPU (default: every layer and each experts:F's)")
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--llama-batched-bench", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from bench.synthetic import bias_router
    from kestrel_stream.loading.loader import load_weights
    from kestrel_stream.run.blas_threads import set_cpu_threads
    from .offload import measured_pool
    set_cpu_threads(args.threads)
    profile, pool = measured_pool(args.threads)
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # `timeout`'s TERM writes what was measured
    rows = []
    try:
        for path in args.files:
            weights = load_weights(path)
            if args.bias_router:
                bias_router(weights, preferred=max(1, weights.config.num_experts // 8), strength=args.bias_router)
            for which in [b for b in args.budgets if b != "none"]:       # none: llama.cpp's rows alone
                for stream in (["off"] if which == "all" else args.stream):
                    for link in ([0] if which == "all" else args.link_experts):
                        for host_nodes in ([1] if which == "all" or link else args.host_nodes):
                            for images in (args.host_reads_images if link not in (0, "defer") else [0]):
                                for row in ours(path, weights, which, args, profile, stream, link, bool(host_nodes),
                                                bool(images)):
                                    print(row, flush=True)
                                    rows.append(row)
            for row in theirs(path, weights.config, args) if args.llama_bench else []:
                print(row, flush=True)
                rows.append(row)
    finally:                # a row that fails (or `timeout` ending the run) keeps the rows measured before it
        signal.signal(signal.SIGTERM, before)
        if rows:
            report(args, pool, rows)


def report(args, pool, rows: list[dict]) -> None:
    """bench/results' files of the rows measured."""
    out = write_results("moe-offload", environment(), rows, [c for c in COLUMNS if any(c in r for r in rows)],
                        out_dir=args.out,
                        notes=(f"host memory pool (calibrate, this run): {pool}; the host roofline is a token's "
                               f"expert bytes not resident at the pool's best rate. Ours: {args.new_tokens} greedy "
                               f"tokens after one, medians of {args.repeats}; pp: a {args.prompt}-token prompt; "
                               f"{args.sessions} sessions decoding together after 32-token prompts; offload's "
                               f"experts on the host with {args.threads} threads; rows with a ring: offload steps "
                               f"of up to {args.stream_chunk} tokens, the experts' ring by KESTREL_STREAM_EXPERTS"
                               + (f"; routers skewed (bias_router {args.bias_router})" if args.bias_router else "")
                               + ". llama-bench -r 3 averages."))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
