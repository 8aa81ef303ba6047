"""The permute layout's block-fp8 grouped GEMM with each K step's promotion under the next step's MMA
(a Gluon kernel, Hopper, Triton 3.6), its checks, and its torch reference.

``out[r] = dequant(x[r]) @ dequant(w[m_indices[r]])^T`` for every row ``r`` of a packed buffer whose
rows come in 128-row segments, one expert each (:func:`~moe_kernels.kernels.permute.permute` with
``align=128``; ``m_indices`` is -1 on padding rows). ``x`` holds fp8 rows with one float32 scale per
row per 128 columns, ``w`` fp8 experts with one scale per 128 x 128 block (DeepSeek-V3's format,
``formats.FORMATS["block"]``). Rows of padding are never written. With ``gated=True`` (GEMM 1, ``w`` of
``2F`` rows, gate then up) each tile multiplies gate rows and the matching up rows together and stores
``silu(gate) * up``: ``[M_pad, F]``, with no ``[M_pad, 2F]`` intermediate.

Why a kernel of its own: a block-fp8 K step multiplies its 128-deep product by the row's and the block's
scales before adding it to the accumulator (the promotion). Triton 3.6 compiles ``tl.dot`` then the
promotion into a wait for every product (``wgmma.wait_group 0``), so the tensor cores idle while the CUDA
cores promote. Gluon exposes the waits: the kernel (:mod:`moe_kernels.kernels._gluon_block_fp8_kernel`)
issues step s+1's MMA before it promotes step s. On the H200 (``gluon-block-fp8-ab.json``, 16,384 tokens)
that ran DeepSeek-V3's GEMM 1 at 798 TFLOP/s and GEMM 2 at 794, against 698 and 645 for the package's
Triton kernel (:func:`~moe_kernels.kernels.contiguous_gemm.grouped_gemm_contiguous`).

:func:`available` says where it runs: Triton 3.6 with Gluon for NVIDIA GPUs, an sm_90 device. Elsewhere
:func:`block_fp8_grouped` refuses with that reason; :func:`block_fp8_grouped_reference` is the same
product in torch. Two segments of 128 rows, the second half padding, two experts::

    >>> import torch
    >>> from moe_kernels.kernels.formats import FORMATS
    >>> block = FORMATS["block"]
    >>> g = torch.Generator().manual_seed(0)
    >>> w, w_scale = block.quantize_weight(torch.randn(2, 128, 256, generator=g) / 16)
    >>> x, x_scale = block.quantize_activations(torch.randn(256, 256, generator=g))
    >>> m_indices = torch.tensor([0] * 128 + [1] * 64 + [-1] * 64, dtype=torch.int32)
    >>> out = block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices)
    >>> out.shape, bool((out[192:] == 0).all())                 # padding rows: nothing
    (torch.Size([256, 128]), True)
    >>> want = block.dequantize_activations(x[:1], x_scale[:1]) @ block.dequantize_weight(w, w_scale)[0].T
    >>> bool(torch.allclose(out[:1].float(), want, rtol=1e-2, atol=1e-2))
    True
    >>> block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices, gated=True).shape   # silu(gate) * up
    torch.Size([256, 64])
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_tensor, fail
from .._runtime import note_launch
from ._gluon_block_fp8_kernel import GLUON_HOPPER, TILE_K, TILE_M

__all__ = ["available", "block_fp8_grouped", "block_fp8_grouped_reference"]


def available(device: torch.device | str) -> str | None:
    """None where :func:`block_fp8_grouped` runs on ``device``, else why not (a sentence)."""
    device = torch.device(device)
    if not GLUON_HOPPER:
        return "needs Triton 3.6's Gluon for NVIDIA GPUs (compiled kernels, not the interpreter)"
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"needs an sm_90 GPU (Hopper), got sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    return None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a`` spans and those ``b`` spans intersect (both 2-D, dense in their last dimension)."""
    def span(t):
        start = t.data_ptr()
        return start, start + ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * t.element_size() if t.numel() else start
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check(func, x, x_scale, w, w_scale, m_indices, out, block_n, gated=False, validate_ids=True, tile_m=TILE_M,
           dtype=torch.float8_e4m3fn):
    """The arguments of a block-fp8 call (``dtype`` bf16: of a bf16 one, with no scales and a K step of 64)."""
    scaled = dtype == torch.float8_e4m3fn
    check_tensor(func, "w", w, ndim=3, dtypes=(dtype,), contiguous=True)
    e, n, k = w.shape
    if e == 0:
        fail(func, "w", "must hold at least one expert", tuple(w.shape))
    check_tensor(func, "x", x, ndim=2, dtypes=(dtype,), device=w.device, last_dim_contiguous=True)
    if x.data_ptr() % 16 or x.stride(0) % 16:   # (the copy engine reads 16-byte aligned rows)
        fail(func, "x", "must start on 16 bytes and have a row stride of a multiple of 16 elements",
             (x.data_ptr() % 16, x.stride(0)))
    step = TILE_K if scaled else TILE_K // 2   # (a K step of 128 bytes)
    if x.shape[1] != k or k == 0 or k % step:
        fail(func, "x", f"must have K = w.shape[2] = {k} columns, a positive multiple of {step}", tuple(x.shape))
    if x.shape[0] % tile_m:
        fail(func, "x", f"must have a multiple of {tile_m} rows (segments aligned to {tile_m})", tuple(x.shape))
    if scaled and n % (256 if gated else 128):
        fail(func, "w", f"must have N a multiple of {256 if gated else 128} (gated: two halves of 128-row scale "
             "blocks)", tuple(w.shape))
    if not scaled and n % 128:
        fail(func, "w", "must have N a multiple of 128 (tiles of 128 weight rows; gated, 64 gate and 64 up rows)",
             tuple(w.shape))
    if scaled:
        check_tensor(func, "x_scale", x_scale, ndim=2, dtypes=(torch.float32,), device=w.device,
                     last_dim_contiguous=True)
        if tuple(x_scale.shape) != (x.shape[0], k // 128):
            fail(func, "x_scale", f"must have shape {(x.shape[0], k // 128)}", tuple(x_scale.shape))
        check_tensor(func, "w_scale", w_scale, ndim=3, dtypes=(torch.float32,), device=w.device,
                     last_dim_contiguous=True)
        if tuple(w_scale.shape) != (e, n // 128, k // 128):
            fail(func, "w_scale", f"must have shape {(e, n // 128, k // 128)} (128 x 128 blocks)",
                 tuple(w_scale.shape))
    else:
        for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
            if scale is not None:
                fail(func, name, "must be None for bf16 operands", type(scale).__name__)
    check_tensor(func, "m_indices", m_indices, ndim=1, dtypes=(torch.int32,), device=w.device, contiguous=True)
    if m_indices.shape[0] != x.shape[0]:
        fail(func, "m_indices", f"must have one entry per row of x ({x.shape[0]})", tuple(m_indices.shape))
    # A tile's expert is an address the kernel does not check (an id of E or more would read weight scales
    # out of bounds), and a tile computes all its rows with its largest id: with ``validate_ids`` both are
    # checked here, reading them back to the host (not while a CUDA graph captures the call, where that would
    # end the capture). permute_experts, whose m_indices come from permute, skips it.
    capturing = m_indices.is_cuda and torch.cuda.is_current_stream_capturing()
    if validate_ids and m_indices.numel() and not capturing:
        if int(m_indices.max()) >= e:
            fail(func, "m_indices", f"must hold experts in [0, {e}) or -1", int(m_indices.max()))
        tiles = m_indices.view(-1, tile_m)
        top = tiles.max(dim=1, keepdim=True).values
        if bool(((tiles != top) & (tiles >= 0)).any()):
            fail(func, "m_indices", f"must give each {tile_m}-row tile one expert (and -1 on its padding rows)",
                 "a tile with two experts")
    if out is not None:
        check_tensor(func, "out", out, ndim=2, dtypes=(torch.bfloat16,), device=w.device, last_dim_contiguous=True)
        width = n // 2 if gated else n
        if tuple(out.shape) != (x.shape[0], width):
            fail(func, "out", f"must have shape {(x.shape[0], width)}", tuple(out.shape))
        # (bf16, where out can have x's shape: the grids run ahead, so a tile's output would overwrite rows that
        # another tile still reads)
        if _overlap(out, x):
            fail(func, "out", "must not share memory with x", "an overlapping tensor")


def _check_rows_used(func, rows_used, m_indices, device, validate_ids, half_tiles=False, tile_m=TILE_M):
    """The persistent grid visits the tiles below ``rows_used`` and takes each one's expert from its first row:
    with ``validate_ids`` (a read-back, skipped while a graph captures) ``rows_used`` must be a multiple of
    ``tile_m`` (128, or the transposed grid's ``block_t``) in ``[0, M_pad]``, every tile below it must start on a
    real row and no real row may lie past it. ``half_tiles`` (128-row tiles; one whose row 64 is padding
    multiplies rows 0-63 only): no real row may follow row 64's padding."""
    if rows_used.device != device:
        fail(func, "rows_used", f"must be on {device}", rows_used.device)
    capturing = rows_used.is_cuda and torch.cuda.is_current_stream_capturing()
    if not validate_ids or capturing:
        return
    used = int(rows_used[0])
    if used < 0 or used > m_indices.shape[0] or used % tile_m:
        fail(func, "rows_used", f"must be a multiple of {tile_m} in [0, {m_indices.shape[0]}]", used)
    if bool((m_indices[:used:tile_m] < 0).any()) or bool((m_indices[used:] >= 0).any()):
        fail(func, "m_indices", f"must start every {tile_m}-row tile below rows_used={used} on a real row, and "
             "hold no real row past it", "a tile of padding, or a real row past rows_used")
    if half_tiles:
        _check_half_tiles(func, m_indices[:used])


def _check_half_tiles(func, m_indices):
    """A half tile (its row 64 padding) multiplies rows 0-63 only: no real row may follow row 64's padding."""
    tiles = m_indices.view(-1, TILE_M)
    if bool(((tiles[:, TILE_M // 2:] >= 0).any(dim=1) & (tiles[:, TILE_M // 2] < 0)).any()):
        fail(func, "m_indices", f"must hold no real row after padding at row {TILE_M // 2} of a tile with half_tiles",
             "a real row after a half tile's padding")


def block_fp8_grouped(x, x_scale, w, w_scale, m_indices, *, out=None, gated: bool = False, overlap: bool = True,
                      block_n: int = 128, stages: int = 4, validate_ids: bool = True,
                      rows_used: torch.Tensor | None = None, quantize_output: bool = False, half_tiles: bool = False,
                      block_t: int | None = None, tma_store: bool = False):
    """``out[r] = dequant(x[r]) @ dequant(w[m_indices[r]])^T`` in bf16 (``[M_pad, N]``) for the rows with
    ``m_indices >= 0``; others are not written (``out``, if given, keeps them). ``x`` fp8 ``[M_pad, K]`` in
    128-row segments, ``x_scale`` float32 ``[M_pad, K/128]``, ``w`` fp8 ``[E, N, K]``, ``w_scale`` float32
    ``[E, N/128, K/128]``, ``m_indices`` int32 ``[M_pad]``. ``gated``: ``silu(gate) * up`` of the two
    halves of N, ``[M_pad, N/2]``. ``overlap=False`` promotes each step in order (the A/B's control).
    ``validate_ids`` reads ``m_indices`` back to check it (a host sync; skipped while a graph captures).
    Tiles: 128 x ``block_n`` x 128 (gated: ``block_n / 2`` gate and as many up rows), ``stages`` TMA
    buffers, 8 warps (two warpgroups of 64 rows: the builds tested), one program per tile. With ``rows_used``
    (int32 ``[1]`` on the device: the rows the segments span, :class:`~moe_kernels.kernels.permute.PermutedRows`'
    ``rows_used``) a persistent grid instead: one program per SM walks the tiles of those rows, its loads
    running ahead across tiles (:mod:`moe_kernels.kernels._gluon_block_fp8_persistent`; promotion overlapped
    only). ``quantize_output`` (gated, with ``rows_used``): ``(out, out_scale)``, the output in fp8 with one
    float32 scale per row per 128 columns (``[M_pad, N/2]``, ``[M_pad, N/256]``), bit for bit the bf16 output
    quantised by :func:`~moe_kernels.kernels.quant.per_token_group_quant_fp8`: GEMM 2's input with no bf16
    intermediate and no quantiser launch. ``half_tiles``: a tile whose rows 64-127 are all
    padding (a segment's last, with at most 64 real rows) multiplies 64 rows, half the MMAs (one program a tile,
    overlapped, 128 columns; or on the persistent grid). ``block_t`` (16, 32
    or 64, with ``rows_used``; decode): the product transposed on tiles of 128 weight rows by ``block_t`` token
    rows, segments aligned to ``block_t`` (:mod:`moe_kernels.kernels._gluon_transposed`; ``block_n`` is
    not used; ``quantize_output`` as on the persistent grid). ``tma_store`` (plain, with ``rows_used``): each whole
    tile is stored by one asynchronous TMA copy that runs on under the next tile's MMAs, its padding rows too
    (what the products of those rows of ``x`` are): only rows past ``rows_used`` keep what ``out`` held. The
    launch record (``gluon_block_fp8.gemm``) says which variant ran."""
    func = "block_fp8_grouped"
    for name, flag in (("gated", gated), ("overlap", overlap), ("validate_ids", validate_ids),
                       ("quantize_output", quantize_output), ("half_tiles", half_tiles), ("tma_store", tma_store)):
        if not isinstance(flag, bool):
            fail(func, name, "must be a bool", repr(flag), TypeError)
    check_int(func, "stages", stages, lo=2, hi=6)   # (a ring of 2 buffers at least; 6 of 128-column tiles fill 192 KiB)
    if block_n not in (64, 128):
        fail(func, "block_n", "must be 64 or 128", repr(block_n))
    persistent = rows_used is not None
    if persistent:
        check_tensor(func, "rows_used", rows_used, ndim=1, dtypes=(torch.int32,))
        if tuple(rows_used.shape) != (1,):
            fail(func, "rows_used", "must have shape (1,)", tuple(rows_used.shape))
        if not overlap:
            fail(func, "overlap", "must be True with rows_used (the persistent grid overlaps its promotion)", overlap)
        if block_n != 128:   # (its builds: 128-column tiles only)
            fail(func, "block_n", "must be 128 with rows_used (the persistent and transposed grids' tile)", block_n)
        # (the persistent grid's shared memory: the epilogue's buffers cannot share the ring's, which the next
        # tile's loads are filling; 6 gated stages or 5 quantising ones pass the H200's 227 KiB)
        most = 6 if block_t is not None else 4 if quantize_output else 5 if gated or (tma_store and half_tiles) else 6
        if stages > most:
            fail(func, "stages", f"must be at most {most} on the persistent grid here (shared memory)", stages)
    if half_tiles and not (overlap and block_n == 128):   # (the builds tested)
        fail(func, "half_tiles", "needs overlap=True and block_n=128", dict(overlap=overlap, block_n=block_n))
    if block_t is not None:
        if block_t not in (16, 32, 64):
            fail(func, "block_t", "must be None, 16, 32 or 64", repr(block_t))
        if not persistent or half_tiles:
            fail(func, "block_t", "needs rows_used, without half_tiles (the transposed grid)",
                 dict(rows_used=persistent, half_tiles=half_tiles))
    if tma_store and (gated or not persistent or block_t is not None):
        fail(func, "tma_store", "needs rows_used and a plain GEMM (not gated, not transposed)",
             dict(gated=gated, rows_used=persistent, block_t=block_t))
    if quantize_output and not (gated and persistent and block_n == 128 and out is None):
        fail(func, "quantize_output", "needs gated=True, rows_used, block_n=128 and out=None",
             dict(gated=gated, rows_used=persistent, block_n=block_n, out=out is not None))
    reason = available(w.device if isinstance(w, torch.Tensor) else "cpu")
    if reason is not None:
        fail(func, "w", f"must be on a device this kernel runs on ({reason})", getattr(w, "device", w))
    tile_m = block_t or TILE_M
    _check(func, x, x_scale, w, w_scale, m_indices, out, block_n, gated, validate_ids, tile_m)
    if tma_store and out is not None and (out.data_ptr() % 16 or out.stride(0) % 8):   # (what a TMA copy needs)
        fail(func, "out", "must start on 16 bytes and have a row stride of a multiple of 8 elements with tma_store",
             (out.data_ptr() % 16, out.stride(0)))
    if persistent:
        _check_rows_used(func, rows_used, m_indices, w.device, validate_ids, half_tiles, tile_m)
    elif half_tiles and validate_ids and not (m_indices.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_half_tiles(func, m_indices)
    out_scale = None
    if quantize_output:   # (rows of padding are not written: each reaches only its own rows in GEMM 2)
        out = torch.empty(x.shape[0], w.shape[1] // 2, device=x.device, dtype=torch.float8_e4m3fn)
        out_scale = torch.empty(x.shape[0], w.shape[1] // 256, device=x.device, dtype=torch.float32)
    elif out is None:
        out = torch.empty(x.shape[0], w.shape[1] // 2 if gated else w.shape[1], device=x.device, dtype=torch.bfloat16)
    note_launch("gluon_block_fp8.gemm", gated=gated, overlap=overlap, block_n=block_n, stages=stages,
                persistent=persistent, quantize_output=quantize_output, half_tiles=half_tiles, block_t=block_t,
                tma_store=tma_store)
    if x.shape[0] and block_t is not None:
        from ._gluon_transposed import launch as launch_transposed, warps_for

        launch_transposed(x, x_scale, w, w_scale, m_indices, rows_used, out, block_t=block_t, stages=stages,
                          num_warps=warps_for(block_t), gated=gated, out_scale=out_scale)
    elif x.shape[0] and persistent:
        from ._gluon_block_fp8_persistent import launch as launch_persistent

        launch_persistent(x, x_scale, w, w_scale, m_indices, rows_used, out, block_n=block_n, stages=stages,
                          num_warps=8, gated=gated, out_scale=out_scale, half_tiles=half_tiles, tma_store=tma_store)
    elif x.shape[0]:
        from ._gluon_block_fp8_kernel import launch

        launch(x, x_scale, w, w_scale, m_indices, out, overlap=overlap, block_n=block_n, stages=stages, num_warps=8,
               gated=gated, half_tiles=half_tiles)
    return (out, out_scale) if quantize_output else out


def block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices, *, gated: bool = False) -> torch.Tensor:
    """Torch reference for :func:`block_fp8_grouped`: each expert's rows dequantised and multiplied in
    float32 (``gated``: then ``silu(gate) * up`` in float32), rounded once to bf16; zero on the other rows."""
    from .activation import silu_mul_reference
    from .formats import FORMATS

    block = FORMATS["block"]
    out = torch.zeros(x.shape[0], w.shape[1], device=x.device, dtype=torch.float32)
    for e in range(w.shape[0]):
        rows = (m_indices == e).nonzero().flatten()
        if rows.numel():
            a = block.dequantize_activations(x[rows], x_scale[rows])
            out[rows] = a @ block.dequantize_weight(w[e:e + 1], w_scale[e:e + 1])[0].T
    return silu_mul_reference(out, torch.bfloat16) if gated else out.to(torch.bfloat16)
