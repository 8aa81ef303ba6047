"""Alignment: turn ragged per-expert rows into whole tiles (``moe_align_block_size``).

(Triton kernel to be added beside the reference below.)
"""

from __future__ import annotations

import torch

from . import _runtime  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)
from ._checks import check_ids_in_range, check_int, check_tensor


def moe_align_block_size_reference(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """Torch reference for :func:`moe_align_block_size`.

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``:

    * ``sorted_token_ids`` int32 ``[numel + E*(block_size-1)]``: assignment indices (positions in
      ``topk_ids.flatten()``) grouped by expert, each expert's segment padded up to a multiple of
      ``block_size`` with the sentinel ``numel``; trailing unused slots also hold ``numel``.
      Inside a segment, assignments are in increasing index order.
    * ``expert_ids`` int32 ``[ceil(len(sorted_token_ids)/block_size)]``: the expert of each block,
      ``-1`` for blocks past the end of the used region.
    * ``num_tokens_post_padded`` int32 ``[1]``: the used length (sum of padded counts).

    Example (the vLLM docstring's example with 0-based ids)::

        >>> ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]])
        >>> s, e, n = moe_align_block_size_reference(ids, 4, 4)
        >>> s[: int(n)].tolist()
        [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
        >>> e[: int(n) // 4].tolist()
        [0, 1, 2, 3]
    """
    func = "moe_align_block_size"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "block_size", block_size, lo=1)
    check_ids_in_range(func, "topk_ids", topk_ids, num_experts)
    flat = topk_ids.flatten().to(torch.int64)
    numel = flat.numel()
    device = flat.device
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    capacity = numel + num_experts * (block_size - 1)
    sorted_ids = torch.full((capacity,), numel, dtype=torch.int32, device=device)
    order = torch.sort(flat, stable=True).indices  # grouped by expert, index order inside
    rank = torch.arange(numel, device=device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    num_blocks = (capacity + block_size - 1) // block_size
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), padded // block_size)
    expert_ids[: block_expert.numel()] = block_expert.to(torch.int32)
    total = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, expert_ids, total


# Placeholder until the Triton kernel lands: the public name exists so that callers can use it.
moe_align_block_size = moe_align_block_size_reference
