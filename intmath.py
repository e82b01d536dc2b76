"""Integer helpers shared by the planner, the engine and the step shapes."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for integers (``b > 0``)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pad_pow2(xs) -> list:
    """``xs`` padded to a power-of-two length with repeats of its first element (the same
    index written twice writes the same value, so padded copies are harmless)."""
    xs = list(xs)
    return xs + [xs[0]] * (next_pow2(len(xs)) - len(xs))
