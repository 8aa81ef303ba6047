"""The router at decode as two launches chained by programmatic dependent launch (PDL).

:mod:`moe_kernels.kernels.gate_routing` puts the gate, the routing and the alignment in one launch:
the gate's split-``d`` partials are spread over the SMs and the last program to arrive (an atomic
counter per token block, zeroed by a fill before the launch) adds them and routes. On the H200
that one launch was *slower* than the cuBLAS gate, the routing kernel and the alignment kernel one
after another (``gate-routing.json``). What it adds: a fill, atomics with acquire/release order,
and one program, started only when the last partial is in, that does everything else.

This module keeps the split gate and drops the counter. Two launches:

1. :func:`~moe_kernels.kernels.gate_routing.store_gate_partial` over the grid of
   :func:`~moe_kernels.kernels.gate_routing.gate_tiles`: each program writes its float32 partial
   logits, and first of all lets the next launch start (``gdc_launch_dependents``);
2. one program that waits for the first launch's memory (``gdc_wait``), then for each block of
   tokens adds the partials in a fixed order, stores the logits and routes them (the routing
   kernels' own body), and then aligns every assignment (the alignment kernel's own body).

With PDL (Hopper and newer, launched through Triton's ``launch_pdl``) the second launch is already
resident when the first ends, so the pair costs about one launch's latency and a half, not two
(``launch-floor.json``: 0.6-0.7 us per extra kernel with PDL, 1.0-1.2 without, back to back in a
CUDA graph). Without PDL (an older GPU, the interpreter) the same two kernels run one after the
other, with the same results.

Outputs are those of :func:`~moe_kernels.kernels.gate_routing.gate_route_and_align` exactly: the
same partials added in the same order give the same logits bit for bit, and the same routing and
alignment bodies run on them. ``sorted_topk`` picks the top-k by one partial sort
(:mod:`moe_kernels.kernels.sorted_topk`) instead of ``k`` rounds of argmax: the same ids, in the
same order, and the same weights.

One program routes every token, so this is for decode batches: up to :data:`MAX_TOKENS` tokens
(and the alignment in the same program up to ``ALIGN_MAX_ASSIGNMENTS`` assignments, else its own
launch), a clear error above.

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

import torch

import functools

from .._checks import fail
from .._runtime import HAS_TRITON, INTERPRET, kernel, next_power_of_2, note_launch, tl
from ._pdl import pdl_available
from .align import _COUNT_TILE, _FILL_TILE, _SINGLE_TILE, align_bins_and_pad_tile, alignment_buffer_sizes
from .gate_routing import BLOCK_T as GATE_BLOCK_T, _check, _gate_route, gate_tiles

__all__ = ["MAX_TOKENS", "gate_route_chained", "gate_route_chained_checked"]

#: Most tokens the one routing program takes: it routes them a block at a time, one after another.
MAX_TOKENS = 128
#: Tokens the routing program holds at once (fewer when the batch is smaller).
_ROUTE_BLOCK = 16

if HAS_TRITON:
    from ._pdl import gdc_launch_dependents, gdc_wait
    from .align import _align_program
    from .gate_routing import add_partials_and_route, store_gate_partial

    @kernel
    def _chained_gate_kernel(x_ptr, gate_ptr, partial_ptr, num_tokens, num_experts, hidden_size, stride_x,
                             stride_gate, k_span, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        if PDL:   # the routing program may launch now: it waits for this launch's memory itself
            gdc_launch_dependents()
        store_gate_partial(x_ptr, gate_ptr, partial_ptr, num_tokens, num_experts, hidden_size, stride_x, stride_gate,
                           k_span, IEEE, BLOCK_T, BLOCK_E, BLOCK_K)

    @kernel
    def _chained_route_kernel(
        partial_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, used_ptr,
        num_tokens, num_experts, topk, renormalize, scale, num_groups, experts_per_group, topk_group, block_size,
        GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SIGMOID: tl.constexpr, PRECISE: tl.constexpr,
        SORTED: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_K: tl.constexpr, E_COLS: tl.constexpr,
        G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr, ALIGN: tl.constexpr, NUM_BINS: tl.constexpr,
        ALIGN_TILE: tl.constexpr, PAD_TILE: tl.constexpr, COUNT_TILE: tl.constexpr, FILL_TILE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """The one program: add, route and (``ALIGN``) align every token."""
        if PDL:   # launched before the gate's partials are all written: wait for them here
            gdc_wait()
        for first_token in range(0, num_tokens, BLOCK_T):
            add_partials_and_route(partial_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, first_token, num_tokens,
                                   num_experts, topk, renormalize, scale, num_groups, experts_per_group, topk_group,
                                   GROUPED, HAS_BIAS, USE_SIGMOID, PRECISE, SORTED, BLOCK_T, SPLIT_K, E_COLS, G_PAD,
                                   S_PAD, K_PAD)
        if ALIGN:
            tl.debug_barrier()   # every thread's ids stored before any thread reads them back
            numel = num_tokens * topk
            _align_program(0, 1, ids_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, used_ptr, numel, num_experts,
                           block_size, numel, False, NUM_BINS, ALIGN_TILE, COUNT_TILE, 1, PAD_TILE, FILL_TILE, "",
                           ".cg")


def gate_route_chained(hidden_states: torch.Tensor, gate_weight: torch.Tensor, topk: int, renormalize: bool,
                       scoring_func: str = "softmax", *, block_size: int | None = None,
                       num_expert_group: int | None = None, topk_group: int | None = None,
                       routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None,
                       sorted_topk: bool = True, pdl: bool = True):
    """The router (and, with ``block_size``, the alignment) in two chained launches:
    ``(topk_weights, topk_ids, logits)``, or with ``block_size`` also
    ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, exactly as
    :func:`~moe_kernels.kernels.gate_routing.gate_and_route` and
    :func:`~moe_kernels.kernels.gate_routing.gate_route_and_align` return them. Same arguments and
    checks, and ``hidden_states`` holds at most :data:`MAX_TOKENS` tokens. ``sorted_topk``: the
    top-k by one partial sort (else ``k`` rounds of argmax; same result). ``pdl``: chain the
    launches where the GPU can (else they run one after the other; same result)."""
    func = "gate_route_chained"
    _check(func, hidden_states, gate_weight, topk, renormalize, scoring_func, num_expert_group, topk_group,
           routed_scaling_factor, e_score_correction_bias)
    if hidden_states.shape[0] > MAX_TOKENS:
        fail(func, "hidden_states", f"must have at most {MAX_TOKENS} tokens (one program routes them all; "
             "gate_routing.gate_and_route or the gate then routing.fused_topk take more)",
             f"{hidden_states.shape[0]} tokens")
    if block_size is not None:
        alignment_buffer_sizes(func, hidden_states.new_empty((hidden_states.shape[0], topk), dtype=torch.int32),
                               block_size, gate_weight.shape[0])
    for name, value in (("sorted_topk", sorted_topk), ("pdl", pdl)):
        if not isinstance(value, bool):
            fail(func, name, "must be a bool", type(value).__name__, TypeError)
    return gate_route_chained_checked(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                      block_size=block_size, num_expert_group=num_expert_group, topk_group=topk_group,
                                      routed_scaling_factor=routed_scaling_factor,
                                      e_score_correction_bias=e_score_correction_bias, sorted_topk=sorted_topk,
                                      pdl=pdl)


def gate_route_chained_checked(hidden_states, gate_weight, topk, renormalize, scoring_func="softmax", *,
                               block_size=None, num_expert_group=None, topk_group=None, routed_scaling_factor=1.0,
                               e_score_correction_bias=None, sorted_topk=True, pdl=True):
    """:func:`gate_route_chained` for arguments already checked."""
    launch = functools.partial(_launch, sorted_topk=sorted_topk, pdl=pdl and pdl_available(hidden_states.device))
    weights, ids, logits, alignment = _gate_route(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                                  num_expert_group, topk_group, routed_scaling_factor,
                                                  e_score_correction_bias, block_size, launch, "gate_route_chained")
    return (weights, ids, logits) if block_size is None else (weights, ids, logits, *alignment)


def _launch(hidden_states, gate_weight, bias, topk, renormalize, scoring_func, num_expert_group, topk_group,
            routed_scaling_factor, weights, ids, logits, alignment, *, sorted_topk, pdl):
    num_tokens, hidden_size = hidden_states.shape
    num_experts = gate_weight.shape[0]
    grouped = num_expert_group is not None or bias is not None
    groups = num_expert_group or 1
    per_group = num_experts // groups
    g_pad, s_pad = next_power_of_2(groups), next_power_of_2(per_group)
    e_cols = g_pad * s_pad if grouped else next_power_of_2(num_experts)
    tiles = gate_tiles(num_tokens, num_experts, hidden_size)
    partial = torch.empty((tiles["split_k"], num_tokens, num_experts), dtype=torch.float32,
                          device=hidden_states.device)
    sorted_ids, expert_ids, used, block_size = alignment if alignment is not None else (ids, ids, ids, 1)
    num_bins, pad_tile = align_bins_and_pad_tile(num_experts, block_size)
    route_block = min(_ROUTE_BLOCK, next_power_of_2(num_tokens))
    note_launch("chained_routing.gate", split_k=tiles["split_k"], pdl=pdl)
    _chained_gate_kernel[(tiles["t_blocks"], tiles["e_blocks"], tiles["split_k"])](
        hidden_states, gate_weight, partial, num_tokens, num_experts, hidden_size, hidden_states.stride(0),
        gate_weight.stride(0), tiles["k_span"], IEEE=hidden_states.dtype == torch.float32,
        BLOCK_T=GATE_BLOCK_T, BLOCK_E=tiles["block_e"], BLOCK_K=tiles["block_k"], PDL=pdl, num_warps=4,
    )
    note_launch("chained_routing.route", grouped=grouped, pdl=pdl, sorted_topk=sorted_topk,
                aligned=alignment is not None, route_block=route_block)
    _chained_route_kernel[(1,)](
        partial, bias if bias is not None else logits, logits, weights, ids, sorted_ids, expert_ids, used,
        num_tokens, num_experts, topk, renormalize, float(routed_scaling_factor), groups, per_group,
        topk_group or 1, block_size,
        GROUPED=grouped, HAS_BIAS=bias is not None, USE_SIGMOID=scoring_func == "sigmoid", PRECISE=not INTERPRET,
        SORTED=sorted_topk, BLOCK_T=route_block, SPLIT_K=tiles["split_k"], E_COLS=e_cols, G_PAD=g_pad, S_PAD=s_pad,
        K_PAD=next_power_of_2(topk), ALIGN=alignment is not None, NUM_BINS=num_bins, ALIGN_TILE=_SINGLE_TILE,
        PAD_TILE=pad_tile, COUNT_TILE=_COUNT_TILE, FILL_TILE=_FILL_TILE, PDL=pdl,
        num_warps=8 if alignment is not None or route_block * e_cols > 2048 else 4,
        **({"launch_pdl": True} if pdl else {}),
    )
