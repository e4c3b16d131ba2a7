"""Speculative decoding against plain decoding at batch 1, through Engine.generate (the path users take).

    PYTHONPATH=. python3 -m bench.speculative --model M (-md DRAFT | --spec lookup) --prompts FILE
        [--chat] [-n 128] [--draft-max 4,8,16] [--spec-policy auto|always] [--device auto] [--mode auto]
        [--vram-budget B] [--temp 0] [--repeats 3] [--out DIR]

FILE holds prompts separated by lines of `---` (--chat: each is a user message in the model's chat
template).  Per prompt and draft_max: plain and speculative decode tok/s (best of --repeats after a
warm-up), the speedup, the acceptance, tokens per target pass, and (greedy) whether the tokens are the
same; the last row per draft_max is the whole file's (tokens over seconds).  Rows go to stdout as JSON
lines, and with --out a result file under DIR.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kestrel_stream as ks


def read_prompts(path: str, chat: bool) -> list:
    texts = [p.strip("\n") for p in Path(path).read_text().split("\n---\n")]
    texts = [t for t in texts if t.strip()]
    return [[{"role": "user", "content": t}] for t in texts] if chat else texts


def best_run(engine, prompt, args, speculative: bool):
    kw = dict(temperature=args.temp, seed=1, speculative=speculative, ignore_eos=args.ignore_eos)
    engine.generate(prompt, 4, **kw)                       # warm caches, capture graphs, the draft's too
    runs = [engine.generate(prompt, args.new_tokens, **kw) for _ in range(args.repeats)]
    return max(runs, key=lambda r: r.decode_tok_s)


def row(name, draft_max, plain_tokens, plain_s, spec_tokens, spec_s, stats, same):
    plain_tok_s = plain_tokens / plain_s if plain_s else 0.0
    spec_tok_s = spec_tokens / spec_s if spec_s else 0.0
    return {"prompt": name, "draft_max": draft_max, "plain_tok_s": round(plain_tok_s, 2),
            "spec_tok_s": round(spec_tok_s, 2), "speedup": round(spec_tok_s / plain_tok_s, 3) if plain_tok_s else None,
            "acceptance": stats.get("spec_acceptance"), "tokens_per_pass": stats.get("spec_tokens_per_pass"),
            "draft_length": stats.get("spec_draft_length"), "plain_passes": stats.get("spec_plain_passes"),
            "tokens": spec_tokens, "same_tokens": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", required=True)
    draft = p.add_mutually_exclusive_group(required=True)
    draft.add_argument("-md", "--model-draft", default=None)
    draft.add_argument("--spec", default=None, choices=["lookup"])
    p.add_argument("--prompts", required=True, help="a text file of prompts separated by lines of ---")
    p.add_argument("--chat", action="store_true", help="each prompt is a user message (the chat template)")
    p.add_argument("-n", "--new-tokens", type=int, default=128)
    p.add_argument("--draft-max", default="8", help="comma-separated chain lengths to try")
    p.add_argument("--spec-policy", default="auto", choices=["auto", "always"],
                   help="auto: the cost model sets each round's length (and may turn drafting off); always: "
                        "every round drafts")
    p.add_argument("--device", default="auto")
    p.add_argument("--mode", default="auto")
    p.add_argument("--vram-budget", default=None)
    p.add_argument("-c", "--max-seq-len", type=int, default=None)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --new-tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write a result file (json + md) under this directory")
    args = p.parse_args()
    engine = ks.load(args.model, device=args.device, mode=args.mode, vram_budget=args.vram_budget,
                     max_seq_len=args.max_seq_len, draft=args.model_draft, spec=args.spec,
                     spec_policy=args.spec_policy)
    prompts = read_prompts(args.prompts, args.chat)
    rows = []
    for draft_max in [int(k) for k in args.draft_max.split(",")]:
        engine.speculation.draft_max = draft_max
        totals = [0, 0.0, 0, 0.0, {"spec_drafted": 0, "spec_accepted": 0, "spec_passes": 0}, True]
        for i, prompt in enumerate(prompts):
            plain = best_run(engine, prompt, args, speculative=False)
            spec = best_run(engine, prompt, args, speculative=True)
            same = spec.tokens == plain.tokens if args.temp == 0 else None
            steps = max(len(plain.tokens) - 1, 0), max(len(spec.tokens) - 1, 0)
            rows.append(row(f"#{i}", draft_max, steps[0], plain.decode_s, steps[1], spec.decode_s, spec.stats, same))
            print(json.dumps(rows[-1]), flush=True)
            totals[0] += steps[0]
            totals[1] += plain.decode_s
            totals[2] += steps[1]
            totals[3] += spec.decode_s
            for key in totals[4]:
                totals[4][key] += spec.stats.get(key, 0)
            totals[5] = totals[5] and bool(same) if same is not None else None
        t = totals[4]
        stats = {"spec_acceptance": round(t["spec_accepted"] / t["spec_drafted"], 4) if t["spec_drafted"] else 0.0,
                 "spec_tokens_per_pass": round((t["spec_accepted"] + t["spec_passes"]) / t["spec_passes"], 4)
                 if t["spec_passes"] else 0.0}
        rows.append(row("all", draft_max, totals[0], totals[1], totals[2], totals[3], stats, totals[5]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        from kestrel_stream.cli.bench import environment
        from .report import write_results
        env = environment()
        notes = (f"target {args.model}, draft {args.model_draft or args.spec}, device {engine.device}, "
                 f"mode {engine.mode}, {args.new_tokens} new tokens, temperature {args.temp}; decode tok/s "
                 f"(the first token, from the prefill, excluded), best of {args.repeats}")
        out = write_results("speculative", env, rows, ["prompt", "draft_max", "plain_tok_s", "spec_tok_s", "speedup",
                                                       "acceptance", "tokens_per_pass", "tokens", "same_tokens"],
                            notes=notes, out_dir=Path(args.out))
        print(f"wrote {out}", file=sys.stderr)
    engine.close()


if __name__ == "__main__":
    main()
