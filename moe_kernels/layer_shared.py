"""The shared expert inside a layer: beside the routed experts, or among them as slot ``E``.

A layer built with ``shared_expert="separate"`` keeps the shared FFN apart and runs it as its own two
GEMMs; one built with ``"fused"`` stacks it after the routed experts (expert ``E``, a copy made once, at
load time) and appends it to every token's ids; one built with ``"auto"`` stacks it the same way (one of
the routed width; a wider one, Qwen2-MoE's, stays apart) and, per batch
(:func:`~moe_kernels.kernels.shared_choice.choose_shared_slot`, measured), either appends the slot or
runs the stacked expert ``E`` apart, through views of the stacked tensors: no second copy of its weights.

    >>> import torch
    >>> from moe_kernels import MoELayer
    >>> layer = MoELayer.random("deepseek-v3", hidden_size=32, intermediate_size=16, dtype=torch.float32,
    ...                         device="cpu", seed=0, shared_expert="auto")
    >>> w13, w2, _, _ = shared_tensors(layer.weights)
    >>> w13.data_ptr() == layer.weights.w13[256].data_ptr(), tuple(w2.shape)
    (True, (32, 16))
"""

from __future__ import annotations

import torch

from .kernels.index_gather import dense_expert
from .kernels.shared import shared_ffn
from .layer_spec import LayerWeights


def shared_tensors(w: LayerWeights):
    """The shared expert's ``(w13, w2, w13_scale, w2_scale)``: its own tensors, or for stacked weights
    views of expert ``E`` (scales None for 16/32-bit weights)."""
    if w.shared_fused:
        e = w.num_experts
        return (w.w13[e], w.w2[e], None if w.w13_scale is None else w.w13_scale[e],
                None if w.w2_scale is None else w.w2_scale[e])
    return w.shared_w13, w.shared_w2, w.shared_w13_scale, w.shared_w2_scale


def runs_apart(w: LayerWeights, shared_slot: bool) -> bool:
    """Whether a call runs a shared expert on its own GEMMs: one kept apart, or a stacked one this batch does
    not take as a slot."""
    return w.shared_w13 is not None or (w.shared_fused and not shared_slot)


def with_shared_slot(topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: LayerWeights, shared_gate):
    """The router's ``[T, k]`` weights and ids with the shared expert as slot ``k + 1``: id ``E``, weight 1
    (or its sigmoid gate). Made at every call (not kept in the plan): a CUDA graph captures the fill with
    the call."""
    column = torch.ones_like(topk_weights[:, :1]) if shared_gate is None else shared_gate
    return (torch.cat([topk_weights, column], dim=1),
            torch.cat([topk_ids, torch.full_like(topk_ids[:, :1], w.num_experts)], dim=1))


def shared_expert_output(plan, hidden_states: torch.Tensor, w: LayerWeights, shared_gate, activations):
    """The shared expert run apart, ``[T, d]`` (times Qwen2-MoE's sigmoid gate, if any): the routed
    experts' GEMMs (W8A8 in fp8) on a dense block map (one expert, every token: no alignment, no top-k
    sum) with the plan's own tiles, or cuBLAS GEMMs where the plan has none (16/32-bit weights above
    ``layer.DENSE_SHARED_MAX_TOKENS`` tokens)."""
    w13, w2, w13_scale, w2_scale = shared_tensors(w)
    if plan.shared_choice is None:
        shared = shared_ffn(hidden_states, w13, w2)
        return shared if shared_gate is None else shared.mul_(shared_gate.to(shared.dtype))
    return dense_expert(hidden_states, w13, w2, fmt=plan.format, config=plan.shared_choice.config,
                        w1_scale=w13_scale, w2_scale=w2_scale, weight=shared_gate, activations=activations)
