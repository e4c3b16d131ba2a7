"""CI: bench/load_time.py's child processes import kestrel_stream from the tree they time and keep the
caller's other import paths (dependencies installed with pip --target, as on the GPU machine)."""
import os

from bench import load_time


def test_child_path_puts_the_tree_first_and_drops_other_trees(tmp_path, monkeypatch):
    other_tree, deps = tmp_path / "other", tmp_path / "site"
    (other_tree / "kestrel_stream").mkdir(parents=True)
    deps.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(other_tree), str(deps), ""]))
    tree = tmp_path / "baseline"
    assert load_time.child_path(tree).split(os.pathsep) == [str(tree), str(deps)]
    monkeypatch.delenv("PYTHONPATH")
    assert load_time.child_path(tree) == str(tree)
