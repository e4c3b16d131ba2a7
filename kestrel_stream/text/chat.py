"""Chat templates: a model's jinja2 template rendered in a sandbox with the variables and filters transformers
gives it.

``tojson`` is transformers' own, not jinja2's: jinja2's escapes ``<``, ``>``,
``&`` and ``'`` for HTML and sorts keys, so a tool's schema or a call's
arguments would read otherwise than in the text the model was trained on.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


class ChatTemplateError(ValueError):
    """A template that fails to compile or raises while rendering (raise_exception)."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    # transformers' settings: keep the template's own whitespace control, loop controls, tojson as HF
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages: expected a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r}")
    return messages


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra) -> str:
    """The prompt text for `messages`; `extra` (e.g. tools) is passed to the template as variables."""
    from jinja2 import TemplateError
    check_messages(messages)
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed while rendering: {e}") from None
