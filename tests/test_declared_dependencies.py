"""Every third-party module the shipped package imports is declared in pyproject.toml.

A module that arrives only as someone else's dependency (orbax-checkpoint and rich came
through flax) breaks when that package drops it. This walks the syntax tree of every file the
wheel ships (the package, not ``tests/`` or ``tools/``), maps each top-level import outside the
standard library to its distribution, and finds it in ``[project].dependencies`` — or, for an
import only an optional feature makes, in the extra named below. Host-only: nothing is imported.
"""
from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_SHIPPED = {"tests", "tools", "build", "dist", "notebooks"}  # setup.py's NOT_SHIPPED, and no .py in notebooks/
# import -> (extra that provides it, why it is not a core dependency)
OPTIONAL = {
    "matplotlib": ("notebooks", "only `k3serve plan --compare --png` draws, importing it when asked"),
}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9._-]+)", requirement).group(1)).lower()


def shipped_files() -> list[pathlib.Path]:
    return [p for p in ROOT.rglob("*.py") if p != ROOT / "setup.py"
            and not any(part.startswith(".") or part in NOT_SHIPPED for part in p.relative_to(ROOT).parts[:-1])]


def third_party_imports(files) -> dict[str, set[str]]:
    """Top-level module -> the files importing it (absolute imports outside the standard
    library and k3serve itself)."""
    found: dict[str, set[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"k3serve", "__future__"}:
                found.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return found


def test_every_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in project.get("optional-dependencies", {}).items()}
    dists = importlib.metadata.packages_distributions()
    imports = third_party_imports(shipped_files())
    assert {"jax", "grpc", "orbax"} <= set(imports)  # the walk sees the package
    missing = []
    for mod, files in sorted(imports.items()):
        names = {_name(d) for d in dists.get(mod, [mod])}
        if mod in OPTIONAL:
            extra = OPTIONAL[mod][0]
            if not names & extras.get(extra, set()):
                missing.append(f"{mod} (optional) not in the {extra!r} extra")
        elif not names & core:
            missing.append(f"{mod} ({', '.join(sorted(names))}) imported by {', '.join(sorted(files))}")
    assert not missing, "undeclared in pyproject.toml [project].dependencies:\n" + "\n".join(missing)
