"""The CPU engine keeps one host copy of a repacked weight (run/host/repacked.py): with AVX-512 VNNI its Q4_K
/ Q6_K projections are the kernels' repacked groups alone, nothing keeps the blocks they were made from
(the fused weights' arrays, the views of the file), its logits are those of weights prepared beside their
blocks bit for bit, and a process that loads a Q4_K_M file and runs a step holds about one copy."""
from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from bench.make_gguf import write as write_gguf
from kestrel_stream import native
from kestrel_stream.loading.loader import load_weights
from kestrel_stream.model.quant4 import BlockTensor, tensor_parts
from kestrel_stream.options import Options
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.host import HostBackend
from kestrel_stream.run.host.repacked import RepackedTensor
from test_native_kernels import REPACKED_ROWS
from test_quant4 import CFG

ROOT = Path(__file__).resolve().parents[1]
NATIVE = Options.from_env().with_(host_kernels="native")
pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not native.load().repacks("Q4_K"),
                                reason="no C compiler or no AVX-512 VNNI here: nothing is repacked")
MOE = dataclasses.replace(CFG, arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)


@pytest.fixture(scope="module", params=["dense", "moe"])
def gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("mix") / "m.gguf"
    write_gguf(CFG if request.param == "dense" else MOE, None, str(path), seed=3, mix="q4_k_m")
    return path


def projections(weights) -> list:
    out = [weights.lm_head]
    for lw in weights.layers:
        out += [lw.wqkv, lw.wo] + ([lw.moe.gate_up, lw.moe.down] if lw.moe else [lw.w_gate_up, lw.w_down])
    return out


def test_the_cpu_engine_holds_no_block_it_repacked(gguf):
    weights = load_weights(gguf)
    blocks = [weakref.ref(part.blocks) for w in projections(weights) for part in tensor_parts(w)
              if isinstance(part, BlockTensor)]
    assert blocks
    engine = Engine(weights, device="cpu", mode="cpu", options=NATIVE)
    del weights
    gc.collect()
    assert all(ref() is None for ref in blocks)          # the fused arrays and the views of the file
    held = [part for w in projections(engine.weights) for part in tensor_parts(w)]
    assert all(isinstance(part, RepackedTensor) for part in held)
    assert engine.weights.embed is engine.weights.lm_head      # still tied: the embedding reads the groups
    engine.close()


def test_outputs_are_those_of_weights_prepared_beside_their_blocks(gguf):
    """The engine against a host backend that prepares each weight from its blocks on first use (what the
    CPU engine did before), on a prompt, decode steps and two sessions in one step."""
    engine = Engine(load_weights(gguf), device="cpu", mode="cpu", options=NATIVE)
    reference = HostBackend(load_weights(gguf), options=NATIVE)
    a, b = engine.new_session(), engine.new_session()
    kv_a, kv_b = reference.alloc_kv(64), reference.alloc_kv(64)
    prompt = [5, 3, 200, 17, 9, 44, 1, 2]
    got = a.prefill(prompt)
    expect = reference.forward([(kv_a, np.array(prompt), 0)])[0]
    assert np.array_equal(got, expect)
    assert np.array_equal(b.prefill([7]), reference.forward([(kv_b, np.array([7]), 0)])[0])
    for step, token in enumerate([11, 12, 13]):
        expect = reference.forward([(kv_a, np.array([token]), len(prompt) + step)])[0]
        assert np.array_equal(a.decode(token), expect[-1])
    rows = engine.step([(a, np.array([14])), (b, np.array([15, 16]))])
    expect = reference.forward([(kv_a, np.array([14]), len(prompt) + 3), (kv_b, np.array([15, 16]), 1)])
    for got_rows, expect_rows in zip(rows, expect):
        assert np.array_equal(got_rows, expect_rows)
    engine.close()


def test_a_repacked_tensor_reads_as_its_blocks(gguf):
    weights = load_weights(gguf)
    repacked = HostBackend(weights, options=NATIVE, sole_reader=True).weights
    for before, after in zip(projections(weights), projections(repacked)):
        for part, held in zip(tensor_parts(before), tensor_parts(after)):
            assert held.shape == part.shape and held.nbytes == part.nbytes
            assert np.array_equal(held.file_rows(slice(None)), part.blocks)
            rows = np.array([0, part.shape[0] - 1, part.shape[0] // 2, 3])
            assert np.array_equal(held.dequantize_rows(rows), part.dequantize_rows(rows))
            assert np.array_equal(held.dequantize(rows_per_chunk=7), part.dequantize())


def test_a_loaded_q4_k_m_file_is_on_the_host_once(tmp_path):
    """A process that loads a Q4_K_M file on the CPU engine and runs a prompt holds its repacked weights
    and little else: its RSS grows by less than 1.3 times the file and the modules it imports."""
    cfg = dataclasses.replace(CFG, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, vocab_size=4096,
                              num_attention_heads=16, num_key_value_heads=8)
    path = tmp_path / "big.gguf"
    write_gguf(cfg, None, str(path), seed=1, mix="q4_k_m")
    out = subprocess.run([sys.executable, "-m", "bench.host_rss", str(path), "--prompt", "16", "--new-tokens", "2",
                          "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    rss = json.loads(out.stdout)
    grown_mib = rss["decoded"]["VmRSS"] - rss["start"]["VmRSS"]
    file_mib = path.stat().st_size / 2**20
    assert grown_mib < 1.3 * file_mib + 20, (rss, file_mib)          # before: 2.9 times (92 MiB of 32)


def test_a_repacked_weight_gives_its_rows_back_as_the_blocks():
    """PreparedWeight.file_rows, the numpy form of ks_repack's layouts, inverts it: every row count a group
    may end at, several blocks a row, rows in any order and repeated."""
    kernels = native.load()
    if "avx512vnni" not in kernels.supported:
        pytest.skip("no AVX-512 VNNI here: nothing is repacked")
    rng = np.random.default_rng(8)
    vnni = kernels.with_isa("avx512vnni")
    for fmt in ("Q4_K", "Q6_K"):
        for n in REPACKED_ROWS:
            blocks = rng.integers(0, 256, (n, 3 * {"Q4_K": 144, "Q6_K": 210}[fmt]), dtype=np.uint8)
            prepared = vnni.prepare_blocks(fmt, blocks, 768)
            assert np.array_equal(prepared.file_rows(slice(None)), blocks)
            rows = rng.integers(0, n, 9)
            assert np.array_equal(prepared.file_rows(rows), blocks[rows])
