"""pytest configuration: the tests folder is on sys.path (pyproject) for ``_util``.

One persistent XLA compilation cache per test session (a fresh temporary folder, removed at
exit): engines built by different test modules with the same shapes (e.g. the k3-tiny-a engine
of the engine tests and of the gRPC tests) load the compiled step instead of compiling it
again. Nothing is shared between sessions, so a stale cache can never mask a change.
"""
import atexit
import shutil
import tempfile

from k3serve.compile_cache import enable_compile_cache

_CACHE = tempfile.mkdtemp(prefix="k3serve-test-xla-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
enable_compile_cache(_CACHE, min_compile_secs=1.0)
