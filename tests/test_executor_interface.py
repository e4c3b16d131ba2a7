"""The engine asks its executor through the Executor interface only; counters are one dataclass."""
import ast
from pathlib import Path

import numpy as np

from bench.synthetic import random_q8_weights
from kestrel_stream.run.engine import Engine
from kestrel_stream.run.executor import Executor, StepCounters

RUN = Path(__file__).resolve().parents[1] / "kestrel_stream" / "run"


def probes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")]


def test_the_engine_does_not_probe_its_executor():
    assert probes(RUN / "engine.py") == [] and probes(RUN / "session.py") == []


def test_the_greedy_chain_reads_no_private_member_of_the_executor():
    tree = ast.parse((RUN / "device" / "greedy_chain.py").read_text())
    private = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and isinstance(node.value, ast.Name) and node.value.id == "x" and node.attr.startswith("_")]
    assert private == []


def test_counters_that_do_not_apply_are_left_out_of_the_public_names():
    counters = StepCounters.counting("kernels")
    counters.syncs += 2
    assert counters.as_dict() == {"steps": 0, "tokens": 0, "syncs": 2, "launches": 0, "h2d_bytes": 0,
                                  "d2h_bytes": 0, "kernels": 0}


def test_a_cpu_engine_answers_the_whole_interface():
    engine = Engine(random_q8_weights("tiny", seed=2), device="cpu")
    assert isinstance(engine.executor, Executor) and engine.executor.window_plan is None
    with engine.new_session() as s:
        logits = s.prefill([1, 2, 3])
        greedy = s.decode_greedy(4)
        assert 0 <= greedy < engine.config.vocab_size
        assert engine.executor.generate_greedy([(s.kv, np.array([1]), s.position)], 2) is None
    assert engine.executor.stats == engine.executor.counters.as_dict()
    assert engine.executor.counters.steps == 2 and engine.executor.counters.tokens == 4
    assert engine.plan_summary().startswith("cpu:")
    engine.close()
    assert logits.shape == (3, engine.config.vocab_size)
