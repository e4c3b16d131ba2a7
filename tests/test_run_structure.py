"""How the library is put together: backends behind small contracts, not mixins and rebound methods; a small
executor; long modules only where one concern needs the room (and their docstring says so)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fake_cuda
import scheduler
from bench.synthetic import random_q8_weights
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.run.compat import HybridExecutor
from kestrel_stream.run.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [p for pkg in ("kestrel_stream", "scheduler") for p in (ROOT / pkg).rglob("*.py")]
PLAIN_BASES = {"object", "ABC", "Protocol"}
LONG_MODULE_LINES = 350
CONFIG = ModelConfig(arch="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96,
                     rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=64)


def test_no_rebound_methods_in_the_library():
    users = [str(p.relative_to(ROOT)) for p in LIBRARY if "MethodType" in p.read_text()]
    assert not users, f"types.MethodType in {users}: bind a backend behind a protocol instead"


def test_no_class_has_more_than_one_real_base():
    """Mixins are what this rules out; an error class may also be the builtin error it stands for
    (`except ValueError` catches InvalidTokenError)."""
    offenders = []
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
            real = [b for b in bases if b not in PLAIN_BASES]
            if len(real) > 1 and not all(b.endswith(("Error", "Exception")) for b in real):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(bases)})")
    assert not offenders, offenders


def test_long_modules_say_why_they_are_one_concern():
    long = []
    for path in LIBRARY:
        text = path.read_text()
        if text.count("\n") > LONG_MODULE_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "one concern" not in doc.lower():
                long.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long, f"over {LONG_MODULE_LINES} lines without a docstring sentence on why they are one concern: {long}"


@pytest.mark.parametrize("mode", ["cpu", "gpu", "gated", "layers=1"], ids=["cpu", "whole-device", "gated", "layers"])
def test_the_executor_holds_few_attributes(monkeypatch, mode):
    fake_cuda.install(monkeypatch)
    weights = random_q8_weights(CONFIG, seed=2)
    if mode in ("cpu", "gpu"):
        engine = Engine(weights, device="cpu" if mode == "cpu" else "cuda", mode=mode, max_seq_len=32, max_batch=4)
        executor = engine.executor
    else:
        executor = HybridExecutor(weights, mode, scheduler.H200_MEASURED, max_seq_len=32, max_batch=4)
    assert len(vars(executor)) < 25, sorted(vars(executor))
    executor.close()


def test_a_steady_batch1_gpu_decode_crosses_few_library_files(monkeypatch):
    """docs/design.md lists them: session, engine, step_executor, whole_step, kv_paged, step_io and
    weight_window, and on a GPU cuda/driver.py (the emulation stands in for it here)."""
    import sys
    fake_cuda.install(monkeypatch)
    engine = Engine(random_q8_weights(CONFIG, seed=2), device="cuda", mode="gpu", max_seq_len=32, max_batch=4)
    session = engine.new_session()
    session.prefill([1, 2, 3])
    for _ in range(3):
        session.decode_greedy(5)
        session.decode(5)
    library = (str(ROOT / "kestrel_stream"), str(ROOT / "scheduler"))
    crossed: set[str] = set()

    def profile(frame, event, arg):
        caller = frame.f_back
        if (event == "call" and frame.f_code.co_filename.startswith(library) and caller is not None
                and caller.f_code.co_filename.startswith(library + (__file__,))):
            crossed.add(str(Path(frame.f_code.co_filename).relative_to(ROOT)))
    for step in (lambda: session.decode_greedy(5), lambda: session.decode(5)):
        crossed.clear()
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
        assert "kestrel_stream/run/device/whole_step.py" in crossed, sorted(crossed)
        assert len(crossed) + 1 <= 8, sorted(crossed)         # + cuda/driver.py on a GPU
    engine.close()
