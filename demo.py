"""The embedded demo model: a small synthetic K3 checkpoint with the demo tokenizer, built
on first use and cached (``$K3SERVE_CACHE`` or ``~/.cache/k3serve``).

It stands above both of its parts, the synthetic weights (``checkpoints.synthetic``) and the
demo tokenizer (``server.text.demo_tokenizer``), so that neither imports the other's floor
(docs/layout.md).
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

from .checkpoints import synthetic
from .checkpoints.synthetic import DEMO_SEED, default_cache_dir, demo_checkpoint_name, demo_config


def demo_checkpoint(cache_dir: str | os.PathLike | None = None, *, seed: int = DEMO_SEED) -> Path:
    """Path of the demo checkpoint, generating it on first use.

    It lives in ``cache_dir`` (default :func:`default_cache_dir`) under
    :func:`demo_checkpoint_name`. Generation writes into a temporary sibling folder that is
    renamed into place in one step, so concurrent callers never see a partial checkpoint;
    the loser of a race discards its copy and uses the winner's.
    """
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    config = demo_config()
    final = base / demo_checkpoint_name(config, seed)
    if (final / "config.json").is_file():
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=base))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the cache entry should be shareable
    try:
        synthetic.generate_checkpoint(tmp, copy.deepcopy(config), seed)
        try:  # the demo tokenizer (sentencepiece, trained in ~2 s); ids-only use needs none
            from .server.text.demo_tokenizer import write_demo_tokenizer

            write_demo_tokenizer(tmp)
        except ImportError as e:
            import warnings

            warnings.warn(f"demo checkpoint written without a tokenizer ({e})", stacklevel=2)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def model_or_demo(model: str | os.PathLike | None) -> Path:
    """``model`` as a path, or the embedded demo checkpoint (built on first use) when None."""
    return Path(model) if model else demo_checkpoint()
