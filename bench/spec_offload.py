"""Speculative decoding where the target does not fit in VRAM (issue 41's batch-1 table), one JSON row a
measurement.

    PYTHONPATH=. python3 -m bench.spec_offload --target T.gguf --draft D.gguf
        [--resident 0.5,0.25] [--prompts bench/speculative_prompts.txt,bench/spec_heldout_prompts.txt] [--chat]
        [-n 128] [--draft-max 8] [--tree-nodes 1,32] [--lookup] [--spec-policy auto] [--device auto]
        [--mode offload] [-c 2048] [--repeats 2] [--llama-bench PATH [--llama-threads 16]]
        [--curve-model Q8B.gguf | --curve-preset qwen3-8b] [--curve-resident 0.25] [--curve-max 256]
        [--out DIR]

For each target residency R (1: no budget, everything in VRAM; else the share of the target's layer weights the VRAM budget leaves resident;
the draft model is loaded first, all resident, and its VRAM counted in the same budget: ks.load's
pair budget), and each prompt of each file (files: lines of `---` between prompts; the second file
holds prompts not used in development, one returning a 60-line function with one fix):
  - "plain": this project's plain decoding at that budget (the same engine, speculative=False);
  - "spec": speculative decoding with the draft model, once per --tree-nodes value (1: chains) and, with
    --lookup, prompt lookup; speedup over plain, acceptance, tokens per target pass, tree nodes, and
    (greedy) whether the tokens equal plain decoding's;
  - "llama-bench" (--llama-bench PATH): `llama-bench -m TARGET -ngl N -p 0 -n N_NEW -r 3 -o json` with N the
    largest whose weights in VRAM fit ours, counted two ways (vram "pair": R of the target's layers and the
    draft; "target": R of the target's layers alone, llama-speculative's -ngl beside its draft): llama.cpp's
    -ngl N holds N-1 layers and the output layer (bench/offload.py's weight_budget_of).
"pass_curve" rows: the pass time of 1, 2, 4, ... --curve-max tokens (every row's logits, as a verify pass
wants them) on --curve-model (a qwen3-8b-shaped file) or --curve-preset's random weights at
--curve-resident.  On the CPU (--device cpu) budgets do not apply: rows say resident null.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import kestrel_stream as ks
from kestrel_stream.errors import CapacityError
from kestrel_stream.spec.speculation import Speculation

from .speculative import best_run, read_prompts

PROMPT_FILES = "bench/speculative_prompts.txt,bench/spec_heldout_prompts.txt"


def emit(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def layer_weight_bytes(config) -> list[int]:
    """Each decoder layer's projection bytes as the placement counts them (bench/offload's measure)."""
    from scheduler import offload
    per_layer, _, _ = offload._layer_items(config)
    return [sum(group.values()) for group in per_layer]


def target_budget(config, resident: float, max_seq_len: int, max_batch: int) -> int:
    """The target's VRAM budget leaving `resident` of its layer weights resident after mode offload's KV pool
    and activations for steps of max(max_batch, a prefill chunk) tokens (bench/offload.py's offload_budget,
    from a config)."""
    import scheduler
    from kestrel_stream.run.device.budget import ALIGN, plan_offload_memory, weight_items
    from kestrel_stream.run.step_executor import DEFAULTS
    needs = plan_offload_memory(config, budget_bytes=1 << 50, free_bytes=1 << 51, profile=scheduler.profile.H200_POOL,
                                max_tokens=max(max_batch, DEFAULTS[False][2]), max_sessions=256,
                                max_seq_len=max_seq_len, attention_splits=16, max_batch=max_batch).needs
    weights = int(resident * sum(layer_weight_bytes(config)))
    return needs.total + 2 * ALIGN * (len(weight_items(config)) + 8) + weights


def load_pair(args, resident: float | None):
    """The target and the draft at `resident` (None: no budget), the draft's share inside the budget."""
    kw = dict(device=args.device, mode=args.mode, max_seq_len=args.max_seq_len, max_batch=1, draft=args.draft,
              draft_max=args.draft_max, spec_policy=args.spec_policy)
    if resident is None or resident >= 1:                  # everything resident: no budget
        return ks.load(args.target, **kw)
    pair = ks.load(args.target, **kw)                     # no budget: the draft's share, measured as loaded
    share, config = pair.speculation.device_bytes(), pair.config
    pair.close()
    return ks.load(args.target, vram_budget=share + target_budget(config, resident, args.max_seq_len, 1), **kw)


def spec_rows(engine, args, resident, prompt_sets, rows: list[dict]) -> None:
    """plain and speculative rows of every prompt at one budget."""
    model_draft = engine.speculation
    lookup = Speculation.lookup(args.draft_max, args.spec_policy) if args.lookup else None
    drafts = [("model", nodes) for nodes in args.tree_nodes] + ([("lookup", max(args.tree_nodes))] if lookup else [])
    for set_name, prompts in prompt_sets:
        for i, prompt in enumerate(prompts):
            where = {"resident": resident, "prompt_set": set_name, "prompt": i}
            engine.speculation = model_draft
            try:
                plain = best_run(engine, prompt, args, speculative=False)
            except CapacityError as e:           # a prompt longer than -c allows
                emit(rows, {"kind": "skipped", **where, "reason": str(e)})
                continue
            plain_tok_s = plain.decode_tok_s
            emit(rows, {"kind": "plain", **where, "tok_s": round(plain_tok_s, 2), "tokens": len(plain.tokens)})
            for draft, nodes in drafts:
                engine.speculation = model_draft if draft == "model" else lookup
                engine.speculation.tree_nodes = nodes
                spec = best_run(engine, prompt, args, speculative=True)
                stats = spec.stats
                emit(rows, {"kind": "spec", **where, "draft": draft, "tree_nodes": nodes,
                            "tok_s": round(spec.decode_tok_s, 2),
                            "speedup": round(spec.decode_tok_s / plain_tok_s, 3) if plain_tok_s else None,
                            "acceptance": stats.get("spec_acceptance"),
                            "tokens_per_pass": stats.get("spec_tokens_per_pass"),
                            "mean_tree_nodes": stats.get("spec_tree_nodes"),
                            "plain_passes": stats.get("spec_plain_passes"), "tokens": len(spec.tokens),
                            "same_tokens": spec.tokens == plain.tokens if args.temp == 0 else None})
    engine.speculation = model_draft
    if lookup is not None:
        lookup.close()


def llama_ngl(config, weight_bytes: int) -> int:
    """The largest -ngl whose weights in VRAM (bench/offload.py's ngl_weight_bytes) fit `weight_bytes`."""
    from .offload import ngl_weight_bytes
    return max(n for n in range(config.num_hidden_layers + 2) if ngl_weight_bytes(config, n) <= weight_bytes)


def llama_bench_rows(args, resident: float, config, draft_bytes: int) -> list[dict]:
    """llama-bench's tg rate at the VRAM for weights ours holds, read two ways: `resident` of the target's
    layers and the draft ("pair": plain llama.cpp gets the draft's VRAM for the target too), and the target's
    share alone ("target": what llama-speculative's -ngl gets beside its resident draft, -ngld 99)."""
    share = int(resident * sum(layer_weight_bytes(config)))
    rows = []
    for counted, extra in (("pair", draft_bytes), ("target", 0)):
        ngl = 99 if resident >= 1 else llama_ngl(config, share + extra)
        if rows and rows[-1]["ngl"] == ngl:
            continue
        command = [args.llama_bench, "-m", args.target, "-ngl", str(ngl), "-p", "0", "-n", str(args.new_tokens),
                   "-r", "3", "-o", "json"]
        if args.llama_threads:
            command += ["-t", str(args.llama_threads)]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout)[0]
        rows.append({"kind": "llama-bench", "resident": resident, "vram": counted, "ngl": ngl,
                     "tok_s": round(float(result["avg_ts"]), 2), "command": " ".join(command)})
    return rows


def pass_curve_rows(args, rows: list[dict]) -> None:
    """Pass times of 1, 2, 4, ... curve_max tokens on the curve model at curve_resident."""
    from kestrel_stream.spec.measure import pass_seconds
    if args.curve_model:
        name = args.curve_model
        probe = ks.load(args.curve_model, device="cpu", max_seq_len=args.curve_max)
        config = probe.config
        probe.close()
        budget = None if args.device == "cpu" else target_budget(config, args.curve_resident, args.curve_max,
                                                                 args.curve_max)
        engine = ks.load(args.curve_model, device=args.device, mode=args.mode, vram_budget=budget,
                         max_seq_len=args.curve_max, max_batch=args.curve_max)     # a pass of curve_max: one step
    else:
        from bench.synthetic import random_q8_weights
        from kestrel_stream.loading.presets import PRESETS
        from kestrel_stream.run.engine import Engine
        name, config = f"preset {args.curve_preset}", PRESETS[args.curve_preset]
        device = "cpu" if args.device == "cpu" else "cuda"
        budget = None if device == "cpu" else target_budget(config, args.curve_resident, args.curve_max,
                                                            args.curve_max)
        engine = Engine(random_q8_weights(config, seed=0), device=device, mode=args.mode, max_seq_len=args.curve_max,
                        max_batch=args.curve_max, vram_budget=budget)
    resident = None if engine.device == "cpu" else args.curve_resident
    ids = np.arange(args.curve_max, dtype=np.int64) % engine.config.vocab_size
    with engine.new_session(args.curve_max) as session:
        first = None
        n = 1
        while n <= args.curve_max:
            seconds = pass_seconds(session, ids[:n])
            first = first or seconds
            emit(rows, {"kind": "pass_curve", "model": name, "mode": engine.mode, "resident": resident, "tokens": n,
                        "ms": round(seconds * 1e3, 4), "vs_one": round(seconds / first, 3)})
            n *= 2
    engine.close()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", "-m", required=True)
    p.add_argument("--draft", "-md", required=True)
    p.add_argument("--resident", default="0.5,0.25", help="target residencies (device only; 1: no budget, the "
                   "whole pair in VRAM, llama-bench at -ngl 99)")
    p.add_argument("--prompts", default=PROMPT_FILES, help="comma-separated prompt files (--- between prompts); "
                   "empty: the pass-time curve alone")
    p.add_argument("--chat", action="store_true")
    p.add_argument("-n", "--new-tokens", type=int, default=128)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--tree-nodes", default="1,32", help="comma-separated tree sizes (1: chains)")
    p.add_argument("--lookup", action="store_true", help="prompt lookup rows too")
    p.add_argument("--spec-policy", default="auto", choices=["auto", "always"])
    p.add_argument("--device", default="auto")
    p.add_argument("--mode", default="offload", help="the target's mode on the device (offload: the budgets are "
                   "mode offload's; gpu: the residency window)")
    p.add_argument("-c", "--max-seq-len", type=int, default=2048)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--llama-bench", default=None, help="path of llama-bench, run on the target at -ngl N")
    p.add_argument("--llama-threads", type=int, default=None)
    curve = p.add_mutually_exclusive_group()
    curve.add_argument("--curve-model", default=None, help="a qwen3-8b-shaped file for the pass-time curve")
    curve.add_argument("--curve-preset", default=None, help="random weights of a preset instead")
    p.add_argument("--curve-resident", type=float, default=0.25)
    p.add_argument("--curve-max", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.tree_nodes = [int(n) for n in args.tree_nodes.split(",")]
    args.residents = [float(r) for r in args.resident.split(",")]
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    from kestrel_stream.run.device_choice import resolve_device
    args.device, _ = resolve_device(args.device, "auto")
    if args.device == "cpu":
        args.mode = "cpu"
    prompt_sets = [(Path(f).stem, read_prompts(f, args.chat)) for f in args.prompts.split(",") if f]
    rows: list[dict] = []
    for resident in (args.residents if args.device == "cuda" else [None]) if prompt_sets else []:
        engine = load_pair(args, resident)
        emit(rows, {"kind": "load", "resident": resident, "mode": engine.mode, "device": engine.device,
                    "speculation": engine.speculation.describe(), "plan": engine.plan_summary()})
        spec_rows(engine, args, resident, prompt_sets, rows)
        if engine.speculation.curve is not None:     # what "auto" measured and decided from: pass time by tokens
            emit(rows, {"kind": "measured_curve", "resident": resident, **engine.speculation.curve.as_dict(),
                        "draft_s_per_token": engine.speculation.draft_s_per_token})
        config, draft_bytes = engine.config, engine.speculation.device_bytes()
        engine.close()
        if args.llama_bench and resident is not None:
            for row in llama_bench_rows(args, resident, config, draft_bytes):
                emit(rows, row)
    if args.curve_model or args.curve_preset:
        pass_curve_rows(args, rows)
    if args.out:
        from kestrel_stream.cli.bench import environment
        from .report import write_results
        notes = (f"target {args.target}, draft {args.draft}, {args.new_tokens} new tokens, temperature {args.temp}, "
                 f"best of {args.repeats}; decode tok/s (the prefill's token excluded)")
        out = write_results("spec-offload", environment(), rows,
                            ["kind", "resident", "prompt_set", "prompt", "draft", "tree_nodes", "tok_s", "speedup",
                             "acceptance", "tokens_per_pass", "mean_tree_nodes", "same_tokens", "vram", "ngl", "tokens",
                             "ms", "vs_one"], notes=notes, out_dir=Path(args.out))
        print(f"wrote {out}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
