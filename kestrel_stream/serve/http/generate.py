"""One HTTP generation on the daemon's batcher: the prompt's chunks and each decode token are jobs of the
same step thread and batcher as the socket clients' (Service.prefill_cached / DecodeJob), so HTTP and
socket sessions share every engine step.  A token's next decode is queued
before the token is sent, so the response's encoding and writing overlap the
next step instead of delaying it.

Greedy requests ask the step for the token alone (the device takes the
argmax), and so do plain sampled decodes (the device draws with the choice's
seed and step: sample.cu, the reference sampler's twin); a prompt's last row,
penalties, logprobs, logit_bias and response_format ask for
the last row's logits and draw on the host with the reference sampler
(text/sampling.py), after the bias and the grammar's mask (text/grammar.py),
so the same (seed, prompt) gives the tokens Engine.generate gives.  A request
of n choices runs n sessions, one a choice, choice i with seed + i; their
decodes share each step.  The sessions are opened (``open``, through the
admission queue) before the response starts, a lone choice's prompt queued
in the same visit to the step thread (it runs in the step after the one in
progress), and closed the moment the generation ends or its consumer goes
away (a cancelled stream closes them in ``finally``).

Where the daemon has a draft, a generation speculates unless its body says
``"speculative": false`` (serve/spec_rounds.py), each choice on its own
session: each round's verify pass is a job of the same steps, and the logprobs
of its tokens are the model's rows of that pass.  A request with logit_bias or
response_format decodes plainly: the rounds verify against the model's own
rows, which the bias and the grammar's mask would change.

A chat with tools renders them into its prompt and reads each choice's text
for calls as it streams (serve/http/tool_use.py); a TokenOut carries the
calls its token completed, and a choice that called ends with
``finish_reason`` "tool_calls".

One concern, one file: a generation's way from its checked request to its choices' tokens (its sessions,
jobs, rounds and the shaping of each token), which the completions and chat endpoints share.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import numpy as np

from kestrel_stream.errors import CapacityError, KestrelError
from kestrel_stream.run.device.sample_state import pack_state
from kestrel_stream.wire.protocol import ShuttingDownError
from kestrel_stream.serve.decode_steps import DecodeJob
from kestrel_stream.serve.http.errors import RETRY_AFTER_S, APIError
from kestrel_stream.serve.http.requests import TextRequest
from kestrel_stream.serve.http.tool_use import ToolUse
from kestrel_stream.serve.prefix_scopes import scope_name
from kestrel_stream.serve.spec_rounds import ServedSpeculation, parse_speculative
from kestrel_stream.serve.service import Connection
from kestrel_stream.text.chat import ChatTemplateError
from kestrel_stream.text.detok import IncrementalDecoder
from kestrel_stream.text.grammar import Constraint, GrammarError
from kestrel_stream.text.generation import prompt_ids
from kestrel_stream.text.sampling import sample_logits
from kestrel_stream.text.stop import EOS, LENGTH, STOP, StopChecker
from kestrel_stream.text.tool_calls import ToolCall, ToolCallParser

FINISH = {EOS: "stop", STOP: "stop", LENGTH: "length"}


@dataclass(frozen=True)
class TokenOut:
    token: int
    text: str                                   # the text it released ("" while held back)
    logprob: float | None = None                # with request.logprobs set
    top: tuple[tuple[int, float], ...] = ()     # the most likely tokens of that step and their logprobs
    index: int = 0                              # the choice it belongs to (n > 1)
    calls: tuple[ToolCall, ...] = ()            # the tool calls its text completed


class Choice:
    """One of the request's n sequences: its session, seed, stop conditions, text and grammar state."""

    def __init__(self, index: int, seed: int, stop: StopChecker, decoder: IncrementalDecoder | None,
                 constraint: Constraint | None, calls: ToolCallParser | None = None):
        self.index, self.seed, self.stop, self.decoder, self.constraint = index, seed, stop, decoder, constraint
        self.calls = calls              # reads tool calls out of the text, where tools are offered
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.spec = None                # its ServedSpeculation, where it speculates
        self.pending: list = []         # TokenOuts of a speculative round not yet yielded


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
        if request.n > service.max_sessions:
            raise APIError(400, f"n={request.n} needs {request.n} sessions at once; this server has "
                                f"{service.max_sessions} (--max-sessions)", param="n")
        self.tool_use = ToolUse.of(request, tokenizer)
        try:
            if self.tool_use is not None:       # the template writes BOS itself where the model wants one
                self.ids = tokenizer.encode(self.tool_use.prompt(), add_special=False)
            else:
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
        bias = request.logit_bias
        if bias and max(bias) >= service.vocab_size:
            raise APIError(400, f"logit_bias: token id {max(bias)} is outside the vocabulary "
                                f"0..{service.vocab_size - 1}", param="logit_bias")
        self.bias = None
        if bias:
            self.bias = np.zeros(service.vocab_size, np.float32)
            self.bias[list(bias)] = list(bias.values())
        seed = request.params.resolved_seed()
        constraint = self.constraint(request)
        if constraint is not None:
            eos = frozenset(eos) | constraint.end_ids      # the grammar's end is the generation's
        # choice i samples with seed + i: the same tokens as a request of n=1 with that seed
        self.choices = [Choice(i, (seed + i) % 2**64, StopChecker(eos, request.stop, self.max_tokens),
                               IncrementalDecoder(tokenizer, self.ids) if tokenizer is not None else None,
                               constraint.copy() if constraint is not None and i else constraint,
                               self.tool_use.parser() if self.tool_use is not None else None)
                        for i in range(request.n)]
        try:
            self.speculate, self.draft_max = parse_speculative(request.speculative, engine.speculation)
        except ValueError as e:
            raise APIError(400, str(e), param="speculative") from None
        if self.bias is not None or constraint is not None:
            self.speculate = False      # the rounds verify against the model's rows, not the shaped ones
        params = request.params
        logits_needed = (not params.greedy or params.penalized or request.logprobs is not None or self.bias is not None
                         or constraint is not None)
        self.want = "last" if logits_needed else "token"
        # sampled without penalties, logprobs, bias or grammar: each decode's token drawn on the device where
        # the step can (step_jobs.DecodeJob's want "sample")
        self.draws = (not params.greedy and not params.penalized and request.logprobs is None and self.bias is None
                      and constraint is None)
        self.first_token_s: float | None = None     # time to the first token, from the start of open()
        self.started_s = time.perf_counter()
        self.queue_wait_s = 0.0                     # time spent in the admission queue
        self.conn = Connection(peer="http")         # holds the sessions once open
        self.cached_tokens = 0                      # the first choice's prompt tokens from the prefix cache

    def constraint(self, request: TextRequest) -> Constraint | None:
        """The grammar of a forced tool call or of response_format (json_object, json_schema) in its first
        state; None without one."""
        if self.tool_use is not None and self.tool_use.offers_tools:     # a response_format included
            return self.tool_use.constraint(self.service.grammars(), self.service.vocab_size)
        if request.response_format is None:
            return None
        if self.tokenizer is None:
            raise APIError(400, "response_format needs a tokenizer; the model has none", param="response_format")
        try:
            return self.service.grammars().json(request.response_format.schema, self.service.vocab_size)
        except GrammarError as e:
            raise APIError(400, f"response_format.json_schema.schema: {e}",
                           param="response_format.json_schema.schema") from None

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    async def open(self) -> None:
        """The generation's sessions (one a choice), after a turn in the admission queue when every session is
        held; APIError 429 when the queue is full.  Cancelled (the client left) while it waits, it holds nothing."""
        service = self.service
        if service.draining:
            raise APIError(503, "the daemon is shutting down", "server_error", code="shutting_down")
        if self.max_tokens == 0:
            return                      # nothing to compute: no session
        self.started_s = time.perf_counter()
        try:
            lone = len(self.choices) == 1
            await service.open_sessions(self.conn, len(self.ids) + self.max_tokens, len(self.choices), wait=True,
                                        what="this generation", prompt=self.ids, scope=self.prefix_scope,
                                        prefill=self.prefill_want if lone else None,
                                        prefill_state=self.draw_state(self.choices[0]) if lone else None)
        except CapacityError as e:
            raise APIError(429, str(e), "server_error", code="capacity", retry_after_s=RETRY_AFTER_S) from None
        except ShuttingDownError as e:
            raise APIError(503, str(e), "server_error", code="shutting_down") from None
        self.queue_wait_s = time.perf_counter() - self.started_s

    async def close(self) -> None:
        """Frees the sessions, whatever has happened (idempotent)."""
        if self.conn.sessions:
            with anyio.CancelScope(shield=True):
                await self.service.close_sessions(self.conn, list(self.conn.sessions))

    async def run(self):
        """The tokens, one TokenOut each (of every choice, in turn), through the batcher; each choice's
        ``finish_reason`` is set once it ends.  The sessions come from ``open``, and are closed the moment the
        generation ends or its consumer goes away."""
        service, started = self.service, self.started_s
        if self.max_tokens == 0:
            for choice in self.choices:
                choice.finish_reason = "length"
            return
        try:
            ids = np.asarray(self.ids, np.int64)
            sessions = list(self.conn.sessions.values())
            jobs = []
            for choice, session in zip(self.choices, sessions):
                if self.speculate and self.max_tokens > 1:
                    choice.spec = await ServedSpeculation.open(service, session, self.request.params, choice.seed,
                                                               self.draft_max)
                # through the prefix cache: a prompt sharing cached blocks (a chat's system prompt, its earlier
                # turns, the first choice's prompt for its siblings) computes only the rest
                jobs.append(await service.prefill_cached(session, ids, self.prefill_want, 1, self.prefix_scope,
                                                         self.conn.prefilling.pop(session.id, None),
                                                         self.draw_state(choice)))
            self.cached_tokens = jobs[0].cached_tokens if jobs else 0
            live = list(self.choices)
            while live:
                for choice in list(live):
                    session = sessions[choice.index]
                    job = jobs[choice.index]
                    if not choice.pending and job is None:
                        # no step queued: a speculative round, or (drafting nothing) one plain step
                        choice.pending = await self.speculative_round(choice, choice.tokens[-1])
                        if not choice.pending:
                            job = self.decode_job(choice, session, choice.tokens[-1])
                            service.submit(job)
                    if not choice.pending:
                        await job.result_or_raise()
                        choice.pending = [self.account(choice, job)]
                    out = choice.pending.pop(0)
                    if self.first_token_s is None:
                        self.first_token_s = time.perf_counter() - started
                    jobs[choice.index] = None
                    if choice.pending:
                        pass                    # the rest of a round's tokens come first
                    elif choice.stop.reason is not None:
                        choice.finish_reason = finish_reason(choice)
                        live.remove(choice)
                    elif choice.spec is None or choice.spec.plain_next(self.max_tokens - len(choice.tokens)):
                        # the next step is queued before this token is sent
                        jobs[choice.index] = self.decode_job(choice, session, out.token)
                        service.submit(jobs[choice.index])
                    yield out
        except KestrelError as e:
            raise APIError(500, f"{type(e).__name__}: {e}", "server_error") from None
        finally:
            for choice in self.choices:
                if choice.spec is not None:
                    await choice.spec.finish(None)
                    choice.spec = None
            await self.close()          # a client gone mid-stream frees its sessions now

    async def speculative_round(self, choice: Choice, token: int) -> list[TokenOut]:
        """The tokens of a speculative round of `choice` after `token`, up to a stop; [] where the round drafted
        nothing (the caller takes a plain step)."""
        budget = self.max_tokens - len(choice.tokens)
        rounded = await choice.spec.round(token, self.ids + choice.tokens, len(choice.tokens), budget,
                                          picks=self.want == "token")
        if rounded is None:
            return []
        emitted, rows = rounded
        outs = []
        for i, token_out in enumerate(emitted):
            outs.append(self.emit(choice, token_out, rows[i] if rows is not None else None))
            if choice.stop.reason is not None:
                break
        return outs

    @property
    def prefill_want(self) -> str:
        return "sample" if self.draws else self.want

    def draw_state(self, choice: Choice):
        """The sampling state of `choice`'s next token where the device draws it (self.draws: the choice's seed
        at its step), else None."""
        return pack_state(self.request.params, choice.seed, len(choice.tokens)) if self.draws else None

    def decode_job(self, choice: Choice, session, token: int) -> DecodeJob:
        """The plain decode step after `token`: its argmax, its draw on the device, or its last logits row."""
        if self.draws:
            return DecodeJob(session, token, "sample", 1, state=self.draw_state(choice))
        return DecodeJob(session, token, self.want, 1)

    def account(self, choice: Choice, job) -> TokenOut:
        fields, arrays = job.result
        if "token" in fields:           # the argmax, or the device's draw
            return self.emit(choice, fields["token"], None)
        logits = np.asarray(arrays["logits"], np.float32).reshape(-1)
        shaped = logits if self.bias is None else logits + self.bias
        if choice.constraint is not None:
            shaped = choice.constraint.mask(shaped)
        token = sample_logits(shaped, self.request.params, choice.seed, len(choice.tokens), self.ids + choice.tokens)
        return self.emit(choice, token, logits)

    def emit(self, choice: Choice, token: int, logits: np.ndarray | None) -> TokenOut:
        """The token of `choice`, its text and (with logits: the model's row it was chosen from) its logprobs."""
        logprob, top = None, ()
        if logits is not None and self.request.logprobs is not None:
            logprob, top = log_probs(np.asarray(logits, np.float32), token, self.request.logprobs)
        choice.tokens.append(token)
        stop = choice.stop
        text = choice.decoder.push(token) if choice.decoder is not None and token not in stop.eos_ids else ""
        released = stop.push(token, text)
        if choice.constraint is not None and stop.reason is None:
            choice.constraint.accept(token)
            if choice.constraint.complete or choice.constraint.error is not None:
                stop.reason = EOS       # the document is whole: nothing may follow it but the end
        if stop.reason in (EOS, LENGTH) and choice.decoder is not None:
            released += stop.finish(choice.decoder.flush())
        calls: list[ToolCall] = []
        if choice.calls is not None:
            released, calls = choice.calls.push(released)
            if stop.reason is not None:
                tail, last = choice.calls.finish()
                released, calls = released + tail, calls + last
        return TokenOut(token, released, logprob, top, choice.index, tuple(calls))

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)


def finish_reason(choice: Choice) -> str:
    """OpenAI's finish_reason of a choice that ended: "tool_calls" where it called and was not cut short."""
    reason = choice.stop.reason
    if choice.calls is not None and choice.calls.calls and reason != LENGTH:
        return "tool_calls"
    return FINISH[reason]


def log_probs(logits: np.ndarray, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log softmax of the model's logits (before sampling filters): the token's and the k most likely."""
    x = logits.astype(np.float64)
    top_value = float(np.max(x))
    lse = top_value + float(np.log(np.sum(np.exp(x - top_value))))
    best = np.argpartition(-x, k - 1)[:k] if k else np.empty(0, np.int64)
    best = best[np.argsort(-x[best], kind="stable")]
    return float(x[token] - lse), tuple((int(t), float(x[t] - lse)) for t in best)
