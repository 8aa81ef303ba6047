"""The permute layout's bf16 grouped GEMM at prefill in Gluon (Hopper, Triton 3.6): its call, its checks, the
shared memory its builds take. The kernel is :mod:`moe_kernels.kernels._gluon_bf16_persistent`.

``out[r] = x[r] @ w[m_indices[r]]^T`` for every real row ``r`` of a packed buffer whose rows come in 128-row
segments, one expert each (:func:`~moe_kernels.kernels.permute.permute` with ``align=128``; ``m_indices`` is -1
on padding rows), below ``rows_used`` (int32 ``[1]`` on the device). One program per SM walks the 128-row tiles
with a ring of TMA loads that runs on across tiles; each K step's wgmma accumulates into the one before it.
``gated`` (GEMM 1, ``w`` of ``2F`` rows, gate then up): ``silu(gate) * up``, ``[M_pad, F]``.

:func:`~moe_kernels.kernels.gluon_block_fp8.available` says where it runs (Triton 3.6's Gluon, sm_90); elsewhere
the call refuses with that reason. Its torch reference is the transposed kernel's
(:func:`~moe_kernels.kernels.gluon_transposed.grouped_transposed_reference`: any segment size). What a build
takes of shared memory (227 KiB an SM on the H100 and the H200), the ring and the epilogue's buffers::

    >>> shared_bytes(block_n=256, stages=4, gated=True) <= SHARED_LIMIT     # GEMM 1: 128 gate + 128 up rows
    True
    >>> shared_bytes(block_n=256, stages=4, gated=False, tma_store=True) <= SHARED_LIMIT
    False
    >>> shared_bytes(block_n=256, stages=3, gated=False, tma_store=True)     # GEMM 2's 3 stages and the TMA tile
    213016
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_tensor, fail
from .._runtime import note_launch
from .gluon_block_fp8 import _check, _check_rows_used, _overlap, available
from .gluon_transposed import grouped_transposed_reference

__all__ = ["bf16_grouped", "bf16_grouped_reference", "gathered_rows_reference", "shared_bytes", "SHARED_LIMIT"]

#: The shared memory one program may take on Hopper (the H100's and the H200's 227 KiB).
SHARED_LIMIT = 227 * 1024

bf16_grouped_reference = grouped_transposed_reference


def gathered_rows_reference(x: torch.Tensor, row_assignments: torch.Tensor, top_k: int) -> torch.Tensor:
    """The packed rows a gathered call reads (``bf16_grouped(row_assignments=, top_k=)``): row ``r`` is token
    ``row_assignments[r] // top_k`` of ``x``, and zeros where ``row_assignments[r] >= T * top_k`` (padding); the
    gathered call's reference is :data:`bf16_grouped_reference` of these rows.

        >>> x = torch.arange(6.0).view(3, 2)
        >>> gathered_rows_reference(x, torch.tensor([5, 0, 6, 1], dtype=torch.int32), 2).tolist()
        [[4.0, 5.0], [0.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
    """
    real = row_assignments < x.shape[0] * top_k
    rows = x.new_zeros(row_assignments.shape[0], x.shape[1])
    rows[real] = x[(row_assignments[real] // top_k).long()]
    return rows


def shared_bytes(block_n: int, stages: int, gated: bool, half_tiles: bool = False, tma_store: bool = False) -> int:
    """The shared memory of a build, as Triton 3.6 allocates it (checked against each build's by the compile
    test): the ring (``stages`` x a 128 x 64 A box and a ``block_n`` x 64 W box, bf16), its barriers, and the
    epilogue's: the TMA store's whole bf16 tile (and, with half tiles, a half tile's layout change for its pointer
    stores), else the layout change of the pointer stores, at most 128 columns at a time."""
    width = block_n // 2 if gated else block_n
    ring = stages * (128 + block_n) * 64 * 2 + 8 * stages
    if tma_store:
        return ring + 128 * width * 2 + (64 * min(width, 128) * 2 if half_tiles else 0)
    return ring + 128 * min(width, 128) * 2


def bf16_grouped(x, w, m_indices, rows_used, *, out=None, gated: bool = False, block_n: int = 256, stages: int = 3,
                 half_tiles: bool = False, tma_store: bool = False, group_m: int = 8,
                 validate_ids: bool = True, row_assignments=None, top_k: int | None = None) -> torch.Tensor:
    """``[M_pad, N]`` bf16 (gated ``[M_pad, N/2]``) for the rows with ``m_indices >= 0`` below ``rows_used``;
    other rows are not written (``out``, if given, keeps them), except with ``tma_store``, which writes each whole
    tile below ``rows_used``, its padding rows too. ``x`` bf16 ``[M_pad, K]`` in 128-row segments, ``w`` bf16
    ``[E, N, K]``, ``m_indices`` int32 ``[M_pad]``. ``block_n``: weight rows a tile (128 or 256; gated half gate
    rows, half up rows); ``stages``: the ring's TMA buffers (2 up to what fits :data:`SHARED_LIMIT`);
    ``half_tiles``: a tile whose rows 64-127 are padding multiplies 64 rows; ``group_m``: the M tiles the walk
    visits before the next weight tile (1: one M tile a weight tile; larger keeps a weight tile in L2 across more
    row tiles, each re-read for each weight tile). ``validate_ids`` reads ``m_indices``
    and ``rows_used`` back to check them (a host sync; skipped while a graph captures). The launch record
    (``gluon_bf16.gemm``) names the build.

    ``row_assignments`` (int32 ``[M_pad]``, :class:`~moe_kernels.kernels.permute.PermutedRows`'s) with ``top_k``:
    ``x`` is the tokens, ``[T, K]``, and row ``r`` is token ``row_assignments[r] // top_k`` (a value of
    ``T * top_k`` or more: a padding row, read as zeros), gathered by the kernel instead of copied into a packed
    buffer first (GEMM 1 of the permute layout without its input's scatter); its reference is
    :data:`bf16_grouped_reference` of :func:`gathered_rows_reference`'s rows."""
    func = "bf16_grouped"
    for name, flag in (("gated", gated), ("half_tiles", half_tiles), ("tma_store", tma_store),
                       ("validate_ids", validate_ids)):
        if not isinstance(flag, bool):
            fail(func, name, "must be a bool", repr(flag), TypeError)
    if type(block_n) is not int or block_n not in (128, 256):
        fail(func, "block_n", "must be 128 or 256", repr(block_n))
    check_int(func, "stages", stages, lo=2, hi=8)
    check_int(func, "group_m", group_m, lo=1, hi=64)
    if shared_bytes(block_n, stages, gated, half_tiles, tma_store) > SHARED_LIMIT:
        most = max(s for s in range(2, 9) if shared_bytes(block_n, s, gated, half_tiles, tma_store) <= SHARED_LIMIT)
        fail(func, "stages", f"must be at most {most} with block_n={block_n}, gated={gated}, half_tiles={half_tiles}, "
             f"tma_store={tma_store} (shared memory: {SHARED_LIMIT} bytes)", stages)
    check_tensor(func, "rows_used", rows_used, ndim=1, dtypes=(torch.int32,))
    if tuple(rows_used.shape) != (1,):
        fail(func, "rows_used", "must have shape (1,)", tuple(rows_used.shape))
    reason = available(w.device if isinstance(w, torch.Tensor) else "cpu")
    if reason is not None:
        fail(func, "w", f"must be on a device this kernel runs on ({reason})", getattr(w, "device", w))
    gathered = row_assignments is not None or top_k is not None
    if gathered:
        _check_gather(func, x, m_indices, out, row_assignments, top_k, validate_ids)
    if gathered and not x.shape[0]:   # (no token: every row is padding; one zero row to describe)
        x = x.new_zeros(1, x.shape[1])
    # (gathered: the checks of the packed rows the kernel reads, on a view of x's first row repeated that many times)
    rows = x.as_strided((m_indices.shape[0], x.shape[1]), (0, 1)) if gathered else x
    _check(func, rows, None, w, None, m_indices, out, 128, gated, validate_ids, dtype=torch.bfloat16)
    if w.shape[1] == 0 or w.data_ptr() % 16:   # (the copy engine reads 16-byte aligned rows)
        fail(func, "w", "must have N > 0 and start on 16 bytes", (tuple(w.shape), w.data_ptr() % 16))
    width = block_n // 2 if gated else block_n
    out_width = w.shape[1] // 2 if gated else w.shape[1]
    if out_width % width:
        fail(func, "w", f"must have {'N/2' if gated else 'N'} a multiple of {width} (the tile's output columns "
             f"with block_n={block_n})", tuple(w.shape))
    if tma_store and out is not None and (out.data_ptr() % 16 or out.stride(0) % 8):   # (what a TMA copy needs)
        fail(func, "out", "must start on 16 bytes and have a row stride of a multiple of 8 elements with tma_store",
             (out.data_ptr() % 16, out.stride(0)))
    _check_rows_used(func, rows_used, m_indices, w.device, validate_ids, half_tiles)
    if out is None:
        out = torch.empty(rows.shape[0], out_width, device=x.device, dtype=torch.bfloat16)
    note_launch("gluon_bf16.gemm", gated=gated, block_n=block_n, stages=stages, half_tiles=half_tiles,
                tma_store=tma_store, group_m=group_m, gathered=gathered)
    if rows.shape[0]:
        from ._gluon_bf16_persistent import launch

        launch(x, w, m_indices, rows_used, out, block_n=block_n, stages=stages, gated=gated, half_tiles=half_tiles,
               tma_store=tma_store, group_m=group_m, row_assignments=row_assignments, top_k=top_k or 1)
    return out


def _check_gather(func, x, m_indices, out, row_assignments, top_k, validate_ids):
    """The gathered call's own arguments: ``row_assignments`` one int32 per row of ``m_indices``, ``top_k`` >= 1,
    ``x``'s rows on 16 bytes (each K step's row is eight 16-byte copies), ``out`` sharing no memory with the tokens
    (the shared checks see only a view of their first row), no assignment negative (``validate_ids``: read back, as
    the ids are; an assignment past ``T * top_k`` is a padding row)."""
    if row_assignments is None or top_k is None:
        fail(func, "row_assignments", "must come with top_k (both or neither)",
             f"row_assignments={type(row_assignments).__name__}, top_k={top_k!r}")
    check_int(func, "top_k", top_k, lo=1)
    check_tensor(func, "row_assignments", row_assignments, ndim=1, dtypes=(torch.int32,), device=m_indices.device,
                 contiguous=True)
    if row_assignments.shape != m_indices.shape:
        fail(func, "row_assignments", f"must have one entry per row of m_indices ({m_indices.shape[0]})",
             tuple(row_assignments.shape))
    check_tensor(func, "x", x, ndim=2, dtypes=(torch.bfloat16,), device=m_indices.device, last_dim_contiguous=True)
    if x.data_ptr() % 16 or x.stride(0) % 8:
        fail(func, "x", "must start on 16 bytes and have a row stride of a multiple of 8 elements when gathered",
             (x.data_ptr() % 16, x.stride(0)))
    if out is not None and _overlap(out, x):
        fail(func, "out", "must not share memory with x (the tokens the rows gather)", "overlapping tensors")
    if x.shape[0] * top_k > 2**31 - 1:
        fail(func, "x", "must have T * top_k below 2**31 (int32 assignments)", (x.shape[0], top_k))
    capturing = row_assignments.is_cuda and torch.cuda.is_current_stream_capturing()
    if validate_ids and row_assignments.numel() and not capturing and int(row_assignments.min()) < 0:
        fail(func, "row_assignments", "must hold no negative assignment", int(row_assignments.min()))
