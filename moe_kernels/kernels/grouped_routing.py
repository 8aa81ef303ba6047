"""DeepSeek-V3's group-limited routing with a selection-only bias (``grouped_topk``).

The experts form ``num_expert_group`` groups; only the ``topk_group`` best groups may contribute
experts, and an optional per-expert ``e_score_correction_bias`` steers the *selection* while the
*weights* stay the unbiased scores (Wang et al. 2024, auxiliary-loss-free balancing). One Triton
launch per call, beside a float32 torch reference that states the rule line by line; both follow
the tie rule of :mod:`moe_kernels.kernels.routing`.

Grouped, with a bias: experts ``{0,1}`` and ``{2,3}`` form two groups and one group is kept.
The bias makes group ``{2,3}`` win and expert 3 rank first, but the weights are still the plain
sigmoid scores of the chosen experts::

    >>> import torch
    >>> tokens = torch.zeros(1, 16)                  # only its row count is used
    >>> logits = torch.tensor([[1.0, 0.5, 0.0, 0.2]])
    >>> bias = torch.tensor([0.0, 0.0, 0.2, 0.4])
    >>> weights, ids = grouped_topk(tokens, logits, 2, False, num_expert_group=2, topk_group=1,
    ...                             scoring_func="sigmoid", e_score_correction_bias=bias)
    >>> ids.tolist()
    [[3, 2]]
    >>> [round(w, 4) for w in weights[0].tolist()]   # sigmoid(0.2), sigmoid(0.0)
    [0.5498, 0.5]
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_number, check_tensor, fail
from .._runtime import HAS_TRITON, INTERPRET, cdiv, kernel, next_power_of_2, note_launch, tl, use_triton
from . import routing
from .routing import _FLOAT_DTYPES, _check_common, _empty_outputs, _launch_config, _rank_descending, _scores

if HAS_TRITON:
    from .routing import _load_scores, _store_topk, _take_topk
    from .sorted_topk import take_topk_keyed, take_topk_sorted

    @kernel
    def _grouped_topk_kernel(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr,
        num_tokens, logits_row_stride, num_groups, experts_per_group, topk_group, topk,
        renormalize, routed_scaling_factor,
        USE_SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr,
        BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr,
        SORTED: tl.constexpr,
    ):
        """One program routes BLOCK_T tokens over all experts, tiled group by group."""
        route_grouped_tokens(logits_ptr, bias_ptr, weights_ptr, ids_ptr, tl.program_id(0) * BLOCK_T, num_tokens,
                             logits_row_stride, num_groups, experts_per_group, topk_group, topk, renormalize,
                             routed_scaling_factor, USE_SIGMOID, HAS_BIAS, PRECISE, BLOCK_T, G_PAD, S_PAD, K_PAD,
                             SORTED)

    @kernel
    def route_grouped_tokens(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr, first_token,
        num_tokens, logits_row_stride, num_groups, experts_per_group, topk_group, topk,
        renormalize, routed_scaling_factor,
        USE_SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr,
        BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr,
        SORTED: tl.constexpr = False,
    ):
        """Route tokens ``first_token`` to ``first_token + BLOCK_T`` (the routing kernel's body, which
        :mod:`moe_kernels.kernels.gate_routing` also calls once the gate's logits are in). ``SORTED``:
        the top-k by one partial sort (:mod:`moe_kernels.kernels.sorted_topk`), not k rounds; ``"keyed"``: k
        rounds of one reduction over packed keys (the same module); the same ids each way.

        Column ``c`` of the [BLOCK_T, G_PAD * S_PAD] tile is member ``c % S_PAD`` of group
        ``c // S_PAD``: each group is padded on its own, so viewing the tile as
        [BLOCK_T, G_PAD, S_PAD] turns group scores into axis-2 reductions even when the group
        size is not a power of two.
        """
        NO_EXPERT: tl.constexpr = G_PAD * S_PAD
        token = first_token + tl.arange(0, BLOCK_T)[:, None]
        column = tl.broadcast_to(tl.arange(0, NO_EXPERT)[None, :], [BLOCK_T, NO_EXPERT])
        group = column // S_PAD
        member = column % S_PAD
        is_expert = (group < num_groups) & (member < experts_per_group)
        expert = tl.where(is_expert, group * experts_per_group + member, NO_EXPERT)
        scores = _load_scores(logits_ptr, token, expert, is_expert, num_tokens,
                              logits_row_stride, USE_SIGMOID, PRECISE)
        selection = scores
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert, mask=is_expert, other=0.0).to(tl.float32)
            selection = scores + bias
        selection = tl.where(is_expert & (selection == selection), selection, float("-inf"))

        # >>> book: group-mask
        # Group scores: the best member, or (with a bias) the sum of the best two members.
        per_group = tl.reshape(selection, [BLOCK_T, G_PAD, S_PAD])
        top1 = tl.max(per_group, axis=2)
        if HAS_BIAS:
            # The second best is top1 again if two members hold it (a tie counts twice, as
            # torch's topk(2) counts it), else the best of the members below it.
            at_top = per_group == top1[:, :, None]
            holders = tl.sum(at_top.to(tl.int32), axis=2)
            below = tl.max(tl.where(at_top, float("-inf"), per_group), axis=2)
            group_scores = top1 + tl.where(holders > 1, top1, below)
        else:
            group_scores = top1
        group_scores = tl.where(group_scores == group_scores, group_scores, float("-inf"))

        # Keep the topk_group best groups (lowest group id on ties): a group's rank is the
        # number of real groups ahead of it, every group's counted at once.
        group_id = tl.arange(0, G_PAD)
        mine, other = group_scores[:, :, None], group_scores[:, None, :]
        other_id, my_id = group_id[None, None, :], group_id[None, :, None]
        ahead = (other > mine) | ((other == mine) & (other_id < my_id))
        rank = tl.sum((ahead & (other_id < num_groups)).to(tl.int32), axis=2)
        kept = (group_id[None, :] < num_groups) & (rank < topk_group)
        kept_columns = tl.reshape(tl.broadcast_to(kept[:, :, None], [BLOCK_T, G_PAD, S_PAD]),
                                  [BLOCK_T, NO_EXPERT])
        # <<< book: group-mask

        # Top-k experts of the kept groups; weights from the unbiased scores.
        if SORTED == "keyed":
            weights, ids = take_topk_keyed(selection, scores, expert, is_expert & kept_columns, topk,
                                           BLOCK_T, K_PAD, NO_EXPERT)
        elif SORTED:
            weights, ids = take_topk_sorted(selection, scores, expert, is_expert & kept_columns, topk,
                                            BLOCK_T, K_PAD, NO_EXPERT)
        else:
            weights, ids = _take_topk(selection, scores, expert, is_expert & kept_columns, topk,
                                      BLOCK_T, K_PAD, NO_EXPERT)
        _store_topk(weights, ids, weights_ptr, ids_ptr, first_token, num_tokens, topk,
                    renormalize, routed_scaling_factor, BLOCK_T, K_PAD)


def _check_grouped(func, gating_output, topk, num_expert_group, topk_group,
                   routed_scaling_factor, e_score_correction_bias) -> int:
    """Checks specific to grouped routing; returns the number of experts per group."""
    num_experts = gating_output.shape[1]
    check_int(func, "num_expert_group", num_expert_group, lo=1, hi=num_experts,
              what_hi="the number of experts")
    if num_experts % num_expert_group != 0:
        fail(func, "num_expert_group", f"must divide the number of experts ({num_experts})",
             num_expert_group)
    experts_per_group = num_experts // num_expert_group
    check_int(func, "topk_group", topk_group, lo=1, hi=num_expert_group, what_hi="num_expert_group")
    check_int(func, "topk", topk, lo=1, hi=topk_group * experts_per_group,
              what_hi=f"topk_group * experts per group = {topk_group} * {experts_per_group}")
    # NaN or inf would reach every weight; zero or a negative factor would silence or flip the experts.
    check_number(func, "routed_scaling_factor", routed_scaling_factor, gt=0)
    if e_score_correction_bias is not None:
        check_tensor(func, "e_score_correction_bias", e_score_correction_bias, ndim=1,
                     dtypes=_FLOAT_DTYPES, device=gating_output.device, contiguous=True)
        if e_score_correction_bias.shape[0] != num_experts:
            fail(func, "e_score_correction_bias",
                 f"must have shape ({num_experts},), one per expert",
                 f"shape {tuple(e_score_correction_bias.shape)}")
        if experts_per_group < 2:
            fail(func, "num_expert_group",
                 "must leave at least 2 experts per group when e_score_correction_bias is given "
                 f"(a group scores as the sum of its top 2); {num_experts} experts",
                 num_expert_group)
    return experts_per_group


def grouped_topk_reference(hidden_states, gating_output, topk, renormalize, num_expert_group,
                           topk_group, scoring_func="softmax", routed_scaling_factor=1.0,
                           e_score_correction_bias=None):
    """Torch reference for :func:`grouped_topk`, in float32, one step per line of the rule."""
    func = "grouped_topk_reference"
    _check_common(func, hidden_states, gating_output, topk, renormalize, scoring_func)
    experts_per_group = _check_grouped(func, gating_output, topk, num_expert_group, topk_group,
                                       routed_scaling_factor, e_score_correction_bias)
    num_tokens = gating_output.shape[0]
    scores = _scores(gating_output, scoring_func)
    selection = scores
    if e_score_correction_bias is not None:
        selection = scores + e_score_correction_bias.float()
    selection = torch.where(selection.isnan(), float("-inf"), selection)
    per_group = selection.view(num_tokens, num_expert_group, experts_per_group)
    if e_score_correction_bias is None:
        group_scores = per_group.max(dim=-1).values
    else:
        group_scores = torch.sort(per_group, dim=-1, descending=True).values[..., :2].sum(dim=-1)
    kept_groups = _rank_descending(group_scores, topk_group)
    group_is_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_is_kept = group_is_kept.repeat_interleave(experts_per_group, dim=1)
    # Every expert of a kept group ranks above every expert of a dropped one, even where its score
    # is -inf or was NaN (the kernel masks dropped groups by availability, not by a -inf score).
    order = _rank_descending(selection, selection.shape[1])
    kept_first = torch.sort((~expert_is_kept).gather(1, order).to(torch.int8), dim=1, stable=True).indices
    ids = order.gather(1, kept_first)[:, :topk]
    weights = scores.gather(1, ids)  # the unbiased scores, whatever steered the choice
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def grouped_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                 renormalize: bool, num_expert_group: int, topk_group: int,
                 scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None):
    """Group-limited top-k routing (DeepSeek-V3): ``(weights float32 [T, k], ids int32 [T, k])``.

    Follows vLLM's ``grouped_topk`` (``vllm/model_executor/layers/fused_moe/router/
    grouped_topk_router.py``), with a deterministic tie rule:

    1. scores = softmax over all E logits, or sigmoid per expert;
    2. selection scores = scores + ``e_score_correction_bias`` if a bias is given, else scores;
    3. the E experts form ``num_expert_group`` consecutive groups of E / num_expert_group; a
       group scores its best selection score, or, with a bias, the sum of its best two;
    4. the ``topk_group`` best groups are kept (ties to the lower group id);
    5. the ``topk`` best experts of the kept groups by selection score, largest first (ties to
       the lower expert id);
    6. their weights are the *unbiased* scores (the bias only steers which experts are chosen;
       Wang et al. 2024, auxiliary-loss-free load balancing), divided by their sum if
       ``renormalize``, then multiplied by ``routed_scaling_factor``.

    Because step 6 already applies ``routed_scaling_factor``, the expert outputs need no further
    scaling (see :func:`append_shared_expert` for what that means for a shared expert).
    ``e_score_correction_bias`` is ``[E]``, any float dtype (read as float32).

    One Triton launch (:func:`grouped_topk_reference` when Triton cannot run for these tensors).
    """
    func = "grouped_topk"
    _check_common(func, hidden_states, gating_output, topk, renormalize, scoring_func)
    _check_grouped(func, gating_output, topk, num_expert_group, topk_group, routed_scaling_factor,
                   e_score_correction_bias)
    return grouped_topk_checked(hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group,
                                scoring_func, routed_scaling_factor, e_score_correction_bias)


def grouped_topk_checked(hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group,
                         scoring_func="softmax", routed_scaling_factor=1.0, e_score_correction_bias=None):
    """:func:`grouped_topk` for arguments already checked (a layer checks its routing once)."""
    tensors = [hidden_states, gating_output]
    if e_score_correction_bias is not None:
        tensors.append(e_score_correction_bias)
    if not use_triton(*tensors):
        return grouped_topk_reference(hidden_states, gating_output, topk, renormalize,
                                      num_expert_group, topk_group, scoring_func,
                                      routed_scaling_factor, e_score_correction_bias)
    num_tokens, num_experts = gating_output.shape
    experts_per_group = num_experts // num_expert_group
    weights, ids = _empty_outputs(num_tokens, topk, gating_output.device)
    if num_tokens == 0:
        return weights, ids
    g_pad = next_power_of_2(num_expert_group)
    s_pad = next_power_of_2(experts_per_group)
    block_t, num_warps = _launch_config(num_tokens, g_pad * s_pad)
    has_bias = e_score_correction_bias is not None
    note_launch("routing.grouped_topk", block_t=block_t, scoring=scoring_func, bias=has_bias,
                topk_body=routing.TOPK_BY_SORT)
    _grouped_topk_kernel[(cdiv(num_tokens, block_t),)](
        gating_output, e_score_correction_bias if has_bias else gating_output, weights, ids,
        num_tokens, gating_output.stride(0), num_expert_group, experts_per_group, topk_group,
        topk, renormalize, float(routed_scaling_factor),
        USE_SIGMOID=scoring_func == "sigmoid", HAS_BIAS=has_bias, PRECISE=not INTERPRET,
        BLOCK_T=block_t,
        G_PAD=g_pad, S_PAD=s_pad, K_PAD=next_power_of_2(topk), SORTED=routing.TOPK_BY_SORT, num_warps=num_warps,
    )
    return weights, ids
