"""What an engine carries for speculative decoding: the draft (a model or prompt lookup) and the longest chain."""
from __future__ import annotations

from kestrel_stream.spec.decoder import SpecDecoder
from kestrel_stream.spec.draft_model import DraftModel
from kestrel_stream.spec.lookup import PromptLookup

DEFAULT_DRAFT_MAX = 8
SPEC_KINDS = ("lookup",)        # --spec's values; a draft model comes with --model-draft


class Speculation:
    def __init__(self, draft, draft_max: int = DEFAULT_DRAFT_MAX):
        self.check_draft_max(draft_max)
        self.draft, self.draft_max = draft, draft_max

    @staticmethod
    def check_draft_max(draft_max) -> None:
        if isinstance(draft_max, bool) or not isinstance(draft_max, int) or draft_max < 1:
            raise ValueError(f"draft_max={draft_max!r}: expected an integer >= 1")

    @classmethod
    def lookup(cls, draft_max: int = DEFAULT_DRAFT_MAX) -> "Speculation":
        return cls(PromptLookup(), draft_max)

    @classmethod
    def model(cls, draft_engine, target_vocab: int, draft_max: int = DEFAULT_DRAFT_MAX) -> "Speculation":
        return cls(DraftModel(draft_engine, target_vocab), draft_max)

    @property
    def kind(self) -> str:
        return self.draft.name

    def decoder(self, session, params, seed: int) -> SpecDecoder:
        """The rounds of one generation (or conversation) on `session`."""
        return SpecDecoder(session, self.draft, self.draft_max, params, seed)

    def device_bytes(self) -> int:
        """The draft's device memory (its arena and KV pool in gpu mode; 0 on the host or for lookup)."""
        return self.draft.device_bytes()

    def close(self) -> None:
        self.draft.close()
