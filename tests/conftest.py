"""pytest configuration: the tests folder is on sys.path (pyproject) for ``_util``.

One persistent XLA compilation cache per test session (a fresh temporary folder, removed at
exit, shared by the session's xdist workers): engines built by different test modules with the same shapes load the compiled step
instead of compiling it again. Nothing is shared between sessions, so a stale cache can never
mask a change.

After each test module — and after any test that leaves the process with many memory
mappings — jax's in-memory caches are cleared and garbage collected. Each compiled step
program of the flattened model holds about 2,000 mappings on XLA:CPU (measured: 446 -> 8,304
after warming up 4 programs of k3-tiny-a, back to 549 once released), and the kernel allows
65,530 per process: with every program of a full run kept alive, XLA:CPU died (a segmentation
fault while serializing an executable, an abort while compiling one) at the same point of
every full run (``test_prefix_engine.py``), while the module alone passed.
"""
import atexit
import gc
import os
import shutil
import tempfile

import pytest

# The test venv has libtpu (the ``tpu`` extra, for the AOT-compile tests): the tests mean the
# CPU (libtpu's probe for a TPU costs ~0.7 s a process and prints errors), and both xdist
# workers may load libtpu to compile for a topology at once (it takes a lock file otherwise).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from k3serve.compile_cache import enable_compile_cache

# ``<home>/jax``: a ``k3serve serve`` subprocess given ``K3SERVE_CACHE=<home>`` (``cache_home``)
# opens the very same path, and so hits what this process compiled (the cache's keys differ
# when the same folder is reached by another path, a symlink included)
# Under pytest-xdist (``make test`` runs two workers) the workers inherit the controller's
# folder through the environment, so a program one worker compiled is a hit for the other;
# only the process that made the folder removes it.
_HOME = os.environ.get("K3SERVE_TEST_HOME")
if not _HOME:
    _HOME = os.environ["K3SERVE_TEST_HOME"] = tempfile.mkdtemp(prefix="k3serve-test-")
    atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
_CACHE = enable_compile_cache(f"{_HOME}/jax", min_compile_secs=0.0)


@pytest.fixture(scope="session")
def cache_home() -> str:
    """``K3SERVE_CACHE`` for subprocesses that should share this session's compiled programs."""
    return _HOME


def _release():
    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


def _num_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    _release()


@pytest.fixture(autouse=True)
def _release_when_mappings_run_high():
    yield
    if _num_mappings() > 30_000:
        _release()
