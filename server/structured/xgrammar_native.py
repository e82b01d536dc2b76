"""xgrammar's native grammar engine, loaded without its Python package (and so without torch).

xgrammar (the grammar engine of SGLang, vLLM and TensorRT-LLM) is a C++ library with a thin
Python layer; ``import xgrammar`` imports torch (its bitmask helpers) and its wheel declares
torch, transformers and triton as requirements. The server needs none of that: it compiles
grammars, advances matchers and fills ``int32`` bitmasks in numpy buffers. So this module loads
the package's native library through ``tvm_ffi`` (xgrammar's own FFI layer, a small pure
dependency) and the generated binding classes from the package's files, never running the
package's ``__init__``.

Install: ``apache-tvm-ffi`` is a dependency of k3serve; xgrammar itself goes in without its
declared requirements, ``pip install --no-deps xgrammar==0.2.9`` (``make install`` does it).
Without it the server runs and refuses constrained requests with :class:`Unavailable`'s message.

The pinned version matters: the binding signatures used in ``server/structured/grammar.py``
(``TokenizerInfo(vocab, vocab_type, vocab_size, stop_ids, add_prefix_space)``,
``GrammarCompiler(info, threads, cache, cache_limit, dynamic)``, ``GrammarMatcher(grammar,
stop_ids, terminate_without_stop, max_rollback, temperature)``, ...) are xgrammar 0.2.9's.
"""
from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

XGRAMMAR_VERSION = "0.2.9"
INSTALL_HINT = f"pip install --no-deps xgrammar=={XGRAMMAR_VERSION} (its native library; torch is not needed)"

_lock = threading.Lock()
_api = None


class Unavailable(RuntimeError):
    """xgrammar (or tvm_ffi) is not installed, or its native library does not load."""


def _version(pkg_dir: Path) -> str | None:
    try:
        from importlib.metadata import version

        return version("xgrammar")
    except Exception:  # noqa: BLE001 - a vendored copy without metadata
        return None


def api():
    """The binding module (``TokenizerInfo``, ``GrammarCompiler``, ``GrammarMatcher``, ...);
    loaded once per process. Raises :class:`Unavailable` with the install command."""
    global _api
    with _lock:
        if _api is not None:
            return _api
        spec = importlib.util.find_spec("xgrammar")
        if spec is None or not spec.submodule_search_locations:
            raise Unavailable(f"constrained decoding needs xgrammar: {INSTALL_HINT}")
        pkg = [Path(p) for p in spec.submodule_search_locations]
        got = _version(pkg[0])
        if got is not None and got != XGRAMMAR_VERSION:
            raise Unavailable(f"xgrammar {got} is installed; k3serve uses its native bindings as of "
                              f"{XGRAMMAR_VERSION}: {INSTALL_HINT}")
        try:
            from tvm_ffi.libinfo import load_lib_module
        except ImportError as e:
            raise Unavailable(f"constrained decoding needs apache-tvm-ffi (a k3serve dependency): {e}") from None
        try:
            load_lib_module("xgrammar", "xgrammar_bindings", extra_lib_paths=pkg)
            path = pkg[0] / "tvm_ffi_binding" / "_ffi_api.py"
            mod_spec = importlib.util.spec_from_file_location("k3serve_xgrammar_ffi_api", path)
            mod = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - any load failure means the same to the caller
            raise Unavailable(f"xgrammar's native library did not load ({e!r}): {INSTALL_HINT}") from None
        _api = mod
        return _api


def available() -> bool:
    try:
        api()
        return True
    except Unavailable:
        return False
