"""``notebooks/04-deploy-v7.ipynb`` runs headless on CPU: the planner's choice, a pre-shard
verified against its source, a 2-process × 4-device server whose greedy tokens equal one
device's, P/D behind smg giving the unified server's text, a trace benchmark without failures
and every process exiting 0 (its cells assert each). About 4 minutes on 2 cores (measured 230 s
with a cold compile cache)."""
from __future__ import annotations

import pytest

from _notebooks import NOTEBOOK_DIR, run_notebook

pytestmark = pytest.mark.slow


def test_deploy_notebook_runs(tmp_path):
    run_notebook(NOTEBOOK_DIR / "04-deploy-v7.ipynb", tmp_path)
