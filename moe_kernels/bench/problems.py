"""Random layers and batches at real model shapes, for the measurement commands.

Weights are scaled by one over the square root of their fan-in so that activations stay of order
one (never zeros: zeros hide unwritten outputs and run faster than real data). Router logits are
independent standard normals, so the top-k is uniform over the experts, the routing the byte
model (:mod:`moe_kernels.model.costs`) assumes.
"""

from __future__ import annotations

import torch

from ..model.shapes import MoEModel


def make_weights(model: MoEModel, dtype: torch.dtype, seed: int, device="cuda"):
    """Random ``w1 [E, 2F, d]`` and ``w2 [E, d, F]`` scaled to keep activations O(1)."""
    e, d, f = model.num_experts, model.hidden_size, model.moe_intermediate_size
    g = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(e, 2 * f, d, device=device, dtype=dtype, generator=g).mul_(d**-0.5)
    w2 = torch.randn(e, d, f, device=device, dtype=dtype, generator=g).mul_(f**-0.5)
    return w1, w2


def make_batch(model: MoEModel, num_tokens: int, dtype: torch.dtype, seed: int, device="cuda"):
    """Hidden states and random router logits; the ids are their top-k, so uniform over experts."""
    from ..kernels.routing import fused_topk

    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(num_tokens, model.hidden_size, device=device, dtype=dtype, generator=g)
    logits = torch.randn(num_tokens, model.num_experts, device=device, dtype=torch.float32, generator=g)
    weights, ids = fused_topk(hidden, logits, model.top_k, True)
    return hidden, logits, weights, ids
