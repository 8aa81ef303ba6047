"""fp8 (e4m3) quantisation: block-scaled weights, activations quantised on the fly.

DeepSeek-V3's checkpoint (and Qwen3-30B-A3B-FP8's) stores every expert matrix in ``float8_e4m3fn``
with one float32 scale per 128x128 block, named ``weight_scale_inv``: the real weight is
``q * scale`` block by block. Activations are quantised at run time per token and per 128-channel
group (1x128), so a GEMM's K loop multiplies, for each 128-wide step, an fp8 tile product by one
activation scale per row and one weight scale per 128 output columns. Why those shapes:

* 128x128 weight blocks: one scale per K step of 128 and per 128 output columns, so the scales
  cost ``1/128^2`` of the weight bytes, and an outlier spoils only its own block;
* 1x128 activation groups: activations have per-token outliers (some tokens are much larger than
  others), and a token's scale must not be set by another token; within a token, 128 channels
  share a scale, again so that one large channel spoils only its group.

Two coarser weight schemes are common in other fp8 checkpoints and are supported for comparison:
per-channel weights (one scale per output row) and per-tensor weights (one scale per expert
matrix), both with per-token activations; their scales apply once, after the K loop. (Per-tensor
*activation* scales, common too, are here only as a quantiser: with them one token's outlier, or
one request's ``inf``, changes every token of the batch.) Which weight scheme goes with which
activation scheme is :mod:`moe_kernels.kernels.formats`' business; this module holds the numbers.

e4m3 holds magnitudes up to 448 with 3 mantissa bits; every scale here is ``amax / 448`` (amax
floored at ``1e-10`` so an all-zero group gets a finite scale), and values are rounded to the
nearest fp8 code after dividing by it, as vLLM's ``per_token_group_quant_fp8`` does
(``vllm/model_executor/layers/quantization/utils/fp8_utils.py`` in vLLM 0.33.0).

    >>> import torch
    >>> x = torch.tensor([[1.0, -2.0, 448.0, 0.5] * 32])          # one token, one 128-group
    >>> q, s = per_token_group_quant_fp8(x)
    >>> q.dtype, tuple(s.shape), float(s[0, 0])                   # amax 448 -> scale 1
    (torch.float8_e4m3fn, (1, 1), 1.0)
    >>> w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(0))
    >>> wq, ws = quantize_weight(w, "block")
    >>> tuple(ws.shape)                                           # [E, N/128, K/128]
    (2, 2, 3)
    >>> bool((dequantize_weight(wq, ws) - w).abs().max() / w.abs().max() < 0.07)   # 3 mantissa bits
    True
"""

from __future__ import annotations

import torch

from .._checks import FLOAT_DTYPES, check_int, check_tensor, fail
from .. import _runtime
from .._runtime import HAS_TRITON, cdiv, kernel, next_power_of_2, note_launch, tl, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128                     # activation group width and weight block edge
EPS = 1e-10
#: Weight scale layouts, and the activation quantisations (see :mod:`moe_kernels.kernels.formats`
#: for which goes with which).
GRANULARITIES = ("block", "channel", "tensor")
#: The quantiser's program: (rows, column groups). (4, 1) read 1 KiB of bf16 a program and ran DeepSeek-V3's
#: GEMM 2 input (163,584 x 2,048 at 16,384 tokens) at about half the read bandwidth (403 us against 217 of
#: bytes, ``permute-gluon-stages.json``).
QUANT_TILE = (4, 1)
#: Triton's interpreter (3.9) rounds fp32 -> fp8 wrongly when the rounding carries into the exponent
#: (124.7 becomes 64, not 128; about 1% of values): under it the quantisers take torch's cast, unless a
#: test whose values quantise exactly turns this off to run a kernel's indexing on the CPU.
INTERPRETER_ROUNDS_FP8_WRONGLY = True
ACTIVATION_SCHEMES = ("group", "token", "tensor")

if HAS_TRITON:

    # >>> book: quant-groups
    @kernel
    def _quant_groups_kernel(x_ptr, stride_x, q_ptr, stride_q, s_ptr, stride_s,
                             num_rows, num_groups, rows_used_ptr,
                             GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr,
                             GROUPS: tl.constexpr, BOUNDED: tl.constexpr):
        # ROWS rows of GROUPS 1xGROUP_SIZE column groups per program:
        # a [ROWS, GROUPS, GROUP_SIZE] block. Per group: amax, scale,
        # divide, round. BOUNDED: the rows below a count on the device
        # only (the permute layout's segments; none is read past them).
        if BOUNDED:
            num_rows = tl.minimum(num_rows, tl.load(rows_used_ptr))
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        in_group = tl.arange(0, GROUP_SIZE)
        cols = (groups[:, None] * GROUP_SIZE + in_group[None, :])[None, :, :]
        real = (rows < num_rows)[:, None] & (groups < num_groups)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x_ptrs = x_ptr + r64[:, :, None] * stride_x + cols
        x = tl.load(x_ptrs, mask=real[:, :, None], other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-10) / 448.0
        q = tl.clamp(x / scale[:, :, None], -448.0, 448.0)
        q_ptrs = q_ptr + r64[:, :, None] * stride_q + cols
        tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=real[:, :, None])
        tl.store(s_ptr + r64 * stride_s + groups[None, :], scale, mask=real)
    # <<< book: quant-groups

    @kernel
    def store_group_quantized(q_ptr, q_rows, s_ptr, s_rows, row_real, acc, pid_n, N, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr, ROUND_TO: tl.constexpr):
        """A GEMM epilogue's fp32 tile ``[BLOCK_M, BLOCK_N]`` (output columns ``pid_n * BLOCK_N``
        onward) stored as the quantiser above would store it: first rounded to ``ROUND_TO`` (the
        dtype the unfused path writes and the quantiser reads: "bf16", "fp16" or "" for fp32), then
        per row and 1 x GROUP_SIZE group: amax, scale, divide, round; the scales go to
        ``s_ptr + s_rows`` at the tile's groups. Real rows and columns below ``N`` only. (The
        arithmetic is the quantiser kernel's, line for line; a test holds the two to the same bits.)"""
        if ROUND_TO == "bf16":
            acc = acc.to(tl.bfloat16).to(tl.float32)
        elif ROUND_TO == "fp16":
            acc = acc.to(tl.float16).to(tl.float32)
        groups = tl.reshape(acc, (BLOCK_M, BLOCK_N // GROUP_SIZE, GROUP_SIZE))
        scale = tl.maximum(tl.max(tl.abs(groups), axis=2), 1e-10) / 448.0
        q = tl.reshape(tl.clamp(groups / scale[:, :, None], -448.0, 448.0), (BLOCK_M, BLOCK_N))
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(q_ptr + q_rows[:, None] + cols[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=row_real[:, None] & (cols[None, :] < N))
        group_ids = pid_n * (BLOCK_N // GROUP_SIZE) + tl.arange(0, BLOCK_N // GROUP_SIZE)
        tl.store(s_ptr + s_rows[:, None] + group_ids[None, :], scale,
                 mask=row_real[:, None] & (group_ids[None, :] < N // GROUP_SIZE))


def _check_activations(func: str, x: object) -> torch.Tensor:
    check_tensor(func, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    return x


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = GROUP, *,
                              rows_used: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` to fp8 ``[T, K]`` and float32 scales ``[T, K/group_size]`` (one Triton launch).

    Each token's channels are cut into groups of ``group_size`` (``K`` must be a multiple); a
    group's scale is its amax over 448, and ``q * scale`` gives the group back to fp8 precision.
    ``rows_used`` (int32 ``[1]`` on ``x``'s device; the permute layout's ``PermutedRows.rows_used``):
    only the rows below it are quantised, the others left unwritten (no host sync).
    """
    func = "per_token_group_quant_fp8"
    _check_groups(func, x, group_size)
    if rows_used is not None:
        check_tensor(func, "rows_used", rows_used, ndim=1, dtypes=(torch.int32,), device=x.device)
        if tuple(rows_used.shape) != (1,):
            fail(func, "rows_used", "must have shape (1,)", tuple(rows_used.shape))
    return _quant_groups(x, group_size, rows_used)


def _check_groups(func: str, x: object, group_size: object) -> None:
    _check_activations(func, x)
    check_int(func, "group_size", group_size, lo=16)
    if group_size & (group_size - 1):
        fail(func, "group_size", "must be a power of two", group_size)
    if x.shape[1] % group_size:
        fail(func, "x", f"must have a multiple of group_size={group_size} columns", f"shape {tuple(x.shape)}")


def _quant_groups(x: torch.Tensor, group_size: int, rows_used: torch.Tensor | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`per_token_group_quant_fp8` after its checks (one Triton launch, or the reference), into ``out``
    (``(q, s)``, a test's) or new tensors."""
    num_rows, k = x.shape
    q, s = out or (torch.empty(num_rows, k, dtype=FP8, device=x.device),
                   torch.empty(num_rows, k // group_size, dtype=torch.float32, device=x.device))
    if not use_triton(x) or (_runtime.INTERPRET and INTERPRETER_ROUNDS_FP8_WRONGLY) or num_rows == 0 or k == 0:
        used = num_rows if rows_used is None else min(num_rows, int(rows_used[0]))   # (the torch path: a read-back)
        q_ref, s_ref = per_token_group_quant_fp8_reference(x[:used], group_size)
        q[:used].copy_(q_ref)
        s[:used].copy_(s_ref)
        return q, s
    rows, groups = QUANT_TILE
    if any(v < 1 or v & (v - 1) for v in (rows, groups)):
        fail("moe_kernels.kernels.quant", "QUANT_TILE", "must be two powers of two (rows, column groups)", QUANT_TILE)
    num_groups = k // group_size
    groups = min(groups, next_power_of_2(num_groups))
    note_launch("quant.groups", group_size=group_size, rows=rows, groups=groups, bounded=rows_used is not None)
    _quant_groups_kernel[(cdiv(num_rows, rows), cdiv(num_groups, groups))](
        x, x.stride(0), q, q.stride(0), s, s.stride(0), num_rows, num_groups, x if rows_used is None else rows_used,
        GROUP_SIZE=group_size, ROWS=rows, GROUPS=groups, BOUNDED=rows_used is not None, num_warps=4)
    return q, s


def per_token_group_quant_fp8_reference(x: torch.Tensor, group_size: int = GROUP):
    """Torch reference of :func:`per_token_group_quant_fp8`."""
    t, k = x.shape
    groups = x.float().view(t, k // group_size, group_size)
    scale = groups.abs().amax(dim=-1).clamp_min(EPS) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(t, k), scale


def quantize_activations(x: torch.Tensor, scheme: str, *, reference: bool = False, group: int = GROUP):
    """Activations ``[T, K]`` to fp8 with float32 scales, one scheme of three: ``group`` (one scale
    per token per ``group`` channels, shape ``[T, K/group]``), ``token`` (one per token, ``[T]``)
    or ``tensor`` (one for the whole tensor, ``[1]``; no format of this package uses it, since one
    token's outlier or ``inf`` would then reach every token, but the chapter shows what it does).
    ``reference`` takes the torch path for the groups too (the others are torch always)."""
    if scheme == "group":
        _check_groups("per_token_group_quant_fp8", x, group)
        return per_token_group_quant_fp8_reference(x, group) if reference else _quant_groups(x, group)
    func = "quantize_activations"
    _check_activations(func, x)
    xf = x.float()
    if scheme == "token":
        scale = xf.abs().amax(dim=1).clamp_min(EPS) / FP8_MAX if x.shape[1] else xf.new_full((x.shape[0],), EPS)
        return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    if scheme == "tensor":
        scale = (xf.abs().amax() if x.numel() else xf.new_zeros(())).clamp_min(EPS).reshape(1) / FP8_MAX
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    fail(func, "scheme", f"must be one of {', '.join(map(repr, ACTIVATION_SCHEMES))}", repr(scheme))


def quantize_weight(w: torch.Tensor, granularity: str = "block", *,
                    block: tuple[int, int] = (GROUP, GROUP)) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights ``[E, N, K]`` to fp8 and their float32 scales (``weight_scale_inv``):
    ``[E, ceil(N/bn), ceil(K/bk)]`` for ``block`` scales of ``block = (bn, bk)`` (a ragged edge
    block scaled by its own amax), ``[E, N]`` for ``channel``, ``[E]`` for ``tensor``. Done once,
    at load time."""
    func = "quantize_weight"
    check_tensor(func, "w", w, ndim=3, dtypes=FLOAT_DTYPES)
    if granularity not in GRANULARITIES:
        fail(func, "granularity", f"must be one of {', '.join(map(repr, GRANULARITIES))}", repr(granularity))
    if w.shape[0] > 8:   # a few experts at a time: the float32 temporaries of a whole layer would not fit
        parts = [_quantize_weight(w[i:i + 8], granularity, block) for i in range(0, w.shape[0], 8)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    return _quantize_weight(w, granularity, block)


def _quantize_weight(w: torch.Tensor, granularity: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
    wf = w.float()
    if granularity == "block":
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        padded = torch.zeros(e, nb * bn, kb * bk, device=w.device)
        padded[:, :n, :k] = wf
        blocks = padded.view(e, nb, bn, kb, bk)
        scale = blocks.abs().amax(dim=(2, 4)).clamp_min(EPS) / FP8_MAX
        q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q.view(e, nb * bn, kb * bk)[:, :n, :k].contiguous(), scale
    if granularity == "channel":
        scale = wf.abs().amax(dim=2).clamp_min(EPS) / FP8_MAX
        return (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    scale = wf.abs().amax(dim=(1, 2)).clamp_min(EPS) / FP8_MAX
    return (wf / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, *, block: tuple[int, int] = (GROUP, GROUP)) -> torch.Tensor:
    """float32 weights from fp8 ``q [E, N, K]`` and any of the three scale layouts (``block``:
    the edges of a block scale)."""
    e, n, k = q.shape
    if scale.dim() == 3:
        full = scale.repeat_interleave(block[0], dim=1)[:, :n].repeat_interleave(block[1], dim=2)[:, :, :k]
    elif scale.dim() == 2:
        full = scale[..., None]
    else:
        full = scale[:, None, None]
    return q.float() * full


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, scheme: str, *, group: int = GROUP) -> torch.Tensor:
    """float32 activations from fp8 ``q [T, K]`` and the scales of :func:`quantize_activations`."""
    if scheme == "group":
        return q.float() * scale.repeat_interleave(group, dim=1)
    return q.float() * (scale[:, None] if scheme == "token" else scale)
