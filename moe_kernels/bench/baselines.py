"""The baselines our layouts are timed against: PyTorch's grouped GEMM over the permuted
segments, and the per-expert Python loop. Not kernels of this package, so they live with the
measurements, not in :mod:`moe_kernels.kernels`.
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_moe_inputs
from ..kernels.combine import unpermute
from ..kernels.permute import permute


def _grouped_mm():
    """``torch.nn.functional.grouped_mm`` (public where it exists), else ``torch._grouped_mm``."""
    op = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if op is None:
        raise NotImplementedError(f"torch_grouped_mm_experts: torch {torch.__version__} has no grouped_mm "
                                  "(torch._grouped_mm appeared in 2.8); use permute_experts instead")
    return op


def torch_grouped_mm_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, align: int = 128,
                             validate_ids: bool = True) -> torch.Tensor:
    """:func:`permute_experts` with PyTorch's grouped GEMM in place of ours: the baseline.

    ``grouped_mm`` takes the packed rows plus ``offs`` (int32 cumulative segment ends), so the
    padded segments go in as they are; its padding rows compute garbage that nobody reads.
    SiLU·mul is a separate torch op on a materialised ``[M_pad, 2F]``. PyTorch's fast path is bf16
    on sm90 (torch >= 2.8); where a build has no kernel for the inputs this raises
    NotImplementedError.
    """
    func = "torch_grouped_mm_experts"
    _, _, num_experts, _, _ = check_moe_inputs(func, hidden_states, w1, w2, topk_weights, topk_ids)
    check_int(func, "align", align, lo=1)
    grouped_mm = _grouped_mm()
    permuted = permute(hidden_states, topk_ids, num_experts, align=align, validate_ids=validate_ids)
    padded = (permuted.segment_counts + align - 1) // align * align
    offs = torch.cumsum(padded, 0, dtype=torch.int32)
    try:
        gate_up = grouped_mm(permuted.rows, w1.transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        y = grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    except RuntimeError as err:
        raise NotImplementedError(f"{func}: this torch build ({torch.__version__}) has no grouped_mm for "
                                  f"{hidden_states.dtype} on {hidden_states.device}: {err}") from err
    return unpermute(y, permuted.src2dst, topk_weights)


def expert_loop(hidden, w1, w2, topk_weights, topk_ids):
    """The naive baseline: one Python iteration (three torch matmuls) per expert that has rows."""
    num_tokens, top_k = topk_ids.shape
    f = w2.shape[2]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()  # one host sync
    tokens, weights = order // top_k, topk_weights.reshape(-1)[order].float()
    out = torch.zeros(num_tokens, hidden.shape[1], device=hidden.device, dtype=torch.float32)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = tokens[start:start + count]
            h = hidden[rows] @ w1[e].T
            y = (torch.nn.functional.silu(h[:, :f]) * h[:, f:]) @ w2[e].T
            out.index_add_(0, rows, y.float() * weights[start:start + count, None])
            start += count
    return out.to(hidden.dtype)
