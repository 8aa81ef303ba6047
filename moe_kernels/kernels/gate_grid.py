"""The router's gate grid: how the ``[T, d] @ [d, E]`` gate is cut into programs at decode.

At a few tokens the gate is a thin product: DeepSeek-V3's reads a 3.7 MB ``[256, 7168]`` matrix
for one token. One program per block of tokens and experts would leave most SMs idle, so both
routers (:mod:`~moe_kernels.kernels.gate_routing`'s one launch and
:mod:`~moe_kernels.kernels.chained_routing`'s chain) also split ``d`` into spans: program
``(token block, expert block, span)`` writes float32 partial logits, which the routing step adds in
a fixed order. :func:`gate_tiles` picks the split: enough programs for the SMs, each a few K steps
long, and no more partials than the routing step reads back cheaply. Both routers take the same grid
for 16-token blocks, so they add the same partials in the same order and give the same logits, bit
for bit.

Worked example, Qwen3-30B-A3B (128 experts, ``d = 2048``, K steps of 128) at one token: 4 expert
blocks of 32; one program per SM would be 33 spans, but there are only 16 K steps, so 16 spans of
one step: 64 programs::

    >>> g = gate_tiles(1, 128, 2048)
    >>> g["e_blocks"] * g["split_k"], g["k_span"] // g["block_k"]
    (64, 1)
"""

from __future__ import annotations

from .._runtime import cdiv, next_power_of_2

__all__ = ["BLOCK_T", "gate_tiles"]

#: Tokens per program: the tensor cores' smallest M tile (``tl.dot`` needs 16 rows).
BLOCK_T = 16
#: Bytes of partial logits the routing step reads back (from L2) per token block, at most.
_PARTIAL_BYTES = 128 * 1024
#: Programs the gate aims at: about one per SM of an H100/H200 (132 SMs), unless that leaves a
#: program more than :data:`_MAX_K_STEPS` K steps; then about two per SM (:data:`_WIDE_TARGET_PROGRAMS`,
#: the rule before). On the H200 (``route-steps-ab-gate.json``, the chain without alignment, graphs,
#: L2 warm) one per SM took Qwen3-30B-A3B from 5.4 to 4.3 us at 64 tokens and 7.1 to 6.0 at 512 (one
#: K step a program became two), DeepSeek-V3 from 8.4 to 7.5 at 128 and 10.0 to 9.1 at 256 (7 steps);
#: where it made DeepSeek-V3's programs 14 steps long (64 and 512 tokens) it lost 0.9 us at 64 (1.9 at
#: 512 with the L2 flushed), and split again to 8 steps still 0.2-0.4 us. (Measured at powers of two.)
#: The three are read at each call (``tools/route_steps_ab.py`` sets them to time the other grids).
_TARGET_PROGRAMS = 132
_WIDE_TARGET_PROGRAMS = 264
_MAX_K_STEPS = 7


def gate_tiles(num_tokens: int, num_experts: int, hidden_size: int, *, block_t: int = BLOCK_T,
               partial_bytes: int = _PARTIAL_BYTES) -> dict:
    """The gate's grid: expert blocks, K step, split of ``d`` and its span.

    Enough programs to spread the gate's bytes over the SMs (about :data:`_TARGET_PROGRAMS`, or
    :data:`_WIDE_TARGET_PROGRAMS` where that would make a program more than :data:`_MAX_K_STEPS` K
    steps long), but no more partials per token block than its reader takes back in
    ``partial_bytes``. ``block_t`` tokens per program (16, the tensor cores' smallest M tile, by
    default); from 64 the expert blocks are 64 wide too, so that fewer programs re-read the same
    rows of ``x`` and of the gate.

        >>> gate_tiles(1, 128, 2048)      # Qwen3-30B-A3B at one token: 4 x 16 programs
        {'block_e': 32, 'block_k': 128, 'split_k': 16, 'k_span': 128, 'e_blocks': 4, 't_blocks': 1}
        >>> gate_tiles(1, 256, 7168)      # DeepSeek-V3 at one token: 8 x 14 programs
        {'block_e': 32, 'block_k': 128, 'split_k': 14, 'k_span': 512, 'e_blocks': 8, 't_blocks': 1}
        >>> gate_tiles(64, 256, 7168)     # DeepSeek-V3 at 64 tokens: 4 x 8 x 8 programs of 7 steps
        {'block_e': 32, 'block_k': 128, 'split_k': 8, 'k_span': 896, 'e_blocks': 8, 't_blocks': 4}
        >>> gate_tiles(64, 128, 2048)     # Qwen3-30B-A3B at 64 tokens: 4 x 4 x 8 programs of 2 steps
        {'block_e': 32, 'block_k': 128, 'split_k': 8, 'k_span': 256, 'e_blocks': 4, 't_blocks': 4}
        >>> gate_tiles(512, 256, 7168, block_t=64, partial_bytes=2**22)   # 8 x 4 x 8 programs
        {'block_e': 64, 'block_k': 128, 'split_k': 8, 'k_span': 896, 'e_blocks': 4, 't_blocks': 8}
    """
    block_e = 64 if block_t >= 64 and num_experts >= 64 else 32 if num_experts > 16 else 16
    block_k = min(128, max(16, next_power_of_2(hidden_size)))
    t_blocks, e_blocks = max(1, cdiv(num_tokens, block_t)), cdiv(num_experts, block_e)
    k_steps = cdiv(hidden_size, block_k)
    rows = min(num_tokens, block_t)   # the rows of partials a token block really has
    by_bytes = max(1, partial_bytes // (max(rows, 1) * next_power_of_2(num_experts) * 4))
    for target in (_TARGET_PROGRAMS, _WIDE_TARGET_PROGRAMS):
        split = max(1, min(k_steps, by_bytes, target // (t_blocks * e_blocks)))
        if _MAX_K_STEPS is None or cdiv(k_steps, split) <= _MAX_K_STEPS:
            break   # (else the programs are too long: take the wider grid)
    k_span = cdiv(k_steps, split) * block_k
    return {"block_e": block_e, "block_k": block_k, "split_k": cdiv(hidden_size, k_span), "k_span": k_span,
            "e_blocks": e_blocks, "t_blocks": t_blocks}
