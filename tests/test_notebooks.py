"""Every notebook in ``notebooks/`` runs headless, top to bottom, on CPU (``_notebooks.py``);
outputs are not kept. Notebook 4 (deploying on a v7 slice) has its own file,
``test_notebook_deploy.py``."""
from __future__ import annotations

import pytest

from _notebooks import NOTEBOOK_DIR, OWN_TEST_FILE, run_notebook

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
pytestmark = pytest.mark.slow  # each starts a kernel that compiles the demo model


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 4 and OWN_TEST_FILE <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem not in OWN_TEST_FILE], ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    run_notebook(path, tmp_path)
