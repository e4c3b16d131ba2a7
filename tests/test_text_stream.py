"""Stop conditions, incremental detokenization and chat templates, on a small byte-level BPE."""
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from kestrel_stream.text.chat import ChatTemplateError, render_chat
from kestrel_stream.text.detok import IncrementalDecoder
from kestrel_stream.text.stop import StopChecker
from kestrel_stream.text.tokenizer import Tokenizer

TEXTS = ["Hello world, héllo wörld! 你好，世界。 Emoji: 🦅🦅 done.", "  leading spaces\tand\ttabs\n\nnew lines",
         "naïve café – “quotes” ½ ≥ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]


@pytest.fixture(scope="module")
def tok():
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(hf, frozenset({0}), eos_token="<eos>")


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_join_to_the_whole_decode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)          # a split character is held back, never broken
    assert "".join(pieces) + decoder.flush() == text


def test_pieces_after_a_prompt_keep_their_leading_space(tok):
    prompt, rest = tok.encode("Hello"), tok.encode(" world")
    decoder = IncrementalDecoder(tok, prompt)
    assert "".join(decoder.push(t) for t in rest) == " world"


def feed(checker, pieces):
    out = []
    for i, piece in enumerate(pieces):
        out.append(checker.push(i + 100, piece))
        if checker.reason:
            break
    return "".join(out), checker.reason


def test_a_stop_string_split_over_pieces_is_held_back_then_cut():
    checker = StopChecker(stop=["</end>"], max_new_tokens=50)
    released = [checker.push(1, p) for p in ["abc<", "/e", "n"]]
    assert released == ["abc", "", ""]
    assert checker.push(1, "d> tail") == "" and checker.reason == "stop"


def test_held_text_that_turns_out_ordinary_is_released():
    assert feed(StopChecker(stop=["###"], max_new_tokens=4), ["a#", "#b", "c", "d"]) == ("a##bcd", "length")


def test_eos_and_length_stop_with_their_reasons():
    checker = StopChecker(eos_ids={7}, max_new_tokens=10)
    assert checker.push(1, "x") == "x" and checker.reason is None
    assert checker.push(7, "<eos>") == "" and checker.reason == "eos"
    assert feed(StopChecker(max_new_tokens=2), ["a", "b", "c"]) == ("ab", "length")


def test_bad_stop_strings_are_refused():
    with pytest.raises(ValueError, match="stop"):
        StopChecker(stop=[""])


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_template_renders_messages_and_the_generation_prompt():
    text = render_chat(CHATML, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
                       [{"role": "user", "content": "x"}], bos_token="<s>", eos_token="</s>") == "<s>x</s>"


def test_chat_template_is_sandboxed_and_raise_exception_reports():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="messages\\[0\\]"):
        render_chat(CHATML, [{"role": "user"}])
    assert render_chat("{{ strftime_now('%Y') | length }}", [{"role": "user", "content": "x"}]) == "4"


def test_tojson_is_transformers_one_keys_in_order_no_html_escapes():
    template = "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}"
    tools = [{"b": "<x> & 'y'", "a": "é"}]
    assert render_chat(template, [{"role": "user", "content": "x"}], tools=tools) == (
        '[{"b": "<x> & \'y\'", "a": "é"}]|{\n  "b": "<x> & \'y\'",\n  "a": "é"\n}')
