"""The tool fields of a chat completions request, checked into a ``ToolRequest``: ``tools``,
``tool_choice``, ``parallel_tool_calls``, and the tool parts of messages (an assistant's ``tool_calls``, a
``tool`` message's ``tool_call_id``).  A bad one is a 400 naming the field, as every other field's.

``tool_choice``: "none" (no tool is offered to the model, its answer is
text), "auto" (the default with tools: the model may call; its answer is
read for calls), "required" (one call of any tool) or ``{"type": "function",
"function": {"name": ...}}`` (one call of that tool); the last two hold the
output to a grammar of the calls (text/tool_calls.py), so their arguments
are always a document of the function's parameters schema.
``parallel_tool_calls`` (default false, as llama-server's) allows more than
one call an answer.  The legacy ``functions`` and ``function_call`` are
refused, naming their replacements.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kestrel_stream.serve.http.errors import bad_param
from kestrel_stream.text.tool_calls import Tool

MAX_TOOLS = 128                     # OpenAI's limit
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str                     # "none" | "auto" | "required" | "function"
    forced: str | None = None       # the function's name where choice is "function"
    parallel: bool = False

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model is shown: none under tool_choice "none"."""
        return () if self.choice == "none" else self.tools

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a forced call may name (all offered ones under "required")."""
        return tuple(t for t in self.tools if t.name == self.forced) if self.forced else self.offered

    @property
    def forced_call(self) -> bool:
        return self.choice in ("required", "function")


def tool_request(body: dict) -> ToolRequest | None:
    """The checked tool fields of a chat body; None where it offers no tools."""
    for legacy, use in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(legacy) is not None:
            raise bad_param(legacy, f"{legacy} is deprecated and not supported; use {use}", "unsupported_parameter")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", f"expected a boolean, got {parallel!r:.80}", "invalid_type")
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None:
        if choice not in (None, "none", "auto"):
            raise bad_param("tool_choice", f"tool_choice {choice!r:.80} needs tools")
        return None
    if not isinstance(raw, list) or not raw:
        raise bad_param("tools", f"expected a non-empty list of {{'type': 'function', 'function': {{...}}}}, got "
                                 f"{raw!r:.80}", "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise bad_param("tools", f"at most {MAX_TOOLS} tools, got {len(raw)}")
    tools = [tool_of(i, t) for i, t in enumerate(raw)]
    names = [t.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_param("tools", f"two tools are named {duplicate!r}")
    forced = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_param("tool_choice", f"expected 'none', 'auto', 'required' or {{'type': 'function', "
                                           f"'function': {{'name': ...}}}}, got {choice!r:.80}", "invalid_type")
        if name not in names:
            raise bad_param("tool_choice", f"tool_choice names the function {name!r:.64}, which is not among the "
                                           f"tools ({', '.join(names)[:200]})")
        choice, forced = "function", name
    elif choice not in CHOICES:
        raise bad_param("tool_choice", f"expected 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                                       f"{{'name': ...}}}}, got {choice!r:.80}", "invalid_type")
    return ToolRequest(tuple(tools), choice, forced, bool(parallel))


def tool_of(i: int, raw) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
        raise bad_param(where, f"expected {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, "
                               f"got {raw!r:.80}", "invalid_type")
    function = raw["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_param(f"{where}.function.name", f"expected 1..64 letters, digits, '_' or '-', got {name!r:.80}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_param(f"{where}.function.description", f"expected a string, got {description!r:.80}",
                        "invalid_type")
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad_param(f"{where}.function.parameters", f"expected a JSON Schema of an object, got "
                                                        f"{parameters!r:.80}", "invalid_type")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_param(f"{where}.function.strict", f"expected a boolean, got {strict!r:.80}", "invalid_type")
    return Tool(name, description, parameters)


def message_tool_fields(i: int, m: dict, call_ids: set[str]) -> dict:
    """The tool parts of message ``i`` as templates take them: an assistant's ``tool_calls`` (arguments
    parsed into objects; their ids join ``call_ids``), a tool message's ``tool_call_id`` (one of an earlier
    call's ids) and ``name``."""
    out = {}
    calls = m.get("tool_calls")
    if calls is not None:
        where = f"messages[{i}].tool_calls"
        if m["role"] != "assistant":
            raise bad_param(where, "only an assistant message carries tool_calls")
        if not isinstance(calls, list):
            raise bad_param(where, f"expected a list of calls, got {calls!r:.80}", "invalid_type")
        out["tool_calls"] = [call_of(f"{where}[{j}]", c) for j, c in enumerate(calls)]
        call_ids.update(c["id"] for c in out["tool_calls"])
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_param(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id of the call it "
                                                           "answers", "invalid_type")
        if call_id not in call_ids:
            raise bad_param(f"messages[{i}].tool_call_id", f"{call_id!r:.80} is not the id of a tool call of an "
                                                           f"earlier assistant message")
        out["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def call_of(where: str, raw) -> dict:
    function = raw.get("function") if isinstance(raw, dict) else None
    if (not isinstance(function, dict) or raw.get("type", "function") != "function"
            or not isinstance(raw.get("id"), str) or not isinstance(function.get("name"), str)):
        raise bad_param(where, f"expected {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': "
                               f"str}}}}, got {raw!r:.80}", "invalid_type")
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_param(f"{where}.function.arguments", f"expected a JSON object's text, got {arguments!r:.80}",
                        "invalid_type")
    return {"id": raw["id"], "type": "function", "function": {"name": function["name"], "arguments": parsed}}


def tools_chars(tools: ToolRequest | None) -> int:
    """The characters the tools add to a prompt (for the prompt's bounds)."""
    return 0 if tools is None else sum(len(json.dumps(t.as_template())) for t in tools.offered)
