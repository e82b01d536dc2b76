"""The package's import graph: no cycle between modules, and no import from a higher floor.

Every import counts, also one inside a function (a lazy import is still a dependency: it
only moves the failure to run time). The floors, lowest first, are in ``FLOORS``
(docs/layout.md explains them); a module may import its own area and any area on a lower
floor, never one on its own floor or above. Host-only: the files are parsed, nothing is
imported.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_SHIPPED = {"tests", "tools", "notebooks", "build", "dist", "proto"}

# area -> floor; an area is a top-level module or subpackage, or a subpackage of server/,
# or one of server/'s loose modules
FLOORS = {
    "k3serve.intmath": 0,
    "k3serve.compile_cache": 0,
    "k3serve.kernels": 1,
    "k3serve.model": 2,
    "k3serve.sharding": 3,
    "k3serve.checkpoints": 4,
    "k3serve.server.shared_secret": 5,
    "k3serve.server.text": 5,
    "k3serve.server.spec": 5,  # speculative decoding's drafters and acceptance (no engine imports)
    "k3serve.server.structured": 5,  # constrained decoding: grammars and matchers (xgrammar; no engine imports)
    "k3serve.demo": 6,  # the embedded demo model: synthetic weights + the demo tokenizer
    "k3serve.server.engine": 6,
    "k3serve.server.cluster": 7,
    "k3serve.server.pd": 7,
    "k3serve.server.client": 7,
    "k3serve.server.api": 8,
    "k3serve.server.bench": 9,
    "k3serve.server.cli_preshard": 9,
    "k3serve.server.cli_compile": 9,
    "k3serve.server.cli": 10,
    "k3serve.server": 11,  # server/__init__.py
    "k3serve": 12,  # the package's lazy facade (LLM, SamplingParams)
}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in NOT_SHIPPED or any(part.startswith(".") for part in rel.parts):
            continue
        name = ".".join(("k3serve",) + rel.with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _imports(name: str, path: pathlib.Path, mods) -> set[str]:
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c.startswith("k3serve") and c not in mods:
                c = c.rsplit(".", 1)[0] if "." in c else ""
            if c in mods and c not in (name, "k3serve"):  # the root package is imported by every import
                out.add(c)
    return out


def _graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def area(module: str) -> str:
    """The longest key of ``FLOORS`` that ``module`` is or lies in."""
    best = ""
    for a in FLOORS:
        if (module == a or module.startswith(a + ".")) and len(a) > len(best):
            best = a
    return best


def test_every_module_has_a_floor():
    assert [m for m in _graph() if not area(m)] == []


def upward_imports(graph) -> list[str]:
    """Imports of an area on the same or a higher floor than the importing module's."""
    bad = []
    for m, targets in graph.items():
        for t in targets:
            a, b = area(m), area(t)
            if a != b and FLOORS[b] >= FLOORS[a]:
                bad.append(f"{m} -> {t} ({a} floor {FLOORS[a]} -> {b} floor {FLOORS[b]})")
    return sorted(bad)


def _reachable(graph, start) -> set[str]:
    stack, reach = [start], set()
    while stack:
        for t in graph.get(stack.pop(), ()):
            if t not in reach:
                reach.add(t)
                stack.append(t)
    return reach


def modules_in_cycles(graph) -> list[str]:
    """Modules from which an import chain leads back to themselves."""
    return sorted(m for m in graph if m in _reachable(graph, m))


def test_no_import_from_the_same_or_a_higher_floor():
    assert upward_imports(_graph()) == []


def test_no_cycle():
    assert modules_in_cycles(_graph()) == []


def test_the_checks_can_fail():
    """A planted back-edge and a two-module cycle are reported."""
    graph = {"k3serve.model.a": {"k3serve.server.engine.b"}, "k3serve.server.engine.b": {"k3serve.model.a"},
             "k3serve.kernels.c": set()}
    assert modules_in_cycles(graph) == ["k3serve.model.a", "k3serve.server.engine.b"]
    assert upward_imports(graph) == ["k3serve.model.a -> k3serve.server.engine.b "
                                     "(k3serve.model floor 2 -> k3serve.server.engine floor 6)"]
