"""One generation: prompt in, tokens and text out, sampled or greedy, stopped by EOS, stop strings or length.

Engine.generate builds a `Generation` and either runs it to the end or hands
it out as the stream iterator.  Greedy steps keep the engine's device-chained
path (many steps per host sync in gpu mode); a chain runs in chunks that grow
from CHAIN_FIRST_CHUNK to the chain's capacity so an EOS ends the work soon
after it appears.  Sampled steps draw on the device where the executor can
(`forward_sample`: 4 bytes back per token) and on the host otherwise.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kestrel_stream.obs import trace
from kestrel_stream.text.detok import IncrementalDecoder
from kestrel_stream.text.sampling import SamplingParams, sample_logits
from kestrel_stream.text.stop import EOS, LENGTH, StopChecker

CHAIN_FIRST_CHUNK = 16
CHAIN_MAX_CHUNK = 256


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it released (may be "" while text is held back)."""
    token: int
    text: str


def prompt_ids(engine, prompt, add_special: bool = True) -> list[int]:
    """Token ids from text, chat messages ([{'role', 'content'}, ...]) or ids."""
    tokenizer = engine.tokenizer
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
        if tokenizer is None:
            from kestrel_stream.errors import InvalidTokenError
            raise InvalidTokenError(f"{engine.weights.source}: the model has no tokenizer; give prompt token ids")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special=add_special)
        # the template writes BOS itself where the model wants one
        return tokenizer.encode(tokenizer.apply_chat_template(prompt), add_special=False)
    return np.asarray(prompt).reshape(-1).tolist() if not isinstance(prompt, list) else prompt


class Generation:
    def __init__(self, engine, prompt, max_new_tokens: int, params: SamplingParams, stop=None,
                 ignore_eos: bool = False, speculation=None):
        # speculation: a spec.Speculation (drafts verified many tokens a step) or None (plain decoding)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 0")
        self.engine, self.params = engine, params
        self.ids = engine.check_tokens(prompt_ids(engine, prompt), "prompt").tolist()
        tokenizer = engine.tokenizer
        eos = () if ignore_eos or tokenizer is None else tokenizer.eos_ids
        self.stop = StopChecker(eos, stop, max_new_tokens)
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the model has none")
        self.decoder = IncrementalDecoder(tokenizer, self.ids) if tokenizer is not None else None
        self.seed = params.resolved_seed()
        self.tokens: list[int] = []
        self.text_parts: list[str] = []
        self.result = None
        self.speculation = speculation
        self.spec = None                # the spec.SpecDecoder of the running generation

    # -- the steps ----------------------------------------------------------
    def _first(self, s) -> int:
        return self.pick(s.prefill(self.ids, logits="last"), 0)

    def pick(self, logits: np.ndarray, step: int) -> int:
        return sample_logits(logits, self.params, self.seed, step, self.ids + self.tokens)

    def _next_tokens(self, s, token: int, budget: int, chunk: int) -> list[int]:
        """The tokens after `token`: a chained chunk (greedy on gpu) or one step."""
        engine, params, step = self.engine, self.params, len(self.tokens)
        if self.spec is not None:
            ahead = self.spec.plain_tokens_ahead(budget) if self._chains(params) else 0
            if ahead > 1:               # speculation off for a while: plain steps chained, as without a draft
                chained = engine.generate_chained(s, token, min(ahead, chunk), params, self.seed, step)
                if chained is not None:
                    self.spec.record_plain(len(chained))
                    return chained
            return self.spec.next_tokens(token, self.ids + self.tokens, step, budget)
        if params.penalized:            # the penalties need the history: logits back, sampled on the host
            return [self.pick(s.decode(token), step)]
        if self._chains(params) and budget > 1:
            chained = engine.generate_chained(s, token, min(budget, chunk), params, self.seed, step)
            if chained is not None:
                return chained
        return [s.decode_greedy(token) if params.greedy else s.decode_sample(token, params, self.seed, step)]

    def _chains(self, params) -> bool:
        """Whether plain steps may run chained on the device (several steps, one sync)."""
        return self.engine.chain_greedy and not params.penalized and trace.active is None

    def pieces(self):
        """Run the generation, yielding a Piece per token; `result` is set when it ends."""
        engine, stop = self.engine, self.stop
        with engine.new_session() as s, self._speculating(s):
            s.check_room(len(self.ids) + max(stop.max_new_tokens - 1, 0))
            before = engine.executor.counters.as_dict()
            t0 = time.perf_counter()
            token = self._first(s) if stop.max_new_tokens > 0 else None
            t1 = time.perf_counter()
            mid = engine.executor.counters.as_dict()
            pending = [token] if token is not None else []
            chunk = CHAIN_FIRST_CHUNK if stop.eos_ids or stop.stop else CHAIN_MAX_CHUNK
            while pending:
                token = pending.pop(0)
                piece = self.account(token)
                yield piece
                if stop.reason is not None:
                    break
                if not pending:
                    budget = stop.max_new_tokens - len(self.tokens)
                    pending = self._next_tokens(s, token, budget, chunk)
                    chunk = min(2 * chunk, CHAIN_MAX_CHUNK)
            t2 = time.perf_counter()
            after = engine.executor.counters.as_dict()
        if stop.reason is None:
            stop.reason = LENGTH
        self.result = engine.generation_result(self.tokens, t1 - t0, t2 - t1, len(self.ids), before, mid, after,
                                               text="".join(self.text_parts) if self.decoder else None,
                                               stop_reason=stop.reason)
        if self.spec is not None:
            self.result.stats.update(self.spec.stats.as_dict())

    @contextmanager
    def _speculating(self, s):
        """self.spec on session `s` while the generation runs, where the engine speculates."""
        if self.speculation is None:
            yield
            return
        self.spec = self.speculation.decoder(s, self.params, self.seed)
        try:
            yield
        finally:
            self.spec.close()

    def account(self, token: int) -> Piece:
        stop = self.stop
        self.tokens.append(token)
        is_eos = token in stop.eos_ids
        text = self.decoder.push(token) if self.decoder is not None and not is_eos else ""
        released = stop.push(token, text)
        if stop.reason in (EOS, LENGTH) and self.decoder is not None:
            released += stop.finish(self.decoder.flush())
        self.text_parts.append(released)
        return Piece(token, released)

    def run(self):
        for _ in self.pieces():
            pass
        return self.result


class Stream:
    """The iterator generate(stream=True) returns: Pieces; `.result` once exhausted."""

    def __init__(self, generation: Generation):
        self.generation = generation
        self._pieces = generation.pieces()

    def __iter__(self):
        return self

    def __next__(self) -> Piece:
        return next(self._pieces)

    @property
    def result(self):
        return self.generation.result

    def close(self) -> None:
        self._pieces.close()
