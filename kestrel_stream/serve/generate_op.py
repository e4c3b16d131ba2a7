"""The daemon's ``generate`` op: text or ids in, sampled or greedy tokens and text out, streamed or at once.

Every field of the request is checked here, before anything runs, so a bad
one is answered with a ProtocolError naming it and changes nothing.  The
steps then go through the batcher like any client's decodes (service.prefill_cached
and service.decode queue jobs for the step thread), so many generations share
each engine step.  Sampling, stop strings and detokenization are those of the
in-process Engine.generate (text/generation.py's Generation), with the same
seed and step counter, so a request gives the tokens and text the engine gives.

With ``stream: true`` each token goes out as its own frame as soon as it is
known, before the next step is queued: {"token", "text", "position"}; the
last frame has ``"done": true`` with stop_reason, the whole text and the
tokens array, as the single answer of a request without ``stream`` has.

Where the daemon has a draft, a generation speculates (serve/spec_rounds.py)
unless its request says ``"speculative": false``; the answer then carries the
generation's ``speculation`` figures (acceptance, tokens per pass, draft length).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kestrel_stream.errors import KestrelError
from kestrel_stream.run.device.sample_state import pack_state
from kestrel_stream.serve.spec_rounds import ServedSpeculation, parse_speculative
from kestrel_stream.wire.protocol import ProtocolError
from kestrel_stream.text.generation import Generation
from kestrel_stream.text.sampling import SamplingParams
from kestrel_stream.text.stop import LENGTH
from kestrel_stream.serve.sampling_defaults import SamplingDefaults

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_PROMPT_CHARS = 60_000          # the header is at most 64 KiB anyway
MAX_MESSAGES = 4096
# (field, kind, check, what the check asks): the sampling fields and their ranges, as SamplingParams takes them
SAMPLING_FIELDS = (
    ("temperature", float, lambda v: v >= 0, ">= 0"),
    ("top_k", int, lambda v: -1 <= v < 2**31, "an integer in -1..2**31-1 (<= 0: off)"),
    ("top_p", float, lambda v: 0 < v <= 1, "in (0, 1] (1: off)"),
    ("min_p", float, lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
    ("repeat_penalty", float, lambda v: 0 < v <= 100, "in (0, 100] (1: off)"),
    ("presence_penalty", float, lambda v: -100 <= v <= 100, "in [-100, 100]"),
    ("frequency_penalty", float, lambda v: -100 <= v <= 100, "in [-100, 100]"),
    ("repeat_last_n", int, lambda v: 0 <= v < 2**31, "an integer >= 0"),
)


def chat_messages(engine, messages, op: str) -> list[dict]:
    """The 'messages' field, checked: [{"role": str, "content": str}, ...], bounded, with a template to render them."""
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise ProtocolError(f"{op}: field 'messages' must be a list of 1..{MAX_MESSAGES} "
                            f"{{'role': str, 'content': str}} objects")
    chars = 0
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)):
            raise ProtocolError(f"{op}: messages[{i}] must be {{'role': str, 'content': str}}, got {m!r:.80}")
        chars += len(m["role"]) + len(m["content"])
    if chars > MAX_PROMPT_CHARS:
        raise ProtocolError(f"{op}: field 'messages' holds {chars} characters, over {MAX_PROMPT_CHARS}")
    if engine.tokenizer is None or not engine.tokenizer.chat_template:
        raise ProtocolError(f"{op}: field 'messages' needs the model's chat template; the daemon's model has none; "
                            f"send 'prompt' or 'ids'")
    return messages


@dataclass
class GenerateRequest:
    generation: Generation
    stream: bool
    speculate: bool = False
    draft_max: int | None = None        # the request's cap on drafted chains (None: the daemon's)


def is_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def parse_generate(engine, header: dict, arrays: dict, max_new_tokens_limit: int,
                   defaults: SamplingDefaults = SamplingDefaults()) -> GenerateRequest:
    """The checked request; ProtocolError (or InvalidTokenError for a token id) on the first bad field.
    defaults: serve's sampling flags, for the fields the request leaves out."""
    op = "generate"
    count = header.get("n", defaults.get("max_tokens", 16))
    if type(count) is not int or not 0 <= count <= max_new_tokens_limit:
        raise ProtocolError(f"{op}: field 'n' must be an integer in 0..{max_new_tokens_limit}, got {count!r}")
    params = {name: value for name, value in defaults.given().items() if name != "max_tokens"}
    for name, kind, check, what in SAMPLING_FIELDS:
        if name not in header or header[name] is None:
            continue
        value = header[name]
        if (type(value) is not int if kind is int else not is_number(value)) or not check(value):
            raise ProtocolError(f"{op}: field {name!r} must be {'' if kind is int else 'a number '}{what}, "
                                f"got {value!r}")
        params[name] = value
    seed = header.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**64):
        raise ProtocolError(f"{op}: field 'seed' must be an integer in 0..2**64-1 or null, got {seed!r}")
    flags = {}
    for name in ("stream", "ignore_eos"):
        flags[name] = header.get(name, False)
        if type(flags[name]) is not bool:
            raise ProtocolError(f"{op}: field {name!r} must be true or false, got {flags[name]!r}")
    stop = header.get("stop")
    if stop is not None:
        if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
            raise ProtocolError(f"{op}: field 'stop' must be a list of at most {MAX_STOP_STRINGS} non-empty "
                                f"strings of at most {MAX_STOP_CHARS} characters, got {stop!r}")
        if stop and engine.tokenizer is None:
            raise ProtocolError(f"{op}: field 'stop' needs a tokenizer; the daemon's model has none")
    prompt = header.get("prompt")
    if header.get("messages") is not None:
        if prompt is not None or "ids" in arrays:
            raise ProtocolError(f"{op}: give one of the fields 'prompt' (text), 'messages' (chat) or the array 'ids'")
        prompt = chat_messages(engine, header["messages"], op)
    elif prompt is not None:
        if not isinstance(prompt, str) or not 0 < len(prompt) <= MAX_PROMPT_CHARS:
            raise ProtocolError(f"{op}: field 'prompt' must be a string of 1..{MAX_PROMPT_CHARS} characters")
        if "ids" in arrays:
            raise ProtocolError(f"{op}: give either the field 'prompt' (text) or the array 'ids', not both")
        if engine.tokenizer is None:
            raise ProtocolError(f"{op}: field 'prompt' needs a tokenizer; the daemon's model has none; send 'ids'")
    elif "ids" not in arrays:
        raise ProtocolError(f"{op}: expected the field 'prompt' (text) or an array 'ids' (int32 or int64, shape [n])")
    else:
        prompt = engine.check_tokens(arrays["ids"], f"{op} ids")
    try:
        speculate, draft_max = parse_speculative(header.get("speculative"), engine.speculation)
    except ValueError as e:
        raise ProtocolError(f"{op}: field {e}") from None
    try:
        sampling = SamplingParams(**params, seed=seed)
        generation = Generation(engine, prompt, count, sampling, stop, flags["ignore_eos"])
    except KestrelError:                # e.g. an InvalidTokenError, which is a ValueError too
        raise
    except ValueError as e:             # what the checks above let through, in SamplingParams' own words
        raise ProtocolError(f"{op}: {e}") from None
    return GenerateRequest(generation, flags["stream"], speculate, draft_max)


async def run_generation(service, session, request: GenerateRequest, send_frame, request_id) -> tuple[dict, dict]:
    """Prefill, then decode steps (or speculative rounds) through the batcher; each token streamed when asked.
    The final answer's (header fields, arrays)."""
    generation = request.generation
    params, stop = generation.params, generation.stop
    # greedy without penalties needs only the argmax (on the device in gpu mode), else the last logits row
    # (a sampled generation without penalties has each token drawn on the device where the step can)
    want = "token" if params.greedy and not params.penalized else "last"
    session.check_room(len(generation.ids) + max(stop.max_new_tokens - 1, 0))
    start = session.position
    spec = None
    if request.speculate and stop.max_new_tokens > 1:
        spec = await ServedSpeculation.open(service, session, params, generation.seed, request.draft_max)
    try:
        if stop.max_new_tokens > 0:
            if want == "last" and not params.penalized:     # sampled: the first token drawn where the step can
                job = await service.prefill_cached(session, np.asarray(generation.ids, np.int64), "sample", 1,
                                                   state=pack_state(params, generation.seed, 0))
            else:
                job = await service.prefill_cached(session, np.asarray(generation.ids, np.int64), want, 1)
            tokens = [picked(generation, job, want)]
            while tokens:
                for token in tokens:
                    piece = generation.account(token)
                    if request.stream:
                        await send_frame({"id": request_id, "ok": True, "token": piece.token, "text": piece.text,
                                          "position": start + len(generation.ids) + len(generation.tokens) - 1})
                    if stop.reason is not None:
                        break
                if stop.reason is not None:
                    break
                tokens = await next_tokens(service, session, generation, spec, token, want)
    finally:
        if spec is not None:
            await spec.finish(start + len(generation.ids) + max(len(generation.tokens) - 1, 0))
    if stop.reason is None:
        stop.reason = LENGTH
    service.replica_of(session).counters["generated_tokens"] += len(generation.tokens)
    text = "".join(generation.text_parts) if generation.decoder is not None else None
    fields = {"position": session.position, "stop_reason": stop.reason, "text": text}
    if spec is not None:
        fields["speculation"] = spec.decoder.stats.as_dict()
    if request.stream:
        fields["done"] = True
    return fields, {"tokens": np.asarray(generation.tokens, np.int32)}


def picked(generation: Generation, job, want: str) -> int:
    """The token a prefill or decode job's answer gives: its argmax or the device's draw, or drawn here from
    its last row."""
    fields, out = job.result
    return fields["token"] if "token" in fields else generation.pick(out["logits"], len(generation.tokens))


async def next_tokens(service, session, generation: Generation, spec, token: int, want: str) -> list[int]:
    """The tokens after `token`: a speculative round's, or one decode step's."""
    budget = generation.stop.max_new_tokens - len(generation.tokens)
    if spec is not None and not spec.plain_next(budget):
        rounded = await spec.round(token, generation.ids + generation.tokens, len(generation.tokens), budget,
                                   picks=want == "token")
        if rounded is not None:
            return rounded[0]
    if want == "last" and not generation.params.penalized:      # sampled: drawn on the device where it can
        state = pack_state(generation.params, generation.seed, len(generation.tokens))
        return [picked(generation, await service.decode(session, token, "sample", 1, state), want)]
    return [picked(generation, await service.decode(session, token, want, 1), want)]
