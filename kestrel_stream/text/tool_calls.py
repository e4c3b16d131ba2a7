"""Tool calls in a model's output: the two formats chat templates teach, read back as the text streams, and
the grammar that holds a forced call to its function's parameters.

- ``hermes`` (Qwen2/2.5/3, Hermes 2/3, and this server's fallback prompt):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block a
  call, text before or between them is the message's content.
- ``llama3`` (Llama 3.1-3.3 templates): the whole answer is one JSON object
  ``{"name": ..., "parameters": {...}}`` (its ``<|python_tag|>`` is a control
  token, so it never reaches the text).

The format is told from the template's text (``call_format``).  A call that
does not parse, or names a function the request did not offer, stays text:
the client sees what the model wrote rather than a call it cannot make.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

HERMES, LLAMA3 = "hermes", "llama3"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# the JSON of a forced call is written as the templates write calls in the prompt (json.dumps' separators)
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and the JSON Schema of its arguments object."""
    name: str
    description: str | None
    parameters: dict

    def as_template(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape, as transformers passes ``tools``)."""
        function = {"name": self.name, **({"description": self.description} if self.description else {}),
                    "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # the arguments object as JSON text, as OpenAI sends it

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_format(template: str | None) -> str:
    """The call format a chat template teaches: llama3 where it speaks of ipython or the python tag, else
    hermes (the ``<tool_call>`` templates, and the fallback prompt of templates that know no tools)."""
    if template and OPEN not in template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3
    return HERMES


def arguments_key(fmt: str) -> str:
    return "parameters" if fmt == LLAMA3 else "arguments"


def parse_call(text: str, names: frozenset[str]) -> ToolCall | None:
    """One call's JSON (``{"name", "arguments" | "parameters"}``), or None when it is not a call of ``names``."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):          # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """The content and the calls of one choice's text, fed as it streams: ``push`` each piece, ``finish`` at
    the end; each returns (content released now, calls completed now).  Text that may still become a call is
    held back, and whitespace next to a call is dropped.  ``max_calls``: later calls are dropped
    (parallel_tool_calls false)."""

    def __init__(self, fmt: str, names: frozenset[str], max_calls: int | None = None):
        self.fmt, self.names, self.max_calls = fmt, names, max_calls
        self.held = ""          # text not yet released: a possible start of a call, or whitespace
        self.inside = False     # hermes: between OPEN and CLOSE
        self.after_call = False # hermes: the whitespace that follows is the call's, not content
        self.space = ""         # hermes: the whitespace before the OPEN being read (text again if no call)
        self.whole: bool | None = None      # llama3: the answer is one JSON object (None: not known yet)
        self.calls = 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.held += text
        return self.hermes() if self.fmt == HERMES else self.llama3()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held at the end: a call whose closing tag never came is a call if its JSON is whole."""
        held, self.held = self.held, ""
        if self.inside or self.whole:
            call = parse_call(held, self.names)
            if call is not None:
                return "", self.kept([call])
            return (self.space + OPEN + held if self.inside else held), []
        if not held.strip():
            return ("" if self.calls else held), []
        return self.release(held), []

    def kept(self, calls: list[ToolCall]) -> list[ToolCall]:
        if self.max_calls is not None:
            calls = calls[:max(0, self.max_calls - self.calls)]
        self.calls += len(calls)
        return calls

    def release(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text

    def hermes(self) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            if self.inside:
                end = self.held.find(CLOSE)
                if end < 0:
                    break
                body, self.held = self.held[:end], self.held[end + len(CLOSE):]
                self.inside = False
                call = parse_call(body, self.names)
                if call is None:
                    content += self.space + OPEN + body + CLOSE
                    self.after_call = False
                else:
                    calls += self.kept([call])
                    self.after_call = True
                continue
            at = self.held.find(OPEN)
            if at >= 0:
                before = self.held[:at].rstrip()
                self.space = self.held[len(before):at]
                content += self.release(before)
                self.held = self.held[at + len(OPEN):]
                self.inside = True
                continue
            # release all but a tail that could begin OPEN, and trailing whitespace (a call may follow it)
            keep = next((n for n in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                         if self.held.endswith(OPEN[:n])), 0)
            body = self.held[:len(self.held) - keep].rstrip()
            content += self.release(body)
            self.held = self.held[len(body):]
            break
        return content, calls

    def llama3(self) -> tuple[str, list[ToolCall]]:
        if self.whole is None:
            start = self.held.lstrip()
            if not start:
                return "", []
            self.whole = start.startswith("{")
        if self.whole:
            return "", []           # the whole answer decides: held to the end
        content, self.held = self.held, ""
        return content, []


def forced_grammar(fmt: str, tools: list[Tool], parallel: bool, text_schema: dict | None = None,
                   optional: bool = False) -> str:
    """llguidance's lark grammar of an answer that is a call of one of ``tools`` (arguments valid for its
    schema), several in a row where ``parallel``; ``optional``: the answer may instead be a JSON document of
    ``text_schema`` (tool_choice auto with a response_format)."""
    key = arguments_key(fmt)
    rules = []
    for i, tool in enumerate(tools):
        schema = {"type": "object", "properties": {"name": {"const": tool.name}, key: tool.parameters},
                  "required": ["name", key], "additionalProperties": False, "x-guidance": CALL_JSON}
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    call = " | ".join(f"call_{i}" for i in range(len(tools)))
    if fmt == HERMES:
        block = f'"{OPEN}\\n" ({call}) "\\n{CLOSE}"'
        calls = f'{block} ("\\n" {block})*' if parallel else block
    else:
        calls = f"({call})"         # llama3: one call is the whole answer
    start = f"start: {calls}"
    if optional:
        text = {**(text_schema or {"type": "object"}), "x-guidance": {"whitespace_flexible": False}}
        start += " | answer"
        rules.append(f"answer: %json {json.dumps(text)}")
    return "\n".join([start, *rules]) + "\n"
