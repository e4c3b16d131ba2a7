"""What an engine carries for speculative decoding: the draft (a model or prompt lookup), the longest chain,
and the policy that sets each round's draft length.

policy "auto" (the default): the cost model (cost.py) chooses each round's
length from the target's pass-time curve, measured once on first use
(measure.py), the running acceptance, the draft's time per token and the batch,
and turns speculation off where it would not pay.  "always": every round
drafts, its length following the acceptance alone (decoder.DraftLength).
"""
from __future__ import annotations

import threading

from kestrel_stream.spec.cost import PassCurve
from kestrel_stream.spec.decoder import SpecDecoder
from kestrel_stream.spec.draft_model import DraftModel
from kestrel_stream.spec.lookup import PromptLookup
from kestrel_stream.run.token_tree import MAX_NODES

DEFAULT_DRAFT_MAX = 8
DEFAULT_TREE_NODES = 32         # the most nodes of a round's token tree (run/token_tree.MAX_NODES at most)
SPEC_KINDS = ("lookup",)        # --spec's values; a draft model comes with --model-draft
POLICIES = ("auto", "always")   # --spec-policy's values


class Speculation:
    def __init__(self, draft, draft_max: int = DEFAULT_DRAFT_MAX, policy: str = "auto",
                 curve: PassCurve | None = None, tree_nodes: int = DEFAULT_TREE_NODES):
        self.check_draft_max(draft_max)
        self.check_policy(policy)
        self.check_tree_nodes(tree_nodes)
        self.draft, self.draft_max, self.policy = draft, draft_max, policy
        self.tree_nodes = tree_nodes        # the most nodes of a round's token tree (1: chains only)
        self.curve = curve                  # the target's pass times (None: measured on first use)
        self.draft_s_per_token: float | None = None if draft.name != "lookup" else 0.0
        self.measuring = threading.Lock()

    @staticmethod
    def check_draft_max(draft_max) -> None:
        if isinstance(draft_max, bool) or not isinstance(draft_max, int) or draft_max < 1:
            raise ValueError(f"draft_max={draft_max!r}: expected an integer >= 1")

    @staticmethod
    def check_tree_nodes(tree_nodes) -> None:
        if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or not 1 <= tree_nodes <= MAX_NODES:
            raise ValueError(f"tree_nodes={tree_nodes!r}: expected an integer in 1..{MAX_NODES} (1: chains only)")

    @staticmethod
    def check_policy(policy) -> None:
        if policy not in POLICIES:
            raise ValueError(f"spec_policy={policy!r}: expected one of {', '.join(POLICIES)}")

    @classmethod
    def lookup(cls, draft_max: int = DEFAULT_DRAFT_MAX, policy: str = "auto",
               tree_nodes: int = DEFAULT_TREE_NODES) -> "Speculation":
        return cls(PromptLookup(), draft_max, policy, tree_nodes=tree_nodes)

    @classmethod
    def model(cls, draft_engine, target_vocab: int, draft_max: int = DEFAULT_DRAFT_MAX,
              policy: str = "auto", tree_nodes: int = DEFAULT_TREE_NODES) -> "Speculation":
        return cls(DraftModel(draft_engine, target_vocab), draft_max, policy, tree_nodes=tree_nodes)

    @property
    def kind(self) -> str:
        return self.draft.name

    def measure(self, engine) -> None:
        """The target's pass-time curve and the draft's time per token, measured once (the engine's thread:
        these are engine steps); nothing to do under policy "always"."""
        if self.policy != "auto":
            return
        with self.measuring:
            if self.curve is None:
                from kestrel_stream.spec.measure import MAX_TOKENS, measure_pass_curve
                self.curve = measure_pass_curve(engine, MAX_TOKENS)
            if self.draft_s_per_token is None:
                self.draft_s_per_token = self.draft.token_seconds()

    def decoder(self, session, params, seed: int, draft_max: int | None = None) -> SpecDecoder:
        """The rounds of one generation (or conversation) on `session`, with chains of at most `draft_max`
        (None: the engine's); under policy "auto" the curve of the session's engine is measured first where it
        was not yet (on this thread: it runs engine steps)."""
        self.measure(session.engine)
        return SpecDecoder(session, self.draft, min(draft_max or self.draft_max, self.draft_max), params, seed,
                           self)

    def describe(self) -> str:
        """One line for `plan` and the daemon's log."""
        what = {"draft": "draft model", "lookup": "prompt lookup"}.get(self.kind, f"draft {self.kind}")
        if self.kind == "draft":
            what += f" {self.draft.source}"
        line = f"speculative decoding: {what}, chains of up to {self.draft_max} tokens, policy {self.policy}"
        if self.policy == "auto":
            line += ("; " + self.curve.describe()) if self.curve is not None else "; pass times measured on first use"
        if self.tree_nodes > 1:
            line += f"; rounds draft trees of up to {self.tree_nodes} nodes"
        return line

    def device_bytes(self) -> int:
        """The draft's device memory (its arena and KV pool in gpu mode; 0 on the host or for lookup)."""
        return self.draft.device_bytes()

    def close(self) -> None:
        self.draft.close()

