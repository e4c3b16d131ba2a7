"""Drafting policies replayed over a real pair's text: tokens a pass and modeled tok/s, without a GPU.

    python3 -m bench.spec_replay --target T.gguf --draft D.gguf --prompts bench/speculative_prompts.txt --chat \
        [-n 128] [--curve 1:10.0,2:10.6,4:12.2,8:14.6,16:20.7] [--draft-ms 0.83] [--out DIR]

Greedy speculation keeps a drafted token exactly where it equals the
target's own greedy token, and a chain stops at its first miss, so what a
round keeps depends only on the target's greedy text and on the draft's rows
along it.  Both are made once per prompt on this machine (the target's
``generate``, then one draft prefill over prompt + text, every row's top
candidates kept); each policy is then replayed round by round over them:

- ``chain k`` (fixed) and ``auto k`` (spec/cost.py's choose_draft_length with
  the running acceptance, as the engine's policy "auto" does);
- ``gate k p``: the chain stops drafting at the first token the draft gives
  less than p (its drafting time saved where it is unsure);
- ``sibling k s``: beside each chain token, the draft's second candidate as a
  leaf where it has s of the first one's chance (no extra draft pass: the
  chain's own rows hold it); where the target's token at the miss is that
  leaf, the round keeps it and the target's token after it.

A round's time is the target's pass over its nodes (``--curve``: ms at token
counts, linear between, spec/cost.py's PassCurve) plus the drafted tokens at
``--draft-ms`` each, and one more draft pass where the draft lags the text (its
catch-up: after a plain pass, or after a fully kept chain, whose last draft the
chain never fed); plain decoding is a one-token pass a token.  The default
curve has the shape of mode offload's pass at 50 % resident on the H200 (a
1.7B Q4_K_M, bench/results/2026-12-05-h200-spec-rounds-pricing.md) at the real
pair's one-token 10 ms; the window's flatter curve was 1:11.4,2:12.0,4:12.4,8:13.8.  The figures
are a model, not a measurement: they rank policies by what the pair's text
allows; bench/spec_offload.py measures the engine on a device.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import kestrel_stream as ks
from kestrel_stream.spec.cost import Acceptance, PassCurve, choose_draft_length
from kestrel_stream.text.generation import prompt_ids

from .speculative import read_prompts

TOP = 4                 # draft candidates kept per row


@dataclass
class Rows:
    """One prompt's target text and the draft's candidates along it: row j predicts text[j]."""
    text: np.ndarray            # int64 [n]
    top: np.ndarray             # int64 [n, TOP], the draft's most likely first
    chance: np.ndarray          # float64 [n, TOP], their probabilities


def draft_rows(target, draft, prompt, new_tokens: int) -> Rows:
    ids = prompt_ids(target, prompt)
    text = list(target.generate(prompt, new_tokens, speculative=False).tokens)
    session = draft.new_session(len(ids) + len(text) + 1)
    try:
        logits = session.prefill(ids + text[:-1])[len(ids) - 1:, :target.config.vocab_size].astype(np.float64)
    finally:
        session.close()
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    top = np.argsort(-p, axis=1)[:, :TOP]
    return Rows(np.array(text, np.int64), top, np.take_along_axis(p, top, axis=1))


@dataclass(frozen=True)
class Policy:
    kind: str                   # chain, auto, gate, sibling
    k: int
    value: float = 0.0          # gate: the least chance drafted; sibling: the leaf's share of the first's chance

    @property
    def name(self) -> str:
        return f"{self.kind} {self.k}" + (f" {self.value:g}" if self.kind in ("gate", "sibling") else "")

    @classmethod
    def parse(cls, text: str) -> "Policy":
        parts = text.split()
        if not parts or parts[0] not in ("chain", "auto", "gate", "sibling") or len(parts) != (
                3 if parts[0] in ("gate", "sibling") else 2):
            raise ValueError(f"policy {text!r}: expected 'chain K', 'auto K', 'gate K P' or 'sibling K S'")
        return cls(parts[0], int(parts[1]), float(parts[2]) if len(parts) == 3 else 0.0)


@dataclass
class Replay:
    tokens: int
    passes: int
    drafted: int
    seconds: float

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes


def replay(rows: Rows, policy: Policy, curve: PassCurve, draft_s: float) -> Replay:
    """The rounds `policy` makes over `rows` (module docstring)."""
    text, top, chance = rows.text, rows.top, rows.chance
    n, position, passes, drafted, seconds = len(text), 0, 0, 0, 0.0
    acceptance = Acceptance()
    behind = False              # the draft lacks a token of the text: its next drafting round catches up first
    while position < n:
        k = policy.k if policy.kind != "auto" else choose_draft_length(curve, acceptance.rate, policy.k, 1, draft_s)
        k = min(k, n - position - 1)
        chain = 0
        while chain < k and not (policy.kind == "gate" and chance[position + chain, 0] < policy.value):
            chain += 1
        kept = 0
        while kept < chain and top[position + kept, 0] == text[position + kept]:
            kept += 1
        leaves = 0
        emitted = kept + 1                  # the kept run and the target's own token after it
        if policy.kind == "sibling":
            has_leaf = chance[position:position + chain, 1] >= policy.value * chance[position:position + chain, 0]
            leaves = int(has_leaf.sum())
            if kept < chain and has_leaf[kept] and top[position + kept, 1] == text[position + kept]:
                emitted += 1                # the leaf was the target's token: the target's next one comes too
        position += min(emitted, n - position)
        seconds += curve.time_s(chain + 1 + leaves) + chain * draft_s + (draft_s if chain and behind else 0.0)
        behind = kept == chain      # a plain pass's token, or a fully kept chain's last draft, never fed to it
        drafted += chain
        passes += 1
        acceptance.record(chain, kept)
    return Replay(n, passes, drafted, seconds)


def parse_curve(text: str) -> PassCurve:
    try:
        points = [(int(a), float(b) / 1e3) for a, b in (p.split(":") for p in text.split(","))]
    except ValueError:
        raise SystemExit(f"--curve {text!r}: expected TOKENS:MS pairs, e.g. 1:11.4,8:13.8") from None
    return PassCurve(tuple(t for t, _ in points), tuple(s for _, s in points))


DEFAULT_POLICIES = ("auto 8", "chain 4", "chain 8", "chain 12", "auto 16", "gate 12 0.5", "gate 16 0.5",
                    "sibling 8 0.1", "sibling 8 0.3")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", required=True, help="text files of prompts separated by lines of ---, comma-separated")
    p.add_argument("--chat", action="store_true", help="each prompt is a user message (the chat template)")
    p.add_argument("-n", "--new-tokens", type=int, default=128)
    p.add_argument("--curve", default="1:10.0,2:10.6,4:12.2,8:14.6,16:20.7",
                   help="the target's pass time, TOKENS:MS,... (default: mode offload's shape at 50 %% resident on "
                        "the H200 at the real pair's one-token 10 ms; module docstring)")
    p.add_argument("--draft-ms", type=float, default=0.83, help="the draft's time per drafted token")
    p.add_argument("--policy", action="append", default=None,
                   help=f"a policy to replay (repeat the flag); default: {', '.join(DEFAULT_POLICIES)}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write a result file (json + md) under this directory")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    curve = parse_curve(args.curve)
    try:
        policies = [Policy.parse(text) for text in (args.policy or DEFAULT_POLICIES)]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    target = ks.load(args.target, device=args.device)
    draft = ks.load(args.draft, device=args.device)
    prompts = [(Path(f).stem, i, prompt) for f in args.prompts.split(",") if f
               for i, prompt in enumerate(read_prompts(f, args.chat))]
    all_rows = [draft_rows(target, draft, prompt, args.new_tokens) for _, _, prompt in prompts]
    target.close()
    draft.close()
    draft_s, plain_s = args.draft_ms / 1e3, curve.time_s(1)
    out = []
    for policy in policies:
        speedups = []
        for (name, i, _), rows in zip(prompts, all_rows):
            r = replay(rows, policy, curve, draft_s)
            speedup = (r.tokens / r.seconds) / (1 / plain_s)
            speedups.append(speedup)
            out.append({"policy": policy.name, "prompt": f"{name} {i}", "tokens": r.tokens,
                        "tokens_per_pass": round(r.tokens_per_pass, 3),
                        "drafted_per_pass": round(r.drafted / r.passes, 3), "modeled_speedup": round(speedup, 3)})
            print(json.dumps(out[-1]), flush=True)
        out.append({"policy": policy.name, "prompt": "geometric mean",
                    "modeled_speedup": round(math.exp(sum(map(math.log, speedups)) / len(speedups)), 3)})
        print(json.dumps(out[-1]), flush=True)
    if args.out:
        from kestrel_stream.cli.bench import environment
        from .report import write_results
        notes = (f"target {args.target}, draft {args.draft}, {args.new_tokens} new tokens, greedy; pass curve "
                 f"{curve.describe()}; draft {args.draft_ms} ms a token; modeled, not measured (bench/spec_replay.py)")
        path = write_results("spec-replay", environment(), out, ["policy", "prompt", "tokens", "tokens_per_pass",
                                                                 "drafted_per_pass", "modeled_speedup"],
                             notes=notes, out_dir=Path(args.out))
        print(f"wrote {path}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
