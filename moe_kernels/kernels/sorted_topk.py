"""Top-k in one partial sort: each score and its column packed into one 64-bit key.

The routing kernels' first top-k (:func:`~moe_kernels.kernels.routing._take_topk`) takes ``k``
rounds of argmax: each round is three reductions across the ``E`` experts (the best score, the
lowest column holding it, its weight), so ``k = 8`` is 24 reductions one after the other, each a
chain of warp shuffles and, across warps, a barrier. At decode (one to a few tokens) that chain
*is* the routing kernel's time.

:func:`take_topk_sorted` selects the same ``k`` entries, in the same order, with ``tl.topk``
(Triton's bitonic partial sort) over one key per column:

* the high 32 bits hold the score as an integer that orders like the float: a float32's bits
  compare like signed integers for positive values, and for negative ones after flipping every
  bit but the sign (``bits ^ 0x7FFFFFFF``); ``-0.0`` is first made ``+0.0`` so that the two tie,
  as floats do;
* the low 32 bits hold ``N - 1 - column``: of two equal scores the lower column has the larger
  key, which is the tie rule (lower expert id first), and every key is distinct;
* a column that is not available gets the smallest int64, below every available key (even a
  ``-inf`` score's), so an available column is never passed over for an unavailable one.

Then the largest ``K_PAD`` keys, already in descending order, give the columns
(``N - 1 - low bits``), and ``tl.gather`` fetches their expert ids and weights. The sort is
``log2(K_PAD)`` bitonic stages plus ``log2(N / K_PAD)`` merge rounds of compare-and-swap: its
depth grows with ``log N``, where the rounds of argmax grow with ``k``.

:func:`take_topk_keyed` keeps the ``k`` rounds but makes each one reduction instead of three: the
largest key is the best score and, on a tie, the lowest column, both at once; the column's key is
then set to the smallest int64, and the weights and ids are gathered once, after the last round.
Measured on an H100, the routing kernels are fastest on the keyed rounds (their default,
:data:`~moe_kernels.kernels.routing.TOPK_BY_SORT`) and the chained router at decode on the sort (its default).

A worked example of the keys (the interpreter runs the same code on the CPU)::

    >>> import struct
    >>> def key(score, column, n):   # what the kernel computes, in Python
    ...     bits = struct.unpack("<i", struct.pack("<f", score + 0.0))[0]
    ...     ordered = bits ^ 0x7FFFFFFF if bits < 0 else bits
    ...     return (ordered << 32) | (n - 1 - column)
    >>> sorted(range(4), key=lambda c: -key([0.5, 2.0, 0.5, -1.0][c], c, 4))
    [1, 0, 2, 3]
"""

from __future__ import annotations

from .._runtime import HAS_TRITON, kernel, tl

__all__ = ["take_topk_keyed", "take_topk_sorted"]

if HAS_TRITON:

    @kernel
    def packed_keys(selection, available, NO_EXPERT: tl.constexpr):
        """One int64 key per entry of ``selection`` (``[BLOCK_T, N]``, ``N = NO_EXPERT``): the score's
        ordered bits high, ``N - 1 - column`` low; the smallest int64 where not ``available``."""
        columns = tl.arange(0, NO_EXPERT)[None, :]
        # >>> book: packed-keys
        bits = (selection + 0.0).to(tl.int32, bitcast=True)   # (+ 0.0: -0.0 becomes +0.0)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        keys = (ordered.to(tl.int64) << 32) | (NO_EXPERT - 1 - columns).to(tl.int64)
        keys = tl.where(available, keys, -9223372036854775808)
        # <<< book: packed-keys
        return keys

    @kernel
    def take_topk_keyed(selection, weight_source, expert_ids, available, topk,
                        BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, NO_EXPERT: tl.constexpr):
        """:func:`take_topk_sorted`'s result by ``topk`` rounds of one reduction each (the largest
        packed key), the weights and ids gathered once after the last round."""
        keys = packed_keys(selection, available, NO_EXPERT)
        slot = tl.arange(0, K_PAD)[None, :]
        top = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
        for j in range(topk):
            best = tl.max(keys, axis=1, keep_dims=True)
            keys = tl.where(keys == best, -9223372036854775808, keys)   # taken (keys are distinct)
            top = tl.where(slot == j, best, top)
        chosen = (NO_EXPERT - 1) - top.to(tl.int32)   # (slots from topk on: column N - 1, masked by the store)
        weights = tl.where(slot < topk, tl.gather(weight_source, chosen, 1), 0.0)
        return weights, tl.gather(expert_ids, chosen, 1)

    @kernel
    def take_topk_sorted(selection, weight_source, expert_ids, available, topk,
                         BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, NO_EXPERT: tl.constexpr):
        """The ``topk`` best available entries of each row of ``selection`` (``[BLOCK_T, N]``),
        largest first, lowest column on ties: ``(weights, ids)``, each ``[BLOCK_T, K_PAD]``, the
        ``weight_source`` values and ``expert_ids`` of those columns, as
        :func:`~moe_kernels.kernels.routing._take_topk` returns them (slots from ``topk`` on: weight
        0, an id the caller's store masks). ``NO_EXPERT`` is the column count ``N``."""
        # >>> book: sorted-topk
        keys = packed_keys(selection, available, NO_EXPERT)
        if K_PAD == 1:   # (Triton 3.6's tl.topk fails to compile k = 1 on a one-row block)
            top = tl.max(keys, axis=1, keep_dims=True)
        else:
            top = tl.topk(keys, K_PAD)   # descending
        # The low 32 bits (a truncating cast) give the column back. An unavailable
        # entry's are 0, column N - 1: a real column, in a slot the store masks.
        chosen = (NO_EXPERT - 1) - top.to(tl.int32)
        # Slots from topk on are 0, as the rounds leave them (the renormalisation
        # sums every slot).
        slot = tl.arange(0, K_PAD)[None, :]
        weights = tl.where(slot < topk, tl.gather(weight_source, chosen, 1), 0.0)
        # <<< book: sorted-topk
        return weights, tl.gather(expert_ids, chosen, 1)
