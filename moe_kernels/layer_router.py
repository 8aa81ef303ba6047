"""Which router a layer call runs, and running it: the gate, the routing and, where it can, the alignment.

Four routers give the same ids (:mod:`moe_kernels.kernels.gate_routing` and
:mod:`moe_kernels.kernels.chained_routing` add the gate's partial products in a fixed order; the
two-step path's cuBLAS gate and :mod:`moe_kernels.kernels.tile_routing`'s tiles may break a near-tie
the other way, as any two float32 GEMMs may):

* the two steps: the gate on tensor cores (:func:`~moe_kernels.kernels.routing.router_logits`), then
  the rule's routing kernel, then, for an aligned block map, the alignment kernel;
* one launch (:func:`~moe_kernels.kernels.gate_routing.gate_and_route`): the split gate whose last
  program routes, up to :data:`GATE_ROUTING_MAX_TOKENS` (off: slower on the H200);
* launches chained by PDL (:func:`~moe_kernels.kernels.chained_routing.gate_route_chained`): the split
  gate, one routing program per token and the alignment, up to :data:`CHAINED_ROUTER_MAX_TOKENS`;
* at prefill, one launch of whole-E tiles (:func:`~moe_kernels.kernels.tile_routing.gate_and_route_tiles`),
  from :data:`TILE_ROUTER_MIN_TOKENS` past the chain's reach (:func:`choose_tile_router`; measured slower: off).

A worked choice (Qwen3-30B-A3B's top-8, a bf16 gate for bf16 activations, an aligned block map)::

    >>> choose_router(64, True, 8, True)   # (gate_routing, gate_alignment, chained)
    (True, True, True)
    >>> choose_router(1024, True, 8, True)   # past the chained router's reach: the two steps
    (False, False, False)
"""

from __future__ import annotations

from ._checks import env_int
from .kernels import chained_routing, gate_routing, tile_routing
from .kernels.blocks import aligned_blocks
from .kernels.index_gather import gemm1_launches_first
from .kernels.routing import router_logits

__all__ = ["CHAINED_ROUTER_MAX_TOKENS", "GATE_ROUTING_MAX_TOKENS", "ROUTER_LAUNCHES_GEMM1", "TILE_ROUTER_MIN_TOKENS",
           "choose_router", "choose_tile_router", "gemm1_follows_router", "route"]

#: Up to this many tokens the router is :mod:`moe_kernels.kernels.chained_routing`'s launches chained by
#: PDL (the split gate, one routing program per token, the alignment) instead of the cuBLAS gate, the
#: routing kernel and the alignment kernel: all of the chain's reach. Timed on the H200
#: (``gate-routing.json`` at 1acf7da, CUDA graphs, L2 warm, with the alignment): 5.5-13.0 us against
#: 12.5-20.4 for Qwen3-30B-A3B at 1-512 tokens, 7.7-22.3 against 17.2-28.5 for DeepSeek-V3 (its gate in
#: 64-token blocks from 128 tokens). ``MOE_KERNELS_CHAINED_ROUTER_MAX_TOKENS`` sets it for a process.
CHAINED_ROUTER_MAX_TOKENS = env_int("MOE_KERNELS_CHAINED_ROUTER_MAX_TOKENS", 512)
#: Up to this many tokens (taking precedence) the router is one launch
#: (:func:`~moe_kernels.kernels.gate_routing.gate_and_route`, an arrival counter per token block): 0,
#: off, slower than the two steps on the H200 (``gate-routing.json`` at 1acf7da: DeepSeek-V3 at one
#: token 20.0 against 12.4 us). ``MOE_KERNELS_GATE_ROUTING_MAX_TOKENS`` sets it for a process.
GATE_ROUTING_MAX_TOKENS = env_int("MOE_KERNELS_GATE_ROUTING_MAX_TOKENS", 0)
#: From this many tokens, where neither router above runs, the gate and the routing are one launch of
#: whole-E tiles (:mod:`moe_kernels.kernels.tile_routing`) instead of the cuBLAS gate and the routing kernel:
#: 0, off: on an H100 (``tile-router-ab-s42.json``, Qwen3-30B-A3B) its default tiles took 1.14-1.71 times the two
#: steps' time at 1,024-16,384 tokens (64-token blocks 0.97 times at 16,384 only).
#: ``MOE_KERNELS_TILE_ROUTER_MIN_TOKENS`` sets it for a process.
TILE_ROUTER_MIN_TOKENS = env_int("MOE_KERNELS_TILE_ROUTER_MIN_TOKENS", 0)
#: Whether the chained router's last launch lets GEMM 1 launch early, GEMM 1 a programmatic dependent that waits for
#: the router's memory (issue 19's PDL between the router and the GEMMs), where nothing runs between the two
#: (:func:`gemm1_follows_router`). Off until timed on a GPU. ``MOE_KERNELS_ROUTER_LAUNCHES_GEMM1`` (0 or 1) sets it
#: for a process; a change later reaches only calls not yet recorded (``moe_kernels._replay.forget_all_plans()``
#: forgets the recorded ones and their graphs).
ROUTER_LAUNCHES_GEMM1 = env_int("MOE_KERNELS_ROUTER_LAUNCHES_GEMM1", 0) == 1


def choose_router(num_tokens: int, gate_in_activation_dtype: bool, top_k: int, alignable: bool):
    """``(gate_routing, gate_alignment, chained)`` for a call at ``num_tokens`` tokens: whether the gate
    and the routing run as one router (a launch or a chain; only with the gate in the activations'
    dtype, as checkpoints store it), whether that router aligns the ids too (``alignable``: an aligned
    index-gather block map whose ids are the router's, i.e. no shared expert fused as slot E after the
    routing, and not the one-launch GEMMs; at most the router's ``ALIGN_MAX_ASSIGNMENTS``), and whether
    it is the chained one."""
    one_launch = 0 < num_tokens <= GATE_ROUTING_MAX_TOKENS
    chained = not one_launch and 0 < num_tokens <= min(CHAINED_ROUTER_MAX_TOKENS, chained_routing.MAX_TOKENS)
    fused = (one_launch or chained) and gate_in_activation_dtype
    router = chained_routing if chained else gate_routing
    aligned = fused and alignable and num_tokens * top_k <= router.ALIGN_MAX_ASSIGNMENTS
    return fused, aligned, fused and chained


def choose_tile_router(num_tokens: int, gate_in_activation_dtype: bool, gate_routing: bool, num_experts: int) -> bool:
    """Whether a call at ``num_tokens`` routes with the tile router: from :data:`TILE_ROUTER_MIN_TOKENS`
    (when set), with the gate in the activations' dtype, where :func:`choose_router` took no router
    (``gate_routing`` False), for at most :data:`~moe_kernels.kernels.tile_routing.MAX_EXPERTS` experts.

        >>> choose_tile_router(16384, True, False, 128)   # off by default
        False
    """
    return (0 < TILE_ROUTER_MIN_TOKENS <= num_tokens and gate_in_activation_dtype and not gate_routing
            and num_experts <= tile_routing.MAX_EXPERTS)


def gemm1_follows_router(plan, *, quantize: bool, launches_between: bool) -> bool:
    """Whether GEMM 1 takes a programmatic dependent launch behind the chained router
    (:data:`ROUTER_LAUNCHES_GEMM1`): on index-gather, after the chained router, with no launch between the two: no
    activation quantiser (``quantize``), no shared expert in line and no shared gate (``launches_between``), no shared
    slot, and GEMM 1 the experts call's first launch
    (:func:`~moe_kernels.kernels.index_gather.gemm1_launches_first`: a block map the router made or the naive one, no
    zeroed fp32 sum, an unsplit GEMM 1 of its own). Elsewhere the trigger would let no dependent start: the launch
    after the router is a plain one, which waits for it whole.

        >>> from types import SimpleNamespace
        >>> plan = SimpleNamespace(chained=True, layout="index_gather", shared_slot=False)
        >>> gemm1_follows_router(plan, quantize=True, launches_between=False)   # (off; and fp8 quantises first)
        False
    """
    return bool(ROUTER_LAUNCHES_GEMM1 and plan.chained and plan.layout == "index_gather" and not plan.shared_slot
                and not quantize and not launches_between and gemm1_launches_first(
                    plan.config, plan.format, blocks_given=plan.gate_alignment, naive=bool(plan.naive_blocks),
                    activations_given=False))


def route(plan, hidden_states, weights, routing, *, launch_next: bool = False):
    """The call's ``(topk_weights, topk_ids, blocks)``: ``blocks`` the aligned block map when the router
    aligned the ids (``plan.gate_alignment``), else None (the experts then build their own). ``launch_next``: the
    chained router lets the next launch (GEMM 1) start early (:func:`gemm1_follows_router`)."""
    w = weights
    rule = dict(num_expert_group=routing.num_expert_group, routed_scaling_factor=routing.routed_scaling_factor,
                topk_group=routing.topk_group if routing.num_expert_group is not None or w.bias is not None else None,
                e_score_correction_bias=w.bias)
    args = (hidden_states, w.gate, routing.top_k, routing.renormalize, routing.scoring_func)
    if plan.tile_router:
        return (*tile_routing.gate_and_route_tiles_checked(*args, **rule)[:2], None)
    if not plan.gate_routing:
        logits = router_logits(hidden_states, w.gate)
        return (*routing.route(hidden_states, logits, w.bias, checked=True), None)
    block_size = plan.config.block_m if plan.gate_alignment else None
    if plan.chained:
        topk_weights, topk_ids, _, *alignment = chained_routing.gate_route_chained_checked(
            *args, block_size=block_size, launch_next=launch_next, **rule)
    elif plan.gate_alignment:   # the router's launch aligns its ids too
        topk_weights, topk_ids, _, *alignment = gate_routing.gate_route_and_align_checked(
            *args, block_size=block_size, **rule)
    else:
        topk_weights, topk_ids, _ = gate_routing.gate_and_route_checked(*args, **rule)
    blocks = None
    if plan.gate_alignment:
        blocks = aligned_blocks(*alignment, block_size, topk_ids.numel(), w.num_experts)
    return topk_weights, topk_ids, blocks
