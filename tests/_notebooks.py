"""Run a notebook of ``notebooks/`` headless, top to bottom, with this interpreter's kernel
(nbclient); a cell that raises — the ``assert`` cells check each notebook's results — fails."""
from __future__ import annotations

import os
import pathlib

import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
# notebooks with a test file of their own (so the two test workers can take them apart)
OWN_TEST_FILE = {"04-deploy-v7"}
# notebooks whose cells time execution (a benchmark): run with no XLA flags, as a user runs
# them (03's benchmark took 71 -> 104 s with the tests' -O0 XLA:CPU code); the others keep the
# tests' flags (``_util.TEST_XLA_FLAGS``: compiles at about half the time), which notebook 4
# passes on to the servers it starts
EXECUTION_BOUND = {"03-prefix-caching"}


def run_notebook(path: pathlib.Path, cwd: pathlib.Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    from _util import child_xla_flags

    keep = child_xla_flags()  # this process's flags but a device count: the notebook picks its own devices
    env_flags = os.environ.pop("XLA_FLAGS", None)
    if path.stem not in EXECUTION_BOUND and keep:
        os.environ["XLA_FLAGS"] = keep
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        os.environ.pop("XLA_FLAGS", None)
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
