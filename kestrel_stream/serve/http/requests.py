"""The body of a completions or chat completions request, checked field by field into a ``TextRequest``.

Every field is checked for its type and range before anything reaches the
engine; a bad one is answered 400 with the field named in ``param``.  Fields
OpenAI defines that this server does not implement (``best_of`` > 1,
``echo``, ``suffix``, the legacy ``functions``, tools on /v1/completions) are
refused rather than ignored, so a client never gets an answer to a question
it did not ask.  The tool fields of a chat are checked in serve/http/tools.py.

A prompt's size is bounded before it is rendered or tokenized (``PromptBounds``):
no more messages than the context has tokens, and no more characters than
the context's tokens could hold at the tokenizer's longest token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kestrel_stream.serve.http.errors import APIError, bad_param
from kestrel_stream.serve.http.tools import ToolRequest, message_tool_fields, tool_request, tools_chars
from kestrel_stream.serve.sampling_defaults import SamplingDefaults
from kestrel_stream.text.sampling import SamplingParams

MAX_STOP_STRINGS = 4                # OpenAI's limit
MAX_CHOICES = 128                   # OpenAI's limit of n
MAX_LOGIT_BIAS = 1024               # token ids one request may bias
MAX_SCHEMA_CHARS = 64 << 10
TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")
MAX_CACHE_SALT_CHARS = 256
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left

KNOWN_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                "seed", "stop", "presence_penalty", "frequency_penalty", "repeat_penalty", "n", "user",
                "logit_bias", "ignore_eos", "cache_salt"}   # top_k, min_p, repeat_penalty, ignore_eos: as llama-server;
                                                        # cache_salt: as vLLM
KNOWN_COMMON |= {"speculative"}     # false opts out of the daemon's draft (serve -md, --spec lookup)
KNOWN_COMPLETIONS = KNOWN_COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix", "response_format", *TOOL_FIELDS}
KNOWN_CHAT = KNOWN_COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format",
                             *TOOL_FIELDS}


@dataclass(frozen=True)
class PromptBounds:
    """What a prompt may hold before it is tokenized: each message is at least one token of the context, each
    token at most ``max_token_chars`` characters (the vocabulary's longest)."""
    context_tokens: int
    max_token_chars: int

    @property
    def max_chars(self) -> int:
        return self.context_tokens * self.max_token_chars

    def check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise APIError(400, f"{param}: {chars} characters cannot fit this model's context of "
                                f"{self.context_tokens} tokens (at most {self.max_token_chars} characters a token)",
                           param=param, code="context_length_exceeded")


@dataclass(frozen=True)
class ResponseFormat:
    kind: str                               # "json_object" or "json_schema"
    schema: dict | None = None              # json_schema's schema (None: any JSON object)


@dataclass
class TextRequest:
    chat: bool
    prompt: str | list[int] | list[dict]    # text, token ids, or chat messages
    max_tokens: int | None                  # None: the room left in the context
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool                     # stream_options.include_usage: a last chunk with usage
    logprobs: int | None                    # None: none; else how many alternatives per token (0..)
    ignore_eos: bool = False                # generate max_tokens whatever the model says (benchmarks)
    cache_salt: str | None = None           # reuse only prefixes cached by requests with the same salt
    n: int = 1                              # choices: sequences sampled from the same prompt
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    response_format: ResponseFormat | None = None   # None: text
    speculative: object = None              # the body's "speculative" (false: opt out), checked against the draft
    tools: ToolRequest | None = None        # chat: the tools offered and tool_choice (None: no tools)


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise bad_param(name, f"expected {kind}, got {type(value).__name__} {value!r}", "invalid_type")
    if (not integer and not math.isfinite(value)) or not low <= value <= high:
        raise bad_param(name, f"{value!r} is outside {low}..{high}")
    return value


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", f"expected a string or a list of strings, got {stop!r}", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_param("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    return [s for s in stops if s]      # OpenAI accepts "" and ignores it


def parse_request(body, chat: bool, vocab_size: int, bounds: PromptBounds | None = None,
                  defaults: SamplingDefaults = SamplingDefaults()) -> TextRequest:
    """The checked request; APIError 400 naming the first bad field.  bounds: the prompt's size is checked
    against them (None: not checked here).  defaults: serve's sampling flags, for the fields the body leaves out."""
    d = defaults.get
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - (KNOWN_CHAT if chat else KNOWN_COMPLETIONS))
    if unknown:
        raise bad_param(unknown[0], "this field is not supported by this server", "unsupported_parameter")
    n = number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    for name in () if chat else TOOL_FIELDS:
        if body.get(name) is not None:
            raise bad_param(name, "tool calling is a chat feature: use /v1/chat/completions", "unsupported_parameter")
    tools = tool_request(body) if chat else None
    if tools is not None and bounds is not None:
        bounds.check_chars(tools_chars(tools), "tools")
    if not chat and number(body, "best_of", 1, 1, 1 << 30, integer=True) != 1:
        raise bad_param("best_of", "only best_of=1 is supported")
    echo = body.get("echo")
    if not chat and echo is not None and not isinstance(echo, bool):
        raise bad_param("echo", f"expected a boolean, got {echo!r:.80}", "invalid_type")
    if not chat and echo:
        raise bad_param("echo", "echo is not supported")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_param("user", f"expected a string, got {user!r:.80}", "invalid_type")
    if not chat and body.get("suffix") is not None:
        raise bad_param("suffix", "suffix is not supported")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_param("stream", f"expected a boolean, got {stream!r}", "invalid_type")
    options = body.get("stream_options")
    options = {} if options is None else options
    if (not isinstance(options, dict) or set(options) - {"include_usage"}
            or not isinstance(options.get("include_usage", False), bool)):
        raise bad_param("stream_options", f"expected {{'include_usage': bool}}, got {options!r:.80}", "invalid_type")
    prompt = chat_messages(body, bounds) if chat else completion_prompt(body, vocab_size, bounds)
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(body, limit_name, d("max_tokens", None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS), 0,
                        1 << 31, integer=True)
    try:
        params = SamplingParams(
            temperature=float(number(body, "temperature", d("temperature", 1.0), 0.0, 2.0)),
            top_p=float(number(body, "top_p", d("top_p", 1.0), 1e-9, 1.0)),
            top_k=number(body, "top_k", d("top_k", 0), -1, 1 << 31, integer=True),
            min_p=float(number(body, "min_p", d("min_p", 0.0), 0.0, 1.0)),
            presence_penalty=float(number(body, "presence_penalty", d("presence_penalty", 0.0), -2.0, 2.0)),
            frequency_penalty=float(number(body, "frequency_penalty", d("frequency_penalty", 0.0), -2.0, 2.0)),
            repeat_penalty=float(number(body, "repeat_penalty", d("repeat_penalty", 1.0), 1e-3, 10.0)),
            seed=number(body, "seed", None, 0, 2 ** 64 - 1, integer=True))
    except ValueError as e:             # the checks above should leave nothing for SamplingParams to refuse
        raise APIError(400, str(e)) from None
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_param("ignore_eos", f"expected a boolean, got {ignore_eos!r}", "invalid_type")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise bad_param("cache_salt", f"expected a string of 1..{MAX_CACHE_SALT_CHARS} characters, got "
                                      f"{salt!r:.80}", "invalid_type")
    return TextRequest(chat, prompt, max_tokens, params, stop_strings(body), stream,
                       bool(options.get("include_usage", False)), logprobs_of(body, chat), ignore_eos, salt, n,
                       logit_bias_of(body, vocab_size), response_format_of(body), body.get("speculative"), tools)


def logit_bias_of(body: dict, vocab_size: int) -> dict[int, float] | None:
    """{"token id": bias in -100..100} as OpenAI sends it (ids as strings; integers accepted too)."""
    bias = body.get("logit_bias")
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise bad_param("logit_bias", f"expected an object of token id -> bias, got {bias!r:.80}", "invalid_type")
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_param("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
    out = {}
    for key, value in bias.items():
        text = str(key)
        if not text.isdigit() or not 0 <= int(text) < vocab_size:
            raise bad_param("logit_bias", f"key {key!r:.40} is not a token id in 0..{vocab_size - 1}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_param("logit_bias", f"the bias of token {text} must be a number in -100..100, got {value!r:.40}")
        out[int(text)] = float(value)
    return out


def response_format_of(body: dict) -> ResponseFormat | None:
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_param("response_format", f"expected {{'type': 'text' | 'json_object' | 'json_schema'}}, got "
                                           f"{fmt!r:.80}", "invalid_type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(kind)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise bad_param("response_format.json_schema", f"expected {{'name': str, 'schema': object}}, got "
                                                       f"{spec!r:.80}", "invalid_type")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_param("response_format.json_schema.schema", f"expected a JSON Schema object, got {schema!r:.80}",
                        "invalid_type")
    if len(str(schema)) > MAX_SCHEMA_CHARS:
        raise bad_param("response_format.json_schema.schema", f"a schema of at most {MAX_SCHEMA_CHARS} characters")
    return ResponseFormat(kind, schema)


def logprobs_of(body: dict, chat: bool) -> int | None:
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise bad_param("logprobs", f"expected a boolean, got {wanted!r}", "invalid_type")
        top = number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS_CHAT, integer=True)
        if top is not None and not wanted:
            raise bad_param("top_logprobs", "needs logprobs: true")
        return (top or 0) if wanted else None
    return number(body, "logprobs", None, 0, MAX_LOGPROBS_COMPLETIONS, integer=True)


def completion_prompt(body: dict, vocab_size: int, bounds: PromptBounds | None) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]              # a batch of one prompt, as the openai client may send it
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param("prompt", "the prompt is empty")
        if bounds is not None:
            bounds.check_chars(len(prompt), "prompt")
        return prompt
    if isinstance(prompt, list) and bounds is not None and len(prompt) > bounds.context_tokens:
        raise APIError(400, f"prompt: {len(prompt)} token ids; this model's context is {bounds.context_tokens} "
                            f"tokens", param="prompt", code="context_length_exceeded")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_param("prompt", f"token id {bad} is outside the vocabulary 0..{vocab_size - 1}")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_param("prompt", "only one prompt per request is supported")
    raise bad_param("prompt", f"expected a non-empty string or a list of token ids, got {prompt!r:.80}",
                    "invalid_type")


def chat_messages(body: dict, bounds: PromptBounds | None) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "expected a non-empty list of {'role': ..., 'content': ...}", "invalid_type")
    if bounds is not None and len(messages) > bounds.context_tokens:
        raise APIError(400, f"messages: {len(messages)} messages cannot fit this model's context of "
                            f"{bounds.context_tokens} tokens", param="messages", code="context_length_exceeded")
    out, chars, call_ids = [], 0, set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_param(f"messages[{i}]", f"expected an object with a string 'role', got {m!r:.80}",
                            "invalid_type")
        content = m.get("content")
        if isinstance(content, list):   # content parts: only text ones can be rendered
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_param(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_param(f"messages[{i}].content", f"expected a string, got {content!r:.80}", "invalid_type")
        tool_fields = message_tool_fields(i, m, call_ids)
        chars += len(content) + len(m["role"]) + (len(str(tool_fields)) if tool_fields else 0)
        out.append({"role": m["role"], "content": content, **tool_fields})
    if bounds is not None:
        bounds.check_chars(chars, "messages")
    return out
