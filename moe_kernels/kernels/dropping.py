"""What a capacity-factor layer would compute: the dropless kernel with the dropped weights zeroed.

Inference engines drop nothing (:mod:`moe_kernels.model.capacity` explains the training rule and
counts what it would drop). :func:`moe_with_capacity` shows what dropping does to the output, so
the chapter can compare it with the dropless layer on the same inputs.
"""

from __future__ import annotations

import torch

from .._checks import check_moe_inputs
from ..model.capacity import _capacity, capacity_assign
from .index_gather import fused_experts


def moe_with_capacity(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    capacity_factor: float,
) -> torch.Tensor:
    """The routed experts' output ``[T, d]`` as a capacity-factor layer computes it.

    Same arguments as :func:`moe_kernels.kernels.index_gather.fused_experts`, plus the capacity factor
    ``alpha``. The capacity is :func:`~moe_kernels.model.capacity.expert_capacity` of this batch; the assignments
    :func:`~moe_kernels.model.capacity.capacity_assign` rejects
    contribute exactly zero, so a token whose ``k`` assignments all drop gets a zero row (the
    residual connection outside the layer is all that carries it). Implemented by zeroing those
    routing weights and running the dropless index-gather kernel, so the GEMMs are the ones the
    rest of the chapter tests; the dropped rows are still computed and then multiplied by zero,
    where a training kernel would never have copied them into its buffers.
    """
    func = "moe_with_capacity"
    num_tokens, topk, num_experts, _, _ = check_moe_inputs(func, hidden_states, w1, w2,
                                                           topk_weights, topk_ids)
    capacity = _capacity(func, num_tokens, topk, num_experts, capacity_factor)  # names this function in errors
    keep = capacity_assign(topk_ids, num_experts, capacity)
    kept_weights = torch.where(keep, topk_weights, torch.zeros_like(topk_weights))
    # The ids were validated by capacity_assign: no need to check them twice.
    return fused_experts(hidden_states, w1, w2, kept_weights, topk_ids, validate_ids=False)
