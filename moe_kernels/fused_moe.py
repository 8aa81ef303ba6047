"""Index-gather fused MoE: two grouped GEMMs that read activations through the alignment indices.

This is vLLM's layout (vllm-project/vllm, ``vllm/model_executor/layers/fused_moe/fused_moe.py``,
``fused_moe_kernel``), written afresh. The activations are never copied into expert order.
Instead the alignment step (:func:`moe_kernels.align.moe_align_block_size`) lists, expert by
expert, which *assignments* (positions in ``topk_ids.flatten()``) each expert serves, padded to
whole blocks of ``BLOCK_M`` rows. One Triton program then owns one M-block and one N-tile:

1. it reads its block's expert id, and the ``BLOCK_M`` assignment indices of its block;
2. it gathers the matching activation rows as ``assignment // top_k`` (assignment ``a`` belongs
   to token ``a // top_k``), masking the padding rows (index ``>= numel``);
3. it streams that expert's weight tile and multiplies.

GEMM 1 reads ``w1[e]`` (``[2F, d]``: gate rows, then up rows). Each program computes the gate
tile *and* the matching up tile, so ``silu(gate) * up`` happens in the epilogue, in fp32, and
only ``[numel, F]`` is written: vLLM writes ``[numel, 2F]`` and runs a separate activation
kernel that reads it back. GEMM 2 reads ``w2[e]`` (``[d, F]``) with ``top_k = 1``, because its
input rows are already in assignment order; its epilogue multiplies by the routing weight in
fp32 before the cast and writes ``[T, k, d]``. :func:`moe_sum` adds the ``k`` slots of each
token (fp32 accumulation) into ``[T, d]``.

When a batch is so small that almost every assignment hits a different expert
(``num_tokens * top_k * 4 <= num_experts``, vLLM's rule), sorting buys nothing: block ``m``
is simply assignment ``m`` (one real row, the rest masked), and its expert is
``topk_ids.flatten()[m]``. That is the *naive block assignment*; no alignment kernel runs.

Worked example: two tokens, top-2 of three experts, ``block_m = 16``::

    >>> import torch
    >>> from moe_kernels.reference import moe_reference
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.randn(2, 32, generator=g)
    >>> w1 = torch.randn(3, 2 * 16, 32, generator=g) / 8   # E=3, F=16, d=32
    >>> w2 = torch.randn(3, 32, 16, generator=g) / 4
    >>> ids = torch.tensor([[2, 0], [2, 1]])
    >>> weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    >>> blocks = assign_blocks(ids, 16, 3, naive=False)
    >>> blocks.sorted_token_ids[:16].tolist()   # expert 0's block: assignment 1, then padding (4)
    [1, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    >>> blocks.expert_ids[:3].tolist()          # one block per expert touched
    [0, 1, 2]
    >>> out = fused_experts(x, w1, w2, weights, ids)
    >>> ref = moe_reference(x, w1, w2, weights, ids)
    >>> bool(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref) < 1e-5)
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from . import _runtime
from ._checks import check_int, check_moe_inputs, check_tensor, fail
from ._runtime import HAS_TRITON, tl, triton, use_triton
from .align import moe_align_block_size, use_naive_block_assignment
from .reference import silu_and_mul_reference

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ID_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------
# Tile configuration
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Tiles and launch settings of one grouped GEMM (the M tile is shared, see FusedMoEConfig).

    ``block_n`` counts *output* columns: for GEMM 1 a program loads ``2 * block_n`` weight rows
    (the gate tile and the matching up tile). ``group_m`` M-blocks are visited before moving to
    the next N-tile, so that M-blocks of one expert share weight tiles in L2.
    """

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class FusedMoEConfig:
    """The M tile (which is also the alignment block size) and the tiles of both GEMMs."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "FusedMoEConfig":
        return FusedMoEConfig(d["block_m"], GemmTiles(**d["gate_up"]), GemmTiles(**d["down"]))


def default_config(M: int, E: int, N: int, K: int) -> FusedMoEConfig:
    """vLLM's bf16 heuristic (``get_default_config``), for ``M`` tokens, ``N = F``, ``K = d``.

    vLLM runs one config for both GEMMs. Its GEMM 1 tile of ``block_n`` columns of ``[2F, d]``
    covers ``block_n / 2`` gate and ``block_n / 2`` up columns, so our fused gate/up GEMM takes
    half the N tile to keep the same weight tile per program.
    """
    block_m = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
    block_n = 64 if M <= 64 else 128
    block_k = 128 if M <= 64 else 64
    group_m = 16 if M // max(E, 1) > 128 else 1
    num_warps = 4 if M <= 128 else 8
    num_stages = 4 if M <= 32 else 3
    return FusedMoEConfig(
        block_m,
        GemmTiles(max(16, block_n // 2), block_k, group_m, num_warps, num_stages),
        GemmTiles(block_n, block_k, group_m, num_warps, num_stages),
    )


def _cfg(block_m: int, gate_up: tuple, down: tuple) -> FusedMoEConfig:
    return FusedMoEConfig(block_m, GemmTiles(*gate_up), GemmTiles(*down))


# Measured on an NVIDIA H200 with torch 2.11 / triton 3.6, bf16, uniform routing
# (`python -m moe_kernels.bench --tune`; results/nvidia-h200/fused-moe-tuning.json and
# notes/perf-fused-moe.md). Keyed by (device name, E, N = F, K = d), then by token count M;
# tiles are (block_n, block_k, group_m, num_warps, num_stages).
_TUNED: dict[tuple[str, int, int, int], dict[int, FusedMoEConfig]] = {
    ("NVIDIA H200", 256, 2048, 7168): {  # deepseek-v3
        1: _cfg(16, (128, 128, 1, 4, 3), (256, 128, 1, 4, 3)),
        2: _cfg(16, (64, 256, 1, 4, 3), (128, 128, 1, 4, 5)),
        4: _cfg(16, (32, 256, 1, 4, 5), (128, 256, 1, 4, 3)),
        8: _cfg(16, (32, 256, 1, 4, 5), (128, 256, 1, 4, 3)),
        16: _cfg(16, (32, 256, 1, 4, 5), (128, 128, 1, 4, 5)),
        32: _cfg(16, (32, 256, 1, 4, 5), (256, 128, 1, 4, 3)),
        64: _cfg(16, (32, 256, 1, 4, 5), (256, 128, 1, 4, 3)),
        128: _cfg(16, (32, 256, 1, 4, 5), (128, 128, 1, 4, 4)),
        256: _cfg(16, (32, 256, 1, 4, 3), (128, 128, 1, 4, 4)),
        512: _cfg(32, (128, 128, 8, 4, 3), (128, 128, 8, 4, 3)),
        1024: _cfg(64, (64, 128, 8, 4, 4), (128, 64, 8, 8, 4)),
        2048: _cfg(64, (128, 64, 8, 8, 4), (128, 64, 8, 8, 4)),
        4096: _cfg(128, (128, 64, 8, 8, 4), (256, 64, 8, 8, 4)),
        8192: _cfg(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3)),
        16384: _cfg(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3)),
    },
    ("NVIDIA H200", 128, 768, 2048): {  # qwen3-30b-a3b
        1: _cfg(16, (64, 128, 1, 4, 5), (32, 256, 1, 4, 3)),
        2: _cfg(16, (64, 128, 1, 4, 3), (128, 128, 1, 4, 3)),
        4: _cfg(16, (64, 128, 1, 4, 3), (128, 128, 1, 4, 4)),
        8: _cfg(16, (64, 128, 1, 4, 5), (128, 128, 1, 4, 3)),
        16: _cfg(16, (64, 128, 1, 4, 5), (256, 128, 1, 4, 3)),
        32: _cfg(16, (64, 256, 1, 4, 3), (128, 128, 1, 4, 3)),
        64: _cfg(16, (128, 128, 1, 4, 3), (128, 128, 1, 4, 4)),
        128: _cfg(16, (128, 128, 1, 4, 3), (128, 128, 1, 4, 4)),
        256: _cfg(32, (128, 128, 8, 8, 3), (128, 128, 8, 4, 3)),
        512: _cfg(32, (128, 128, 8, 4, 3), (128, 64, 8, 4, 3)),
        1024: _cfg(64, (128, 64, 8, 8, 4), (128, 64, 8, 8, 3)),
        2048: _cfg(128, (128, 64, 8, 8, 4), (256, 64, 8, 8, 4)),
        4096: _cfg(128, (128, 64, 8, 8, 4), (256, 64, 8, 8, 4)),
        8192: _cfg(128, (128, 64, 8, 8, 4), (256, 64, 8, 8, 4)),
        16384: _cfg(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3)),
    },
}


@functools.lru_cache(maxsize=None)
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def tuned_config(device_name: str, M: int, E: int, N: int, K: int) -> FusedMoEConfig | None:
    """The measured bf16 config for this GPU and shape at the nearest token count (by ratio), if any."""
    table = _TUNED.get((device_name, E, N, K))
    if not table:
        return None
    return table[min(table, key=lambda m: (abs(math.log(m / max(M, 1))), m))]


def get_config(M: int, E: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str) -> FusedMoEConfig:
    """The tile configuration for ``M`` tokens over ``E`` experts with ``F = N``, ``d = K``.

    A tuned entry (:func:`tuned_config`) is used when one was measured for this GPU and shape
    in bf16, otherwise :func:`default_config`.
    """
    device = torch.device(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        tuned = tuned_config(_device_name(device.index), M, E, N, K)
        if tuned is not None:
            return tuned
    return default_config(M, E, N, K)


# ----------------------------------------------------------------------------------------------
# Which rows each M-block reads
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockAssignment:
    """What each M-block of ``block_m`` rows reads, and which expert it multiplies by.

    ``sorted_token_ids is None`` marks the naive assignment: block ``m`` is assignment ``m``
    alone, and ``expert_ids`` is ``topk_ids.flatten()``. Otherwise the three tensors are
    :func:`moe_align_block_size`'s outputs. ``num_m_blocks`` is the launch grid along M: an upper
    bound on the blocks in use (programs past ``num_tokens_post_padded`` return at once).
    """

    block_m: int
    expert_ids: torch.Tensor
    sorted_token_ids: torch.Tensor | None
    num_tokens_post_padded: torch.Tensor | None
    num_m_blocks: int

    @property
    def naive(self) -> bool:
        return self.sorted_token_ids is None


def assign_blocks(topk_ids: torch.Tensor, block_m: int, num_experts: int, *, naive: bool | None = None,
                  validate_ids: bool = True) -> BlockAssignment:
    """Build the block map for ``topk_ids``: naive when ``naive`` says so, or by default when
    :func:`moe_kernels.align.use_naive_block_assignment` (vLLM's ``T * k * 4 <= E``) holds.

    The naive map needs no index tensors at all (the kernel computes "row 0 of block ``m`` is
    assignment ``m``" itself), so at decode no kernel runs before the GEMMs. The alignment's
    own :func:`moe_kernels.align.naive_block_assignment` builds the same map as explicit
    tensors, which the aligned path also accepts.

    ``validate_ids`` is passed to the alignment (its range check costs a host sync on the GPU).
    """
    func = "assign_blocks"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES)
    check_int(func, "block_m", block_m, lo=16)
    check_int(func, "num_experts", num_experts, lo=1)
    num_tokens, top_k = topk_ids.shape
    numel = topk_ids.numel()
    if naive is None:
        naive = use_naive_block_assignment(num_tokens, top_k, num_experts)
    if naive:
        return BlockAssignment(block_m, topk_ids.reshape(-1).contiguous(), None, None, numel)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, block_m, num_experts,
                                                                   validate_ids=validate_ids)
    # Each non-empty expert wastes at most block_m - 1 padding rows, and at most min(E, numel)
    # experts are non-empty: no need to launch programs for the worst case of every expert.
    bound = numel + min(num_experts, numel) * (block_m - 1)
    num_m_blocks = min(expert_ids.numel(), -(-bound // block_m))
    return BlockAssignment(block_m, expert_ids, sorted_ids, num_post_padded, num_m_blocks)


def _assignments_by_block(blocks: BlockAssignment, numel: int):
    """(assignment index, expert id) for every real row of the block map, as the kernel sees them."""
    if blocks.naive:
        return torch.arange(numel, device=blocks.expert_ids.device), blocks.expert_ids.long()
    used = int(blocks.num_tokens_post_padded[0])
    rows = blocks.sorted_token_ids[:used].long()
    experts = blocks.expert_ids.long().repeat_interleave(blocks.block_m)[:used]
    real = rows < numel
    return rows[real], experts[real]


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_m_blocks", "num_valid_rows"])
    def _expert_gemm_kernel(
        a_ptr, b_ptr, c_ptr, topk_weights_ptr,
        sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
        num_m_blocks, num_valid_rows, N, K,
        stride_am, stride_be, stride_bn, stride_cm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        TOP_K: tl.constexpr,
        NAIVE_BLOCKS: tl.constexpr,
        SILU_AND_MUL: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr,
        EVEN_K: tl.constexpr,
        IEEE_FP32: tl.constexpr,
    ):
        # C[row] = A[row // TOP_K] @ B[expert]^T for the rows of one M-block; B is [E, N', K].
        pid = tl.program_id(0)
        num_n_tiles = tl.cdiv(N, BLOCK_N)
        # Walk GROUP_M M-blocks down one N-tile before moving right, so that consecutive programs
        # of one expert reuse the same weight tile from L2.
        programs_per_group = GROUP_M * num_n_tiles
        first_m = (pid // programs_per_group) * GROUP_M
        group_rows = min(num_m_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % programs_per_group) % group_rows
        pid_n = (pid % programs_per_group) // group_rows

        offs_m = tl.arange(0, BLOCK_M)
        if NAIVE_BLOCKS:
            rows = tl.where(offs_m == 0, pid_m, num_valid_rows).to(tl.int64)
        else:
            if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
                return
            rows = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + offs_m).to(tl.int64)
        row_real = rows < num_valid_rows
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :]
        c_mask = row_real[:, None] & (offs_n[None, :] < N)
        if expert == -1:
            # The block's expert is not computed here (vLLM: expert parallelism): its rows are 0.
            tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
            return

        offs_k = tl.arange(0, BLOCK_K)
        # Padding rows read row 0 instead of being masked: loads stay unpredicated, and those rows
        # are never stored.
        a_rows = tl.where(row_real, rows // TOP_K, 0)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        # Columns past N wrap around for the same reason; their results are masked at the store.
        b_ptrs = b_ptr + expert * stride_be + (offs_n % N)[None, :] * stride_bn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SILU_AND_MUL:
            up_ptrs = b_ptrs + N * stride_bn
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if IEEE_FP32:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if SILU_AND_MUL:
                if EVEN_K:
                    up = tl.load(up_ptrs)
                else:
                    up = tl.load(up_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                if IEEE_FP32:
                    acc_up = tl.dot(a, up, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(a, up, acc_up)
                up_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        if SILU_AND_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if MUL_ROUTED_WEIGHT:
            weight = tl.load(topk_weights_ptr + rows, mask=row_real, other=0.0).to(tl.float32)
            acc = acc * weight[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

    @triton.jit
    def _moe_sum_kernel(x_ptr, out_ptr, D, stride_xt, stride_xk, stride_ot,
                        TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for slot in tl.static_range(TOP_K):
            acc += tl.load(x_ptr + token * stride_xt + slot * stride_xk + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + token * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _interpreted_bf16(*tensors: torch.Tensor) -> bool:
    # The interpreter's bf16 tl.dot multiplies raw bit patterns (triton issue 11584).
    return _runtime.INTERPRET and any(t.dtype == torch.bfloat16 for t in tensors)


def _launch_expert_gemm(a, b, out, topk_weights, blocks: BlockAssignment, *, n_out: int, top_k: int,
                        silu_and_mul: bool, tiles: GemmTiles) -> None:
    num_valid_rows = out.shape[0]
    k_in = a.shape[1]
    grid = (blocks.num_m_blocks * triton.cdiv(n_out, tiles.block_n),)
    if grid[0] == 0:
        return
    # Unused pointer arguments (naive blocks have no sorted ids, GEMM 1 has no weights) get any
    # tensor: the constexpr flags compile the loads away.
    sorted_ids = blocks.expert_ids if blocks.naive else blocks.sorted_token_ids
    num_post_padded = blocks.expert_ids if blocks.naive else blocks.num_tokens_post_padded
    _expert_gemm_kernel[grid](
        a, b, out, topk_weights if topk_weights is not None else out,
        sorted_ids, blocks.expert_ids, num_post_padded,
        blocks.num_m_blocks, num_valid_rows, n_out, k_in,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=blocks.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        TOP_K=top_k,
        NAIVE_BLOCKS=blocks.naive,
        SILU_AND_MUL=silu_and_mul,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        EVEN_K=k_in % tiles.block_k == 0,
        IEEE_FP32=a.dtype == torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _check_out(func: str, out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor(func, "out", out, dtypes=(like.dtype,), device=like.device, contiguous=True)
    if tuple(out.shape) != tuple(shape):
        fail(func, "out", f"must have shape {tuple(shape)}", f"shape {tuple(out.shape)}")
    return out


# ----------------------------------------------------------------------------------------------
# The three stages
# ----------------------------------------------------------------------------------------------


def expert_gate_up(hidden_states: torch.Tensor, w1: torch.Tensor, blocks: BlockAssignment, top_k: int, *,
                   tiles: GemmTiles, out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM 1 with SiLU-and-mul in its epilogue: row ``a`` of the result (``[numel, F]``) is
    ``silu(w1[e][:F] @ x_t) * (w1[e][F:] @ x_t)`` for assignment ``a`` = (token ``t``, expert ``e``).

    Rows follow the assignment order of ``topk_ids.flatten()``. Inputs are assumed checked
    (see :func:`fused_experts`).
    """
    numel = hidden_states.shape[0] * top_k
    f = w1.shape[1] // 2
    out = _check_out("expert_gate_up", out, (numel, f), hidden_states)
    if not use_triton(hidden_states, w1, out):
        out.copy_(_gate_up_reference(hidden_states, w1, blocks, top_k))
        return out
    _launch_expert_gemm(hidden_states, w1, out, None, blocks, n_out=f, top_k=top_k, silu_and_mul=True, tiles=tiles)
    return out


def expert_down(intermediate: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, blocks: BlockAssignment, *,
                tiles: GemmTiles, out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM 2: row ``a`` of the result is ``topk_weights.flatten()[a] * (w2[e] @ intermediate[a])``.

    ``intermediate`` is :func:`expert_gate_up`'s ``[numel, F]``; the result is ``[T, k, d]``
    (assignment order), the routing weight applied in fp32 before the cast.
    """
    num_tokens, top_k = topk_weights.shape
    d = w2.shape[1]
    out = _check_out("expert_down", out, (num_tokens, top_k, d), intermediate)
    flat_out = out.view(num_tokens * top_k, d)
    if not use_triton(intermediate, w2, topk_weights, out):
        flat_out.copy_(_down_reference(intermediate, w2, topk_weights, blocks))
        return out
    _launch_expert_gemm(intermediate, w2, flat_out, topk_weights.contiguous(), blocks, n_out=d, top_k=1,
                        silu_and_mul=False, tiles=tiles)
    return out


def moe_sum(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the ``k`` slots of ``x`` (``[T, k, d]``) into ``[T, d]``, accumulating in fp32.

    >>> moe_sum(torch.arange(12.0).reshape(2, 3, 2)).tolist()
    [[6.0, 9.0], [24.0, 27.0]]
    """
    func = "moe_sum"
    check_tensor(func, "x", x, ndim=3, dtypes=_FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, top_k, d = x.shape
    out = _check_out(func, out, (num_tokens, d), x)
    if not use_triton(x, out):
        out.copy_(moe_sum_reference(x))
        return out
    if num_tokens == 0 or d == 0:
        return out
    block_d = min(1024, triton.next_power_of_2(d))
    grid = (num_tokens, triton.cdiv(d, block_d))
    _moe_sum_kernel[grid](x, out, d, x.stride(0), x.stride(1), out.stride(0),
                          TOP_K=top_k, BLOCK_D=block_d, num_warps=4)
    return out


# ----------------------------------------------------------------------------------------------
# Torch references of the three stages (used without Triton, and by the tests)
# ----------------------------------------------------------------------------------------------


def _gate_up_reference(hidden_states, w1, blocks: BlockAssignment, top_k: int) -> torch.Tensor:
    numel = hidden_states.shape[0] * top_k
    rows, experts = _assignments_by_block(blocks, numel)
    out = torch.zeros(numel, w1.shape[1] // 2, dtype=torch.float32, device=hidden_states.device)
    for e in torch.unique(experts[experts >= 0]).tolist():
        mine = rows[experts == e]
        h = hidden_states[mine // top_k].float() @ w1[e].float().T
        out[mine] = silu_and_mul_reference(h)
    return out.to(hidden_states.dtype)


def _down_reference(intermediate, w2, topk_weights, blocks: BlockAssignment) -> torch.Tensor:
    numel = topk_weights.numel()
    rows, experts = _assignments_by_block(blocks, numel)
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros(numel, w2.shape[1], dtype=torch.float32, device=intermediate.device)
    for e in torch.unique(experts[experts >= 0]).tolist():
        mine = rows[experts == e]
        out[mine] = weights[mine, None] * (intermediate[mine].float() @ w2[e].float().T)
    return out.to(intermediate.dtype)


def moe_sum_reference(x: torch.Tensor) -> torch.Tensor:
    """Torch reference for :func:`moe_sum`."""
    return x.float().sum(dim=1).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_size_m: int | None = None,
    config: FusedMoEConfig | None = None,
    blocks: BlockAssignment | None = None,
    naive_block_assignment: bool | None = None,
    validate_ids: bool = True,
) -> torch.Tensor:
    """The routed experts' output ``[T, d]``: ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t)``.

    ``w1`` is ``[E, 2F, d]`` (gate rows, then up rows), ``w2`` is ``[E, d, F]``, ``hidden_states``
    ``[T, d]``, ``topk_weights`` / ``topk_ids`` ``[T, k]`` (0-based expert ids).

    ``config`` defaults to :func:`get_config`; ``block_size_m`` overrides its M tile.
    ``blocks`` passes a precomputed :func:`assign_blocks` result (its ``block_m`` wins), e.g. to
    time the GEMMs without the alignment. ``naive_block_assignment`` forces the small-batch path
    on or off (default: vLLM's rule, see :func:`assign_blocks`). ``validate_ids`` checks every id lies in
    ``[0, E)``, which costs a device-to-host read: turn it off inside CUDA graphs and timed loops.

    Under the Triton interpreter (no GPU), bf16 inputs are computed in fp32 and the result is
    cast back to bf16, because the interpreter's bf16 dot is wrong.
    """
    func = "fused_experts"
    check_moe_inputs(func, hidden_states, w1, w2, topk_weights, topk_ids, allow_empty=True,
                     validate_ids=validate_ids)
    if block_size_m is not None:
        check_int(func, "block_size_m", block_size_m, lo=16)
    if _interpreted_bf16(hidden_states):
        return fused_experts(hidden_states.float(), w1.float(), w2.float(), topk_weights, topk_ids,
                             block_size_m=block_size_m, config=config, blocks=blocks,
                             naive_block_assignment=naive_block_assignment, validate_ids=False).to(torch.bfloat16)
    num_tokens, d = hidden_states.shape
    num_experts, two_f, _ = w1.shape
    top_k = topk_ids.shape[1]
    if config is None:
        config = get_config(num_tokens, num_experts, two_f // 2, d, hidden_states.dtype, hidden_states.device)
    if blocks is None:
        block_m = block_size_m if block_size_m is not None else config.block_m
        # The ids were range-checked above when asked for: the alignment need not do it again.
        blocks = assign_blocks(topk_ids, block_m, num_experts, naive=naive_block_assignment, validate_ids=False)
    intermediate = expert_gate_up(hidden_states, w1, blocks, top_k, tiles=config.gate_up)
    per_slot = expert_down(intermediate, w2, topk_weights, blocks, tiles=config.down)
    return moe_sum(per_slot)


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    *,
    block_size_m: int | None = None,
    config: FusedMoEConfig | None = None,
) -> torch.Tensor:
    """The whole routed layer from router logits: ``fused_topk`` (softmax top-k), then
    :func:`fused_experts`. ``gating_output`` is ``[T, E]``."""
    from .routing import fused_topk

    topk_weights, topk_ids = fused_topk(hidden_states, gating_output, topk, renormalize)
    # The ids come from our own top-k over E logits, so the range check (a host sync) is skipped.
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, block_size_m=block_size_m,
                         config=config, validate_ids=False)
