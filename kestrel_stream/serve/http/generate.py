"""One HTTP generation on the daemon's batcher: the prompt's chunks and each decode token are jobs of the
same step thread and batcher as the socket clients' (Service.prefill_cached / DecodeJob), so HTTP and
socket sessions share every engine step.  A token's next decode is queued
before the token is sent, so the response's encoding and writing overlap the
next step instead of delaying it.

Greedy requests ask the step for the token alone (the device takes the
argmax); sampling, penalties and logprobs ask for the last row's logits and
draw on the host with the reference sampler (text/sampling.py), so the same
(seed, prompt) gives the tokens Engine.generate gives.  The session is opened
when the first token is wanted and closed the moment the generation ends or
its consumer goes away (a cancelled stream closes it in ``finally``).

Where the daemon has a draft, a generation speculates unless its body says
``"speculative": false`` (serve/spec_rounds.py): each round's verify pass is a
job of the same steps, and the logprobs of its tokens are the model's rows of
that pass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import numpy as np

from kestrel_stream.errors import CapacityError, KestrelError
from kestrel_stream.serve.decode_steps import DecodeJob
from kestrel_stream.serve.http.errors import RETRY_AFTER_S, APIError
from kestrel_stream.serve.http.requests import TextRequest
from kestrel_stream.serve.prefix_scopes import scope_name
from kestrel_stream.serve.spec_rounds import ServedSpeculation, parse_speculative
from kestrel_stream.serve.service import Connection
from kestrel_stream.text.chat import ChatTemplateError
from kestrel_stream.text.detok import IncrementalDecoder
from kestrel_stream.text.generation import prompt_ids
from kestrel_stream.text.sampling import sample_logits
from kestrel_stream.text.stop import EOS, LENGTH, STOP, StopChecker

FINISH = {EOS: "stop", STOP: "stop", LENGTH: "length"}


@dataclass(frozen=True)
class TokenOut:
    token: int
    text: str                                   # the text it released ("" while held back)
    logprob: float | None = None                # with request.logprobs set
    top: tuple[tuple[int, float], ...] = ()     # the most likely tokens of that step and their logprobs


class HttpGeneration:
    def __init__(self, service, request: TextRequest, key_scope: str | None = None):
        """Tokenizes and checks the room; APIError (400) before anything runs.  key_scope: the prefix cache scope
        of the request's API key (--prefix-cache-scope key; None: shared), narrowed by its cache_salt."""
        self.service, self.request, engine = service, request, service.engine
        self.prefix_scope = key_scope
        if request.cache_salt is not None:
            self.prefix_scope = scope_name("salt", f"{key_scope}\0{request.cache_salt}")
        tokenizer = self.tokenizer = engine.tokenizer
        if tokenizer is None and not (isinstance(request.prompt, list) and not request.chat):
            raise APIError(400, "the model has no tokenizer: give the prompt as token ids", param="prompt")
        if tokenizer is not None and request.chat and not tokenizer.chat_template:
            raise APIError(400, "the model has no chat template; use /v1/completions", param="messages")
        try:
            self.ids = [int(t) for t in prompt_ids(engine, request.prompt)]
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        room = engine.max_seq_len - len(self.ids)
        if room < 1:
            raise APIError(400, f"the prompt is {len(self.ids)} tokens; this model's context is "
                                f"{engine.max_seq_len} tokens", param="messages" if request.chat else "prompt",
                           code="context_length_exceeded")
        self.max_tokens = room if request.max_tokens is None else request.max_tokens
        if self.max_tokens > room:
            raise APIError(400, f"max_tokens={self.max_tokens} with a prompt of {len(self.ids)} tokens exceeds "
                                f"this model's context of {engine.max_seq_len} tokens", param="max_tokens",
                           code="context_length_exceeded")
        eos = tokenizer.eos_ids if tokenizer is not None and not request.ignore_eos else ()
        if request.stop and tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; the model has none", param="stop")
        self.stop = StopChecker(eos, request.stop, self.max_tokens)
        self.decoder = IncrementalDecoder(tokenizer, self.ids) if tokenizer is not None else None
        self.seed = request.params.resolved_seed()
        try:
            self.speculate, self.draft_max = parse_speculative(request.speculative, engine.speculation)
        except ValueError as e:
            raise APIError(400, str(e), param="speculative") from None
        params = request.params
        self.want = "last" if not params.greedy or params.penalized or request.logprobs is not None else "token"
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.first_token_s: float | None = None     # time to the first token, from the start of run()

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    async def run(self):
        """The tokens, one TokenOut each, through the batcher; ``finish_reason`` is set once it ends."""
        service, started = self.service, time.perf_counter()
        if self.max_tokens == 0:
            self.finish_reason = "length"
            return
        if service.draining:
            raise APIError(503, "the daemon is shutting down", "server_error", code="shutting_down")
        conn = Connection(peer="http")
        spec = None
        try:
            try:
                await service.op_open(conn, {"max_seq_len": len(self.ids) + self.max_tokens}, {})
            except CapacityError as e:
                raise APIError(429, str(e), "server_error", code="capacity", retry_after_s=RETRY_AFTER_S) from None
            session = next(iter(conn.sessions.values()))
            if self.speculate and self.max_tokens > 1:
                spec = await ServedSpeculation.open(service, session, self.request.params, self.seed,
                                                    self.draft_max)
            # through the prefix cache: a prompt sharing cached blocks (a chat's system prompt, its earlier turns)
            # computes only the rest, as the socket clients' generate does
            job = await service.prefill_cached(session, np.asarray(self.ids, np.int64), self.want, 1,
                                               self.prefix_scope)
            pending = [self.account(job)]
            self.first_token_s = time.perf_counter() - started
            while pending:
                out = pending.pop(0)
                job = None
                if self.stop.reason is None and not pending and (
                        spec is None or spec.plain_next(self.max_tokens - len(self.tokens))):
                    job = DecodeJob(session, out.token, self.want, 1)   # queued before this token is sent
                    service.steps.submit(job)
                yield out
                if pending or self.stop.reason is not None:
                    continue
                if job is None:
                    pending = await self.speculative_round(spec, out.token)
                    if pending:
                        continue
                    job = DecodeJob(session, out.token, self.want, 1)
                    service.steps.submit(job)
                await job.wait()
                if job.error is not None:
                    raise job.error
                pending = [self.account(job)]
        except KestrelError as e:
            raise APIError(500, f"{type(e).__name__}: {e}", "server_error") from None
        finally:
            if spec is not None:
                await spec.finish(None)
            if conn.sessions:
                with anyio.CancelScope(shield=True):    # a client gone mid-stream frees its session now
                    await service.close_sessions(conn, list(conn.sessions))
        self.finish_reason = FINISH[self.stop.reason]

    async def speculative_round(self, spec, token: int) -> list[TokenOut]:
        """The tokens of a speculative round after `token`, up to a stop; [] where the round drafted nothing
        (the caller takes a plain step)."""
        budget = self.max_tokens - len(self.tokens)
        rounded = await spec.round(token, self.ids + self.tokens, len(self.tokens), budget)
        if rounded is None:
            return []
        outs = []
        for emitted, row in zip(*rounded):
            outs.append(self.emit(emitted, row))
            if self.stop.reason is not None:
                break
        return outs

    def account(self, job) -> TokenOut:
        fields, arrays = job.result
        if self.want == "token":
            return self.emit(fields["token"], None)
        logits = np.asarray(arrays["logits"], np.float32).reshape(-1)
        token = sample_logits(logits, self.request.params, self.seed, len(self.tokens), self.ids + self.tokens)
        return self.emit(token, logits)

    def emit(self, token: int, logits: np.ndarray | None) -> TokenOut:
        """The token, its text and (with logits: the model's row it was chosen from) its logprobs."""
        logprob, top = None, ()
        if logits is not None and self.request.logprobs is not None:
            logprob, top = log_probs(np.asarray(logits, np.float32), token, self.request.logprobs)
        self.tokens.append(token)
        stop = self.stop
        text = self.decoder.push(token) if self.decoder is not None and token not in stop.eos_ids else ""
        released = stop.push(token, text)
        if stop.reason in (EOS, LENGTH) and self.decoder is not None:
            released += stop.finish(self.decoder.flush())
        return TokenOut(token, released, logprob, top)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)


def log_probs(logits: np.ndarray, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log softmax of the model's logits (before sampling filters): the token's and the k most likely."""
    x = logits.astype(np.float64)
    top_value = float(np.max(x))
    lse = top_value + float(np.log(np.sum(np.exp(x - top_value))))
    best = np.argpartition(-x, k - 1)[:k] if k else np.empty(0, np.int64)
    best = best[np.argsort(-x[best], kind="stable")]
    return float(x[token] - lse), tuple((int(t), float(x[t] - lse)) for t in best)
