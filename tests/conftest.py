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
# XLA:CPU's LLVM backend at -O0 (``_util.TEST_XLA_FLAGS``): most of the suite's time is compiling
# step programs that then run a few tiny steps, and LLVM's optimisation passes are much of each
# compile (measured on 2 cores: a k3-tiny-a speculative engine test 50 -> 32 s, a 32-device
# recipe child 105 -> 53 s). The same HLO through the same XLA passes: only the CPU machine code
# is less optimised (TPU AOT compiles are unaffected). Set before jax starts its backend; the
# children of ``_util.run_children`` and the multi-host servers keep it (``child_xla_flags``).
# Notebooks keep these flags but the benchmark one (``_notebooks.py``): 03's benchmark is
# execution-bound and took 71 -> 104 s at -O0.
from _util import TEST_XLA_FLAGS  # noqa: E402

if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

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


# ``make test`` hands whole files to two workers (``--dist loadfile``), in collection order once
# xdist's own reordering (by number of tests: one-test files such as the notebook's went last)
# is off. Heaviest files first, so that the last files a worker takes are short and the two
# workers end together. Seconds per file, measured on a 2-core box with both workers busy
# (``pytest --durations=0``, 2026-12-07, scaled to a quiet box; rounded; only the order matters,
# and a file not listed counts as light).
_FILE_SECONDS = {
    "test_spec_engine": 320, "test_spec_serving": 315, "test_compile_cli": 315, "test_dspark_engine": 265,
    "test_pd_multihost": 245, "test_notebook_deploy": 215, "test_preshard": 205, "test_multihost": 170,
    "test_notebooks": 170, "test_sharding": 160, "test_packed_rows": 150, "test_attention_dp": 145,
    "test_structured": 135, "test_engine": 105, "test_pallas_backend": 100, "test_mla_pool_width": 90,
    "test_pd_layouts": 80, "test_spec_step": 80, "test_pallas_recipes": 75, "test_step_collectives": 75,
    "test_kda_spec_kernel": 75, "test_pd_multiprocess": 70, "test_golden": 70, "test_pd_smg": 65,
    "test_structured_smg": 60, "test_model_step": 50, "test_weights_loading": 50, "test_kda_prefill_kernel": 45,
    "test_llm_api": 40, "test_cli": 40, "test_mla_ragged_kernel": 40, "test_ep_dispatch": 35,
    "test_prefix_engine": 35, "test_serve_cli": 30, "test_parallel_sampling": 30, "test_pd_engine": 30,
    "test_tpu_aot_mla": 30, "test_kda_pools": 25, "test_roofline": 25, "test_flat_step": 20, "test_tpu_aot_kda": 20,
    "test_dspark_model": 20, "test_sampler": 20, "test_gmm_mxfp4": 20, "test_kernels": 20, "test_smg_router": 15,
    "test_pd_server": 15, "test_layer_plan": 15, "test_grpc_server": 15, "test_mla_ragged": 15,
    "test_spec_accept": 15, "test_suffix_equivalence": 15,
}


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", None):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Files by ``_FILE_SECONDS``, heaviest first (a stable sort: tests keep their order within a
    file, and files of equal weight keep theirs). Every worker sorts the same collection the
    same way, as xdist requires."""
    weight = lambda item: -_FILE_SECONDS.get(item.path.stem, 0)
    items[:] = sorted(items, key=weight)
