"""Server-side sampling defaults: ``serve --temp 0.7 --top-p 0.9 ...`` sets what a generation request that names
none of these fields gets, over HTTP and the socket alike; a request's own value always wins.

A field no flag sets takes the model's own recommendation where the model
carries one: a Hugging Face checkpoint's generation_config.json (its
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``; a
``do_sample`` of false means greedy), a GGUF's ``general.sampling.*`` keys
(llama.cpp's names).  Without either, a field keeps its API's default
(OpenAI's for HTTP: temperature 1, top_p 1; Engine.generate's for the
socket's generate).  The flags are checked once, before the model loads,
with generate's ranges; a model's value out of those ranges is left out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

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


# the model's recommended values: generation_config.json's keys and a GGUF's, to SamplingDefaults fields
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                          "repetition_penalty": "repeat_penalty"}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repeat_penalty"}


def in_range(values: dict) -> dict:
    """The values of ``values`` (field -> number) that the flag of their field would accept."""
    kept = {}
    for _, name, low, high, integer in FLAGS:
        value = values.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            continue
        if low <= value <= high:
            kept[name] = value
    return kept


def from_generation_config(config: dict) -> dict:
    """generation_config.json's recommended sampling, as SamplingDefaults fields."""
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return in_range({field: config.get(key) for key, field in GENERATION_CONFIG_KEYS.items()})


def from_gguf_metadata(metadata: dict) -> dict:
    """A GGUF's general.sampling.* values, as SamplingDefaults fields."""
    values = {field: metadata.get(key) for key, field in GGUF_KEYS.items()}
    return in_range({field: v.item() if isinstance(v, np.generic) else v for field, v in values.items()})


def model_sampling_defaults(source: str) -> dict:
    """The model's recommended sampling (field -> value), read from its files; {} when it has none."""
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from kestrel_stream.loading.gguf_file import open_shared
        f = open_shared(path)
        return from_gguf_metadata({key: f.metadata(key) for key in f.keys() if key in GGUF_KEYS})
    config = path / "generation_config.json"
    if not config.is_file():
        return {}
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}                   # a config that does not read recommends nothing
    return from_generation_config(data) if isinstance(data, dict) else {}


def with_model_defaults(flags: SamplingDefaults, model: dict) -> SamplingDefaults:
    """The flags, and the model's values for the fields no flag set."""
    return replace(flags, **{name: value for name, value in model.items() if getattr(flags, name) is None})
