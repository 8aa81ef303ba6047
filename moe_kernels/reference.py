"""The direct per-token MoE reference, in float64.

Every grouped-GEMM layout in this package (index-gather, permute, masked) must agree with this
function, which knows nothing about alignment, tiles, padding or segments: for each token it
looks up that token's experts and adds up their weighted outputs, in float64.

Weight layout (vLLM's): ``w1`` is ``[E, 2*F, d]`` with the gate projection in rows ``[0, F)`` and
the up projection in rows ``[F, 2F)``; ``w2`` is ``[E, d, F]``. An expert computes
``w2[e] @ (silu(w1[e][:F] @ x) * (w1[e][F:] @ x))``.

Example::

    >>> import torch
    >>> x = torch.tensor([[1.0, 2.0]])
    >>> w1 = torch.zeros(2, 2, 2); w1[:, 0, 0] = 1.0; w1[:, 1, 1] = 1.0   # gate = x0, up = x1
    >>> w2 = torch.ones(2, 2, 1)                                          # both outputs = a
    >>> out = moe_reference(x, w1, w2, torch.tensor([[0.25, 0.75]]), torch.tensor([[0, 1]]))
    >>> round(float(out[0, 0]), 6)   # silu(1) * 2 = 1.462117, weights sum to 1
    1.462117
"""

from __future__ import annotations

import torch


def silu_and_mul_reference(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [gate | up]`` along the last dimension."""
    f = h.shape[-1] // 2
    gate, up = h[..., :f], h[..., f:]
    return gate * torch.sigmoid(gate) * up


def moe_reference(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Output ``[T, d]`` in float64: ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t)``.

    Loops over the experts that occur (so each expert's weights are upcast once), but each
    token's output is built only from its own ids and weights: no alignment, no padding.
    """
    from ._checks import check_ids_in_range, fail

    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        fail("moe_reference", "topk_weights", f"must have the shape of topk_ids {tuple(topk_ids.shape)}",
             f"shape {tuple(topk_weights.shape)}")
    check_ids_in_range("moe_reference", "topk_ids", topk_ids, w1.shape[0], on_device=False)
    x = hidden_states.to(torch.float64)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    ids = topk_ids.to(torch.int64)
    weights = topk_weights.to(torch.float64)
    for e in torch.unique(ids).tolist():
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        h = x[tokens] @ w1[e].to(torch.float64).T
        y = silu_and_mul_reference(h) @ w2[e].to(torch.float64).T
        out.index_add_(0, tokens, weights[tokens, slots, None] * y)
    return out


def moe_reference_fp8(hidden_states, w1, w2, topk_weights, topk_ids, *, w1_scale, w2_scale,
                      granularity: str, intermediate_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The W8A8 layer on the *same* quantised numbers as the kernels, then exact arithmetic.
    ``granularity`` names the weights' format (``FORMATS`` of :mod:`moe_kernels.kernels.formats`:
    ``"block"``, ``"channel"`` or ``"tensor"``), which says how the activations are quantised.

    The activations are quantised with the torch reference quantiser and dequantised, each expert's
    weights dequantised (one expert at a time, so real model shapes fit), both expert GEMMs done in
    float64; between them the activation is rounded to ``intermediate_dtype`` (what GEMM 1 writes)
    and requantised, as the kernels do. So the only differences left against a kernel are its
    float32 accumulation order and, rarely, an fp8 code of the intermediate that this rounding
    moves across a boundary. Runs on the inputs' device.
    """
    from .kernels.formats import WeightFormat

    fmt = WeightFormat.named("moe_reference_fp8", "granularity", granularity)

    def through_fp8(x):
        q, s = fmt.quantize_activations(x.float(), reference=True)
        return fmt.dequantize_activations(q, s).to(torch.float64)

    def expert(w, scale, e):
        return fmt.dequantize_weight(w[e:e + 1], scale[e:e + 1])[0].to(torch.float64)

    ids, weights = topk_ids.to(torch.int64).flatten(), topk_weights.to(torch.float64).flatten()
    k = topk_ids.shape[1]
    x = through_fp8(hidden_states)
    inter = torch.zeros(ids.numel(), w2.shape[2], dtype=torch.float64, device=x.device)
    present = torch.unique(ids).tolist()
    for e in present:
        rows = torch.nonzero(ids == e).flatten()
        inter[rows] = silu_and_mul_reference(x[rows // k] @ expert(w1, w1_scale, e).T)
    y_in = through_fp8(inter.to(intermediate_dtype))
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for e in present:
        rows = torch.nonzero(ids == e).flatten()
        out.index_add_(0, rows // k, weights[rows, None] * (y_in[rows] @ expert(w2, w2_scale, e).T))
    return out
