"""Test helpers: golden cases and loaded models (one load per case per session)."""
from __future__ import annotations

import pathlib

import numpy as np

DATA = pathlib.Path(__file__).parent / "data"
K3_CASES = ["k3-tiny-a", "k3-tiny-b"]
ALL_CASES = K3_CASES + ["kimi-linear-tiny"]

_models: dict = {}


def load_case(case: str, dtype: str = "float32"):
    from k3serve.model import load_pretrained

    key = (case, dtype)
    if key not in _models:
        _models[key] = load_pretrained(DATA / case, dtype=dtype)
    return _models[key]


_golden: dict = {}


def golden(case: str) -> dict:
    if case not in _golden:
        _golden[case] = dict(np.load(DATA / case / "golden.npz"))
    return _golden[case]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
