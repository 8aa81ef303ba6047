"""How many rows each grouped-GEMM layout must hold, and what its buffers cost.

Pure arithmetic on sizes (and, for the measured cap, on a routing): the kernels in
:mod:`moe_kernels.kernels` allocate exactly what these functions count, so the chapter can
compare the layouts at the real model shapes on any machine.

* the contiguous (permute) layout packs the experts' rows end to end, each segment aligned to
  ``align`` rows: :func:`max_padded_rows` is the most any routing of ``T*k`` assignments needs;
* the masked layout gives every expert ``m_max`` rows: :func:`m_max_token_budget` (SGLang's
  default, correct by construction) or :func:`m_max_measured_cap` (the hottest expert's count,
  one device-to-host read);
* :func:`masked_buffer_bytes` / :func:`compact_buffer_bytes` price them, :func:`choose_layout`
  picks one against a memory budget, and :func:`permute_copy_bytes` counts what the permute copy
  moves, which the index-gather layout never spends.

Qwen3-30B-A3B (E = 128, d = 2048, F = 768, top-8) in bf16::

    >>> import torch
    >>> gb = lambda b: round(b / 1e9, 2)
    >>> gb(masked_buffer_bytes(128, m_max_token_budget(16384), 2048, 768, torch.bfloat16))
    12.0
    >>> gb(compact_buffer_bytes(16384, 8, 128, 2048, 768, torch.bfloat16))
    0.83
    >>> choose_layout(64, 8, 128, 2048, 768, torch.bfloat16, budget_bytes=2**30)
    'masked'
    >>> choose_layout(16384, 8, 128, 2048, 768, torch.bfloat16, budget_bytes=2**30)
    'compact'
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import ID_DTYPES, check_dtype, check_int, check_tensor, fail

#: DeepGEMM's masked kernels want ``m_max`` to be a multiple of their block M; SGLang uses 256.
MASKED_M_BLOCK = 256


def max_padded_rows(num_assignments: int, num_experts: int, align: int) -> int:
    """The most rows the aligned segments can need, over every routing of the assignments.

    An expert with ``c >= 1`` rows takes ``ceil(c/align) = 1 + (c-1)//align`` blocks; summed over
    ``J`` non-empty experts that is at most ``J + (n-J)//align``, which grows with ``J``, so the
    worst case has ``J = min(n, E)``. Sizing the packed buffer by this bound keeps its shape a
    function of ``(n, E, align)`` only, so no host sync is needed (and CUDA graphs see one shape).
    SGLang uses the same bound (``_get_compact_all_tokens`` in
    ``python/sglang/srt/layers/moe/moe_runner/deep_gemm.py``); vLLM's ``numel + E*(align-1)``
    is never smaller.

        >>> max_padded_rows(8, 256, 128)      # one decode token, top-8: 8 blocks, not 32,520 rows
        1024
        >>> max_padded_rows(4096, 256, 128)   # 512 tokens, top-8
        36608
    """
    func = "max_padded_rows"
    check_int(func, "num_assignments", num_assignments, lo=0)
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "align", align, lo=1)
    nonempty = min(num_assignments, num_experts)
    return align * (nonempty + (num_assignments - nonempty) // align)


class CopyBytes(NamedTuple):
    """Bytes of activation rows that the permute and the unpermute move through memory."""

    permute: int
    unpermute: int


def permute_copy_bytes(num_tokens: int, topk: int, hidden_size: int, dtype: torch.dtype) -> CopyBytes:
    """Bytes the copy costs: what the index-gather layout never spends.

    ``permute`` reads each token row once and writes ``k`` copies; ``unpermute`` reads the ``k``
    result rows of each token and writes one. Padding rows are neither read nor written, and the
    int32 index traffic (about 12 bytes per assignment) is left out: at real widths it is well
    under 1%.
    """
    func = "permute_copy_bytes"
    check_int(func, "num_tokens", num_tokens, lo=0)
    check_int(func, "topk", topk, lo=1)
    check_int(func, "hidden_size", hidden_size, lo=1)
    check_dtype(func, "dtype", dtype)
    row = hidden_size * dtype.itemsize
    moved = num_tokens * (1 + topk) * row
    return CopyBytes(permute=moved, unpermute=moved)


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert (int32 ``[E]``) with no host sync; ids outside ``[0, E)`` are not counted."""
    check_tensor("expert_counts", "topk_ids", topk_ids, dtypes=ID_DTYPES)
    check_int("expert_counts", "num_experts", num_experts, lo=1)
    flat = topk_ids.flatten().to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, torch.where(valid, flat, 0), valid.to(torch.int64))
    return counts.to(torch.int32)




def m_max_token_budget(num_tokens: int, block: int = MASKED_M_BLOCK) -> int:
    """``(T//block + 1)*block``: room for all ``T`` tokens on any one expert (SGLang's default).

    Needs no look at the routing, so it is fixed before the batch exists (CUDA graphs), and it
    cannot overflow as long as no token names the same expert twice (top-k never does).

        >>> m_max_token_budget(1), m_max_token_budget(255), m_max_token_budget(256)
        (256, 256, 512)
    """
    check_int("m_max_token_budget", "num_tokens", num_tokens, lo=0)
    check_int("m_max_token_budget", "block", block, lo=1)
    return (num_tokens // block + 1) * block


def _read_ids_range_and_hottest(func: str, topk_ids: torch.Tensor, counts: torch.Tensor,
                                num_experts: int) -> int:
    """One device-to-host read that validates the ids and returns the hottest expert's count."""
    lo, hi, hottest = torch.stack(
        [topk_ids.min().to(torch.int64), topk_ids.max().to(torch.int64),
         counts.max().to(torch.int64)]).tolist()
    if lo < 0 or hi >= num_experts:
        fail(func, "topk_ids", f"must hold expert ids in [0, {num_experts})", f"ids in [{lo}, {hi}]")
    return hottest


def m_max_measured_cap(topk_ids: torch.Tensor, num_experts: int, block: int = MASKED_M_BLOCK) -> int:
    """The hottest expert's row count rounded up to ``block`` (at least ``block``).

    Correct by construction for this routing and usually far below the token budget; the price
    is one device-to-host read, which CUDA-graph capture forbids (SGLang's
    ``SGLANG_OPT_DG_MASKED_M_CAP``, off by default).
    """
    func = "m_max_measured_cap"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES)
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "block", block, lo=1)
    if topk_ids.numel() == 0:
        return block
    hottest = _read_ids_range_and_hottest(func, topk_ids, expert_counts(topk_ids, num_experts),
                                          num_experts)
    return max(block, (hottest + block - 1) // block * block)


def _row_buffers_bytes(num_rows: int, hidden_size: int, intermediate_size: int,
                       dtype: torch.dtype) -> int:
    # With SiLU·mul fused into GEMM1, two row buffers are live at any time: [R, d] input and
    # [R, F] activation during GEMM1, [R, F] and the [R, d] output (written over the input)
    # during GEMM2.
    return num_rows * (hidden_size + intermediate_size) * dtype.itemsize


def masked_buffer_bytes(num_experts: int, m_max: int, hidden_size: int, intermediate_size: int,
                        dtype: torch.dtype) -> int:
    """Peak bytes of the masked layout's row buffers: ``E*m_max`` rows of ``d + F`` elements."""
    func = "masked_buffer_bytes"
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "m_max", m_max, lo=1)
    check_int(func, "hidden_size", hidden_size, lo=1)
    check_int(func, "intermediate_size", intermediate_size, lo=1)
    check_dtype(func, "dtype", dtype)
    return _row_buffers_bytes(num_experts * m_max, hidden_size, intermediate_size, dtype)


def compact_buffer_bytes(num_tokens: int, topk: int, num_experts: int, hidden_size: int,
                         intermediate_size: int, dtype: torch.dtype, align: int = 128) -> int:
    """Peak bytes of the contiguous layout's row buffers, sized for the worst routing.

    Rows: :func:`moe_kernels.model.buffers.max_padded_rows` of ``T*k`` assignments, what
    :func:`moe_kernels.kernels.permute.permute_experts` allocates.
    """
    func = "compact_buffer_bytes"
    check_int(func, "num_tokens", num_tokens, lo=0)
    check_int(func, "topk", topk, lo=1)
    check_int(func, "hidden_size", hidden_size, lo=1)
    check_int(func, "intermediate_size", intermediate_size, lo=1)
    check_dtype(func, "dtype", dtype)
    rows = max_padded_rows(num_tokens * topk, num_experts, align)
    return _row_buffers_bytes(rows, hidden_size, intermediate_size, dtype)


def choose_layout(num_tokens: int, topk: int, num_experts: int, hidden_size: int,
                  intermediate_size: int, dtype: torch.dtype, budget_bytes: int) -> str:
    """``"masked"`` if its buffers at the token-budget ``m_max`` fit the budget, else ``"compact"``.

    Masked is preferred when it fits (static shapes, no sync to size it); compact is the
    fallback because it sizes for what routing can actually produce. SGLang's rule since #33474
    (``python/sglang/srt/layers/moe/moe_runner/deep_gemm.py``).
    """
    check_int("choose_layout", "budget_bytes", budget_bytes, lo=0)
    m_max = m_max_token_budget(num_tokens)
    needed = masked_buffer_bytes(num_experts, m_max, hidden_size, intermediate_size, dtype)
    return "masked" if needed <= budget_bytes else "compact"
