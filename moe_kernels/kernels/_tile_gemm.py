"""The one tile-GEMM that every grouped-GEMM layout is built on.

The three layouts of the chapter (index-gather, permute, masked) differ only in how a program
finds *its rows* and *its expert*; what it then computes is the same: one ``[BLOCK_M, BLOCK_N]``
tile of ``A[rows] @ W[e]^T`` with an fp32 accumulator, optionally the matching up-projection
tile, and an epilogue. That part lives here, once:

* :func:`expert_tile_product` - the K loop. ``a_rows`` are element offsets of the tile's rows,
  one per row, each naming a row that is safe to read (a layout points its padding rows at a
  real row, so the loads need no row mask and stay unpredicated); weight columns past ``N`` wrap
  around for the same reason. With ``GATED`` it also multiplies by the up half of a ``[2N, K]``
  ``w1`` (rows ``N..2N``) and returns ``silu(gate) * up``, computed in fp32: this is the fused
  SiLU·mul of GEMM 1, so the ``[rows, 2N]`` pre-activation never reaches memory.
* :func:`scale_rows` - the routed-weight epilogue of GEMM 2: each row times its routing weight,
  in fp32, before the single rounding to the output dtype.
* :func:`store_tile` - the masked store: only real rows and columns ``< N`` are written.

Host side: :func:`dot_precision` (fp32 inputs would silently run as TF32), :func:`check_out`
(a caller's output buffer) and :func:`in_float32_under_interpreter`, the one workaround for
Triton's interpreter, whose bf16 ``tl.dot`` multiplies raw bit patterns (triton issue 11584) and
whose fp32 -> bf16 stores truncate.
"""

from __future__ import annotations

import torch

from .._checks import check_tensor, fail
from .._runtime import HAS_TRITON, interpreted_bf16, kernel, tl

if HAS_TRITON:

    @kernel
    def expert_tile_product(
        a_ptr, a_rows, w_ptr, stride_wn, pid_n, N, K,
        GATED: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """fp32 ``[BLOCK_M, BLOCK_N]``: ``A[a_rows, :K] @ W[cols, :K]^T`` (``silu(gate) * up`` when
        ``GATED``) for output columns ``cols = pid_n * BLOCK_N + [0, BLOCK_N)``.

        ``a_ptr``/``w_ptr`` point at ``A`` and at this expert's ``W``, both contiguous along K;
        ``a_rows`` (int64) are the element offsets of the tile's rows in ``A``.
        """
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] + ks[None, :]
        w_ptrs = w_ptr + (cols % N).to(tl.int64)[None, :] * stride_wn + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            up_ptrs = w_ptrs + N * stride_wn
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
                w = tl.load(w_ptrs, mask=ks[:, None] < k_left, other=0.0)
            acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
            if GATED:
                if EVEN_K:
                    up = tl.load(up_ptrs)
                else:
                    up = tl.load(up_ptrs, mask=ks[:, None] < k_left, other=0.0)
                acc_up = tl.dot(a, up, acc_up, input_precision=INPUT_PRECISION)
                up_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        return acc

    @kernel
    def scale_rows(acc, weights_ptr, assignments, row_real):
        """GEMM 2's epilogue: row ``i`` of ``acc`` times ``weights[assignments[i]]``, in fp32."""
        weight = tl.load(weights_ptr + assignments, mask=row_real, other=0.0).to(tl.float32)
        return acc * weight[:, None]

    @kernel
    def store_tile(out_ptr, out_rows, row_real, acc, pid_n, N, BLOCK_N: tl.constexpr):
        """Write the real rows (``row_real``) and the columns ``< N`` of a tile, cast once."""
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + out_rows[:, None] + cols[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_real[:, None] & (cols[None, :] < N))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: true fp32 for fp32 inputs (the default would be TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_out(func: str, out: object, shape: tuple, like: torch.Tensor, *,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A caller's contiguous output buffer of ``shape`` (checked), or a new one like ``like``."""
    dtype = like.dtype if dtype is None else dtype
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    check_tensor(func, "out", out, dtypes=(dtype,), device=like.device, contiguous=True)
    if tuple(out.shape) != tuple(shape):
        fail(func, "out", f"must have shape {tuple(shape)}", f"shape {tuple(out.shape)}")
    return out


def in_float32_under_interpreter(run, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor | None:
    """Under the interpreter, run a bf16 GEMM stage in float32 and round into ``out`` once.

    ``run(float32_inputs..., out=float32_buffer)`` is the stage itself. Returns ``out`` when it
    did so, None when the inputs need no workaround (the caller then launches as usual).
    """
    if not interpreted_bf16(out, *inputs):
        return None
    wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    widened = [t.float() if t.dtype == torch.bfloat16 else t for t in inputs]
    run(*widened, out=wide)
    return out.copy_(wide)


def gemm_width(func: str, w: torch.Tensor, silu_mul: bool) -> int:
    """Output columns of a grouped GEMM over ``w [E, N_w, K]``: ``N_w``, or ``N_w/2`` when the
    SiLU·mul epilogue halves it."""
    if not silu_mul:
        return w.shape[1]
    if w.shape[1] % 2:
        fail(func, "w", "must have an even number of rows [gate | up] when silu_mul=True", f"shape {tuple(w.shape)}")
    return w.shape[1] // 2


def expert_rows_product(x_rows: torch.Tensor, w_expert: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    """Torch reference of one expert's tile product, in float32 like the kernels' accumulators."""
    h = x_rows.float() @ w_expert.float().T
    if silu_mul:
        gate, up = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
    return h
