"""The ``kestrel-stream`` command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kestrel_stream.errors import KestrelError
from kestrel_stream.cli.plan import cmd_calibrate, cmd_plan


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids: empty prompt")
    return ids


def progress_bar(desc: str):
    """A load-progress callback (bytes done of total) that shows a bar only when loading takes a moment."""
    from tqdm import tqdm
    bar = None

    def update(done: int, total: int, what: str = "") -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=0.5, file=sys.stderr,
                       leave=False)
        if what:
            bar.set_postfix_str(what[-40:], refresh=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return update


def vram_budget_arg(text: str):
    from kestrel_stream.run.budget import parse_vram_budget
    try:
        return parse_vram_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory or .gguf file")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--mode", default="auto", help="auto|cpu|gated|gpu|layers=N")
    p.add_argument("--vram-budget", default=None, type=vram_budget_arg,
                   help="device memory for gpu mode (weights + KV caches + activations): e.g. 2GiB, 1500MB, "
                        "0.5 (fraction of free VRAM); weights that do not fit stream over PCIe")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"],
                   help="gpu mode's KV cache: f16 (default) or f32 (the reference arithmetic)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the quantized cache")
    p.add_argument("--prof", action="store_true",
                   help="print the per-stage profile table of offloaded calls at exit (as KESTREL_PROF=1)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="record a Chrome trace (.json or .json.gz; view with `timeline` or Perfetto)")


def load_engine(args):
    import kestrel_stream as ks
    if getattr(args, "prof", False):
        from kestrel_stream.obs import prof
        prof.enable()
    if getattr(args, "trace", None):
        from kestrel_stream.obs import trace
        trace.start(args.trace, command=args.command)
    return ks.load(args.model, device=args.device, mode=args.mode, vram_budget=args.vram_budget,
                   max_seq_len=args.max_seq_len, cache=not args.no_cache, progress=progress_bar("loading"),
                   kv_dtype=args.kv_dtype)


def cmd_make_model(args) -> int:
    from kestrel_stream.loading.presets import PRESETS, make_model
    cfg = PRESETS[args.preset]
    from tqdm import tqdm
    from kestrel_stream.model.weights import hf_tensor_shapes
    total = len(hf_tensor_shapes(cfg))
    with tqdm(total=total, desc=f"writing {args.preset}", unit="tensor", delay=0.5, file=sys.stderr,
              leave=False) as bar:
        out = make_model(args.out_dir, args.preset, seed=args.seed, dtype=args.dtype,
                         on_tensor=lambda name: bar.update(1))
    print(f"wrote {args.preset} ({cfg.arch}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}, {args.dtype}) to {out}")
    return 0


def cmd_generate(args) -> int:
    engine = load_engine(args)
    result = engine.generate(args.prompt_ids, args.max_new_tokens)
    report = {
        "tokens": result.tokens,
        "prompt_len": result.prompt_len,
        "prefill_tok_s": round(result.prefill_tok_s, 2),
        "decode_tok_s": round(result.decode_tok_s, 2),
        "ms_per_token": round(1000.0 / result.decode_tok_s, 3) if result.decode_tok_s else None,
        "syncs_per_token": result.stats.get("syncs_per_token", 0.0),
        "launches_per_token": result.stats.get("launches_per_token", 0.0),
        "mode": engine.mode,
        "device": engine.device,
    }
    report.update(window_report(engine, result.stats))
    if args.json:
        print(json.dumps(report))
    else:
        print("tokens:", " ".join(map(str, result.tokens)))
        print(f"prefill {report['prefill_tok_s']} tok/s, decode {report['decode_tok_s']} tok/s, "
              f"{report['syncs_per_token']} syncs/token ({engine.device}, mode {engine.mode})")
    engine.close()
    return 0


def window_report(engine, stats: dict) -> dict:
    """The residency window's plan and per-token counters, when gpu mode streams weights."""
    from kestrel_stream.run.engine import WINDOW_COUNTERS
    window = getattr(engine.executor, "window_plan", None)
    if window is None:
        return {}
    keep = ("resident_bytes", "streamed_bytes_per_step", "slot_count", "slot_bytes", "prefetch_distance")
    out = {"window": {key: getattr(window, key) for key in keep} | {
        "vram_budget_bytes": engine.executor.vram_budget, "weight_budget_bytes": window.budget_bytes,
        "resident_items": len(window.resident), "streamed_items": len(window.streamed)}}
    for key in WINDOW_COUNTERS:
        if f"{key}_per_token" in stats:
            out[f"{key}_per_token"] = round(stats[f"{key}_per_token"], 3)
    return out


def cmd_bench(args) -> int:
    from kestrel_stream.cli.bench import environment, measure
    from kestrel_stream.loading.presets import ensure_preset
    if not args.model:
        args.model = str(ensure_preset(args.preset))
    engine = load_engine(args)
    result = measure(engine, prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats)
    result.update(model=args.model, preset=args.preset, **environment())
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{Path(args.model).name}: prefill {result['prefill_tok_s']} tok/s, decode {result['decode_tok_s']} "
              f"tok/s ({result['ms_per_token']} ms/token), {result['syncs_per_token']} syncs/token "
              f"[{engine.device}, mode {engine.mode}]")
    engine.close()
    return 0


def cmd_serve(args) -> int:
    from kestrel_stream.serve.daemon import run_daemon
    return run_daemon(args)


def cmd_timeline(args) -> int:
    from kestrel_stream.obs.timeline import run
    out, summary = run(args.trace_file, args.output, args.steps)
    print(summary)
    print(f"wrote {out}")
    return 0


def cmd_demo(args) -> int:
    from kestrel_stream.cli.demo import run_demo
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    from kestrel_stream.loading.presets import PRESETS
    parser = argparse.ArgumentParser(prog="kestrel-stream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random Hugging Face checkpoint of a preset's shapes")
    p.add_argument("out_dir")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("generate", help="greedy decode from prompt token ids")
    add_engine_args(p)
    p.add_argument("--prompt-ids", required=True, type=parse_ids)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="prefill and decode throughput")
    add_engine_args(p)
    p.set_defaults(model=None)
    for action in p._actions:
        if action.dest == "model":
            action.required = False
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="used when --model is not given")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("plan", help="print every weight's placement, fused group, FLOPs, bytes and why")
    p.add_argument("--model", required=True)
    p.add_argument("--mode", default="auto", help="auto|cpu|gated|gpu|layers=N")
    p.add_argument("--batch", type=int, default=1, help="tokens per step (M)")
    p.add_argument("--profile", default=None, help="h200 | seed | a profile JSON file (default: calibrate this GPU)")
    p.add_argument("--vram-budget", default=None, help="also show gpu mode's residency window under this budget")
    p.add_argument("--max-seq-len", type=int, default=None, help="KV positions per session (with --vram-budget)")
    p.add_argument("--max-batch", type=int, default=32, help="sessions per step (with --vram-budget)")
    p.add_argument("--max-sessions", type=int, default=None, help="KV block tables (with --vram-budget)")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"], help="gpu mode's KV pool (with --vram-budget)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("calibrate", help="measure this machine's device profile for the cost-model gate")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("serve", help="run the daemon: own the model, answer clients on a socket")
    add_engine_args(p)
    from kestrel_stream.serve.daemon import add_serve_args
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("timeline", help="HTML timeline and summary of a --trace file")
    p.add_argument("trace_file", metavar="TRACE")
    p.add_argument("-o", "--output", default=None, help="HTML file to write (default: beside TRACE)")
    p.add_argument("--steps", default=None, help="a:b selects steps a..b-1 (0 is the first step traced)")
    p.set_defaults(func=cmd_timeline)

    p = sub.add_parser("demo", help="make the tiny model if missing and run decode steps on it")
    p.add_argument("--dir", default=None, help="where the model and outputs go (default: the cache dir)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 0:
        print("kestrel-stream: error: --max-new-tokens must be >= 0", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (KestrelError, ValueError, FileNotFoundError) as e:
        print(f"kestrel-stream: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        from kestrel_stream.obs import trace
        written = trace.stop()
        if written is not None:
            print(f"kestrel-stream: trace written to {written}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
