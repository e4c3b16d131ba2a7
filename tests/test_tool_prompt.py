"""Tools rendered into the prompt through the model's chat template: a template that takes tools renders exactly
what transformers' apply_chat_template renders; where a template has no place for a part (the tool list, an
assistant's calls, a tool result), that part is written in the documented fallback format."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kestrel_stream.text.tool_prompt import (FALLBACK_HEAD, TemplateCaps, fallback_tools_text, render_tool_chat,
                                             template_caps)

from tool_templates import LLAMA31_STYLE, QWEN25, SMOLLM2

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <in> a city & more",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"c": 18}'}]
ROLE_CHECKING = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
                 "[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def tokenizer(template: str):
    return SimpleNamespace(chat_template=template, bos_token="<s>", eos_token="</s>")


def transformers_render(template: str, messages, tools) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True,
                                        bos_token="<s>", eos_token="</s>")
    return rendered[0]


@pytest.mark.parametrize("template", [QWEN25, LLAMA31_STYLE], ids=["qwen2.5", "llama3.1-style"])
def test_a_template_that_takes_tools_renders_as_transformers_does(template):
    assert template_caps(template) == TemplateCaps(True, True, True)
    ours = render_tool_chat(tokenizer(template), CONVERSATION, TOOLS)
    assert ours == transformers_render(template, CONVERSATION, TOOLS)
    assert '"description": "Weather <in> a city & more"' in ours       # json.dumps as transformers: no HTML escapes


def test_qwen_writes_calls_and_results_as_its_model_was_trained():
    text = render_tool_chat(tokenizer(QWEN25), CONVERSATION, TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"c": 18}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_the_fallback_parts_and_keeps_its_own():
    assert template_caps(SMOLLM2) == TemplateCaps(False, False, True)
    text = render_tool_chat(tokenizer(SMOLLM2), CONVERSATION, TOOLS)
    system = "<|im_start|>system\n" + fallback_tools_text(TOOLS) + "<|im_end|>\n"
    assert text.startswith(system)
    assert json.dumps(TOOLS[0]) in text and "SmolLM" not in text    # the tools' system turn replaces the default
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in text
    assert '<|im_start|>tool\n{"c": 18}<|im_end|>' in text           # its own turn for a tool result
    with_system = render_tool_chat(tokenizer(SMOLLM2), [{"role": "system", "content": "Be brief."}, *CONVERSATION],
                                   TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n" + FALLBACK_HEAD)


def test_a_template_that_refuses_the_tool_role_gets_results_as_user_turns():
    assert template_caps(ROLE_CHECKING) == TemplateCaps(False, False, False)
    two = [*CONVERSATION, {"role": "tool", "tool_call_id": "call_1", "content": "more"}]
    text = render_tool_chat(tokenizer(ROLE_CHECKING), two, None)
    assert "[user] <tool_response>\n{\"c\": 18}\n</tool_response>\n<tool_response>\nmore\n</tool_response>\n" in text
    assert FALLBACK_HEAD not in text            # no tools offered (tool_choice none): no tool list
