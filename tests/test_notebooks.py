"""Every notebook in ``notebooks/`` runs headless, top to bottom, on CPU (``_notebooks.py``);
outputs are not kept. Notebook 4 (deploying on a v7 slice) has its own file,
``test_notebook_deploy.py``. Host-only: each notebook's install cell checks every module the
notebook imports, and installs ``k3serve[notebooks]``, which provides them (on a TPU VM or
Colab where k3serve came without that extra, notebooks 2-4 stopped at matplotlib)."""
from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys
import tomllib

import pytest

from _notebooks import NOTEBOOK_DIR, OWN_TEST_FILE, run_notebook

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 4 and OWN_TEST_FILE <= {p.stem for p in NOTEBOOKS}


@pytest.mark.slow  # each starts a kernel that compiles the demo model
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem not in OWN_TEST_FILE], ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    run_notebook(path, tmp_path)


def _code_cells(path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _imports(source: str) -> set[str]:
    """Top-level modules a cell imports (shell ``!`` and magic ``%`` lines left out)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("!", "%")))
    mods = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


def _assigned(source: str, name: str):
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _dist(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9._-]+)", requirement).group(1)).lower()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_cell_checks_every_import(path):
    cells = _code_cells(path)
    install = next((c for c in cells if "K3SERVE_SPEC" in c), None)
    assert install is not None, "no install cell"
    checked = _assigned(install, "NEEDS")
    assert checked, "the install cell names the modules it checks in NEEDS"
    third_party = set().union(*map(_imports, cells)) - set(sys.stdlib_module_names)
    assert "k3serve" in checked and not third_party - set(checked), \
        f"imported but not checked by the install cell: {sorted(third_party - set(checked))}"
    assert "[notebooks]" in _assigned(install, "K3SERVE_SPEC")
    project = tomllib.loads((NOTEBOOK_DIR.parent / "pyproject.toml").read_text())["project"]
    provided = {_dist(r) for r in project["dependencies"] + project["optional-dependencies"]["notebooks"]}
    dists = importlib.metadata.packages_distributions()
    for mod in third_party - {"k3serve"}:
        assert {_dist(d) for d in dists.get(mod, [mod])} & provided, f"{mod}: not in k3serve[notebooks]"
