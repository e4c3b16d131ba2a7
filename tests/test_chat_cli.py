"""`kestrel-stream chat` driven through a pipe: the template, turns kept in the KV (each turn prefills only its
own tokens), /reset, /system, multi-line input, Ctrl-C, end of input."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from http_helpers import CHAT_TEMPLATE, chat_model

STATS = re.compile(r"\[prefilled (\d+) tokens(; [^;]*)?; (\d+) tokens at [\d.]+ tok/s; (\w+)\]")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("chat"))


def chat(model, stdin: str, *flags):
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", "chat", "-m", str(model), "--device", "cpu",
                           "-n", "6", *flags], input=stdin, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc, [(int(m[1]), int(m[3]), m[4]) for m in STATS.finditer(proc.stderr)]


def prefill_len(text: str) -> int:
    return len(text.encode())           # the tiny model's byte-level tokenizer: one token a byte


def test_later_turns_prefill_only_their_own_tokens(model):
    proc, turns = chat(model, "hello\nsecond question\nthird\n")
    assert [t[1:] for t in turns] == [(6, "length")] * 3
    # the template: <role>content\n per message, then <assistant>
    assert turns[0][0] == prefill_len("<user>hello\n<assistant>")
    assert turns[1][0] == prefill_len("\n<user>second question\n<assistant>")     # the answer's \n, the new turn
    assert turns[2][0] == prefill_len("\n<user>third\n<assistant>")
    assert proc.stdout.count("\n") >= 3                                            # one answer a line at least


def test_reset_system_and_multi_line_input(model):
    stdin = 'first\n/system be brief\nline one \\\nline two\n"""\nblock a\nblock b\n"""\n/reset\nagain\n/exit\nnever\n'
    proc, turns = chat(model, stdin)
    assert "system message set" in proc.stderr and "starts again" in proc.stderr
    assert [t[0] for t in turns] == [
        prefill_len("<user>first\n<assistant>"),
        prefill_len("<system>be brief\n<user>line one \nline two\n<assistant>"),   # /system started again
        prefill_len("\n<user>block a\nblock b\n<assistant>"),
        prefill_len("<system>be brief\n<user>again\n<assistant>")]                  # /reset keeps the system
    assert len(turns) == 4                                                           # /exit: "never" not sent


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The chat model with a 32,768-position context: a 5,000-token answer outlasts the test's Ctrl-C."""
    import json
    from dataclasses import replace
    from kestrel_stream.loading.presets import PRESETS, make_model
    path = make_model(tmp_path_factory.mktemp("chat-long"), replace(PRESETS["tiny"], max_position_embeddings=32768),
                      seed=1, dtype="f32")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return path


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(long_model):
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_stream", "chat", "-m", str(long_model), "--device", "cpu",
                             "--ignore-eos", "-c", "32768", "-n", "5000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    proc.stdin.write("a long answer please\n")
    proc.stdin.flush()
    first = proc.stdout.read(1)                     # the answer has begun (it would run to the context's end)
    assert first
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate("next\n", timeout=120)
    assert proc.returncode == 0, err
    turns = [(int(m[1]), int(m[3]), m[4]) for m in STATS.finditer(err)]
    assert turns[0][2] == "interrupted" and turns[0][1] < 5000
    assert turns[1][0] == prefill_len("\n<user>next\n<assistant>")          # the cut answer stayed in the KV
    assert turns[1][1:] == (5000, "length")


def test_a_model_without_a_chat_template_is_a_clear_error(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "kestrel_stream", "chat", "-m", str(tiny_model), "--device", "cpu"],
                          input="hi\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no chat template" in proc.stderr and "Traceback" not in proc.stderr


def test_sampled_answers_repeat_with_the_seed(model):
    flags = ("--temp", "0.9", "--top-k", "0", "--min-p", "0", "-s", "3")
    first, turns = chat(model, "hello\nagain\n", *flags)
    second, _ = chat(model, "hello\nagain\n", *flags)
    greedy, _ = chat(model, "hello\nagain\n")
    assert first.stdout == second.stdout and first.stdout != greedy.stdout
    assert turns[1][0] == prefill_len("\n<user>again\n<assistant>")


def test_a_template_that_rewrites_earlier_turns_prefills_the_conversation_again(tmp_path):
    import json
    from dataclasses import replace
    from kestrel_stream.loading.presets import PRESETS, make_model
    path = make_model(tmp_path, replace(PRESETS["tiny"], max_position_embeddings=2048), seed=1, dtype="f32")
    # past answers shown by their first 2 characters only (as templates drop a past answer's reasoning)
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{{ m.content[:2] }}{% else %}"
                "{{ m.content }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    proc, turns = chat(path, "hello\nnext\n")
    assert "the template rewrote earlier turns" in proc.stderr
    assert turns[1][0] > prefill_len("<user>hello\n<assistant>") + prefill_len("<user>next\n<assistant>")
