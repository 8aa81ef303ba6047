"""The gate and the routing in one launch: ``hidden_states @ gate.T``, then top-k (plain or grouped).

At decode the router is two small launches, the gate's GEMM and the routing kernel, each with its
own fixed cost; the gate alone reads the ``[E, d]`` gate matrix (3.7 MB for DeepSeek-V3) with a
handful of tokens. :func:`gate_and_route` does both in one launch:

* the grid tiles the logits ``[T, E]`` by token blocks of ``BLOCK_T`` and expert blocks of
  ``BLOCK_E``, and splits ``d`` into ``SPLIT_K`` spans, so that even one token spreads the gate's
  bytes over many SMs (64 programs for Qwen3-30B-A3B's 0.5 MB gate, 112 for DeepSeek-V3's 3.7 MB);
* each program writes its float32 partial logits to a scratch ``[SPLIT_K, T, E]`` and counts
  itself in with an atomic add on its token block's arrival counter;
* the last program to arrive for a token block (it sees ``E_BLOCKS * SPLIT_K - 1`` arrivals before
  its own) adds the ``SPLIT_K`` partials in a fixed order (the logits are deterministic, whatever
  order the programs ran in), writes them to ``[T, E]`` and routes its tokens with the same code
  as the routing kernels (:func:`~moe_kernels.kernels.routing.route_tokens`,
  :func:`~moe_kernels.kernels.grouped_routing.route_grouped_tokens`).

:func:`gate_route_and_align` adds the alignment to the same launch: each token block's last program,
once it has routed its tokens, counts itself in on one more counter (token blocks routed); the last
token block to arrive aligns every token's ids as one program, with the alignment kernel's own body
(:mod:`moe_kernels.kernels.align`, reading the ids the other SMs wrote through L2). Gate, routing and
alignment are then one launch where they were three.

The gate's products are those of :func:`~moe_kernels.kernels.routing.gate` on a GPU: 16-bit
operands on the tensor cores, float32 sums (in another order: near-ties between experts may break
the other way, as between any two float32 GEMMs); float32 operands are multiplied in IEEE float32.

The arrival counters are zeroed by a fill before the launch (a memset node in a CUDA graph). A
buffer kept between calls and reset by the kernel would save it, but calls on two streams would
then share it, and so would every replay and CUDA graph of a recorded layer call
(:mod:`moe_kernels._replay` keeps a tensor made outside the call as a constant).

A worked example, four experts, one token, top-2, checked against the two-step path::

    >>> import torch
    >>> from moe_kernels.kernels.routing import fused_topk, gate
    >>> x = torch.tensor([[1.0, 2.0]])
    >>> gate_weight = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, -1.0], [2.0, 0.0]])
    >>> weights, ids, logits = gate_and_route(x, gate_weight, topk=2, renormalize=True)
    >>> logits.tolist(), ids.tolist()
    ([[1.0, 1.5, -2.0, 2.0]], [[3, 1]])
    >>> two_steps = fused_topk(x, gate(x, gate_weight), 2, True)
    >>> torch.equal(ids, two_steps[1]) and torch.allclose(weights, two_steps[0])
    True
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_number, check_tensor, fail
from .._runtime import HAS_TRITON, INTERPRET, cdiv, interpreted_bf16, kernel, next_power_of_2, note_launch, tl, use_triton
from .align import (_COUNT_TILE, _FILL_TILE, _SINGLE_TILE, align_bins_and_pad_tile, align_checked,
                    alignment_buffer_sizes, empty_alignment, moe_align_block_size_reference)
from .gate_grid import BLOCK_T, gate_tiles
from .grouped_routing import grouped_topk_reference
from .routing import _FLOAT_DTYPES, _SCORING_FUNCS, _empty_outputs, fused_topk_reference

__all__ = ["gate_and_route", "gate_and_route_checked", "gate_and_route_reference", "gate_route_and_align",
           "gate_route_and_align_checked"]

#: Most assignments (T * k) :func:`gate_route_and_align` aligns inside its launch, in one program
#: that ranks them 64 at a time (the alignment kernel places 64 per program): 1,024 is 128 tokens
#: of Qwen3-30B-A3B or DeepSeek-V3. Above it (and with no tokens) the alignment is a launch of its
#: own. Timed on the H200 (``gate-routing.json``): the one program aligning 512 assignments (64
#: tokens) added 22-23 us to the launch, where the alignment's own launch adds 5-6; at 1,024, 51-65.
ALIGN_MAX_ASSIGNMENTS = 1024

if HAS_TRITON:
    from .align import _align_program
    from .grouped_routing import route_grouped_tokens
    from .routing import route_tokens

    @kernel
    def store_gate_partial(x_ptr, gate_ptr, partial_ptr, num_tokens, num_experts, hidden_size, stride_x, stride_gate,
                           k_span, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """Program ``(token block, expert block, span of d)``'s float32 partial logits, stored at
        ``partial[span, tokens, experts]`` (also the first launch of
        :mod:`moe_kernels.kernels.chained_routing`)."""
        pid_t, pid_e, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        token_ok, expert_ok = tokens < num_tokens, experts < num_experts

        # >>> book: gate-partial
        # This program's share of the logits:
        # BLOCK_T tokens x BLOCK_E experts over one span of d.
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        k_start = pid_k * k_span
        for k0 in range(k_start, k_start + k_span, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden_size
            x_rows = tokens.to(tl.int64)[:, None] * stride_x
            a = tl.load(x_ptr + x_rows + offs_k[None, :],
                        mask=token_ok[:, None] & k_ok[None, :], other=0.0)
            gate_rows = experts.to(tl.int64)[:, None] * stride_gate
            b = tl.load(gate_ptr + gate_rows + offs_k[None, :],
                        mask=expert_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:   # float32 operands: no TF32 rounding, as the float32 gate
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        partial_rows = (pid_k * num_tokens + tokens.to(tl.int64)[:, None]) * num_experts
        partial = partial_ptr + partial_rows + experts[None, :]
        tl.store(partial, acc, mask=token_ok[:, None] & expert_ok[None, :])
        # <<< book: gate-partial

    @kernel
    def add_partials_and_route(partial_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, first_token, num_tokens,
                               num_experts, topk, renormalize, scale, num_groups, experts_per_group, topk_group,
                               GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SIGMOID: tl.constexpr,
                               PRECISE: tl.constexpr, SORTED: tl.constexpr, BLOCK_T: tl.constexpr,
                               SPLIT_K: tl.constexpr, E_COLS: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr,
                               K_PAD: tl.constexpr):
        """Tokens ``first_token`` to ``first_token + BLOCK_T``: their logits, the ``SPLIT_K`` partials
        added in a fixed order (the logits are deterministic, whatever order the programs that wrote
        them ran in), stored, then routed by the routing kernels' own body."""
        tokens = first_token + tl.arange(0, BLOCK_T)
        columns = tl.arange(0, E_COLS)
        mask = (tokens < num_tokens)[:, None] & (columns < num_experts)[None, :]
        offsets = tokens.to(tl.int64)[:, None] * num_experts + columns[None, :]
        logits = tl.zeros([BLOCK_T, E_COLS], dtype=tl.float32)
        # Unrolled, so that every partial's load is in flight at once (read from L2, ``.cg``: other
        # SMs wrote them); a loop would wait for each in turn.
        for split in tl.static_range(SPLIT_K):
            logits += tl.load(partial_ptr + split * num_tokens * num_experts + offsets, mask=mask, other=0.0,
                              cache_modifier=".cg")
        tl.store(logits_ptr + offsets, logits, mask=mask)
        tl.debug_barrier()   # the routing below reads them back through other threads
        if GROUPED:
            route_grouped_tokens(logits_ptr, bias_ptr, weights_ptr, ids_ptr, first_token, num_tokens,
                                 num_experts, num_groups, experts_per_group, topk_group, topk, renormalize,
                                 scale, USE_SIGMOID, HAS_BIAS, PRECISE, BLOCK_T, G_PAD, S_PAD, K_PAD, SORTED)
        else:
            route_tokens(logits_ptr, weights_ptr, ids_ptr, first_token, num_tokens, num_experts,
                         num_experts, topk, renormalize, scale, USE_SIGMOID, PRECISE, BLOCK_T, E_COLS, K_PAD, SORTED)

    @kernel
    def _gate_routing_kernel(
        x_ptr, gate_ptr, bias_ptr, partial_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr,
        sorted_ids_ptr, expert_ids_ptr, used_ptr,
        num_tokens, num_experts, hidden_size, stride_x, stride_gate, k_span,
        topk, renormalize, scale, num_groups, experts_per_group, topk_group, block_size,
        GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SIGMOID: tl.constexpr, PRECISE: tl.constexpr,
        IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, E_COLS: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr,
        K_PAD: tl.constexpr, ALIGN: tl.constexpr, NUM_BINS: tl.constexpr, ALIGN_TILE: tl.constexpr,
        PAD_TILE: tl.constexpr, COUNT_TILE: tl.constexpr, FILL_TILE: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        store_gate_partial(x_ptr, gate_ptr, partial_ptr, num_tokens, num_experts, hidden_size, stride_x, stride_gate,
                           k_span, IEEE, BLOCK_T, BLOCK_E, BLOCK_K)
        # Every thread's stores, then one release: the last program to arrive sees them all.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) * SPLIT_K - 1:
            # Thread 0's acquire, carried to every thread of the program before any of them reads.
            tl.debug_barrier()
            add_partials_and_route(partial_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, pid_t * BLOCK_T, num_tokens,
                                   num_experts, topk, renormalize, scale, num_groups, experts_per_group, topk_group,
                                   GROUPED, HAS_BIAS, USE_SIGMOID, PRECISE, False, BLOCK_T, SPLIT_K, E_COLS, G_PAD,
                                   S_PAD, K_PAD)
            if ALIGN:
                # >>> book: gate-align
                # The alignment needs every token's ids: the last token block to finish
                # routing aligns them all, as one program (the alignment kernel's own body).
                tl.debug_barrier()
                t_blocks = tl.num_programs(0)
                routed = tl.atomic_add(arrivals_ptr + t_blocks, 1, sem="acq_rel", scope="gpu")
                if routed == t_blocks - 1:
                    tl.debug_barrier()
                    numel = num_tokens * topk
                    _align_program(0, 1, ids_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, used_ptr,
                                   numel, num_experts, block_size, numel, False, NUM_BINS,
                                   ALIGN_TILE, COUNT_TILE, 1, PAD_TILE, FILL_TILE, "", ".cg")
                # <<< book: gate-align


def _check(func, hidden_states, gate_weight, topk, renormalize, scoring_func, num_expert_group, topk_group,
           routed_scaling_factor, e_score_correction_bias, dtypes=_FLOAT_DTYPES) -> None:
    check_tensor(func, "hidden_states", hidden_states, ndim=2, dtypes=dtypes, last_dim_contiguous=True)
    check_tensor(func, "gate_weight", gate_weight, ndim=2, dtypes=(hidden_states.dtype,),
                 device=hidden_states.device, last_dim_contiguous=True)
    num_experts, hidden_size = gate_weight.shape
    check_int(func, "hidden_states.shape[1]", hidden_states.shape[1], lo=1)
    if hidden_size != hidden_states.shape[1]:
        fail(func, "gate_weight", f"must be [E, {hidden_states.shape[1]}] (d of hidden_states)",
             f"shape {tuple(gate_weight.shape)}")
    check_int(func, "num_experts", num_experts, lo=1)
    if not isinstance(renormalize, bool):
        fail(func, "renormalize", "must be a bool", type(renormalize).__name__, TypeError)
    if scoring_func not in _SCORING_FUNCS:
        fail(func, "scoring_func", "must be 'softmax' or 'sigmoid'", repr(scoring_func))
    check_number(func, "routed_scaling_factor", routed_scaling_factor, gt=0)
    grouped = num_expert_group is not None or e_score_correction_bias is not None
    if not grouped:
        check_int(func, "topk", topk, lo=1, hi=num_experts, what_hi="the number of experts, gate_weight.shape[0]")
        if topk_group is not None:
            fail(func, "topk_group", "must be None without num_expert_group", repr(topk_group))
        return
    # The grouped rule's own checks, on the logits' shape (an empty [0, E] stands in for them).
    from .grouped_routing import _check_grouped

    _check_grouped(func, gate_weight.new_empty((0, num_experts)), topk, num_expert_group or 1, topk_group or 1,
                   routed_scaling_factor, e_score_correction_bias)


def gate_and_route_reference(hidden_states, gate_weight, topk, renormalize, scoring_func="softmax", *,
                             num_expert_group=None, topk_group=None, routed_scaling_factor=1.0,
                             e_score_correction_bias=None):
    """Torch reference for :func:`gate_and_route`: the gate in float64 (its logits returned in float64),
    then the routing rule's float32 reference on them. Takes float64 inputs too."""
    _check("gate_and_route_reference", hidden_states, gate_weight, topk, renormalize, scoring_func,
           num_expert_group, topk_group, routed_scaling_factor, e_score_correction_bias,
           dtypes=(*_FLOAT_DTYPES, torch.float64))
    logits = hidden_states.double() @ gate_weight.double().T
    if num_expert_group is None and e_score_correction_bias is None:
        weights, ids = fused_topk_reference(hidden_states, logits.float(), topk, renormalize, scoring_func)
        return weights * routed_scaling_factor, ids, logits
    weights, ids = grouped_topk_reference(hidden_states, logits.float(), topk, renormalize, num_expert_group or 1,
                                          topk_group or 1, scoring_func, routed_scaling_factor,
                                          e_score_correction_bias)
    return weights, ids, logits


def gate_and_route(hidden_states: torch.Tensor, gate_weight: torch.Tensor, topk: int, renormalize: bool,
                   scoring_func: str = "softmax", *, num_expert_group: int | None = None,
                   topk_group: int | None = None, routed_scaling_factor: float = 1.0,
                   e_score_correction_bias: torch.Tensor | None = None):
    """The router in one launch: ``(topk_weights float32 [T, k], topk_ids int32 [T, k], logits float32 [T, E])``.

    ``gate_weight`` is ``[E, d]`` in the dtype of ``hidden_states [T, d]``. The routing rule is
    :func:`~moe_kernels.kernels.routing.fused_topk`'s (then the weights times
    ``routed_scaling_factor``), or, with ``num_expert_group`` or ``e_score_correction_bias``,
    :func:`~moe_kernels.kernels.grouped_routing.grouped_topk`'s, with the same arguments and checks.
    Meant for decode batches: every token block re-reads the gate matrix (from L2 after the first),
    so from a few hundred tokens the two-step path (a GEMM, then the routing kernel) reads less.
    """
    func = "gate_and_route"
    _check(func, hidden_states, gate_weight, topk, renormalize, scoring_func, num_expert_group, topk_group,
           routed_scaling_factor, e_score_correction_bias)
    return gate_and_route_checked(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                  num_expert_group=num_expert_group, topk_group=topk_group,
                                  routed_scaling_factor=routed_scaling_factor,
                                  e_score_correction_bias=e_score_correction_bias)


def gate_and_route_checked(hidden_states, gate_weight, topk, renormalize, scoring_func="softmax", *,
                           num_expert_group=None, topk_group=None, routed_scaling_factor=1.0,
                           e_score_correction_bias=None):
    """:func:`gate_and_route` for arguments already checked (a layer checks its routing once)."""
    weights, ids, logits, _ = _gate_route(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                          num_expert_group, topk_group, routed_scaling_factor,
                                          e_score_correction_bias, None)
    return weights, ids, logits


def gate_route_and_align(hidden_states: torch.Tensor, gate_weight: torch.Tensor, topk: int, renormalize: bool,
                         scoring_func: str = "softmax", *, block_size: int, num_expert_group: int | None = None,
                         topk_group: int | None = None, routed_scaling_factor: float = 1.0,
                         e_score_correction_bias: torch.Tensor | None = None):
    """:func:`gate_and_route` and then the alignment of its ids into blocks of ``block_size`` rows,
    in the same launch: ``(topk_weights, topk_ids, logits, sorted_token_ids, expert_ids,
    num_tokens_post_padded)``, the last three exactly as
    :func:`~moe_kernels.kernels.align.moe_align_block_size` returns them for ``topk_ids``.

    The last token block to finish routing aligns every assignment in one program (the alignment
    kernel's own body, reading the ids from L2), so the router and the alignment cost one launch.
    One program places :data:`ALIGN_MAX_ASSIGNMENTS` assignments at most; above that, and with no
    tokens, the alignment runs as its own launch (same result).

        >>> x = torch.tensor([[1.0, 2.0], [0.0, 1.0], [2.0, 0.0]])
        >>> gate_weight = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, -1.0], [2.0, 0.0]])
        >>> *_, sorted_ids, expert_ids, used = gate_route_and_align(x, gate_weight, 2, True, block_size=2)
        >>> int(used), sorted_ids[: int(used)].tolist(), expert_ids[: int(used) // 2].tolist()
        (6, [3, 5, 1, 2, 0, 4], [0, 1, 3])
    """
    func = "gate_route_and_align"
    _check(func, hidden_states, gate_weight, topk, renormalize, scoring_func, num_expert_group, topk_group,
           routed_scaling_factor, e_score_correction_bias)
    alignment_buffer_sizes(func, hidden_states.new_empty((hidden_states.shape[0], topk), dtype=torch.int32),
                           block_size, gate_weight.shape[0])
    return gate_route_and_align_checked(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                        block_size=block_size, num_expert_group=num_expert_group,
                                        topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
                                        e_score_correction_bias=e_score_correction_bias)


def gate_route_and_align_checked(hidden_states, gate_weight, topk, renormalize, scoring_func="softmax", *,
                                 block_size, num_expert_group=None, topk_group=None, routed_scaling_factor=1.0,
                                 e_score_correction_bias=None):
    """:func:`gate_route_and_align` for arguments already checked."""
    weights, ids, logits, alignment = _gate_route(hidden_states, gate_weight, topk, renormalize, scoring_func,
                                                  num_expert_group, topk_group, routed_scaling_factor,
                                                  e_score_correction_bias, block_size)
    return (weights, ids, logits, *alignment)


def _gate_route(hidden_states, gate_weight, topk, renormalize, scoring_func, num_expert_group, topk_group,
                routed_scaling_factor, bias, block_size, launch=None, caller="gate_route_and_align", align_max=None):
    """The launch (or the torch fallback): weights, ids, logits and, when ``block_size`` is given,
    the alignment ``(sorted_token_ids, expert_ids, num_tokens_post_padded)`` (else None). ``launch``:
    another router's launch, with this one's arguments (:mod:`moe_kernels.kernels.chained_routing`'s), which
    aligns up to ``align_max`` assignments (default :data:`ALIGN_MAX_ASSIGNMENTS`)."""
    num_tokens, hidden_size = hidden_states.shape
    num_experts = gate_weight.shape[0]
    if not use_triton(hidden_states, gate_weight, *([bias] if bias is not None else [])):
        weights, ids, logits = gate_and_route_reference(
            hidden_states, gate_weight, topk, renormalize, scoring_func, num_expert_group=num_expert_group,
            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, e_score_correction_bias=bias)
        alignment = None if block_size is None else moe_align_block_size_reference(ids, block_size, num_experts)
        return weights, ids, logits.float(), alignment
    if interpreted_bf16(hidden_states, gate_weight):
        # The interpreter's bf16 dot is wrong (triton issue 11584); the products of bf16 numbers are
        # exact in float32, so float32 operands compute the same logits.
        hidden_states, gate_weight = hidden_states.float(), gate_weight.float()
    device = hidden_states.device
    weights, ids = _empty_outputs(num_tokens, topk, device)
    logits = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=device)
    numel = num_tokens * topk
    align_here = block_size is not None and 0 < numel <= (ALIGN_MAX_ASSIGNMENTS if align_max is None else align_max)
    alignment = empty_alignment(numel, block_size, num_experts, device) if align_here else None
    if num_tokens > 0:
        (launch or _launch)(hidden_states, gate_weight, bias, topk, renormalize, scoring_func, num_expert_group,
                            topk_group, routed_scaling_factor, weights, ids, logits,
                            (*alignment, block_size) if align_here else None)
    if block_size is not None and not align_here:   # no tokens, or more than one program should place
        alignment = align_checked(caller, ids, block_size, num_experts, False)
    return weights, ids, logits, alignment


def rule_columns(num_experts: int, num_expert_group, bias) -> tuple:
    """What the routing bodies' launches need of the rule: ``(grouped, groups, per_group, g_pad, s_pad,
    e_cols)``: grouped (DeepSeek-V3's rule: groups or a bias), the groups and experts per group, each padded
    to a power of two, and the score tile's columns (groups x padded members, or E padded).

        >>> rule_columns(256, 8, None), rule_columns(128, None, None)
        ((True, 8, 32, 8, 32, 256), (False, 1, 128, 1, 128, 128))
    """
    grouped = num_expert_group is not None or bias is not None
    groups = num_expert_group or 1
    per_group = num_experts // groups
    g_pad, s_pad = next_power_of_2(groups), next_power_of_2(per_group)
    return grouped, groups, per_group, g_pad, s_pad, g_pad * s_pad if grouped else next_power_of_2(num_experts)


def _launch(hidden_states, gate_weight, bias, topk, renormalize, scoring_func, num_expert_group, topk_group,
            routed_scaling_factor, weights, ids, logits, alignment):
    num_tokens, hidden_size = hidden_states.shape
    num_experts = gate_weight.shape[0]
    device = hidden_states.device
    grouped, groups, per_group, g_pad, s_pad, e_cols = rule_columns(num_experts, num_expert_group, bias)
    tiles = gate_tiles(num_tokens, num_experts, hidden_size)
    partial = torch.empty((tiles["split_k"], num_tokens, num_experts), dtype=torch.float32, device=device)
    # One arrival counter per token block, and one for the token blocks routed (the alignment's).
    arrivals = torch.zeros(tiles["t_blocks"] + (alignment is not None), dtype=torch.int32, device=device)
    sorted_ids, expert_ids, used, block_size = alignment if alignment is not None else (ids, ids, ids, 1)
    num_bins, pad_tile = align_bins_and_pad_tile(num_experts, block_size)
    note_launch("gate_routing.gate_and_route", grouped=grouped, split_k=tiles["split_k"], block_e=tiles["block_e"],
                programs=tiles["t_blocks"] * tiles["e_blocks"] * tiles["split_k"], aligned=alignment is not None)
    _gate_routing_kernel[(tiles["t_blocks"], tiles["e_blocks"], tiles["split_k"])](
        hidden_states, gate_weight, bias if bias is not None else logits, partial, logits, arrivals, weights, ids,
        sorted_ids, expert_ids, used,
        num_tokens, num_experts, hidden_size, hidden_states.stride(0), gate_weight.stride(0), tiles["k_span"],
        topk, renormalize, float(routed_scaling_factor), groups, per_group, topk_group or 1, block_size,
        GROUPED=grouped, HAS_BIAS=bias is not None, USE_SIGMOID=scoring_func == "sigmoid", PRECISE=not INTERPRET,
        IEEE=hidden_states.dtype == torch.float32, BLOCK_T=BLOCK_T, BLOCK_E=tiles["block_e"],
        BLOCK_K=tiles["block_k"], SPLIT_K=tiles["split_k"], E_COLS=e_cols, G_PAD=g_pad, S_PAD=s_pad,
        K_PAD=next_power_of_2(topk), ALIGN=alignment is not None, NUM_BINS=num_bins, ALIGN_TILE=_SINGLE_TILE,
        PAD_TILE=pad_tile, COUNT_TILE=_COUNT_TILE, FILL_TILE=_FILL_TILE, num_warps=8 if BLOCK_T * e_cols > 2048 else 4,
    )
