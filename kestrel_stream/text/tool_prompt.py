"""A conversation with tools rendered through the model's chat template, the way the template expects.

Templates differ in what they know: Qwen's and Hermes' take ``tools`` and
render an assistant's ``tool_calls`` and ``tool`` messages; Llama 3.1's put
the tools in the first user message; SmolLM2's and most older ChatML ones
know none of it.  What a template renders is found by rendering it once
with marked probes and looking for the marks (llama.cpp's minja does the
same), cached per template.  Where the template has no place for a part,
it is written as the fallback format, Hermes' (the one Qwen 2.5 uses); a
part the template renders stays the template's (a ChatML template with no
tools still writes a ``tool`` message as a turn of its own, which SmolLM2
answers from, where it echoes a ``<tool_response>`` block):

- tools: a system message (added to the conversation's own first system
  message where there is one) listing each tool's JSON inside
  ``<tools></tools>`` and asking for ``<tool_call>{"name", "arguments"}</tool_call>``;
- an assistant's tool calls: those blocks after its content;
- tool results: user messages of ``<tool_response>...</tool_response>``.

Calls reach templates as transformers passes them: ``{"id", "type",
"function": {"name", "arguments"}}`` with the arguments as an object (the
templates write ``arguments | tojson``), not OpenAI's JSON text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from kestrel_stream.text.chat import ChatTemplateError, render_chat
from kestrel_stream.text.tool_calls import CLOSE, OPEN

FALLBACK_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
FALLBACK_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
PROBE_TOOL, PROBE_CALL, PROBE_RESULT = "kestrel_probe_tool", "kestrel_probe_call", "kestrel_probe_result"


@dataclass(frozen=True)
class TemplateCaps:
    tools: bool             # renders the ``tools`` it is given
    tool_calls: bool        # renders an assistant message's ``tool_calls``
    tool_responses: bool    # renders ``tool`` messages


def _renders(template: str, mark: str, messages: list[dict], **extra) -> bool:
    try:
        return mark in render_chat(template, messages, add_generation_prompt=False, **extra)
    except ChatTemplateError:
        return False


@lru_cache(maxsize=8)
def template_caps(template: str) -> TemplateCaps:
    user = {"role": "user", "content": "hello"}
    tool = {"type": "function", "function": {"name": PROBE_TOOL, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function", "function": {"name": PROBE_CALL, "arguments": {"a": 1}}}]}
    result = {"role": "tool", "tool_call_id": "call_probe", "name": PROBE_CALL, "content": PROBE_RESULT}
    return TemplateCaps(_renders(template, PROBE_TOOL, [user], tools=[tool]),
                        _renders(template, PROBE_CALL, [user, call]),
                        _renders(template, PROBE_RESULT, [user, call, result], tools=[tool]))


def fallback_tools_text(tools: list[dict]) -> str:
    return FALLBACK_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + FALLBACK_TAIL


def calls_as_text(message: dict) -> str:
    """An assistant message's content followed by its calls in the fallback format."""
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]
    blocks = [f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}" for call in calls]
    return "\n".join(([message["content"]] if message["content"] else []) + blocks)


def as_template_expects(messages: list[dict], tools: list[dict] | None, caps: TemplateCaps) -> list[dict]:
    """``messages`` with each part the template cannot render written in the fallback format."""
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls") and not caps.tool_calls:
            out.append({"role": m["role"], "content": calls_as_text(m)})
        elif m["role"] == "tool" and not caps.tool_responses:
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):      # consecutive results: one user turn, as Qwen's
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "tool_responses"} for m in out]
    if tools and not caps.tools:
        text = fallback_tools_text(tools)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_tool_chat(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text of a conversation that offers ``tools`` (OpenAI's shape; None: none offered) or holds
    tool calls and results.  ChatTemplateError from the template."""
    template = tokenizer.chat_template
    caps = template_caps(template)
    extra = {"tools": tools} if tools and caps.tools else {}
    return render_chat(template, as_template_expects(messages, tools, caps), add_generation_prompt=True,
                       bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "", **extra)


def uses_tools(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
