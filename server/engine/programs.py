"""One counter for every program an engine compiles, so ``num_compiles`` is the whole truth.

Why: warm-up promises that serving compiles nothing. A jitted function the count does not
see (a cache copy at a new index length, the token-table row write) would compile lazily
on the engine thread — a stall of a second or more mid-stream — and no "0 compiles after
warm-up" test could notice. So every jitted function the engine owns is made by
:meth:`Programs.jit`, which counts each trace: jax traces a function once per new input
signature (shapes, dtypes, static arguments), right before compiling it, and an
ahead-of-time ``lower`` traces too. Not seen: a recompile for new input *shardings* of
the same shapes (jax reuses the trace); the engine keeps its arrays' layouts fixed.

A multi-host engine counts the same way in every process (each builds the same engine and
runs the same programs).
"""
from __future__ import annotations

import collections
import functools

import jax


class Programs:
    """Traces of the jitted functions made by :meth:`jit`: in all (``count``) and by name."""

    def __init__(self):
        self.by_name: collections.Counter[str] = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.by_name.values())

    def jit(self, fn, name: str, **jit_kwargs):
        """``jax.jit(fn, **jit_kwargs)`` whose every trace counts one program of ``name``."""

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self.by_name[name] += 1  # Python side effect: runs only while tracing
            return fn(*args, **kwargs)

        return jax.jit(traced, **jit_kwargs)


def pow2_widths(bound: int) -> list[int]:
    """1, 2, 4, … up to the power of two that holds ``bound``: every length ``pad_pow2``
    gives a list of at most ``bound`` entries."""
    out = [1]
    while out[-1] < bound:
        out.append(out[-1] * 2)
    return out


def sparse_widths(bound: int, growth: int = 4) -> list[int]:
    """1, ``growth``, ``growth``², … below ``bound``, then ``bound``: the index lengths of a
    program whose padding is free (repeats of one index), so fewer lengths compile."""
    out = [1]
    while out[-1] * growth < bound:
        out.append(out[-1] * growth)
    if out[-1] < bound:
        out.append(bound)
    return out


def width_for(n: int, widths: list[int]) -> int:
    """The smallest of ``widths`` (ascending) that holds ``n``; ValueError past the last."""
    for w in widths:
        if n <= w:
            return w
    raise ValueError(f"{n} entries exceed the widest warm program ({widths[-1]})")
