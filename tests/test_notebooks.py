"""Every notebook in ``notebooks/`` runs headless, top to bottom, on CPU (nbclient with this
interpreter's kernel); a cell that raises — including the ``assert`` cells that check each
notebook's results — fails the test. Outputs are not kept."""
from __future__ import annotations

import os
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
pytestmark = pytest.mark.slow  # each starts a kernel that compiles the demo model


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    env_flags = os.environ.pop("XLA_FLAGS", None)  # the notebook picks its own devices
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
