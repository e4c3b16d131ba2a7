"""Where a speculative round's time goes: its parts timed, and the target's pass alone beside its predicted time.

    PYTHONPATH=. python3 -m bench.spec_rounds --target T.gguf --draft D.gguf [--resident 0.5] [--mode offload]
        [--policy always] [--draft-max 8] [--tree-nodes 1] [-n 128] [--prompts FILE] [--count 2] [--no-chat]
        [-c 2048] [--out DIR]

The target at `--resident` of its layer weights (bench/spec_offload.load_pair: the draft resident, its VRAM
inside the budget), greedy.  Per prompt: plain and speculative tok/s, and each part of the rounds (count, sum
and median ms): `plan` (the draft: `catch_up`, the tokens it lacks, and `draft_chain`, its k chained steps),
`verify` (the target's pass over the round), `verdict`, `keep`, `record`; `round` is the whole of
SpecDecoder.next_tokens, so what it holds beyond plan + verify + the rest is overhead of the round itself.
Then the target's pass alone at 1, 2, 3, ... tokens on a session 500 tokens in (argmax rows, as a verify pass
takes them) with, in mode offload, the placement the executor chooses for that many tokens and its predicted
time, and the draft's chains and catch-up passes alone.  The same file as its own draft keeps every draft
(random weights; the round at its longest).  Rows: JSON lines; --out writes a result file.
"""
from __future__ import annotations

import argparse
import collections
import json
import time
import types

import numpy as np

from kestrel_stream.spec import decoder as spec_decoder
from kestrel_stream.spec import draft_model

from .report import write_results
from .spec_offload import load_pair
from .speculative import read_prompts

PASS_TOKENS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32)
CONTEXT = 500


class Parts:
    """Wall time of named calls, patched onto their owners while the bench runs."""

    def __init__(self):
        self.seconds = collections.defaultdict(list)
        self.patched: list = []         # (owner, name, what it held there, or None: nothing of its own)

    def time(self, owner, name: str, key: str) -> None:
        call = getattr(owner, name)
        self.patched.append((owner, name, vars(owner).get(name)))

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[key].append(time.perf_counter() - started)
        setattr(owner, name, timed)

    def restore(self) -> None:
        """Every patched call as it was, the latest patch first (the bench leaves its process as it found it)."""
        for owner, name, own in reversed(self.patched):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self.patched.clear()

    def summary(self) -> dict:
        return {key: [len(v), round(1e3 * sum(v), 2), round(1e3 * float(np.median(v)), 3)]
                for key, v in self.seconds.items()}


def instrument(engine, parts: Parts) -> None:
    for name in ("next_tokens", "plan", "verdict", "keep", "record"):
        parts.time(spec_decoder.SpecDecoder, name, "round" if name == "next_tokens" else name)
    parts.time(draft_model.DraftModelStream, "_catch_up", "catch_up")
    parts.time(engine.speculation.draft.engine, "generate_chained", "draft_chain")
    round_call = spec_decoder.SpecDecoder.next_tokens

    def next_tokens(self, *args, **kwargs):          # the target session's passes inside a round: `verify`
        if "prefill" not in vars(self.session):
            parts.time(self.session, "prefill", "verify")
        return round_call(self, *args, **kwargs)
    parts.patched.append((spec_decoder.SpecDecoder, "next_tokens", round_call))
    spec_decoder.SpecDecoder.next_tokens = next_tokens


def context_of(engine) -> int:
    """The tokens a session holds before the passes alone: CONTEXT, or less where the engine's room is smaller."""
    return max(1, min(CONTEXT, engine.max_seq_len - max(PASS_TOKENS) - 1))


def pass_rows(engine, repeats: int = 7) -> list[dict]:
    """The target's pass alone at PASS_TOKENS tokens, CONTEXT tokens in, beside the placement's prediction."""
    rows = []
    executor, context = engine.executor, context_of(engine)
    with engine.new_session(context + max(PASS_TOKENS) + 1) as s:
        ids = (np.arange(context + max(PASS_TOKENS)) * 7) % min(1000, engine.config.vocab_size)
        s.prefill(ids[:context], logits="last")
        for n in PASS_TOKENS:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                s.prefill(ids[context:context + n], logits="argmax")
                times.append(time.perf_counter() - started)
                s.truncate(context)
            row = {"kind": "pass", "tokens": n, "best_ms": round(1e3 * min(times), 3),
                   "median_ms": round(1e3 * float(np.median(times)), 3)}
            if getattr(executor, "mode", None) == "offload" and hasattr(executor, "placement_for"):
                from scheduler.offload import HOME_LETTERS
                placement = executor.placement_for(n)
                row["placement"] = "".join(HOME_LETTERS[h] for h in placement.homes)
                row["predicted_ms"] = round(placement.predicted.total_us / 1e3, 3)
            rows.append(row)
    return rows


def draft_rows(draft_engine, repeats: int = 5) -> list[dict]:
    """The draft's k chained steps and its catch-up passes of n tokens, alone, CONTEXT tokens in."""
    rows = []
    context = context_of(draft_engine)
    with draft_engine.new_session(context + 32) as s:
        s.prefill([i % draft_engine.config.vocab_size for i in range(context)], logits="argmax")

        def median_ms(run) -> float:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                run()
                times.append(time.perf_counter() - started)
                s.truncate(context)
            return round(1e3 * float(np.median(times)), 3)
        for k in (1, 4, 8) if draft_engine.generate_chained(s, 7, 1) is not None else ():    # None: no chains here
            s.truncate(context)
            rows.append({"kind": "draft_chain", "k": k,
                         "median_ms": median_ms(lambda: draft_engine.generate_chained(s, 7, k))})
        s.truncate(context)
        for n in (1, 8):
            rows.append({"kind": "draft_catch_up", "tokens": n,
                         "median_ms": median_ms(lambda: s.prefill(list(range(n)), logits="argmax"))})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--resident", type=float, default=0.5)
    p.add_argument("--mode", default="offload")
    p.add_argument("--device", default="cuda")
    p.add_argument("--policy", default="always", choices=["auto", "always"])
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--tree-nodes", type=int, default=1, help="1: chains")
    p.add_argument("-n", "--new-tokens", type=int, default=128)
    p.add_argument("--prompts", default="bench/speculative_prompts.txt")
    p.add_argument("--count", type=int, default=2, help="prompts of the file to run")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="each prompt a user message in the model's chat template (--no-chat: the text itself)")
    p.add_argument("-c", "--max-seq-len", type=int, default=2048)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    pair = types.SimpleNamespace(target=args.target, device=args.device, mode=args.mode, max_seq_len=args.max_seq_len,
                                 draft=args.draft, draft_max=args.draft_max, spec_policy=args.policy)
    engine = load_pair(pair, args.resident if args.device != "cpu" else None)
    engine.speculation.tree_nodes = args.tree_nodes
    parts = Parts()
    instrument(engine, parts)
    rows = []
    try:
        for i, prompt in enumerate(read_prompts(args.prompts, args.chat)[:args.count]):
            kw = dict(temperature=0.0, seed=1, ignore_eos=True)
            engine.generate(prompt, 8, speculative=True, **kw)
            plain = engine.generate(prompt, args.new_tokens, speculative=False, **kw)
            parts.seconds.clear()
            spec = engine.generate(prompt, args.new_tokens, speculative=True, **kw)
            rows.append({"kind": "spec", "prompt": i, "plain_tok_s": round(plain.decode_tok_s, 1),
                         "spec_tok_s": round(spec.decode_tok_s, 1),
                         "tokens_per_pass": spec.stats.get("spec_tokens_per_pass"),
                         "parts": parts.summary()})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        parts.restore()
    curves = getattr(getattr(engine.executor, "profile", None), "host_format_tokens_GBps", None)
    if curves:
        rows.append({"kind": "kernel_rates", "curves": curves})
        print(json.dumps(rows[-1]), flush=True)
    for row in pass_rows(engine) + draft_rows(engine.speculation.draft.engine):
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from kestrel_stream.cli.bench import environment
        flat = [{**{k: v for k, v in r.items() if k != "parts"},
                 **{f"{k}_ms": f"{v[1]} / {v[2]} ({v[0]})" for k, v in r.get("parts", {}).items()}} for r in rows]
        columns = ["kind", "prompt", "plain_tok_s", "spec_tok_s", "tokens_per_pass", "round_ms", "plan_ms",
                   "catch_up_ms", "draft_chain_ms", "verify_ms", "keep_ms", "tokens", "k", "best_ms", "median_ms",
                   "predicted_ms", "placement", "curves"]
        write_results("spec-rounds", environment(), flat, [c for c in columns if any(c in r for r in flat)],
                      notes="round parts: sum ms / median ms (count) over one generation's rounds", out_dir=args.out)
    engine.close()
    return rows


if __name__ == "__main__":
    main()
