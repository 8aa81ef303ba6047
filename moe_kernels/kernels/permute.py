"""Permute: copy every assignment's row into its expert's contiguous, aligned segment.

The index-gather layout (:mod:`moe_kernels.kernels.index_gather`) leaves the activations where they are and lets each
GEMM tile gather its rows through an index list. This module is the other answer, the one SGLang
uses in front of DeepGEMM's ``m_grouped_*_gemm_nt_contiguous``: physically copy the rows so that
each expert owns one contiguous segment of a packed buffer, every segment starting on an
``align``-row boundary (DeepGEMM wants 128). A GEMM tile then covers rows of one expert only and
reads them with plain strided loads; the price is the copy in (``permute``) and the copy back
(:func:`moe_kernels.kernels.combine.unpermute`), which
:func:`moe_kernels.model.buffers.permute_copy_bytes` counts.

The pipeline, each step a Triton kernel with a torch reference beside it:

1. :func:`permute` - where the rows go is exactly what :func:`moe_kernels.kernels.align.moe_align_block_size`
   computes with ``block_size=align``: its ``sorted_token_ids`` *is* the permutation (row ``r`` of
   the packed buffer holds assignment ``sorted_token_ids[r]``, or padding when that is the
   sentinel ``numel``). So alignment is reused, not redone, and one scatter kernel copies the rows
   and writes ``m_indices`` (expert of each row, -1 on padding, DeepGEMM's convention) and
   ``src2dst`` (row of each assignment, SGLang's name).
2. :func:`~moe_kernels.kernels.contiguous_gemm.grouped_gemm_contiguous` - ``[M_pad, K] x w[e]^T``
   where each ``BLOCK_M`` tile belongs to one expert, read from ``m_indices``; tiles of padding
   exit at once and padding rows are never stored. The tile product is the core every layout
   shares (:mod:`moe_kernels.kernels._tile_gemm`). With ``silu_mul=True`` it computes the gate
   and up halves of ``w1`` together and stores only ``silu(gate) * up``, so the ``[M_pad, 2F]``
   intermediate never exists.
3. :func:`~moe_kernels.kernels.combine.unpermute` - gathers each token's ``k`` rows, multiplies by the routing weights in
   float32, sums, and casts once (SGLang's ``post_reorder_deepgemm_triton_kernel`` does the same;
   sgl-project/sglang ``python/sglang/kernels/ops/moe/ep_moe_kernels.py``). Or, with
   ``config.sum_in_gemm``, GEMM 2 does it in its epilogue: each row times its routing weight,
   added with fp32 atomics into its token's row (``PermutedRows.row_assignments`` says which), so
   neither GEMM 2's ``[M_pad, d]`` output nor the pass that reads it back exists.

With ``tiles.persistent`` the GEMMs run one program per SM, which walks only the tiles of the
rows the segments use (``PermutedRows.rows_used``, read on the device). With
``config.gather_rows`` step 1 writes the indices only and GEMM 1 reads each row from its token
(``row_assignments[r] // k``) with pointer loads: the copy in is gone, GEMM 1's output is still
written segment by segment, so GEMM 2 reads contiguous rows as before.

:func:`permute_experts` chains them with no host synchronisation on the GPU: every size comes from
the shapes, and the id check (``validate_ids``, on by default) is a device-side assert. Ids out of
range, checked or not, land in no segment, keep ``src2dst = -1`` and add nothing (SGLang's gather
skips ``dst < 0`` the same way), so no kernel touches memory out of bounds. The packed buffer has
:func:`~moe_kernels.model.buffers.max_padded_rows` rows, the most any routing of ``T*k``
assignments can need (SGLang's ``_get_compact_all_tokens``), which is at most vLLM's
``numel + E*(align-1)`` and far less when ``T*k`` is small. :func:`moe_kernels.bench.baselines.torch_grouped_mm_experts`
runs the same permute/unpermute around ``torch.nn.functional.grouped_mm`` as a baseline.

A worked example: three tokens, ``k = 2``, three experts, segments aligned to 4 rows::

    >>> import torch
    >>> from moe_kernels.kernels.combine import unpermute
    >>> x = torch.arange(6.0).reshape(3, 2)
    >>> ids = torch.tensor([[1, 0], [1, 2], [0, 1]])   # expert 0: 2 rows, 1: 3 rows, 2: 1 row
    >>> p = permute(x, ids, 3, align=4)
    >>> p.m_indices.tolist()                           # 4-row segments, padding marked -1
    [0, 0, -1, -1, 1, 1, 1, -1, 2, -1, -1, -1]
    >>> p.segment_starts.tolist(), p.segment_counts.tolist()
    ([0, 4, 8], [2, 3, 1])
    >>> torch.equal(p.rows[p.src2dst[1, 1]], x[1])      # token 1's second choice went to expert 2
    True
    >>> torch.equal(unpermute(p.rows, p.src2dst, torch.full((3, 2), 0.5)), x)   # the round trip
    True
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import check_dispatch_inputs, check_int, check_moe_inputs, fail
from .._runtime import HAS_TRITON, cdiv, kernel, next_power_of_2, tl, use_triton
from ..model.buffers import expert_counts, max_padded_rows
from ._gemm_operands import check_out
from .align import SINGLE_LAUNCH_MAX_NUMEL, align_checked, moe_align_block_size_reference
from . import align as align_module
from .combine import unpermute
from .config import MoEConfig, check_config, get_config
from .contiguous_gemm import grouped_gemm_contiguous  # noqa: F401 (the layout's GEMM, also imported from here)
from .formats import WeightFormat
from . import permute_gluon
from .quant_scatter import quantize_scatter, scatter_rows

#: Block-fp8 input in one pass (:func:`~moe_kernels.kernels.quant_scatter.quantize_scatter`: each token quantised
#: once, written to its k rows with its scales) instead of the quantiser, the fp8 scatter and the scales' gather
#: (142 + 565 + 130 us at DeepSeek-V3's 16,384 tokens, ``permute-gluon-stages.json``). On since session 30: bit for
#: bit the three-step path on a GPU, and the routed fp8 layer on the Gluon GEMMs 1-7% faster with it on an H100
#: (``results/nvidia-h100-80gb-hbm3/layer-layout-ab-s30b.json``, "permute gluon" against "... one-pass").
ONE_PASS_FP8_INPUT = True
#: The same one pass for unquantised input (:func:`~moe_kernels.kernels.quant_scatter.scatter_rows`: each token read
#: once and written to its k rows, where the row-driven copy reads it once for every row; ``d`` a multiple of 128).
#: On since session 34: the routed bf16 layer on the Gluon GEMMs on an H100 took 1-4% less time at 16,384 tokens
#: (DeepSeek-V3 21,259 against 22,148 us) and -0.5 to +1% at 4,096
#: (``results/nvidia-h100-80gb-hbm3/layer-layout-ab-bf16-one-pass-s34.json``). It feeds the Triton GEMMs too (the H200's
#: bf16 choice for DeepSeek-V3), where it has not been timed; the copy it replaces is the same for both.
ONE_PASS_BF16_INPUT = True
#: Past the alignment's one-launch reach, with ``copy=False``, have the alignment's placing launch write ``m_indices``
#: and ``src2dst`` too, as it does at decode, when it takes the scanned path (``align.CHUNK_OFFSETS``): its build for
#: sm_90 (32-assignment tiles on 4 warps) holds 40 registers a thread with the extra stores and spills nothing, where
#: the summed path's spilled 4.3 KB a thread. It would save the row kernel's launch and the fill of ``src2dst``, but in
#: the routed layer on an H100 (``tools/align_layer_ab.py``, ``align-layer-ab-s41.json``: fp8 and bf16, 4,096 and
#: 16,384 tokens) it gained nothing beyond the spread of the rounds (Qwen3 fp8 at 16,384: 2,009-2,023 us against
#: 1,934-2,031 for the row kernel), so it is off.
INDICES_IN_SCANNED_ALIGNMENT = False

if HAS_TRITON:

    # >>> book: permute-scatter
    @kernel
    def copy_rows(src_ptr, src_rows, dst_ptr, dst_rows, row_mask, width,
                  BLOCK_D: tl.constexpr):
        """Copy ``width`` elements of each row at element offset ``src_rows`` to
        ``dst_rows`` (rows outside ``row_mask`` untouched): the data movement of every
        dispatch."""
        for d0 in range(0, width, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = row_mask[:, None] & (cols < width)[None, :]
            values = tl.load(src_ptr + src_rows[:, None] + cols[None, :], mask=mask)
            tl.store(dst_ptr + dst_rows[:, None] + cols[None, :], values, mask=mask)

    @kernel
    def _permute_rows_kernel(
        hidden_ptr, stride_ht, sorted_ids_ptr, block_experts_ptr, rows_ptr, stride_rm,
        m_indices_ptr, src2dst_ptr, num_rows, num_assignments, topk, hidden_size, align,
        BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, COPY: tl.constexpr,
    ):
        # Row-driven: each packed row looks up which assignment it holds, so padding rows
        # cost one index load and no data movement. (COPY False: the indices only, where the
        # alignment did not write them itself.)
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        in_range = rows < num_rows
        assignment = tl.load(sorted_ids_ptr + rows, mask=in_range, other=num_assignments)
        real = in_range & (assignment < num_assignments)
        expert = tl.load(block_experts_ptr + rows // align, mask=in_range, other=-1)
        tl.store(m_indices_ptr + rows, tl.where(real, expert, -1), mask=in_range)
        tl.store(src2dst_ptr + assignment, rows, mask=real)
        if COPY:
            copy_rows(hidden_ptr, (assignment // topk).to(tl.int64) * stride_ht,
                      rows_ptr, rows.to(tl.int64) * stride_rm, real, hidden_size, BLOCK_D)
    # <<< book: permute-scatter


class PermutedRows(NamedTuple):
    """The contiguous layout: what :func:`permute` returns.

    * ``rows`` ``[M_pad, d]``: expert ``e``'s rows are ``rows[segment_starts[e] :
      segment_starts[e] + segment_counts[e]]``; padding rows are left unwritten (whatever the
      buffer held) and nothing that is stored depends on them. None from ``permute(copy=False)``:
      the indices only.
    * ``m_indices`` int32 ``[M_pad]``: the expert of each row, -1 on padding rows.
    * ``src2dst`` int32 ``[T, k]``: the row that holds assignment ``(t, j)`` (-1 for an
      out-of-range id left unvalidated, which no segment holds).
    * ``rows_used`` int32 ``[1]``: the rows the segments span, padding included (the alignment's
      ``num_tokens_post_padded``); rows past it belong to no segment. It stays on the device: a
      persistent GEMM reads it there to walk only these rows' tiles.
    * ``row_assignments`` int32 ``[M_pad]``: the assignment each row holds (``t * k + j``), ``T*k``
      on padding rows: the inverse of ``src2dst``, by which GEMM 2 can add each row into its token.
    * ``segments_from`` ``(topk_ids, E, align)``: what the two properties below are computed from.
    * ``segment_starts`` int32 ``[E]``: first row of each segment, a multiple of ``align``.
    * ``segment_counts`` int32 ``[E]``: real rows in each segment (tokens routed to the expert).

    The two segment tensors are computed when read (five small launches), from ``topk_ids`` as it is
    then: no GEMM needs them, and computed in every call they were half of ``permute``'s time at decode
    (session 30, an H100: the indices alone took 32-41 us, ``quantize_scatter`` 2.3).

    With ``copy=False``, up to the alignment's one-launch reach (``align.SINGLE_LAUNCH_MAX_NUMEL``
    assignments: decode), the alignment's own launch writes ``m_indices`` and ``src2dst`` as it places
    the rows (no fill of ``src2dst`` and no row kernel: two launches fewer). Past it the row kernel
    writes them: on the summed path the extra stores made ptxas spill 4.3 KB a thread (Triton 3.6,
    sm_90a, 128-assignment tiles on 4 warps), and an H100 layer at 16,384 tokens ran about 20% slower
    with them; the scanned path's build holds them without spilling (``INDICES_IN_SCANNED_ALIGNMENT``),
    but gained nothing measurable in the layer, so it is off.
    """

    rows: torch.Tensor
    m_indices: torch.Tensor
    src2dst: torch.Tensor
    rows_used: torch.Tensor
    row_assignments: torch.Tensor
    segments_from: tuple

    @property
    def segment_starts(self) -> torch.Tensor:
        return _segments(*self.segments_from)[0]

    @property
    def segment_counts(self) -> torch.Tensor:
        return _segments(*self.segments_from)[1]


def _segments(topk_ids: torch.Tensor, num_experts: int, align: int):
    """Aligned segment starts and real row counts per expert, without leaving the device."""
    counts = expert_counts(topk_ids, num_experts)
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    return starts.to(torch.int32), counts


def _check_permute_args(func, hidden_states, topk_ids, num_experts, align):
    check_dispatch_inputs(func, hidden_states, topk_ids, num_experts)
    check_int(func, "align", align, lo=1)


def permute(hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, align: int = 128,
            out: torch.Tensor | None = None, validate_ids: bool = True, copy: bool = True) -> PermutedRows:
    """Copy each assignment's activation row into its expert's ``align``-row-aligned segment.

    ``hidden_states`` ``[T, d]``, ``topk_ids`` ``[T, k]`` (0-based expert ids). ``out``, if given,
    is the ``[max_padded_rows(T*k, E, align), d]`` buffer to fill. ``validate_ids`` checks the ids
    as :func:`moe_kernels.kernels.index_gather.fused_experts` does (on a GPU inside the alignment
    kernel, which reads every id anyway: no launch, no host sync). ``copy=False`` writes the
    indices only (``rows`` is None): for a GEMM 1 that reads each row from its token
    (:func:`~moe_kernels.kernels.contiguous_gemm.grouped_gemm_contiguous`'s ``gather_from``).
    """
    func = "permute"
    _check_permute_args(func, hidden_states, topk_ids, num_experts, align)
    if not isinstance(copy, bool):
        fail(func, "copy", "must be a bool", repr(copy), TypeError)
    if out is not None and not copy:
        fail(func, "out", "must be None with copy=False (no rows are copied)", "a tensor")
    num_tokens, hidden_size = hidden_states.shape
    topk = topk_ids.shape[1]
    num_assignments = num_tokens * topk
    num_rows = max_padded_rows(num_assignments, num_experts, align)
    rows = check_out(func, out, (num_rows, hidden_size), hidden_states) if copy else None
    segments_from = (topk_ids, num_experts, align)
    if not use_triton(hidden_states, topk_ids):
        sorted_ids, block_experts, rows_used = align_checked(func, topk_ids, align, num_experts, validate_ids)
        m_indices, src2dst = _permute_rows_reference(hidden_states, sorted_ids, block_experts, num_rows, topk, align,
                                                     rows)
        return PermutedRows(rows, m_indices, src2dst, rows_used, sorted_ids[:num_rows], segments_from)
    m_indices = torch.empty(num_rows, dtype=torch.int32, device=hidden_states.device)
    if not copy and (num_assignments <= SINGLE_LAUNCH_MAX_NUMEL or indices_in_scanned_alignment()):
        # the alignment's launch writes the indices
        src2dst = torch.empty((num_tokens, topk), dtype=torch.int32, device=hidden_states.device)
        sorted_ids, _, rows_used = align_checked(func, topk_ids, align, num_experts, validate_ids,
                                                 permute_indices=(m_indices, src2dst))
        return PermutedRows(rows, m_indices, src2dst, rows_used, sorted_ids[:num_rows], segments_from)
    sorted_ids, block_experts, rows_used = align_checked(func, topk_ids, align, num_experts, validate_ids)
    src2dst = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=hidden_states.device)
    if num_rows:
        block_rows, block_d = 16, min(next_power_of_2(max(hidden_size, 1)), 256)
        _permute_rows_kernel[(cdiv(num_rows, block_rows),)](
            hidden_states, hidden_states.stride(0), sorted_ids, block_experts, hidden_states if rows is None else rows,
            0 if rows is None else rows.stride(0), m_indices, src2dst, num_rows, num_assignments, topk, hidden_size,
            align, BLOCK_ROWS=block_rows, BLOCK_D=block_d, COPY=copy, num_warps=4,
        )
    return PermutedRows(rows, m_indices, src2dst, rows_used, sorted_ids[:num_rows], segments_from)


def indices_in_scanned_alignment() -> bool:
    """Whether the alignment's placing launch writes the permute indices past its one-launch reach."""
    return INDICES_IN_SCANNED_ALIGNMENT and align_module.CHUNK_OFFSETS == "scanned"


def _permute_rows_reference(hidden_states, sorted_ids, block_experts, num_rows, topk, align, rows=None):
    """Torch reference of the scatter kernel: fills ``rows`` (if given); returns ``(m_indices, src2dst)``."""
    num_assignments = hidden_states.shape[0] * topk
    assignment = sorted_ids[:num_rows].to(torch.int64)
    real = assignment < num_assignments
    row_index = torch.arange(num_rows, device=hidden_states.device)
    m_indices = torch.where(real, block_experts.to(torch.int64)[row_index // align], -1)
    if rows is not None:
        rows[real] = hidden_states[assignment[real] // topk]
    src2dst = torch.full((num_assignments,), -1, dtype=torch.int32, device=hidden_states.device)
    src2dst[assignment[real]] = row_index[real].to(torch.int32)
    return m_indices.to(torch.int32), src2dst.view(-1, topk)


def permute_reference(hidden_states, topk_ids, num_experts, *, align=128):
    """Torch reference for :func:`permute` (same outputs; padding rows are zero here)."""
    _check_permute_args("permute", hidden_states, topk_ids, num_experts, align)
    topk = topk_ids.shape[1]
    num_rows = max_padded_rows(topk_ids.numel(), num_experts, align)
    rows = hidden_states.new_zeros(num_rows, hidden_states.shape[1])
    sorted_ids, block_experts, rows_used = moe_align_block_size_reference(topk_ids, align, num_experts)
    m_indices, src2dst = _permute_rows_reference(hidden_states, sorted_ids, block_experts, num_rows, topk, align,
                                                 rows)
    return PermutedRows(rows, m_indices, src2dst, rows_used, sorted_ids[:num_rows], (topk_ids, num_experts, align))


def permute_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, align: int = 128, config: MoEConfig | None = None,
                    validate_ids: bool = True, w1_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None, gemm: str | None = None) -> torch.Tensor:
    """The MoE experts step in the contiguous layout: permute, two grouped GEMMs, unpermute (or,
    with ``config.sum_in_gemm``, GEMM 2 adding each row into its token, and no unpermute).

    Same arguments and result as :func:`moe_kernels.kernels.index_gather.fused_experts` (fp8
    weights included: the permute then copies fp8 rows, half the bytes, and their scales, unless
    ``config.gather_rows``): ``[T, d]``
    in ``hidden_states.dtype``. No host sync on the GPU. Live intermediates: ``[M_pad, d]`` and
    ``[M_pad, F]`` (GEMM 2 writes into the packed input, which GEMM 1 has finished with; with
    ``sum_in_gemm`` it writes an fp32 ``[T, d]`` instead). With ``config.gather_rows`` nothing is
    copied in: GEMM 1 reads each row from its token through the permutation, and GEMM 2 writes a
    new ``[M_pad, d]`` buffer. ``gemm``: which kernel runs the two GEMMs, "triton" or "gluon" (where a
    Gluon kernel can take the call: :func:`~moe_kernels.kernels.permute_gluon.gemm_kernel`); None: the
    switch ``permute_gluon.FP8_GEMM`` or ``BF16_GEMM``.
    """
    func = "permute_experts"
    num_tokens, _, num_experts, d, f = check_moe_inputs(func, hidden_states, w1, w2, topk_weights, topk_ids)
    check_int(func, "align", align, lo=1)
    fmt = WeightFormat.of_pair(func, w1, w2, w1_scale, w2_scale)
    if config is None:
        if align % 16:
            fail(func, "align", "must be a multiple of 16 (the smallest M tile) for the default tiles", align)
        config = get_config(num_tokens, num_experts, f, d, w1.dtype, hidden_states.device, layout="permute",
                            align=align)
    check_config(func, config, align=align, layout="permute")
    # (the Gluon kernels load each segment's rows with TMA and run their own epilogues: the Triton tiles'
    # gather_rows and sum_in_gemm do not apply to them)
    on_gluon = permute_gluon.gemm_kernel(fmt, config, align, hidden_states, w1, w2, gemm) == "gluon"
    # With gather_rows, GEMM 1 reads each row from its token: nothing is copied.
    gather = config.gather_rows and not on_gluon
    # (the Gluon bf16 GEMM 1 gathering its rows: the indices only)
    gathered_on_gluon = on_gluon and permute_gluon.gathers_gemm1(fmt, align, hidden_states, topk_ids.numel(),
                                                                 num_experts)
    if gathered_on_gluon:
        permuted = permute(hidden_states, topk_ids, num_experts, align=align, validate_ids=validate_ids, copy=False)
        rows, rows_scale = hidden_states, None
    elif ONE_PASS_FP8_INPUT and fmt.activations == "group" and not gather:   # quantised once, written to its rows
        permuted = permute(hidden_states, topk_ids, num_experts, align=align, validate_ids=validate_ids, copy=False)
        rows, rows_scale = quantize_scatter(hidden_states, permuted.src2dst, permuted.m_indices.shape[0],
                                            group=fmt.block[1])
    elif ONE_PASS_BF16_INPUT and not fmt.quantized and not gather and d % 128 == 0:   # read once, written k times
        permuted = permute(hidden_states, topk_ids, num_experts, align=align, validate_ids=validate_ids, copy=False)
        rows, rows_scale = scatter_rows(hidden_states, permuted.src2dst, permuted.m_indices.shape[0]), None
    else:
        x, x_scale = fmt.quantize_activations(hidden_states)
        permuted = permute(x, topk_ids, num_experts, align=align, validate_ids=validate_ids, copy=not gather)
        if gather:
            rows, rows_scale = x, x_scale
        elif x_scale is None:
            rows, rows_scale = permuted.rows, None
        else:   # (per-row scales: the padding rows' garbage reaches no real row)
            rows = permuted.rows
            rows_scale = _permute_scales(x_scale, permuted, topk_ids.shape[1])
    if on_gluon:   # (switches: off)
        return permute_gluon.experts(rows, rows_scale, w1, w1_scale, w2, w2_scale, permuted, topk_weights, fmt, align,
                                     gathered=gathered_on_gluon)
    activated = grouped_gemm_contiguous(
        rows, w1, permuted.m_indices, align=align, silu_mul=True, config=config,
        which="gate_up", x_scale=rows_scale, w_scale=w1_scale,
        out_dtype=hidden_states.dtype, rows_used=permuted.rows_used,
        gather_from=permuted if gather else None)
    if not fmt.quantized:
        if config.sum_in_gemm:
            return _down_and_sum(activated, w2, permuted, topk_weights, config, align, hidden_states.dtype)
        # (GEMM 2 writes into the packed input, which GEMM 1 has finished with; gathered, there is none)
        y = grouped_gemm_contiguous(activated, w2, permuted.m_indices, align=align, out=None if gather else rows,
                                    config=config, which="down", rows_used=permuted.rows_used)
        return unpermute(y, permuted.src2dst, topk_weights)
    a, a_scale = fmt.quantize_activations(activated)
    if config.sum_in_gemm:
        return _down_and_sum(a, w2, permuted, topk_weights, config, align, hidden_states.dtype, a_scale, w2_scale)
    y = grouped_gemm_contiguous(a, w2, permuted.m_indices, align=align, config=config, which="down",
                                x_scale=a_scale, w_scale=w2_scale, out_dtype=hidden_states.dtype,
                                rows_used=permuted.rows_used)
    return unpermute(y, permuted.src2dst, topk_weights)


def _down_and_sum(a, w2, permuted: PermutedRows, topk_weights, config, align, dtype, a_scale=None, w2_scale=None):
    """GEMM 2 adding each row, times its routing weight, into its token (``config.sum_in_gemm``):
    no ``[M_pad, d]`` output and no unpermute pass; one cast of the fp32 sums at the end."""
    summed = torch.zeros(topk_weights.shape[0], w2.shape[1], dtype=torch.float32, device=a.device)
    grouped_gemm_contiguous(a, w2, permuted.m_indices, align=align, config=config, which="down", x_scale=a_scale,
                            w_scale=w2_scale, out=summed, rows_used=permuted.rows_used,
                            sum_slots=(permuted, topk_weights))
    return summed.to(dtype)


def _permute_scales(x_scale: torch.Tensor, permuted: PermutedRows, topk: int) -> torch.Tensor:
    """The per-row activation scales in the packed rows' order."""
    rows = permuted.m_indices.shape[0]
    # Row r of the packed buffer holds assignment src2dst^-1(r); unmatched (padding) rows keep 1.
    packed = x_scale.new_ones((rows + 1,) + tuple(x_scale.shape[1:]))
    dst = permuted.src2dst.flatten().to(torch.int64)
    dst = torch.where(dst >= 0, dst, rows)   # an unvalidated bad id lands in the spare last row
    tokens = torch.arange(dst.numel(), device=dst.device) // topk
    packed.index_copy_(0, dst, x_scale[tokens])
    return packed[:rows]


