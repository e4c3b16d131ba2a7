"""The ``kestrel-stream`` command line: the parser and its verbs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kestrel_stream.errors import KestrelError
from kestrel_stream.options import Environment
from kestrel_stream.cli.args import (UsageError, bars_shown, check_room, choose_device, int_at_least,
                                     join_negative_ids, mode_arg, new_tokens_arg, parse_ids, resolve_model_arg)
from kestrel_stream.cli.engine_args import (MODEL_HELP, Parser, add_draft_args, add_engine_args, load_engine,
                                            prepare_engine, tuning_group)
from kestrel_stream.cli.plan import cmd_calibrate, cmd_plan

DESCRIPTION = """\
An asynchronous, stream-pipelined offload scheduler for LLM inference: the GPU
engine on cuda-python where there is a GPU, the numpy CPU engine elsewhere.

examples:
  kestrel-stream chat -m unsloth/Qwen3-0.6B-GGUF:Q4_K_M          # talk to a GGUF from the Hugging Face Hub
  kestrel-stream generate -m model.Q4_K_M.gguf -p "Once upon a time" -n 64
  kestrel-stream generate -m Qwen/Qwen3-0.6B --chat "What is 2+2?"   # one turn, the model's chat template
  kestrel-stream serve -m model.gguf --http 127.0.0.1:8080       # OpenAI API; a chat page at http://127.0.0.1:8080/
  kestrel-stream demo                                   # tiny model, daemon, two clients, a timeline
  kestrel-stream make-model /tmp/m --preset tiny        # random Qwen3 weights, Hugging Face layout
  kestrel-stream generate -m /tmp/m --prompt-ids 1,2,3 -n 16 --json
  kestrel-stream bench --preset qwen3-0.6b --device cpu
  kestrel-stream serve -m /tmp/m                        # the daemon for Python clients

`kestrel-stream VERB --help` lists a verb's flags and their defaults.
"""


def cmd_make_model(args) -> int:
    from kestrel_stream.loading.presets import PRESETS, make_model
    cfg = PRESETS[args.preset]
    from tqdm import tqdm
    from kestrel_stream.model.weights import hf_tensor_shapes
    total = len(hf_tensor_shapes(cfg))
    with tqdm(total=total, desc=f"writing {args.preset}", unit="tensor", delay=0.5, file=sys.stderr,
              leave=False, disable=not bars_shown()) as bar:
        out = make_model(args.out_dir, args.preset, seed=args.seed, dtype=args.dtype,
                         on_tensor=lambda name: bar.update(1))
    print(f"wrote {args.preset} ({cfg.arch}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}, {args.dtype}) to {out}")
    return 0


def cmd_generate(args) -> int:
    from kestrel_stream.cli.bench import speeds
    from kestrel_stream.cli.text_args import generate_kwargs, prompt_from_args
    from kestrel_stream.text.generation import prompt_ids
    engine = load_engine(args)
    prompt = prompt_from_args(args, engine)
    prompt_len = len(prompt_ids(engine, prompt))
    if args.max_new_tokens == -1:       # until the end of generation: as far as the session has room
        args.max_new_tokens = max(engine.max_seq_len - prompt_len + 1, 1)
    check_room(engine, prompt_len, args.max_new_tokens, "-n/--max-new-tokens")
    # a first call pays one-time costs (page faults, dequantized caches, graph capture): a short run of
    # the same prompt takes them, so the reported speeds are the steady ones; a --trace keeps to the run asked for
    warmup = None if args.trace else engine.generate(prompt, min(2, args.max_new_tokens), **generate_kwargs(args))
    stream = engine.generate(prompt, args.max_new_tokens, stream=True, **generate_kwargs(args))
    show_text = engine.tokenizer is not None and not args.json and args.prompt_ids is None
    for piece in stream:
        if show_text and piece.text:
            print(piece.text, end="", flush=True)
    result = stream.result
    if show_text:
        print()
    report = {
        "tokens": result.tokens,
        "prompt_len": result.prompt_len,
        **speeds(engine, result.prefill_tok_s, result.decode_tok_s, result.stats),
        "warmup_s": round(warmup.prefill_s + warmup.decode_s, 4) if warmup else None,
        "stop_reason": result.stop_reason,
    }
    if result.text is not None:
        report["text"] = result.text
    report.update(window_report(engine, result.stats))
    if "spec_passes" in result.stats:
        report.update({key: result.stats[key] for key in SPEC_REPORT})
        curve = engine.speculation.curve        # policy auto: the pass times the draft lengths came from
        report["spec_policy"] = engine.speculation.policy
        report["spec_pass_curve"] = curve.as_dict() if curve is not None else None
    if args.json:
        print(json.dumps(report))
    else:
        if not show_text:
            print("tokens:", " ".join(map(str, result.tokens)))
        print(f"prefill {report['prefill_tok_s']} tok/s, decode {report['decode_tok_s']} tok/s, "
              f"{report['syncs_per_token']} syncs/token ({engine.device}, mode {engine.mode}"
              + (f"; after a {report['warmup_s']} s warm-up run)" if warmup else "; first run, no warm-up)")
              + f"; stopped: {result.stop_reason}", file=sys.stderr if show_text else sys.stdout)
    engine.close()
    return 0


SPEC_REPORT = ("spec_acceptance", "spec_tokens_per_pass", "spec_draft_length", "spec_drafted", "spec_accepted",
               "spec_passes", "spec_plain_passes")


def window_report(engine, stats: dict) -> dict:
    """The residency window's plan and per-token counters, when gpu mode streams weights."""
    from kestrel_stream.run.engine import WINDOW_COUNTERS
    window = engine.executor.window_plan
    if window is None:
        return {}
    keep = ("resident_bytes", "streamed_bytes_per_step", "slot_count", "slot_bytes", "prefetch_distance")
    out = {"window": {key: getattr(window, key) for key in keep} | {
        "vram_budget_bytes": engine.executor.backend.memory.budget_bytes, "weight_budget_bytes": window.budget_bytes,
        "resident_items": len(window.resident), "streamed_items": len(window.streamed)}}
    for key in WINDOW_COUNTERS:
        if f"{key}_per_token" in stats:
            out[f"{key}_per_token"] = round(stats[f"{key}_per_token"], 3)
    return out


def cmd_bench(args) -> int:
    from kestrel_stream.cli.bench import environment, measure, measure_bar, preset_checkpoint
    preset = None
    if not args.model:
        preset = args.preset
        args.model = str(preset_checkpoint(preset))
    engine = load_engine(args)
    check_room(engine, args.prompt_len, args.new_tokens, "--prompt-len/--new-tokens")
    with measure_bar(args.repeats) as bar:
        result = measure(engine, prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
                         on_run=lambda: bar.update(1))
    result.update(model=args.model, preset=preset, **environment(args.environment))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{Path(args.model).name}: {args.prompt_len}-token prompt, {args.new_tokens} new tokens, median of "
              f"{args.repeats} run(s) after a warm-up: prefill {result['prefill_tok_s']} tok/s, decode "
              f"{result['decode_tok_s']} tok/s ({result['ms_per_token']} ms/token), {result['syncs_per_token']} "
              f"syncs/token [{engine.device}, mode {engine.mode}]")
    engine.close()
    return 0


def cmd_serve(args) -> int:
    from kestrel_stream.serve.daemon import run_daemon
    from kestrel_stream.serve.devices import serve_devices
    from kestrel_stream.serve.endpoint import check_listen_addresses
    from kestrel_stream.serve.flags import check_serve_args
    from kestrel_stream.serve.http.server import http_options
    from kestrel_stream.loading.hub import is_hub_name
    check_serve_args(args)          # bad serve and --http flags fail first: no device notice, no load
    if args.served_model_name is None and is_hub_name(args.model):
        args.served_model_name = args.model         # the name asked for, not its cache folder's
    http_options(args)
    check_listen_addresses(args)    # a port in use: one line, before the model loads
    serve_devices(args)             # --devices: what this machine has, and --device from them
    prepare_engine(args)
    return run_daemon(args, args.environment)


def cmd_plan_of(args) -> int:
    resolve_model_arg(args)         # a Hub name: fetched (or found in the cache) before its config is read
    return cmd_plan(args)


def cmd_chat(args) -> int:
    from kestrel_stream.cli.chat import run_chat
    return run_chat(args, load_engine(args))


def cmd_timeline(args) -> int:
    from kestrel_stream.obs.timeline import run
    out, summary = run(args.trace_file, args.output, args.steps)
    print(summary)
    print(f"wrote {out}")
    return 0


def cmd_demo(args) -> int:
    from kestrel_stream.cli.demo import run_demo
    args.device = choose_device(args)[0]       # the daemon it starts is told the device: one notice, here
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    from kestrel_stream.loading.presets import PRESETS
    from kestrel_stream import __version__
    parser = Parser(prog="kestrel-stream", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kestrel-stream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    parser.verbs = sub.choices          # verb -> its parser: its own usage on its errors

    p = sub.add_parser("make-model", help="write a random Hugging Face checkpoint of a preset's shapes",
                       description="Write a random Hugging Face checkpoint (config.json + safetensors) of a "
                                   "preset's shapes, tensor by tensor, sharded at 2 GiB.")
    p.add_argument("out_dir", help="directory to write (made if missing)")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS),
                   help="tiny: Qwen3-shaped, 2 layers; llama-tiny; llama3-tiny (Llama 3.x rope scaling, "
                        "head_dim 32), mistral-tiny (sliding window, head_dim 80), qwen2-tiny (q/k/v bias, YaRN); "
                        "the real shapes of the Qwen3 models")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"], help="stored dtype")
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("generate", help="generate text (or token ids) from a prompt, greedy or sampled",
                       description="Generate from a text prompt, a chat message or token ids, greedy (the "
                                   "default) or sampled; prints the text as it comes, then the speeds "
                                   "(measured after a short warm-up run).")
    tuning = tuning_group(p)
    add_engine_args(p, tuning)
    from kestrel_stream.cli.text_args import add_text_args
    add_text_args(p, parse_ids)
    add_draft_args(p)
    p.add_argument("-n", "--max-new-tokens", type=new_tokens_arg, default=-1, metavar="N",
                   help="tokens to generate; -1 (the default): until the end of generation, as far as the "
                        "session has room (prompt + N - 1 positions within --max-seq-len)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_generate)

    from kestrel_stream.cli.chat import add_chat_args
    p = sub.add_parser("chat", help="talk with a model in the terminal",
                       description="A conversation in the terminal with the model's chat template; the answer "
                                   "streams as it is generated.  Earlier turns stay in the session's KV cache, so "
                                   "each turn computes only its own tokens.  A line ending in \\ continues on the "
                                   "next; \"\"\" starts and ends a block of lines.  /reset starts again, "
                                   "/system TEXT sets the system message (and starts again), /exit or end of "
                                   "input (Ctrl-D) leaves; Ctrl-C stops an answer and keeps the conversation.")
    add_engine_args(p, tuning_group(p))
    add_chat_args(p)
    add_draft_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="prefill and decode throughput",
                       description="Prefill and decode throughput: the median of --repeats greedy generations "
                                   "after one warm-up.  Without --model, a random checkpoint of --preset is "
                                   "written once under the cache dir ($KESTREL_CACHE_DIR, default "
                                   "~/.cache/kestrel-stream/models) and reused.")
    add_engine_args(p, tuning_group(p))
    p.set_defaults(model=None)
    for action in p._actions:
        if action.dest == "model":
            action.required = False
            action.help += " (default: a random checkpoint of --preset)"
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="used when --model is not given")
    p.add_argument("--prompt-len", type=int_at_least(1), default=32, metavar="N", help="random prompt tokens")
    p.add_argument("--new-tokens", type=int_at_least(1), default=64, metavar="N", help="tokens generated per run")
    p.add_argument("--repeats", type=int_at_least(1), default=3, metavar="N", help="measured runs (median)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the machine and commit")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("plan", help="print every weight's placement, fused group, FLOPs, bytes and why")
    p.add_argument("-m", "--model", required=True, metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--mode", default="auto", type=mode_arg, help="auto|cpu|gated|gpu|offload|layers=N|layers=N+head")
    p.add_argument("--batch", type=int_at_least(1), default=1, help="tokens per step (M)")
    p.add_argument("--profile", default=None, help="h200 | seed | a profile JSON file (default: calibrate this GPU)")
    p.add_argument("--vram-budget", default=None, help="also show gpu mode's residency window under this budget")
    p.add_argument("--max-seq-len", type=int_at_least(1), default=None,
                   help="KV positions per session (with --vram-budget; default: 2048 or the model's context)")
    p.add_argument("--max-batch", type=int_at_least(1), default=32, help="sessions per step (with --vram-budget)")
    p.add_argument("--max-sessions", type=int_at_least(1), default=None,
                   help="KV block tables (with --vram-budget; default: 2 x --max-batch)")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"], help="gpu mode's KV pool (with --vram-budget)")
    p.add_argument("--gguf-blocks", default="native", choices=["native", "q8_0"],
                   help="count a GGUF's Q4_0 / Q4_K / Q6_K tensors in their blocks (native) or as Q8_0")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_draft_args(p)
    p.set_defaults(func=cmd_plan_of)

    p = sub.add_parser("calibrate", help="measure this machine's device profile for the cost-model gate")
    p.add_argument("--verbose", action="store_true", help="say why there is no GPU")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("serve", help="run the daemon: own the model, answer clients on a socket (and HTTP)",
                       description="Run the daemon: it owns the model and batches every client's steps; Python "
                                   "clients on a Unix socket (or --tcp), other tools on the OpenAI-compatible "
                                   "HTTP API with --http, which also serves a chat page at /.")
    tuning = tuning_group(p)
    add_engine_args(p, tuning)
    from kestrel_stream.cli.serve_help import sorted_flags
    from kestrel_stream.serve.flags import add_serve_args
    add_serve_args(sorted_flags(p, tuning))
    add_draft_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("timeline", help="HTML timeline and summary of a --trace file")
    p.add_argument("trace_file", metavar="TRACE")
    p.add_argument("-o", "--output", default=None, help="HTML file to write (default: beside TRACE)")
    p.add_argument("--steps", default=None, help="a:b selects steps a..b-1 (0 is the first step traced)")
    p.set_defaults(func=cmd_timeline)

    p = sub.add_parser("demo", help="make the tiny model if missing and run decode steps on it")
    p.add_argument("--dir", default=None,
                   help="where the model and outputs go (default: $KESTREL_CACHE_DIR/demo, else "
                        "~/.cache/kestrel-stream/demo)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: the GPU when there is one, else the CPU engine")
    p.add_argument("--verbose", action="store_true", help="say why there is no GPU")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    try:
        return run_command(argv)
    except BrokenPipeError:
        # `kestrel-stream ... | head`: the reader left. No traceback, and none at exit either, when Python
        # flushes stdout into the closed pipe: stdout goes to /dev/null (the signal module's SIGPIPE note).
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141                  # 128 + SIGPIPE, what a shell reports for a writer the pipe ended


def run_command(argv=None) -> int:
    argv = join_negative_ids(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    if not argv:                    # a bare `kestrel-stream`: the help, as for a usage error
        parser.print_help(sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:                     # the verb's usage, not the top level's: the flags that verb has
        parser.verbs[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.environment = Environment.from_env()     # the daemon's and result files' variables, read once, here
    try:
        return args.func(args)
    except UsageError as e:
        parser.verbs[args.command].print_usage(sys.stderr)
        print(f"kestrel-stream {args.command}: error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:
        print(f"kestrel-stream: error: out of memory ({e or 'an allocation failed'}); a smaller --max-seq-len "
              f"or model needs less", file=sys.stderr)
        return 1
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
