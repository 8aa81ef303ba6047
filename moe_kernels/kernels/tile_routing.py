"""The router at prefill in one launch: each program computes a tile of logits over every expert, then routes it.

At prefill the gate is a GEMM with a thin N: ``[T, d] @ [d, E]``, 2 T d E FLOPs over one read of
``x`` (DeepSeek-V3 at 16,384 tokens: 60 GFLOP and 235 MB; Qwen3-30B-A3B: 8.6 GFLOP and 67 MB). The
two-step path runs it as a cuBLAS GEMM that writes float32 logits, then the routing kernel, which
reads them back and ranks them (:mod:`moe_kernels.kernels.routing`). At decode the routers split
``d`` over the SMs (:mod:`moe_kernels.kernels.gate_grid`), because a few tokens give too few tiles
to keep the SMs busy; at prefill there are tiles enough without a split, so one program can hold
all ``E`` logits of its tokens:

1. program ``p`` multiplies tokens ``p * BLOCK_T ..`` (``BLOCK_T`` rows of ``x``) by the whole gate,
   all ``E`` experts as the tile's N (padded to a power of two), over all of ``d`` in steps of
   ``BLOCK_K`` through a software pipeline: a float32 ``[BLOCK_T, E]`` tile of logits, in
   registers, on the tensor cores;
2. it stores the tile (the ``logits`` output), and after a barrier routes its tokens
   ``ROUTE_T`` at a time with the routing kernels' own body
   (:func:`~moe_kernels.kernels.routing.route_tokens`,
   :func:`~moe_kernels.kernels.grouped_routing.route_grouped_tokens`), which reads the rows back
   from L2, where this program has just written them.

So the logits never make a round trip through DRAM before they are ranked, and the router is one
launch, not two. Every program reads the whole gate (from L2 after the first few), so small token
blocks multiply that traffic: :func:`tile_router_tiles` takes the largest block that still gives the
SMs a program each.

Measured slower (``tile-router-ab-s42.json``, an H100, Qwen3-30B-A3B, CUDA graphs, L2 warm): from 1,024 to
8,192 tokens the best token block took 1.29-1.54 times as long as the two steps, and at 16,384 the default
block 1.14 times (64.2 against 56.2 us; 64-token blocks 54.8, 0.97 times). The routing is instructions (k
rounds of reductions across E); here each program routes right after its GEMM on the same SM, with little else
resident to issue while those reductions wait (a likely part of the loss). The GEMM alone, :func:`tile_gate`, is
slower than cuBLAS's too (``tile-router-ab-s43.json``: 34.3 against 31.2 us at 16,384 Qwen3-30B-A3B tokens, 13.7
against 6.7 at 4,096; DeepSeek-V3 165.1 against 99.3 at 16,384). So the layer keeps the two steps
(:data:`moe_kernels.layer_router.TILE_ROUTER_MIN_TOKENS` 0).

The products are those of the two-step path on a GPU (16-bit operands on the tensor cores, float32
sums, in another order: a near-tie may break the other way, as between any two float32 GEMMs);
float32 operands are multiplied in IEEE float32. The routing is the routing kernels' body on the
logits this call returns, so its ids equal the rule's reference on those logits.

A worked example, four experts, three tokens, top-2, checked against the two-step path::

    >>> import torch
    >>> from moe_kernels.kernels.routing import fused_topk, gate
    >>> x = torch.tensor([[1.0, 2.0], [0.0, 1.0], [2.0, 0.0]])
    >>> gate_weight = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, -1.0], [2.0, 0.0]])
    >>> weights, ids, logits = gate_and_route_tiles(x, gate_weight, topk=2, renormalize=True)
    >>> ids.tolist()
    [[3, 1], [1, 0], [3, 0]]
    >>> two_steps = fused_topk(x, gate(x, gate_weight), 2, True)
    >>> torch.equal(ids, two_steps[1]) and torch.allclose(weights, two_steps[0])
    True
"""

from __future__ import annotations

import functools

import torch

from .._checks import fail
from .._runtime import (HAS_TRITON, INTERPRET, cdiv, interpreted_bf16, kernel, next_power_of_2, note_launch, tl,
                        use_triton)
from .gate_routing import _check, _gate_route, rule_columns
from . import routing
from .routing import _TILE_ELEMENTS

__all__ = ["gate_and_route_tiles", "gate_and_route_tiles_checked", "tile_gate", "tile_router_tiles", "MAX_EXPERTS",
           "TILE_CHOICES"]

#: Token blocks a program may take (``tl.dot`` needs 16 rows; Hopper's wgmma 64).
TILE_CHOICES = (16, 32, 64, 128)
#: Programs the default tile aims at, at least: about one per SM of an H100 or H200 (132).
_MIN_PROGRAMS = 128
#: Most float32 logits the default tile holds (``BLOCK_T * E``, E padded): 128 x 128, or 64 x 256 for
#: DeepSeek-V3: 64 registers a thread at 8 warps.
_DEFAULT_TILE_LOGITS = 128 * 128
#: Most logits any tile may hold (``block_t`` given): 128 x 256, 128 registers a thread at 8 warps.
_MAX_TILE_LOGITS = 128 * 256
#: Most experts the tile holds (E padded): the gate's rows of three pipeline stages fill an SM's shared
#: memory at 1,024 (266 KB against the H100's and H200's 227 KB; 512 experts on 64-token blocks: 221 KB).
MAX_EXPERTS = 512


def tile_router_tiles(num_tokens: int, num_experts: int, hidden_size: int, *, block_t: int | None = None) -> dict:
    """The launch's tiles: tokens per program (``block_t``, or the largest of :data:`TILE_CHOICES`
    that still gives at least :data:`_MIN_PROGRAMS` programs with a tile of at most
    :data:`_DEFAULT_TILE_LOGITS` logits), the tile's expert columns, the K step, pipeline stages,
    warps and programs.

        >>> tile_router_tiles(16384, 128, 2048)   # Qwen3-30B-A3B: 128 programs of 128 tokens
        {'block_t': 128, 'e_cols': 128, 'block_k': 64, 'stages': 3, 'warps': 8, 'programs': 128}
        >>> tile_router_tiles(16384, 256, 7168)   # DeepSeek-V3: 256 programs of 64
        {'block_t': 64, 'e_cols': 256, 'block_k': 64, 'stages': 3, 'warps': 8, 'programs': 256}
        >>> tile_router_tiles(2048, 128, 2048)["block_t"]   # fewer tokens: smaller blocks, as many programs
        16
    """
    e_cols = max(16, next_power_of_2(num_experts))   # (tl.dot's N is 16 at least)
    if block_t is None:
        block_t = TILE_CHOICES[0]
        for choice in TILE_CHOICES:
            if choice * e_cols <= _DEFAULT_TILE_LOGITS and cdiv(num_tokens, choice) >= _MIN_PROGRAMS:
                block_t = choice
    block_k = min(64, max(16, next_power_of_2(hidden_size)))
    # Two 64-row warpgroups on wgmma from 64 x 128 logits; below that 4 warps hold the tile.
    warps = 8 if block_t * e_cols >= 64 * 128 else 4
    return {"block_t": block_t, "e_cols": e_cols, "block_k": block_k, "stages": 3, "warps": warps,
            "programs": max(1, cdiv(num_tokens, block_t))}


if HAS_TRITON:
    from .grouped_routing import route_grouped_tokens
    from .routing import route_tokens

    @kernel
    def _tile_router_kernel(
        x_ptr, gate_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr,
        num_tokens, num_experts, hidden_size, stride_x, stride_gate,
        topk, renormalize, scale, num_groups, experts_per_group, topk_group,
        GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SIGMOID: tl.constexpr, PRECISE: tl.constexpr,
        SORTED: tl.constexpr, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, E_COLS: tl.constexpr,
        BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ROUTE_T: tl.constexpr, ROUTE_COLS: tl.constexpr,
        G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr, ROUTE: tl.constexpr = True,
    ):
        first = tl.program_id(0) * BLOCK_T
        tokens = first + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, E_COLS)
        token_ok, expert_ok = tokens < num_tokens, experts < num_experts
        x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x
        gate_rows = gate_ptr + experts.to(tl.int64)[:, None] * stride_gate

        # The gate: BLOCK_T tokens times every expert, over all of d (no split,
        # no partials), the loads of later K steps in flight under this one's MMA.
        acc = tl.zeros([BLOCK_T, E_COLS], dtype=tl.float32)
        for k0 in tl.range(0, hidden_size, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden_size
            a = tl.load(x_rows + offs_k[None, :], mask=token_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(gate_rows + offs_k[None, :], mask=expert_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:   # float32 operands: no TF32 rounding, as the float32 gate
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        logits = logits_ptr + tokens.to(tl.int64)[:, None] * num_experts + experts[None, :]
        tl.store(logits, acc, mask=token_ok[:, None] & expert_ok[None, :])
        if ROUTE:
            tl.debug_barrier()   # the routing below reads the rows back through other threads
            # Then the routing kernels' own body, ROUTE_T tokens at a time, on rows
            # this program has just written (in L2, not yet in DRAM).
            for t0 in range(first, first + BLOCK_T, ROUTE_T):
                if GROUPED:
                    route_grouped_tokens(logits_ptr, bias_ptr, weights_ptr, ids_ptr, t0, num_tokens, num_experts,
                                         num_groups, experts_per_group, topk_group, topk, renormalize, scale,
                                         USE_SIGMOID, HAS_BIAS, PRECISE, ROUTE_T, G_PAD, S_PAD, K_PAD, SORTED)
                else:
                    route_tokens(logits_ptr, weights_ptr, ids_ptr, t0, num_tokens, num_experts, num_experts, topk,
                                 renormalize, scale, USE_SIGMOID, PRECISE, ROUTE_T, ROUTE_COLS, K_PAD, SORTED)


def gate_and_route_tiles(hidden_states: torch.Tensor, gate_weight: torch.Tensor, topk: int, renormalize: bool,
                         scoring_func: str = "softmax", *, num_expert_group: int | None = None,
                         topk_group: int | None = None, routed_scaling_factor: float = 1.0,
                         e_score_correction_bias: torch.Tensor | None = None, block_t: int | None = None,
                         sorted_topk: bool | str | None = None):
    """The router in one launch of whole-``E`` tiles: ``(topk_weights float32 [T, k], topk_ids int32 [T, k],
    logits float32 [T, E])``, with the arguments and checks of
    :func:`~moe_kernels.kernels.gate_routing.gate_and_route`. ``block_t``: tokens per program, one of
    :data:`TILE_CHOICES` (default :func:`tile_router_tiles`'s); ``sorted_topk``: the top-k by one
    partial sort (True), k rounds of argmax (False) or of one reduction over packed keys ("keyed"),
    default :data:`~moe_kernels.kernels.routing.TOPK_BY_SORT`: the same ids, the same weights to float32's
    last bit on a GPU."""
    func = "gate_and_route_tiles"
    _check(func, hidden_states, gate_weight, topk, renormalize, scoring_func, num_expert_group, topk_group,
           routed_scaling_factor, e_score_correction_bias)
    if sorted_topk is not None and not (isinstance(sorted_topk, bool) or (isinstance(sorted_topk, str)
                                                                          and sorted_topk == "keyed")):
        fail(func, "sorted_topk", 'must be None, a bool or "keyed"', repr(sorted_topk), TypeError)
    _check_tile(func, hidden_states.shape[0], gate_weight, block_t)
    return gate_and_route_tiles_checked(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                        num_expert_group=num_expert_group, topk_group=topk_group,
                                        routed_scaling_factor=routed_scaling_factor,
                                        e_score_correction_bias=e_score_correction_bias, block_t=block_t,
                                        sorted_topk=sorted_topk)


def _check_tile(func, num_tokens, gate_weight, block_t) -> None:
    """The tile fits: at most :data:`MAX_EXPERTS` experts, and ``block_t`` (or the default's) times E padded
    within :data:`_MAX_TILE_LOGITS` logits."""
    if block_t is not None and (type(block_t) is not int or block_t not in TILE_CHOICES):
        fail(func, "block_t", f"must be None or one of {TILE_CHOICES}", repr(block_t))
    num_experts = gate_weight.shape[0]
    if num_experts > MAX_EXPERTS:
        fail(func, "gate_weight", f"must have at most {MAX_EXPERTS} experts (rows: every tile holds all of them)",
             f"{num_experts} rows")
    tiles = tile_router_tiles(num_tokens, num_experts, gate_weight.shape[1], block_t=block_t)
    if tiles["block_t"] * tiles["e_cols"] > _MAX_TILE_LOGITS:
        fail(func, "block_t", f"must keep the [block_t, E] tile within {_MAX_TILE_LOGITS} logits, E padded to a "
             f"power of two ({tiles['e_cols']})", tiles["block_t"])


def gate_and_route_tiles_checked(hidden_states, gate_weight, topk, renormalize, scoring_func="softmax", *,
                                 num_expert_group=None, topk_group=None, routed_scaling_factor=1.0,
                                 e_score_correction_bias=None, block_t=None, sorted_topk=None):
    """:func:`gate_and_route_tiles` for arguments already checked (a layer checks its routing once)."""
    launch = functools.partial(_launch, block_t=block_t, sorted_topk=routing.TOPK_BY_SORT if sorted_topk is None
                               else sorted_topk)
    weights, ids, logits, _ = _gate_route(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                          num_expert_group, topk_group, routed_scaling_factor,
                                          e_score_correction_bias, None, launch, "gate_and_route_tiles", 0)
    return weights, ids, logits


def tile_gate(hidden_states: torch.Tensor, gate_weight: torch.Tensor, *, block_t: int | None = None) -> torch.Tensor:
    """The gate alone on the same tiles: float32 logits ``[T, E]`` (the kernel without its routing), the
    products of :func:`~moe_kernels.kernels.routing.gate` summed in another order. For timing the tiles'
    GEMM against cuBLAS's.

        >>> tile_gate(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0], [0.5, 0.5]])).tolist()
        [[1.0, 1.5]]
    """
    func = "tile_gate"
    _check(func, hidden_states, gate_weight, 1, True, "softmax", None, None, 1.0, None)
    _check_tile(func, hidden_states.shape[0], gate_weight, block_t)
    if not use_triton(hidden_states, gate_weight):
        return (hidden_states.double() @ gate_weight.double().T).float()
    if interpreted_bf16(hidden_states, gate_weight):   # (the interpreter's bf16 dot: see gate_routing)
        hidden_states, gate_weight = hidden_states.float(), gate_weight.float()
    num_tokens, num_experts = hidden_states.shape[0], gate_weight.shape[0]
    logits = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=hidden_states.device)
    if num_tokens:
        _launch(hidden_states, gate_weight, None, 1, True, "softmax", None, None, 1.0, logits, logits, logits, None,
                block_t=block_t, sorted_topk=False, route=False)
    return logits


def _launch(hidden_states, gate_weight, bias, topk, renormalize, scoring_func, num_expert_group, topk_group,
            routed_scaling_factor, weights, ids, logits, alignment, *, block_t, sorted_topk, route=True):
    num_tokens, hidden_size = hidden_states.shape
    num_experts = gate_weight.shape[0]
    grouped, groups, per_group, g_pad, s_pad, route_cols = rule_columns(num_experts, num_expert_group, bias)
    tiles = tile_router_tiles(num_tokens, num_experts, hidden_size, block_t=block_t)
    route_t = max(1, min(tiles["block_t"], _TILE_ELEMENTS // route_cols))
    note_launch("tile_routing.gate_and_route_tiles" if route else "tile_routing.tile_gate", grouped=grouped,
                block_t=tiles["block_t"], programs=tiles["programs"], warps=tiles["warps"], route_t=route_t,
                sorted_topk=sorted_topk)
    _tile_router_kernel[(tiles["programs"],)](
        hidden_states, gate_weight, bias if bias is not None else logits, logits, weights, ids,
        num_tokens, num_experts, hidden_size, hidden_states.stride(0), gate_weight.stride(0),
        topk, renormalize, float(routed_scaling_factor), groups, per_group, topk_group or 1,
        GROUPED=grouped, HAS_BIAS=bias is not None, USE_SIGMOID=scoring_func == "sigmoid", PRECISE=not INTERPRET,
        SORTED=sorted_topk, IEEE=hidden_states.dtype == torch.float32, BLOCK_T=tiles["block_t"],
        E_COLS=tiles["e_cols"], BLOCK_K=tiles["block_k"], STAGES=tiles["stages"], ROUTE_T=route_t,
        ROUTE_COLS=route_cols, G_PAD=g_pad, S_PAD=s_pad, K_PAD=next_power_of_2(topk), ROUTE=route,
        num_warps=tiles["warps"],
    )
