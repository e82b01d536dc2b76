"""The wheel ships the whole package: every folder of the source tree that holds an
``__init__.py`` (bar tests/ and tools/) with all its modules, and nothing else.

A subpackage missing from the wheel is invisible in the editable install the tests run in, so
this builds the wheel (setuptools, no dependencies) from a copy of the checkout and reads its
file list. ``make wheel-check`` goes further: it installs the wheel in a fresh venv and imports
every module from there.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests", "tools", "build", "dist"}  # top-level folders that are not the package
# Non-Python files the package reads at run time (none so far): each must be listed here and in
# pyproject's package-data.
DATA_FILES: set[str] = set()


def _skip_dir(d: str) -> bool:
    return d.startswith(".") or d == "__pycache__" or d.endswith(".egg-info")


def source_packages() -> dict[str, set[str]]:
    """{package folder relative to the root ("" for the root): its .py files}."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = Path(dirpath).relative_to(ROOT).as_posix()
        rel = "" if rel == "." else rel
        dirnames[:] = [d for d in dirnames if not _skip_dir(d) and not (rel == "" and d in NOT_SHIPPED)]
        if "__init__.py" in filenames:
            out[rel] = {f for f in filenames if f.endswith(".py") and not (rel == "" and f == "setup.py")}
    return out


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"  # a copy: setuptools writes build/ and *.egg-info into the tree it builds
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(src)]
    # setuptools >= 70.1 (the dev extra) builds wheels itself, offline; with an older one pip
    # builds in an isolated environment (fetches setuptools)
    try:
        modern = tuple(int(x) for x in version("setuptools").split(".")[:2]) >= (70, 1)
    except PackageNotFoundError:
        modern = False
    if modern:
        cmd.append("--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("k3serve-*.whl")
    return whl


def test_wheel_ships_every_subpackage_and_nothing_else(tmp_path):
    pkgs = source_packages()
    assert {"", "model", "server", "checkpoints"} <= set(pkgs)
    with zipfile.ZipFile(build_wheel(tmp_path)) as z:
        names = set(z.namelist())
    expected = {f"k3serve/{rel + '/' if rel else ''}{f}" for rel, files in pkgs.items() for f in files}
    missing = sorted(expected - names)
    assert not missing, f"source modules not in the wheel: {missing}"
    shipped = {n for n in names if ".dist-info/" not in n}
    extra = sorted(shipped - expected - {f"k3serve/{f}" for f in DATA_FILES})
    assert not extra, f"the wheel ships files that are not package modules: {extra}"
    assert not any(n.startswith(("k3serve/tests/", "k3serve/tools/", "tests/", "tools/")) for n in names)
