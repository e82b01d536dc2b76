"""The persistent XLA compilation cache: one place that turns it on.

Why: warm-up compiles a handful of step programs; with the cache a second start of the same
configuration loads them instead. It is process-global JAX configuration, so it is set by the
entry points (``k3serve serve``/``bench``, tests' conftest), never by a constructor.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$K3SERVE_CACHE``, else ``~/.cache/k3serve``: demo checkpoints and compiled programs."""
    return Path(os.environ.get("K3SERVE_CACHE") or Path.home() / ".cache" / "k3serve")


def enable_compile_cache(path: str | os.PathLike | None = None, min_compile_secs: float = 0.5) -> Path:
    """Cache every program that took at least ``min_compile_secs`` to compile in ``path``
    (default ``cache_root()/jax``); returns the folder."""
    import jax

    folder = Path(path) if path is not None else cache_root() / "jax"
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
    return folder
