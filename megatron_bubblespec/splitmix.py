"""64-bit words -> one well-mixed 64-bit word (splitmix64): the seeding hash of sample keys, task operands and epoch orders.

``splitmix64`` is Vigna's finaliser; ``chain(w0, w1, ...)`` folds words into one hash as
``h = splitmix64(w0); h = splitmix64(h ^ w_i)``. Both work on Python ints and, element-wise, on
numpy uint64 arrays (the same bits; numpy's uint64 arithmetic wraps modulo 2**64 as the masks do).
Changing either changes every sample key, prompt order and synthetic task.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def splitmix64(x):
    """splitmix64's output function of a 64-bit word (an int, or a numpy uint64 array)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def chain(first, *words):
    """splitmix64 folded over words (ints are taken modulo 2**64; the last may be an array)."""
    h = splitmix64(_word(first))
    for word in words:
        h = splitmix64(h ^ _word(word))
    return h


def _word(value):
    return value & MASK64 if isinstance(value, int) else value
