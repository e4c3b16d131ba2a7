"""Server-side sampling defaults: ``serve --temp 0.7 --top-p 0.9 ...`` sets what a generation request that names
none of these fields gets, over HTTP and the socket alike; a request's own value always wins.

Without a flag, a field keeps its API's default (OpenAI's for HTTP: temperature 1, top_p 1; Engine.generate's
for the socket's generate).  The flags are checked once, before the model loads, with generate's ranges.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

MAX_TEMPERATURE = 100.0             # generate's ranges (cli/text_args.py)
MAX_PENALTY = 100.0
# flag, field, low, high, integer
FLAGS = (("--temp", "temperature", 0.0, MAX_TEMPERATURE, False), ("--top-k", "top_k", -1, 2**31 - 1, True),
         ("--top-p", "top_p", 1e-9, 1.0, False), ("--min-p", "min_p", 0.0, 1.0, False),
         ("--repeat-penalty", "repeat_penalty", 1e-3, MAX_PENALTY, False),
         ("--presence-penalty", "presence_penalty", -MAX_PENALTY, MAX_PENALTY, False),
         ("--frequency-penalty", "frequency_penalty", -MAX_PENALTY, MAX_PENALTY, False),
         ("--max-tokens", "max_tokens", 1, 2**31 - 1, True))


@dataclass(frozen=True)
class SamplingDefaults:
    """None: the API's own default."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None           # a generation's token limit when the request sets none

    def get(self, name: str, api_default):
        value = getattr(self, name)
        return api_default if value is None else value

    def given(self) -> dict:
        """The fields a flag set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


HELP = {"--temp": "temperature of requests that set none (default: the API's own: 1 over HTTP, greedy on the "
                   "socket)",
        "--top-k": "top_k of requests that set none (<= 0: off)",
        "--top-p": "top_p of requests that set none, in (0, 1]",
        "--min-p": "min_p of requests that set none, in 0..1",
        "--repeat-penalty": "repeat_penalty of requests that set none (1: off)",
        "--presence-penalty": "presence_penalty of requests that set none",
        "--frequency-penalty": "frequency_penalty of requests that set none",
        "--max-tokens": "max_tokens of requests that set none (default: 16 for /v1/completions and the socket, "
                        "the room left in the context for chat)"}


def add_sampling_default_args(p) -> None:
    for flag, _, _, _, integer in FLAGS:
        p.add_argument(flag, type=int if integer else float, default=None, help=HELP[flag])


def sampling_defaults_from_args(args) -> SamplingDefaults:
    """The flags as SamplingDefaults; ValueError naming the flag for a value out of range."""
    values = {}
    for flag, name, low, high, _ in FLAGS:
        value = getattr(args, name if name != "temperature" else "temp")
        if value is not None and not (low <= value <= high and value == value):
            raise ValueError(f"{flag} must be in {low:g}..{high:g}, got {value}")
        values[name] = value
    return SamplingDefaults(**values)
