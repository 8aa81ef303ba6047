"""Masked layout: every expert gets a fixed ``[m_max, d]`` slab, and ``masked_m`` says how much is used.

The contiguous layout (``permute.py``) packs the experts' rows end to end, so its row count is
known only up to a bound. The masked layout gives up on packing: the buffer is
``[E, m_max, d]``, expert ``e``'s rows are ``rows[e, :masked_m[e]]``, and every shape is fixed by
``(E, m_max, d)`` alone, which is what CUDA graphs want. DeepGEMM's ``m_grouped_*_gemm_nt_masked``
consumes it, SGLang fills it with ``fused_moe_dispatch_index`` (offsets ``e*m_max + slot``;
sgl-project/sglang ``python/sglang/kernels/ops/moe/ep_moe_kernels.py``), and vLLM's
``BatchedPrepareAndFinalize`` builds the same ``[E_local, m_max, d]`` shape.

Everything turns on ``m_max``:

* :func:`m_max_token_budget` - ``(T//256 + 1)*256``, SGLang's default: enough for every token
  to land on one expert, so correct by construction, and ``E`` times too big on average;
* :func:`m_max_measured_cap` - the hottest expert's count rounded up to 256: one probe and one
  device-to-host read per layer (SGLang's opt-in ``SGLANG_OPT_DG_MASKED_M_CAP``,
  ``python/sglang/srt/environ.py``), not allowed during CUDA-graph capture.

A token is never dropped: :func:`masked_dispatch` counts every assignment (including any that do
not fit), and raises ValueError naming ``m_max`` and the count needed when the hottest expert
overflows. That check shares the one device-to-host read that also validates the expert ids, so
the masked path costs exactly one sync. The grouped GEMM (:func:`grouped_gemm_masked`) launches a
program for every ``BLOCK_M`` tile of every slab; a tile past ``masked_m[e]`` exits after one
scalar load, so unused capacity costs launch slots, not FLOPs. The gather back reuses
:func:`moe_kernels.permute.unpermute`: ``src2dst`` here indexes rows of the flattened
``[E*m_max, d]`` buffer, the same convention as a packed buffer's rows.

A worked example: three tokens, ``k = 2``, three experts, ``m_max = 4``::

    >>> import torch
    >>> x = torch.arange(6.0).reshape(3, 2)
    >>> ids = torch.tensor([[1, 0], [1, 2], [0, 1]])
    >>> d = masked_dispatch(x, ids, num_experts=3, m_max=4)
    >>> d.rows.shape, d.masked_m.tolist()
    (torch.Size([3, 4, 2]), [2, 3, 1])
    >>> torch.equal(d.rows.view(12, 2)[d.src2dst[1, 1]], x[1])   # row e*m_max + slot
    True
    >>> masked_dispatch(x, ids, num_experts=3, m_max=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: masked_dispatch: argument 'm_max' must be >= 3 (the hottest expert's row count; ...

Memory decides between the layouts. Qwen3-30B-A3B (E = 128, d = 2048, F = 768, top-8) in bf16::

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

from ._runtime import HAS_TRITON, tl, triton, use_triton  # first: sets TRITON_INTERPRET
from ._checks import check_dispatch_inputs, check_int, check_moe_inputs, check_tensor, fail
from .permute import (
    COMPUTE_DTYPES,
    ID_DTYPES,
    TileConfig,
    check_out,
    check_tile_config,
    default_tile_config,
    dot_precision,
    expert_counts,
    expert_rows_product,
    gemm_output_width,
    interpreter_cannot_dot,
    max_padded_rows,
    unpermute,
)

if HAS_TRITON:
    from .permute import expert_tile_gemm

__all__ = [
    "MASKED_M_BLOCK", "MaskedRows", "choose_layout", "compact_buffer_bytes", "grouped_gemm_masked",
    "m_max_measured_cap", "m_max_token_budget", "masked_buffer_bytes", "masked_dispatch",
    "masked_dispatch_reference", "masked_experts",
]

#: DeepGEMM's masked kernels want ``m_max`` to be a multiple of their block M; SGLang uses 256.
MASKED_M_BLOCK = 256


# --------------------------------------------------------------------------------------------
# m_max policies
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Memory: the intermediates of each layout, and the choice between them
# --------------------------------------------------------------------------------------------


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
    return _row_buffers_bytes(num_experts * m_max, hidden_size, intermediate_size, dtype)


def compact_buffer_bytes(num_tokens: int, topk: int, num_experts: int, hidden_size: int,
                         intermediate_size: int, dtype: torch.dtype, align: int = 128) -> int:
    """Peak bytes of the contiguous layout's row buffers, sized for the worst routing.

    Rows: :func:`moe_kernels.permute.max_padded_rows` of ``T*k`` assignments, what
    :func:`moe_kernels.permute.permute_experts` allocates.
    """
    func = "compact_buffer_bytes"
    check_int(func, "num_tokens", num_tokens, lo=0)
    check_int(func, "topk", topk, lo=1)
    check_int(func, "hidden_size", hidden_size, lo=1)
    check_int(func, "intermediate_size", intermediate_size, lo=1)
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


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _masked_dispatch_kernel(
        hidden_ptr, stride_ht, stride_hd,
        ids_ptr, stride_it, stride_ik,
        rows_ptr, stride_re, stride_rm, stride_rd,
        counts_ptr, src2dst_ptr,
        num_assignments, topk, num_experts, m_max, hidden_size,
        BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        assignment = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
        in_range = assignment < num_assignments
        token = assignment // topk
        expert = tl.load(ids_ptr + token * stride_it + (assignment % topk) * stride_ik,
                         mask=in_range, other=-1).to(tl.int32)
        # Bad ids are skipped here (never used as an address) and reported by the host check.
        valid = in_range & (expert >= 0) & (expert < num_experts)
        expert = tl.where(valid, expert, 0)
        # Every valid assignment is counted, even one that will not fit: the count is what the
        # overflow check compares with m_max.
        slot = tl.atomic_add(counts_ptr + expert, 1, mask=valid)
        fits = valid & (slot < m_max)
        tl.store(src2dst_ptr + assignment, tl.where(fits, expert * m_max + slot, -1), mask=in_range)
        src = token.to(tl.int64) * stride_ht
        dst = expert.to(tl.int64) * stride_re + slot.to(tl.int64) * stride_rm
        for d0 in range(0, hidden_size, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = fits[:, None] & (cols < hidden_size)[None, :]
            values = tl.load(hidden_ptr + src[:, None] + cols[None, :] * stride_hd, mask=mask)
            tl.store(rows_ptr + dst[:, None] + cols[None, :] * stride_rd, values, mask=mask)

    @triton.jit
    def _masked_gemm_kernel(
        a_ptr, stride_ae, stride_am, stride_ak,
        w_ptr, stride_we, stride_wn, stride_wk,
        out_ptr, stride_oe, stride_om, stride_on,
        masked_m_ptr, m_max, tiles_per_expert, N, K,
        SILU_MUL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        expert = pid // tiles_per_expert
        first_row = (pid % tiles_per_expert) * BLOCK_M
        rows_used = tl.minimum(tl.load(masked_m_ptr + expert), m_max)
        if first_row >= rows_used:
            return
        rows = first_row + tl.arange(0, BLOCK_M)
        slab = expert.to(tl.int64)
        row_offsets = rows.to(tl.int64)
        expert_tile_gemm(
            a_ptr + slab * stride_ae, row_offsets * stride_am, stride_ak,
            w_ptr + slab * stride_we, stride_wn, stride_wk,
            out_ptr + slab * stride_oe, row_offsets * stride_om, stride_on,
            rows < rows_used, tl.program_id(1), N, K,
            SILU_MUL, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------


class MaskedRows(NamedTuple):
    """The masked layout: what :func:`masked_dispatch` returns.

    * ``rows`` ``[E, m_max, d]``: expert ``e``'s rows are ``rows[e, :masked_m[e]]``; the rest of
      each slab is left unwritten and no kernel reads it.
    * ``masked_m`` int32 ``[E]``: rows used per expert.
    * ``src2dst`` int32 ``[T, k]``: ``e*m_max + slot``, the row of assignment ``(t, j)`` in
      ``rows.view(E*m_max, d)``. Order inside a slab is not specified (atomics on the GPU).
    """

    rows: torch.Tensor
    masked_m: torch.Tensor
    src2dst: torch.Tensor


def _check_dispatch_args(func, hidden_states, topk_ids, num_experts, m_max):
    check_dispatch_inputs(func, hidden_states, topk_ids, num_experts)
    check_int(func, "m_max", m_max, lo=1)


def _check_no_overflow(func: str, topk_ids, counts, num_experts: int, m_max: int) -> None:
    hottest = _read_ids_range_and_hottest(func, topk_ids, counts, num_experts)
    if hottest > m_max:
        fail(func, "m_max", f"must be >= {hottest} (the hottest expert's row count; no token is "
             "dropped)", m_max)


def masked_dispatch(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    m_max: int,
    *,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> MaskedRows:
    """Copy each assignment's row into slot ``masked_m[e]++`` of its expert's ``[m_max, d]`` slab.

    One Triton kernel claims slots with an atomic counter per expert and copies the rows; then
    one device-to-host read checks the ids and that no expert overflowed (ValueError naming
    ``m_max`` and the count needed). ``out``, if given, is the ``[E, m_max, d]`` buffer to fill.

    ``check=False`` skips that read (for CUDA-graph capture, where it is illegal, and for timing).
    It is allowed only when ``m_max >= T``, so that no expert can overflow; the ids are then
    trusted, as under ``validate_ids=False`` elsewhere.
    """
    func = "masked_dispatch"
    _check_dispatch_args(func, hidden_states, topk_ids, num_experts, m_max)
    if not check and m_max < hidden_states.shape[0]:
        fail(func, "check", f"may be False only when m_max >= the token count {hidden_states.shape[0]} "
             "(no expert can overflow then)", f"False with m_max={m_max}")
    num_tokens, hidden_size = hidden_states.shape
    topk = topk_ids.shape[1]
    device = hidden_states.device
    rows = check_out(func, out, (num_experts, m_max, hidden_size), hidden_states.dtype, device)
    if rows is None:
        rows = torch.empty(num_experts, m_max, hidden_size, dtype=hidden_states.dtype, device=device)
    if not use_triton(hidden_states, topk_ids, rows):
        return _masked_dispatch_reference(hidden_states, topk_ids, num_experts, m_max, rows)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    src2dst = torch.empty(num_tokens, topk, dtype=torch.int32, device=device)
    block_a, block_d = 16, min(triton.next_power_of_2(hidden_size), 256)
    _masked_dispatch_kernel[(triton.cdiv(num_tokens * topk, block_a),)](
        hidden_states, hidden_states.stride(0), hidden_states.stride(1),
        topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        rows, rows.stride(0), rows.stride(1), rows.stride(2),
        counts, src2dst,
        num_tokens * topk, topk, num_experts, m_max, hidden_size,
        BLOCK_A=block_a, BLOCK_D=block_d, num_warps=4,
    )
    if check:
        _check_no_overflow(func, topk_ids, counts, num_experts, m_max)
    return MaskedRows(rows, counts, src2dst)


def _masked_dispatch_reference(hidden_states, topk_ids, num_experts, m_max, rows):
    counts = expert_counts(topk_ids, num_experts)
    _check_no_overflow("masked_dispatch", topk_ids, counts, num_experts, m_max)
    flat = topk_ids.flatten().to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    first = torch.cumsum(counts.to(torch.int64), 0) - counts
    slot = torch.empty_like(flat)
    slot[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    rows[flat, slot] = hidden_states[torch.arange(flat.numel(), device=flat.device) // topk_ids.shape[1]]
    src2dst = (flat * m_max + slot).to(torch.int32).view(topk_ids.shape)
    return MaskedRows(rows, counts, src2dst)


def masked_dispatch_reference(hidden_states, topk_ids, num_experts, m_max):
    """Torch reference for :func:`masked_dispatch` (slots in assignment order; unused rows zero)."""
    _check_dispatch_args("masked_dispatch", hidden_states, topk_ids, num_experts, m_max)
    rows = hidden_states.new_zeros(num_experts, m_max, hidden_states.shape[1])
    return _masked_dispatch_reference(hidden_states, topk_ids, num_experts, m_max, rows)


# --------------------------------------------------------------------------------------------
# the grouped GEMM over masked slabs
# --------------------------------------------------------------------------------------------


def grouped_gemm_masked(
    x: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``out[e, :masked_m[e]] = x[e, :masked_m[e]] @ w[e]^T`` for every expert ``e``.

    ``x`` ``[E, m_max, K]``, ``w`` ``[E, N_w, K]``; returns ``[E, m_max, N_w]`` (or
    ``[E, m_max, N_w/2]`` of ``silu(gate) * up`` when ``silu_mul``). Rows at or past
    ``masked_m[e]`` are neither read nor written. Under the CPU interpreter, bf16 runs in float32
    and is rounded to bf16 once at the end.
    """
    func = "grouped_gemm_masked"
    check_tensor(func, "x", x, ndim=3, dtypes=COMPUTE_DTYPES)
    check_tensor(func, "w", w, ndim=3, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
    check_tensor(func, "masked_m", masked_m, ndim=1, dtypes=(torch.int32,), device=x.device,
                 contiguous=True)
    num_experts, m_max, k = x.shape
    if w.shape[0] != num_experts or w.shape[2] != k:
        fail(func, "w", f"must have shape [{num_experts}, N, {k}] to match x", f"shape {tuple(w.shape)}")
    if masked_m.shape[0] != num_experts:
        fail(func, "masked_m", f"must have shape [{num_experts}]", f"shape {tuple(masked_m.shape)}")
    n = gemm_output_width(func, w, silu_mul)
    config = check_tile_config(func, config or default_tile_config(x.dtype), None)
    result = check_out(func, out, (num_experts, m_max, n), x.dtype, x.device)
    if result is None:
        result = torch.empty(num_experts, m_max, n, dtype=x.dtype, device=x.device)
    if not use_triton(x, w, masked_m, result):
        return _grouped_gemm_masked_reference(x, w, masked_m, silu_mul, result)
    if interpreter_cannot_dot(x.dtype, x.device):
        wide = result.float()
        grouped_gemm_masked(x.float(), w.float(), masked_m, silu_mul=silu_mul, out=wide,
                            config=config)
        return result.copy_(wide)
    tiles_per_expert = triton.cdiv(m_max, config.block_m)
    grid = (num_experts * tiles_per_expert, triton.cdiv(n, config.block_n))
    _masked_gemm_kernel[grid](
        x, x.stride(0), x.stride(1), x.stride(2),
        w, w.stride(0), w.stride(1), w.stride(2),
        result, result.stride(0), result.stride(1), result.stride(2),
        masked_m, m_max, tiles_per_expert, n, k,
        SILU_MUL=silu_mul, INPUT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return result


def _grouped_gemm_masked_reference(x, w, masked_m, silu_mul, out):
    for e, used in enumerate(masked_m.clamp(max=x.shape[1]).tolist()):
        out[e, :used] = expert_rows_product(x[e, :used], w[e], silu_mul).to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------
# the whole experts step
# --------------------------------------------------------------------------------------------


def masked_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    m_max: int | None = None,
    *,
    config: TileConfig | None = None,
    check: bool = True,
) -> torch.Tensor:
    """The MoE experts step in the masked layout: dispatch, two masked GEMMs, gather back.

    Same arguments and result as :func:`moe_kernels.permute.permute_experts`. ``m_max``
    defaults to :func:`m_max_token_budget` of the batch; pass :func:`m_max_measured_cap` (or any
    value) to shrink the slabs. Too small an ``m_max`` raises ValueError; nothing is dropped.
    ``check=False`` (only with ``m_max >= T``) skips the one host read; see :func:`masked_dispatch`.
    """
    func = "masked_experts"
    num_tokens, _, num_experts, hidden_size, _ = check_moe_inputs(
        func, hidden_states, w1, w2, topk_weights, topk_ids)
    if m_max is None:
        m_max = m_max_token_budget(num_tokens)
    check_int(func, "m_max", m_max, lo=1)
    config = check_tile_config(func, config or default_tile_config(hidden_states.dtype), None)
    dispatched = masked_dispatch(hidden_states, topk_ids, num_experts, m_max, check=check)
    activated = grouped_gemm_masked(dispatched.rows, w1, dispatched.masked_m, silu_mul=True,
                                    config=config)
    y = grouped_gemm_masked(activated, w2, dispatched.masked_m, out=dispatched.rows, config=config)
    return unpermute(y.view(num_experts * m_max, hidden_size), dispatched.src2dst, topk_weights)
