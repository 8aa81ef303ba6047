"""Random layers and batches at real model shapes, for the measurement commands.

Weights are scaled by one over the square root of their fan-in so that activations stay of order
one (never zeros: zeros hide unwritten outputs and run faster than real data). Router logits are
independent standard normals, so the top-k is uniform over the experts, the routing the byte
model (:mod:`moe_kernels.model.costs`) assumes.
"""

from __future__ import annotations

import dataclasses

import torch

from ..model.shapes import MODELS, MoEModel


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


def tool_weights(key: str, fmt, device, **cpu_shape):
    """A model's routed experts for the A/B scripts in ``tools/``: ``(model, dtype, w1, w1_scale,
    w2, w2_scale)``, bf16 weights stored in ``fmt`` (a :class:`~moe_kernels.kernels.formats.WeightFormat`)
    on a GPU; on the CPU (the Triton interpreter) float32, the model shrunk to ``cpu_shape``
    (:class:`MoEModel` fields over d = 256, F = 128, 8 experts, top-2)."""
    model = MODELS[key]
    if torch.device(device).type == "cpu":
        shape = {"hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8, "top_k": 2, **cpu_shape}
        model = dataclasses.replace(model, **shape)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    w1, w2 = make_weights(model, dtype, 0, device)
    (w1, w1_scale), (w2, w2_scale) = fmt.quantize_weight(w1), fmt.quantize_weight(w2)
    return model, dtype, w1, w1_scale, w2, w2_scale


def tool_batch(model: MoEModel, num_tokens: int, dtype: torch.dtype, fmt, device):
    """One batch for the decode A/B scripts in ``tools/``, routed as :func:`make_batch` routes it (seeded by
    its size), with index-gather's tiles for it and its block map: ``(hidden, topk_weights, topk_ids, config,
    blocks)``. ``fmt`` (the weights' :class:`~moe_kernels.kernels.formats.WeightFormat`) picks the tuned table
    and the block map's rule (:func:`tool_blocks`)."""
    from ..kernels.config import get_config

    hidden, _, weights, ids = make_batch(model, num_tokens, dtype, seed=num_tokens, device=device)
    config = get_config(num_tokens, model.num_experts, model.moe_intermediate_size, model.hidden_size,
                        fmt.element or dtype, hidden.device)
    return hidden, weights, ids, config, tool_blocks(ids, config.block_m, model, fmt)


def tool_blocks(ids: torch.Tensor, block_m: int, model: MoEModel, fmt):
    """The block map a layer with weights of format ``fmt`` takes for ``ids`` on ``block_m``-row tiles: the naive
    map by vLLM's rule, and for block-fp8 weights only up to ``blocks.NAIVE_MAX_TOKENS_BLOCK_FP8`` tokens (as
    ``layer.plan_layer`` and ``bench fp8`` decide it)."""
    from ..kernels.blocks import assign_blocks, use_naive_block_assignment

    naive = use_naive_block_assignment(ids.shape[0], model.top_k, model.num_experts, block_fp8=fmt.scales == "block")
    return assign_blocks(ids, block_m, model.num_experts, naive=naive, validate_ids=False)


def index_gather_stages(hidden, w1, w2, w1_scale, w2_scale, weights, ids, fmt, config, blocks) -> dict:
    """Index-gather's decode stages for the A/B scripts in ``tools/``, each a closure that runs one launch alone
    on inputs made once here: ``gemm 1`` (SiLU·mul in its epilogue), ``gemm 2`` (with the top-k sum where
    ``config`` puts it there), ``sum`` (otherwise) and, for a quantised ``fmt`` (a
    :class:`~moe_kernels.kernels.formats.WeightFormat`), ``quantize x`` and ``quantize y``, the two activation
    quantisers."""
    from ..kernels.combine import sum_slots
    from ..kernels.index_gather import down, gate_up

    t, k = ids.shape
    x, x_scale = fmt.quantize_activations(hidden)
    inter = torch.empty(t * k, w1.shape[1] // 2, device=hidden.device, dtype=hidden.dtype)
    gate_up(x, w1, blocks, k, tiles=config.gate_up, out=inter, a_scale=x_scale, w_scale=w1_scale, fmt=fmt)
    y, y_scale = fmt.quantize_activations(inter)
    summed = config.sum_in_gemm
    per_slot = (torch.zeros(t, w2.shape[1], device=hidden.device, dtype=torch.float32) if summed else
                torch.empty(t, k, w2.shape[1], device=hidden.device, dtype=hidden.dtype))
    stages = {"gemm 1": lambda: gate_up(x, w1, blocks, k, tiles=config.gate_up, out=inter, a_scale=x_scale,
                                        w_scale=w1_scale, fmt=fmt),
              "gemm 2": lambda: down(y, w2, weights, blocks, tiles=config.down, out=per_slot, a_scale=y_scale,
                                     w_scale=w2_scale, fmt=fmt, sum_slots=summed)}
    if fmt.quantized:
        stages["quantize x"] = lambda: fmt.quantize_activations(hidden)
        stages["quantize y"] = lambda: fmt.quantize_activations(inter)
    if not summed:
        stages["sum"] = lambda: sum_slots(per_slot)
    return stages
