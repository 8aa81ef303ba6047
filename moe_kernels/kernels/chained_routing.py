"""The router at decode as launches chained by programmatic dependent launch (PDL).

:mod:`moe_kernels.kernels.gate_routing` puts the gate, the routing and the alignment in one launch: the gate's
split-``d`` partials are spread over the SMs and the last program to arrive (an atomic counter per token block, zeroed
by a fill before the launch) adds them and routes. On the H200 that one launch was *slower* than the cuBLAS gate, the
routing kernel and the alignment kernel one after another (``gate-routing.json``). What it adds: a fill, atomics with
acquire/release order, and one program, started only when the last partial is in, that does everything else.

This module keeps the split gate and drops the counter: each step is a launch of its own, and programmatic dependent
launch (PDL: Hopper and newer, Triton's ``launch_pdl``) starts each launch before the one it depends on has ended, so
that it is resident and waiting, not launched, when its inputs are ready:

1. :func:`~moe_kernels.kernels.gate_routing.store_gate_partial` over the grid of :func:`chained_gate_tiles` (16 tokens
   per program, 64 from :data:`WIDE_GATE_FROM_TOKENS`): each program first lets the next launch start
   (``gdc_launch_dependents``), then writes its float32 partial logits;
2. one program per token: it waits for the first launch's memory (``gdc_wait``), adds the token's partials in a fixed
   order, stores its logits and routes it (the routing kernels' own body, on one warp per 128 experts, where a
   reduction is a few shuffles inside a warp, four for DeepSeek-V3's grouped rule (:func:`route_warps`);
3. with a ``block_size``, waiting in turn for the routing's ids, the alignment: up to :data:`ONE_TILE_MAX_ASSIGNMENTS`
   one program from one read of the ids (:func:`align_one_tile`), above it (:data:`ALIGN_BODY` "ranked", the default)
   the counts the routing programs made with atomics, so that the alignment only scans them and scatters
   (:func:`align_by_ranks`), or the alignment kernel's single-launch body ("full": every program counts every id, then
   places its share);
4. with ``launch_next``, the last of these lets the kernel after the chain launch early too (the layer's GEMM 1, a
   programmatic dependent that waits for the chain's memory before its first load).

``launch-floor.json`` (the H200, back to back in a CUDA graph): one more kernel costs 0.96-1.17 us without PDL,
0.57-0.69 with it.

Outputs are those of :func:`~moe_kernels.kernels.gate_routing.gate_and_route` and
:func:`~moe_kernels.kernels.gate_routing.gate_route_and_align`: with the same 16-token gate blocks (below
:data:`WIDE_GATE_FROM_TOKENS`; above it the partials group the products otherwise, so the logits agree to float32's
rounding and a near-tie may route another way) the same partials added in the same order give the same logits bit for
bit, and the same routing and alignment bodies run on them, so the ids and the alignment are the same (with "ranked"
up to the order inside each segment); the weights are too under the interpreter, and to float32's last bits on a GPU
(one token per program there, sixteen in the one-launch router: the softmax's and the renormalisation's sums are
reduced in another order). ``sorted_topk`` picks the top-k by one partial sort
(:mod:`moe_kernels.kernels.sorted_topk`) instead of ``k`` rounds of argmax, or ("keyed") by ``k`` rounds of one
reduction over the sort's packed keys: the same ids in the same order, the same weights (to float32's last bit on a
GPU). Without PDL (an older GPU, the interpreter) the same kernels run one after the other, with the same results.

For decode batches: up to :data:`MAX_TOKENS` tokens, a clear error above.

Worked example, four experts, three tokens, top-2, aligned into blocks of two rows::

    >>> import torch
    >>> x = torch.tensor([[1.0, 2.0], [0.0, 1.0], [2.0, 0.0]])
    >>> gate_weight = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, -1.0], [2.0, 0.0]])
    >>> weights, ids, logits, sorted_ids, expert_ids, used = gate_route_chained(
    ...     x, gate_weight, 2, True, block_size=2)
    >>> ids.tolist()
    [[3, 1], [1, 0], [3, 0]]
    >>> int(used), sorted_ids[: int(used)].tolist(), expert_ids[: int(used) // 2].tolist()
    (6, [3, 5, 1, 2, 0, 4], [0, 1, 3])
"""

from __future__ import annotations

import functools

import torch

from .._checks import fail
from .._runtime import HAS_TRITON, INTERPRET, cdiv, kernel, next_power_of_2, note_launch, tl
from ._pdl import pdl_available
from .align import (_COUNT_TILE, _FILL_ROWS_PER_PROGRAM, _FILL_TILE, _SINGLE_TILE, _SINGLE_WARPS,
                    SINGLE_LAUNCH_MAX_NUMEL, align_bins_and_pad_tile, alignment_buffer_sizes)
from .gate_grid import BLOCK_T as GATE_BLOCK_T, gate_tiles
from .gate_routing import _check, _gate_route, rule_columns

__all__ = ["MAX_TOKENS", "gate_block_tokens", "gate_route_chained", "gate_route_chained_checked"]

#: Most tokens: every token block of the gate re-reads the gate matrix (from L2 after the first), and one routing
#: program per token has nothing to share; past a few hundred tokens the cuBLAS gate and the routing kernel read less.
MAX_TOKENS = 512
#: Most assignments the alignment launch places (its single-launch path: every program counts every id); above,
#: :func:`~moe_kernels.kernels.align.moe_align_block_size` runs with its own launches.
ALIGN_MAX_ASSIGNMENTS = SINGLE_LAUNCH_MAX_NUMEL
#: From this many tokens the gate's programs take 64 tokens each (and 64 experts), not 16: a program reads its rows of
#: ``x`` and of the gate once per token block and expert block, so wider blocks read less from L2 (DeepSeek-V3 at 512
#: tokens: 59 MB instead of 176). On the H200 (``gate-routing.json`` at 1acf7da, with the alignment, graphs, L2 warm)
#: DeepSeek-V3's chain took 15.7 / 22.0 / 35.1 us with 16-token blocks at 128 / 256 / 512 tokens, 13.3 / 16.1 / 22.4
#: with 64 (17.4 / 24.3 / 37.8 against 16.3 / 19.0 / 24.2 when it was chosen); Qwen3-30B-A3B's: 1.7 us less at 512,
#: within 0.1 below.
WIDE_GATE_FROM_TOKENS = 128
#: Token blocks the gate may take, and the most partials per token a routing program adds (its loads are unrolled).
GATE_BLOCK_CHOICES = (16, 32, 64)
_MAX_SPLIT = 32
#: Up to this many assignments (8 tokens of top-8) the alignment launch is one program that reads the ids once
#: (``align_one_tile``). Its [n, n] rank comparison grows with the square: on the H200 (``gate-routing.json``, the
#: chain with its alignment, graphs, L2 warm) it saved 2.4-2.5 us at one token when it was chosen (Qwen3-30B-A3B 7.9
#: -> 5.5, DeepSeek-V3 12.1 -> 9.6), 0.5-1.1 at 8, and lost 0.1-0.3 at 16; at 1acf7da 7.8 -> 5.5 and 10.1 -> 7.7 at
#: one token, 0.6-0.9 at 8, 0-0.1 at 16. Inside a layer it runs less often than that suggests: where each token is its
#: own block (the naive map: up to 4 tokens of Qwen3-30B-A3B, 8 of DeepSeek-V3) the layer aligns nothing, so there it
#: is Qwen3-30B-A3B at 5-8 tokens (0.5 us at 8).
ONE_TILE_MAX_ASSIGNMENTS = 64
#: The alignment launch's body above :data:`ONE_TILE_MAX_ASSIGNMENTS` (read at each launch): "ranked" (rows counted by
#: the routing; a segment's rows in any order on a GPU, ``blocks.same_segments``), "full", or to time parts, "no tail"
#: or "wait only"; and its warps. H200, the chain with it (``gate-routing-ranked.json``): ranked 6.3-9.5 us, full
#: 8.4-13.0 (Qwen3-30B-A3B, 16-512 tokens); DeepSeek-V3 8.7-16.6 against 11.4-22.3.
ALIGN_BODY, ALIGN_BODIES = "ranked", ("full", "ranked", "no tail", "wait only")
ALIGN_WARPS = _SINGLE_WARPS
ONE_TILE_WARPS = 4
#: Tokens per routing program: one, so that a batch's tokens are routed side by side (each on the warps of
#: :func:`route_warps`).
_ROUTE_BLOCK = 1
#: Warps of a routing program: None for :func:`route_warps`'s rule; a number, that many (a measurement switch for
#: ``tools/route_steps_ab.py``). Read at each launch.
ROUTE_WARPS = None


def route_warps(score_columns: int, grouped: bool) -> int:
    """Warps of one token's routing program over ``score_columns`` (the padded experts): one per 128 columns, where
    every reduction of the top-k is a few shuffles inside a warp; four for the grouped rule over more than 128, whose
    group mask and group scores are reductions over a ``[groups, members]`` view. Measured on the H200 (the chain
    without alignment, graphs, L2 warm, us at 1 / 8 / 64 / 256 tokens): DeepSeek-V3's grouped rule over 256 columns
    took 7.0 / 6.8 / 8.5 / 11.2 on two warps, 5.9 / 5.8 / 7.4 / 10.0 on four and 9.1 / 8.6 / 10.2 / 11.9 on one
    (``route-steps-ab-variants.json``; eight were no faster: ``route-steps-ab-warps.json``), while plain softmax over
    256 was no faster on four than on two (5.7 / 5.8 / 7.3 / 9.8 against 5.6 / 5.8 / 7.3 / 9.5), nor Qwen3-30B-A3B's
    over 128 on two than on one (4.0 / 4.1 / 5.5 / 6.4 against 3.8 / 4.1 / 5.3 / 6.4).

        >>> route_warps(128, False), route_warps(256, False), route_warps(256, True)
        (1, 2, 4)
    """
    return ROUTE_WARPS or (4 if grouped and score_columns > 128 else min(4, max(1, score_columns // 128)))

if HAS_TRITON:
    from ._pdl import gdc_launch_dependents, gdc_wait
    from .align import _align_program, _load_experts, fill_tail, pad_segment_ends
    from .gate_routing import add_partials_and_route, store_gate_partial

    @kernel
    def align_one_tile(topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, used_ptr, numel, num_experts, block_size,
                       NUM_BINS: tl.constexpr, TILE: tl.constexpr, PAD_TILE: tl.constexpr, FILL_TILE: tl.constexpr,
                       CACHE: tl.constexpr, FILL_TAIL: tl.constexpr = True):
        """The whole alignment of ``numel <= TILE`` assignments in one program, from one read of the ids:
        :func:`~moe_kernels.kernels.align._align_program` with one chunk, less its separate counting pass (a second
        read of the ids and a ``COUNT_TILE``-wide histogram); the same padding and tail
        (:func:`~moe_kernels.kernels.align.pad_segment_ends`, ``fill_tail``). For the router's chain at a few tokens,
        where the alignment is a chain of dependent steps, each a round trip to L2 or through shared memory, and no
        work to hide them."""
        lanes = tl.arange(0, TILE)
        experts, valid = _load_experts(topk_ids_ptr, lanes, numel, num_experts, CACHE)
        total = tl.histogram(experts, NUM_BINS, mask=valid)
        padded = (total + block_size - 1) // block_size * block_size
        segment_start = tl.cumsum(padded, axis=0) - padded
        real_end = segment_start + total
        used = tl.sum(padded, axis=0)
        tl.store(used_ptr, used)
        same_earlier = ((experts[:, None] == experts[None, :]) & valid[None, :]
                        & (lanes[None, :] < lanes[:, None]))
        row = tl.gather(segment_start, experts, 0) + tl.sum(same_earlier.to(tl.int32), axis=1)
        tl.store(sorted_ids_ptr + row, lanes, mask=valid)
        tl.store(expert_ids_ptr + row // block_size, experts, mask=valid & (row % block_size == 0))
        pad_segment_ends(sorted_ids_ptr, experts, valid, row, real_end, numel, block_size, PAD_TILE)
        if FILL_TAIL:
            capacity = numel + num_experts * (block_size - 1)
            fill_tail(sorted_ids_ptr, expert_ids_ptr, used, capacity, tl.cdiv(capacity, block_size), numel, block_size,
                      0, 1, FILL_TILE)

    @kernel
    def _chained_gate_kernel(x_ptr, gate_ptr, partial_ptr, num_tokens, num_experts, hidden_size, stride_x,
                             stride_gate, k_span, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr, counts_ptr=None, COUNT_BINS: tl.constexpr = 0):
        if PDL:   # the routing program may launch now: it waits for this launch's memory itself
            gdc_launch_dependents()
        if COUNT_BINS > 0:
            # The ranked alignment's per-expert counters start at zero: one program clears them, and
            # the routing programs, which count into them, wait for this whole launch first.
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
                bins = tl.arange(0, COUNT_BINS)
                tl.store(counts_ptr + bins, tl.zeros([COUNT_BINS], dtype=tl.int32), mask=bins < num_experts)
        store_gate_partial(x_ptr, gate_ptr, partial_ptr, num_tokens, num_experts, hidden_size, stride_x, stride_gate,
                           k_span, IEEE, BLOCK_T, BLOCK_E, BLOCK_K)

    @kernel
    def _chained_route_kernel(
        partial_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr,
        num_tokens, num_experts, topk, renormalize, scale, num_groups, experts_per_group, topk_group,
        GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SIGMOID: tl.constexpr, PRECISE: tl.constexpr,
        SORTED: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_K: tl.constexpr, E_COLS: tl.constexpr,
        G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
        counts_ptr=None, ranks_ptr=None, RANKS: tl.constexpr = False,
    ):
        """Program ``p`` adds and routes tokens ``p * BLOCK_T`` to ``(p + 1) * BLOCK_T`` (``RANKS``: and counts their
        ids into ``counts``, keeping each one's rank among its expert's rows)."""
        if PDL:   # launched before the gate's partials are all written: wait for them here
            gdc_wait()
        if TRIGGER:   # the next launch (the alignment, or GEMM 1) may start: it waits for this launch's ids itself
            gdc_launch_dependents()
        add_partials_and_route(partial_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * BLOCK_T,
                               num_tokens, num_experts, topk, renormalize, scale, num_groups, experts_per_group,
                               topk_group, GROUPED, HAS_BIAS, USE_SIGMOID, PRECISE, SORTED, BLOCK_T, SPLIT_K, E_COLS,
                               G_PAD, S_PAD, K_PAD)
        if RANKS:
            # The ids this program just stored (the router's: in [0, E)), read back after a barrier. One atomic per id
            # counts its expert's rows and returns the row's place among them: no histogram of every id.
            tl.debug_barrier()
            tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
            slots = tl.arange(0, K_PAD)
            at = tokens[:, None] * topk + slots[None, :]
            mine = (tokens < num_tokens)[:, None] & (slots < topk)[None, :]
            experts = tl.load(ids_ptr + at, mask=mine, other=0)
            rank = tl.atomic_add(counts_ptr + experts, 1, mask=mine, sem="relaxed")
            tl.store(ranks_ptr + at, rank, mask=mine)

    @kernel
    def align_by_ranks(program, num_programs, ids_ptr, ranks_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr,
                       used_ptr, numel, num_experts, block_size, NUM_BINS: tl.constexpr, TILE: tl.constexpr,
                       PAD_TILE: tl.constexpr, FILL_TILE: tl.constexpr):
        """The alignment from the routing programs' counts and ranks: each program scans the ``E`` counts
        into segments and places its assignments at ``segment_start[expert] + rank``."""
        bins = tl.arange(0, NUM_BINS)
        total = tl.load(counts_ptr + bins, mask=bins < num_experts, other=0, cache_modifier=".cg")
        padded = (total + block_size - 1) // block_size * block_size
        segment_start = tl.cumsum(padded, axis=0) - padded
        real_end = segment_start + total
        used = tl.sum(padded, axis=0)
        if program == 0:
            tl.store(used_ptr, used)
        lanes = tl.arange(0, TILE)
        for tile_start in range(program * TILE, numel, num_programs * TILE):
            offsets = tile_start + lanes
            valid = offsets < numel
            experts = tl.load(ids_ptr + offsets, mask=valid, other=0, cache_modifier=".cg")
            rank = tl.load(ranks_ptr + offsets, mask=valid, other=0, cache_modifier=".cg")
            row = tl.gather(segment_start, experts, 0) + rank
            tl.store(sorted_ids_ptr + row, offsets.to(tl.int32), mask=valid)
            tl.store(expert_ids_ptr + row // block_size, experts, mask=valid & (row % block_size == 0))
            pad_segment_ends(sorted_ids_ptr, experts, valid, row, real_end, numel, block_size, PAD_TILE)
        capacity = numel + num_experts * (block_size - 1)
        fill_tail(sorted_ids_ptr, expert_ids_ptr, used, capacity, tl.cdiv(capacity, block_size), numel, block_size,
                  program, num_programs, FILL_TILE)

    @kernel
    def _chained_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, used_ptr, numel, num_experts, block_size,
                              NUM_BINS: tl.constexpr, TILE: tl.constexpr, PAD_TILE: tl.constexpr,
                              COUNT_TILE: tl.constexpr, FILL_TILE: tl.constexpr, PDL: tl.constexpr,
                              BODY: tl.constexpr, ONE_TILE: tl.constexpr, ranks_ptr=None, counts_ptr=None,
                              TRIGGER: tl.constexpr = False):
        """The alignment kernel's single-launch body (every program counts every id, then places its chunk of ``TILE``
        assignments and writes its share of the tail), after the routing's ids; with ``ONE_TILE``, up to
        :data:`ONE_TILE_MAX_ASSIGNMENTS`, all of it in one program from one read (:func:`align_one_tile`). ``BODY``
        (:data:`ALIGN_BODY`): "full"; "ranked" (:func:`align_by_ranks`); for timing its parts, "no tail" (the tail
        past the used rows left unwritten) or "wait only" (the wait and one read of the ids). ``TRIGGER``: the launch
        after the chain (GEMM 1) may launch now; it waits for this launch's memory itself."""
        if TRIGGER:
            gdc_launch_dependents()
        if PDL:
            gdc_wait()
        if BODY == "wait only":
            if tl.program_id(0) == 0:
                tl.store(used_ptr, tl.load(ids_ptr, cache_modifier=".cg"))
        elif BODY == "ranked":   # counted by the routing programs: scan and scatter only
            align_by_ranks(tl.program_id(0), tl.num_programs(0), ids_ptr, ranks_ptr, counts_ptr, sorted_ids_ptr,
                           expert_ids_ptr, used_ptr, numel, num_experts, block_size, NUM_BINS, TILE, PAD_TILE,
                           FILL_TILE)
        elif ONE_TILE:   # a few tokens: one program, one read of the ids
            align_one_tile(ids_ptr, sorted_ids_ptr, expert_ids_ptr, used_ptr, numel, num_experts, block_size,
                           NUM_BINS, TILE, PAD_TILE, FILL_TILE, ".cg", BODY == "full")
        else:
            _align_program(tl.program_id(0), tl.num_programs(0), ids_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr,
                           used_ptr, numel, num_experts, block_size, TILE, False, NUM_BINS, TILE, COUNT_TILE, 1,
                           PAD_TILE, FILL_TILE, "", ".cg", BODY == "full")


def gate_block_tokens(num_tokens: int) -> int:
    """Tokens per gate program at ``num_tokens``: 16 (the one-launch router's, so that the two give the
    same logits bit for bit), 64 from :data:`WIDE_GATE_FROM_TOKENS`.

        >>> gate_block_tokens(64), gate_block_tokens(512)
        (16, 64)
    """
    return 64 if num_tokens >= WIDE_GATE_FROM_TOKENS else GATE_BLOCK_T


def chained_gate_tiles(num_tokens: int, num_experts: int, hidden_size: int, block_t: int) -> dict:
    """The gate's grid in the chain: :func:`~moe_kernels.kernels.gate_grid.gate_tiles`, the same as the
    one-launch router's with 16-token blocks; wider blocks split ``d`` into at most 32 spans (each
    routing program adds its one token's partials, unrolled), not by the one-launch router's budget for
    a whole token block.

        >>> chained_gate_tiles(512, 256, 7168, 64)   # DeepSeek-V3: 8 x 4 x 8 programs
        {'block_e': 64, 'block_k': 128, 'split_k': 8, 'k_span': 896, 'e_blocks': 4, 't_blocks': 8}
    """
    if block_t == GATE_BLOCK_T:
        return gate_tiles(num_tokens, num_experts, hidden_size)
    rows = max(1, min(num_tokens, block_t))
    return gate_tiles(num_tokens, num_experts, hidden_size, block_t=block_t,
                      partial_bytes=rows * next_power_of_2(num_experts) * 4 * _MAX_SPLIT)


def gate_route_chained(hidden_states: torch.Tensor, gate_weight: torch.Tensor, topk: int, renormalize: bool,
                       scoring_func: str = "softmax", *, block_size: int | None = None,
                       num_expert_group: int | None = None, topk_group: int | None = None,
                       routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None,
                       sorted_topk: bool | str = True, pdl: bool = True, gate_block_t: int | None = None):
    """The router (and, with ``block_size``, the alignment) in launches chained by PDL: ``(topk_weights, topk_ids,
    logits)``, or with ``block_size`` also ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, exactly (with
    "ranked", up to the order in a segment) as :func:`~moe_kernels.kernels.gate_routing.gate_and_route` and
    :func:`~moe_kernels.kernels.gate_routing.gate_route_and_align` return them. Same arguments and checks, and
    ``hidden_states`` holds at most :data:`MAX_TOKENS` tokens. ``sorted_topk``: the top-k by one partial sort (False:
    ``k`` rounds of argmax; "keyed": ``k`` rounds of one reduction over packed keys; the same result). ``pdl``: chain
    the launches where the GPU can (else they run one after the other; same result). ``gate_block_t``: tokens per gate
    program, one of :data:`GATE_BLOCK_CHOICES` (default :func:`gate_block_tokens`); other than 16 the partials are
    summed in another grouping, so the logits may differ from the one-launch router's in float32's last bits (equal
    where every product and sum is exact)."""
    func = "gate_route_chained"
    _check(func, hidden_states, gate_weight, topk, renormalize, scoring_func, num_expert_group, topk_group,
           routed_scaling_factor, e_score_correction_bias)
    if hidden_states.shape[0] > MAX_TOKENS:
        fail(func, "hidden_states", f"must have at most {MAX_TOKENS} tokens (every token block re-reads the gate; "
             "take the gate then routing.fused_topk for more)",
             f"{hidden_states.shape[0]} tokens")
    if block_size is not None:
        alignment_buffer_sizes(func, hidden_states.new_empty((hidden_states.shape[0], topk), dtype=torch.int32),
                               block_size, gate_weight.shape[0])
    if not (isinstance(sorted_topk, bool) or (isinstance(sorted_topk, str) and sorted_topk == "keyed")):
        fail(func, "sorted_topk", 'must be a bool or "keyed"', repr(sorted_topk), TypeError)
    if not isinstance(pdl, bool):
        fail(func, "pdl", "must be a bool", type(pdl).__name__, TypeError)
    if gate_block_t is not None and (type(gate_block_t) is not int or gate_block_t not in GATE_BLOCK_CHOICES):
        fail(func, "gate_block_t", f"must be None or one of {GATE_BLOCK_CHOICES}", repr(gate_block_t))
    return gate_route_chained_checked(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                      block_size=block_size, num_expert_group=num_expert_group, topk_group=topk_group,
                                      routed_scaling_factor=routed_scaling_factor,
                                      e_score_correction_bias=e_score_correction_bias, sorted_topk=sorted_topk,
                                      pdl=pdl, gate_block_t=gate_block_t)


def gate_route_chained_checked(hidden_states, gate_weight, topk, renormalize, scoring_func="softmax", *,
                               block_size=None, num_expert_group=None, topk_group=None, routed_scaling_factor=1.0,
                               e_score_correction_bias=None, sorted_topk=True, pdl=True, gate_block_t=None,
                               launch_next=False):
    """:func:`gate_route_chained` for arguments already checked. ``launch_next``: the chain's last launch lets the
    next kernel on the stream start early (the layer's GEMM 1, launched as a programmatic dependent that waits for the
    chain's memory itself: :func:`~moe_kernels.kernels.index_gather.run_experts`'s ``after_router``)."""
    launch = functools.partial(_launch, sorted_topk=sorted_topk, pdl=pdl and pdl_available(hidden_states.device),
                               gate_block_t=gate_block_t or gate_block_tokens(hidden_states.shape[0]),
                               launch_next=launch_next)
    weights, ids, logits, alignment = _gate_route(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                                  num_expert_group, topk_group, routed_scaling_factor,
                                                  e_score_correction_bias, block_size, launch, "gate_route_chained",
                                                  ALIGN_MAX_ASSIGNMENTS)
    return (weights, ids, logits) if block_size is None else (weights, ids, logits, *alignment)


def _launch(hidden_states, gate_weight, bias, topk, renormalize, scoring_func, num_expert_group, topk_group,
            routed_scaling_factor, weights, ids, logits, alignment, *, sorted_topk, pdl, gate_block_t, launch_next):
    num_tokens, hidden_size = hidden_states.shape
    num_experts = gate_weight.shape[0]
    grouped, groups, per_group, g_pad, s_pad, e_cols = rule_columns(num_experts, num_expert_group, bias)
    tiles = chained_gate_tiles(num_tokens, num_experts, hidden_size, gate_block_t)
    partial = torch.empty((tiles["split_k"], num_tokens, num_experts), dtype=torch.float32, device=ids.device)
    route_block, numel = _ROUTE_BLOCK, num_tokens * topk
    one_tile = numel <= ONE_TILE_MAX_ASSIGNMENTS
    if ALIGN_BODY not in ALIGN_BODIES:
        fail("moe_kernels.kernels.chained_routing", "ALIGN_BODY", f"must be one of {ALIGN_BODIES}", repr(ALIGN_BODY))
    # "ranked" where the chunked body would run: the routing programs count, the gate launch clears.
    ranked = alignment is not None and ALIGN_BODY == "ranked" and not one_tile
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device) if ranked else None
    ranks = torch.empty(numel, dtype=torch.int32, device=ids.device) if ranked else None
    note_launch("chained_routing.gate", split_k=tiles["split_k"], block_t=gate_block_t, pdl=pdl, clears_counts=ranked)
    _chained_gate_kernel[(tiles["t_blocks"], tiles["e_blocks"], tiles["split_k"])](
        hidden_states, gate_weight, partial, num_tokens, num_experts, hidden_size, hidden_states.stride(0),
        gate_weight.stride(0), tiles["k_span"], IEEE=hidden_states.dtype == torch.float32,
        BLOCK_T=gate_block_t, BLOCK_E=tiles["block_e"], BLOCK_K=tiles["block_k"], PDL=pdl, num_warps=4,
        counts_ptr=counts, COUNT_BINS=next_power_of_2(num_experts) if ranked else 0,
    )
    warps = route_warps(route_block * e_cols, grouped)
    # The routing lets the alignment launch early, or, where it is the chain's last launch, the launch after it.
    route_triggers = pdl and (alignment is not None or launch_next)
    note_launch("chained_routing.route", grouped=grouped, pdl=pdl, sorted_topk=sorted_topk, route_block=route_block,
                warps=warps, ranks=ranked, triggers=route_triggers)
    _chained_route_kernel[(cdiv(num_tokens, route_block),)](
        partial, bias if bias is not None else logits, logits, weights, ids,
        num_tokens, num_experts, topk, renormalize, float(routed_scaling_factor), groups, per_group, topk_group or 1,
        GROUPED=grouped, HAS_BIAS=bias is not None, USE_SIGMOID=scoring_func == "sigmoid", PRECISE=not INTERPRET,
        SORTED=sorted_topk, BLOCK_T=route_block, SPLIT_K=tiles["split_k"], E_COLS=e_cols, G_PAD=g_pad, S_PAD=s_pad,
        K_PAD=next_power_of_2(topk), PDL=pdl, TRIGGER=route_triggers,
        counts_ptr=counts, ranks_ptr=ranks, RANKS=ranked, num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )
    if alignment is None:
        return
    sorted_ids, expert_ids, used, block_size = alignment
    num_bins, pad_tile = align_bins_and_pad_tile(num_experts, block_size)
    body = "full" if ALIGN_BODY == "ranked" and not ranked else ALIGN_BODY
    if one_tile:
        programs, tile, warps = 1, max(16, next_power_of_2(numel)), ONE_TILE_WARPS
    else:
        programs = max(cdiv(numel, _SINGLE_TILE), cdiv(sorted_ids.numel(), _FILL_ROWS_PER_PROGRAM), 1)
        tile, warps = _SINGLE_TILE, ALIGN_WARPS
    note_launch("chained_routing.align", pdl=pdl, programs=programs, body=body, warps=warps, one_tile=one_tile,
                triggers=pdl and launch_next)
    _chained_align_kernel[(programs,)](
        ids, sorted_ids, expert_ids, used, numel, num_experts, block_size,
        NUM_BINS=num_bins, TILE=tile, PAD_TILE=pad_tile, COUNT_TILE=_COUNT_TILE, FILL_TILE=_FILL_TILE,
        PDL=pdl, BODY=body, ONE_TILE=one_tile, ranks_ptr=ranks, counts_ptr=counts, TRIGGER=pdl and launch_next,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )
