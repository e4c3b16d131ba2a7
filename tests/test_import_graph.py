"""The package's import graph (module-level and function-level imports alike) has no cycle, between modules
nor between packages, and no module reaches into another package's private names."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kestrel_stream", "scheduler")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    modules = library_modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:      # `from pkg import module` reads the module, else pkg's names
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        # only modules of these packages count (an import of a.b.c runs a and a.b's __init__ too, which
        # would make every package importing its own modules a cycle)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def package_of(module: str) -> str:
    """A module's package node: kestrel_stream's subpackage (kestrel_stream.run), a top-level module of
    kestrel_stream on its own (kestrel_stream.options), kestrel_stream's __init__ (kestrel_stream), or
    another top-level package (scheduler)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kestrel_stream" else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        package = package_of(module)
        packages.setdefault(package, set()).update(package_of(t) for t in targets)
    return {package: targets - {package} for package, targets in packages.items()}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_by_package(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Each _name a package defines (def, class, assignment, self._x = ...) -> the packages defining it."""
    owners: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names = [node.attr]
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names = [node.id]
            else:
                continue
            for name in filter(is_private, names):
                owners.setdefault(name, set()).add(package_of(module))
    return owners


def library_trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in library_modules().items()}


def private_reaches(trees: dict[str, ast.Module]) -> list[str]:
    """`from a.b import _x` with a.b in another package, and `obj._x` where _x is defined only in other
    packages of the library (an attribute of self/cls, or one no package of ours defines, is not counted)."""
    owners = private_names_by_package(trees)
    found = []
    for module, tree in trees.items():
        package = package_of(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if package_of(node.module) != package and node.module.split(".")[0] in PACKAGES:
                    found += [f"{module}: from {node.module} import {a.name}" for a in node.names if is_private(a.name)]
            elif isinstance(node, ast.Attribute) and is_private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr in owners and package not in owners[node.attr]:
                    found.append(f"{module}:{node.lineno}: {ast.unparse(node)} "
                                 f"(private to {', '.join(sorted(owners[node.attr]))})")
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "scheduler.gate" in graph["scheduler.plan"]                 # from .gate import ...
    assert "kestrel_stream.run.step_executor" in graph["kestrel_stream.run.engine"]   # imported inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    packages = package_graph(graph)
    assert "kestrel_stream.client" in packages["kestrel_stream"]        # ks.Client: imported inside __getattr__
    assert "kestrel_stream.errors" in packages["kestrel_stream.run"]    # a module of kestrel_stream is a node
    assert "scheduler" in packages["kestrel_stream.run"] and "kestrel_stream.run" not in packages["kestrel_stream.run"]


def test_the_private_check_sees_imports_and_calls_across_packages():
    trees = {"kestrel_stream.run.engine": ast.parse("class Engine:\n    def _result(self): ...\n_UNITS = {}"),
             "kestrel_stream.text.generation": ast.parse(
                 "from kestrel_stream.run.engine import _UNITS\n"
                 "def run(engine):\n    return engine._result(), engine._own(), engine.__class__\n"
                 "class Generation:\n    def _own(self):\n        return self._result")}
    assert private_reaches(trees) == [
        "kestrel_stream.text.generation: from kestrel_stream.run.engine import _UNITS",
        "kestrel_stream.text.generation:3: engine._result (private to kestrel_stream.run)"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_cycles():
    """The packages layer: none imports, even inside a function, a package that imports it back."""
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_no_package_reaches_into_another_packages_private_names():
    """What one package uses of another is public there: text/ asks the engine for what it needs by name."""
    found = private_reaches(library_trees())
    assert not [f for f in found if f.startswith("kestrel_stream.text.") and "engine._" in f], found
    assert not found, "private names used across packages:\n" + "\n".join(found)
