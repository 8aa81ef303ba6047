"""Index-gather fused MoE: two grouped GEMMs that read activations through the alignment indices.

(Over 400 lines, and kept whole: the layout's kernel, its two stages, each a checked public
function over the unchecked one that :class:`~moe_kernels.layer.MoELayer` calls after checking
once, and the layout's entry points are one mechanism; split, the halves would import each other.)

This is vLLM's layout (vllm-project/vllm, ``vllm/model_executor/layers/fused_moe/fused_moe.py``,
``fused_moe_kernel``), written afresh. The activations are never copied into expert order.
Instead the alignment step (:func:`moe_kernels.kernels.align.moe_align_block_size`) lists, expert by
expert, which *assignments* (positions in ``topk_ids.flatten()``) each expert serves, padded to
whole blocks of ``BLOCK_M`` rows. One Triton program then owns one M-block and one N-tile:

1. it reads its block's expert id, and the ``BLOCK_M`` assignment indices of its block;
2. it gathers the matching activation rows as ``assignment // top_k`` (assignment ``a`` belongs
   to token ``a // top_k``); padding rows (index ``>= numel``) read row 0 and are never stored;
3. it streams that expert's weight tile and multiplies, in the tile-GEMM core shared by all
   layouts (:mod:`moe_kernels.kernels._tile_gemm`).

GEMM 1 reads ``w1[e]`` (``[2F, d]``: gate rows, then up rows) and computes the gate tile *and*
the matching up tile, so ``silu(gate) * up`` happens in the epilogue, in fp32, and only
``[numel, F]`` is written (vLLM writes ``[numel, 2F]`` and runs a separate activation kernel).
GEMM 2 reads ``w2[e]`` (``[d, F]``) with ``top_k = 1``: its rows are already one per assignment,
but it still reads them through ``sorted_token_ids`` in expert order, a real gather. Its epilogue
multiplies by the routing weight in fp32 before the cast and writes ``[T, k, d]``, which
:func:`~moe_kernels.kernels.combine.moe_sum` adds up per token (or, with
``MoEConfig.sum_in_gemm``, adds each row straight into an fp32 ``[T, d]`` with atomics). Tiny batches (vLLM's
``T * k * 4 <= E``; block fp8 up to 2 tokens) skip the alignment: block ``m`` is assignment ``m``, and from two
tokens on the first block of an expert's assignments takes them all (:mod:`moe_kernels.kernels.blocks`).

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

import functools
import os

import torch

from .._checks import FLOAT_DTYPES, check_ids_in_range, check_int, check_moe_inputs, check_tensor, fail
from .._replay import CallPlans
from .._runtime import (HAS_TRITON, INTERPRET, cdiv, device_assert_options, interpreted_bf16, kernel, note_launch,
                        recording, tl, use_triton)
from ._gemm_operands import check_operands, check_out, dequantized, in_float32_under_interpreter, output_dtype
from ._tile_gemm import dot_precision, programs_per_device, weight_descriptor
from .blocks import (BlockAssignment, assign_blocks, assignments_by_block, build_blocks, check_blocks,  # noqa: F401
                     dense_blocks)
from .activation import silu_mul_rows
from .combine import sum_slots
from .config import GemmTiles, MoEConfig, check_block_m, check_config, check_tiles, get_config, separate_sum_tiles
from . import _pdl
from ._pdl import LINE_BYTES, pdl_available
from .formats import WeightFormat
from .gather_tile import rows_reference
from .one_launch import run_one_launch, runs_in_one_launch
from .quant import FP8

if HAS_TRITON:
    from ._pdl import gdc_launch_dependents, gdc_wait
    from .gather_tile import _index_gather_tile, _prefetch_tile_weights


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    # (num_experts is not specialised: a tuner that compiles on a one-expert problem gets the binary
    # the 128- and 256-expert layers run.)
    @kernel(do_not_specialize=["num_m_blocks", "num_valid_rows", "num_experts", "num_tiles"])
    def _index_gather_gemm_kernel(
        a_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
        num_m_blocks, num_valid_rows, num_experts, N, K, stride_am, stride_we, stride_wn, stride_om,
        a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        TOP_K: tl.constexpr, NAIVE_BLOCKS: tl.constexpr, DENSE: tl.constexpr, GATED: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        SCALES: tl.constexpr, SUM_TOP_K: tl.constexpr, SPLIT_K: tl.constexpr, w_desc, TMA_W: tl.constexpr,
        num_tiles, PERSISTENT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, ID_CHECK: tl.constexpr,
        SWAP_AB: tl.constexpr, PDL_TRIGGER: tl.constexpr = 0, PDL_WAIT: tl.constexpr = False,
        PREFETCH_LINE: tl.constexpr = 64, PREFETCH_K: tl.constexpr = -1, out_scale_ptr=None, stride_os=0,
        QUANT_GROUP: tl.constexpr = 0, ROUND_TO: tl.constexpr = "", NAIVE_GROUP: tl.constexpr = 0,
        K_CHUNKS: tl.constexpr = 1,
    ):
        # FLAT (persistent=2 without split-K): the tile loop and the K loop flattened into one software
        # pipeline, so that the next tile's loads start under this tile's epilogue. Triton 3.6 fuses
        # them only if the K loop sits under no branch and has the same bounds in every tile (a split-K
        # slice's bounds differ by tile): the flattened loop visits the blocks in use only, in the same
        # grouped order, so that every tile it visits can enter the K loop.
        FLAT: tl.constexpr = (PERSISTENT == 2) and (SPLIT_K == 1) and (not NAIVE_BLOCKS) and (not DENSE)
        m_blocks = num_m_blocks
        # Programmatic dependent launch (moe_kernels.kernels._pdl): GEMM 1 lets GEMM 2 launch at
        # once; GEMM 2 may ask L2 for its first tile's weights (PREFETCH_K columns; none by
        # default), then waits for GEMM 1 to finish. GEMM 1 behind the router (wait and trigger)
        # reads nothing before its wait, and lets GEMM 2 launch only after it: the block map that
        # GEMM 2's prefetch would read is then final.
        if PDL_TRIGGER == 1 and not PDL_WAIT:
            gdc_launch_dependents()
        if PDL_WAIT:
            if PREFETCH_K != 0:   # (never GEMM 1: _launch passes it 0)
                if FLAT:
                    m_blocks = tl.minimum(tl.cdiv(tl.load(num_tokens_post_padded_ptr), BLOCK_M), num_m_blocks)
                _prefetch_tile_weights(tl.program_id(0), w_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
                                       m_blocks, num_experts, N, K if PREFETCH_K < 0 else tl.minimum(K, PREFETCH_K),
                                       stride_we, stride_wn, BLOCK_M, BLOCK_N, GROUP_M, SPLIT_K, NAIVE_BLOCKS, DENSE,
                                       PREFETCH_LINE)
            gdc_wait()
            if PDL_TRIGGER == 1:
                gdc_launch_dependents()
        if FLAT:
            m_blocks = tl.minimum(tl.cdiv(tl.load(num_tokens_post_padded_ptr), BLOCK_M), num_m_blocks)
        # One tile per program, or (PERSISTENT) one program per SM walking tiles pid, pid + grid, ...
        if PERSISTENT == 0:
            _index_gather_tile(
                tl.program_id(0), a_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                num_tokens_post_padded_ptr, num_m_blocks, num_valid_rows, num_experts, N, K,
                stride_am, stride_we, stride_wn, stride_om,
                a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TOP_K, NAIVE_BLOCKS, DENSE, GATED, MUL_ROUTED_WEIGHT, EVEN_K,
                INPUT_PRECISION, SCALES, SUM_TOP_K, SPLIT_K, w_desc, TMA_W, SCALE_BN, SCALE_BK, ID_CHECK, SWAP_AB,
                out_scale_ptr, stride_os, QUANT_GROUP, ROUND_TO, False, NAIVE_GROUP, K_CHUNKS)
        else:
            tiles = num_tiles
            if FLAT:
                tiles = m_blocks * tl.cdiv(N, BLOCK_N)
            for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLAT):
                _index_gather_tile(
                    tile, a_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                    num_tokens_post_padded_ptr, m_blocks, num_valid_rows, num_experts, N, K,
                    stride_am, stride_we, stride_wn, stride_om,
                    a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                    BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TOP_K, NAIVE_BLOCKS, DENSE, GATED, MUL_ROUTED_WEIGHT, EVEN_K,
                    INPUT_PRECISION, SCALES, SUM_TOP_K, SPLIT_K, w_desc, TMA_W, SCALE_BN, SCALE_BK, ID_CHECK,
                    SWAP_AB, out_scale_ptr, stride_os, QUANT_GROUP, ROUND_TO, FLAT, NAIVE_GROUP,
                    K_CHUNKS)
        if PDL_TRIGGER == 2:
            gdc_launch_dependents()


#: Which GEMM of the naive block map carries its id check, a device assert (the map's labels are
#: the caller's ids, read by no launch before the GEMMs): "down" (GEMM 2) or "gate_up" (GEMM 1).
#: Either is safe: neither GEMM reads through an id outside [0, E), checked or not; the assert
#: only says so. GEMM 2, because there the layer's check costs no GPU time beyond the run-to-run
#: spread (``bench layer --id-check-only`` on the H200: -2.43..+1.22 us at 1, 8 and 64 tokens,
#: both models, bf16 and fp8), while a checked fp8 GEMM 1 measured slower: about 3 us in Qwen3's
#: GEMM 1 kernel at one token, twice (``tools/id_check_gemm1_ab.py``, the profile of each replay).
#: Why is not known (the same TTGIR but the assert, the same loads, no spills). Read at import from
#: ``MOE_KERNELS_NAIVE_ID_CHECK_IN``; a change later reaches only calls not yet recorded
#: (``moe_kernels._replay.forget_all_plans()`` forgets the recorded ones and their graphs).
NAIVE_ID_CHECK_IN = os.environ.get("MOE_KERNELS_NAIVE_ID_CHECK_IN") or "down"
if NAIVE_ID_CHECK_IN not in ("gate_up", "down"):
    raise ValueError("environment variable MOE_KERNELS_NAIVE_ID_CHECK_IN must be 'down' or 'gate_up' (unset: "
                     f"'down'), got {NAIVE_ID_CHECK_IN!r}")


def _launch(a, w, out, topk_weights, blocks: BlockAssignment, *, n_out: int, top_k: int, gated: bool,
            tiles: GemmTiles, scales: tuple, sum_top_k: int = 0, pdl: str = "", quant: tuple | None = None,
            role: str = "") -> None:
    """One GEMM launch. ``pdl`` (see :mod:`moe_kernels.kernels._pdl`): "trigger" lets the next
    kernel launch early, "wait" is that next kernel (launched as a programmatic dependent, it
    prefetches its weights, then waits; GEMM 1, behind the router, prefetches nothing: its block
    map is still being written), "wait+trigger" both; "" neither. ``quant`` (GEMM 1): ``(scales, group,
    round_to)``, the epilogue writes ``out`` as fp8 in 1 x ``group`` groups with their scales.
    ``role``: "gate_up" or "down" (default: by ``gated``; GEMM 1 split over K runs ungated and
    says so); the GEMM that :data:`NAIVE_ID_CHECK_IN` names carries the naive map's id check."""
    num_valid_rows = a.shape[0] * top_k
    k_in = a.shape[1]
    role = role or ("gate_up" if gated else "down")
    if NAIVE_ID_CHECK_IN not in ("gate_up", "down"):
        fail("moe_kernels.kernels.index_gather", "NAIVE_ID_CHECK_IN", "must be 'gate_up' or 'down' (it is read "
             "from MOE_KERNELS_NAIVE_ID_CHECK_IN)", repr(NAIVE_ID_CHECK_IN))
    id_check = blocks.id_check if role == NAIVE_ID_CHECK_IN else ""
    num_tiles = blocks.num_m_blocks * cdiv(n_out, tiles.block_n) * tiles.split_k
    if num_tiles == 0 or n_out == 0:   # (no ids, since every caller refuses a width of 0: none to check)
        return
    grid = (min(num_tiles, programs_per_device(a.device)) if tiles.persistent else num_tiles,)
    w_desc = weight_descriptor(w, tiles)
    # Unused pointer arguments (naive blocks have no sorted ids, GEMM 1 has no weights) get any
    # tensor: the constexpr flags compile the loads away.
    sorted_ids = blocks.expert_ids if blocks.sorted_token_ids is None else blocks.sorted_token_ids
    num_post_padded = blocks.expert_ids if blocks.sorted_token_ids is None else blocks.num_tokens_post_padded
    naive_group = blocks.naive_group if blocks.naive else 0
    if recording():
        note_launch("index_gather.gemm", gemm=role, block_m=blocks.block_m,
                    tiles=tiles, naive_group=naive_group,
                    naive=blocks.naive, dense=blocks.dense, scales=scales[6], sum_top_k=sum_top_k,
                    tma=w_desc is not None, grid=grid, id_check=bool(id_check), pdl=pdl, quant=quant is not None)
    _index_gather_gemm_kernel[grid](
        a, w, out, topk_weights if topk_weights is not None else out,
        sorted_ids, blocks.expert_ids, num_post_padded,
        blocks.num_m_blocks, num_valid_rows, w.shape[0], n_out, k_in,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), *scales[:6],
        BLOCK_M=blocks.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        TOP_K=top_k, NAIVE_BLOCKS=blocks.naive, DENSE=blocks.dense, GATED=gated,
        MUL_ROUTED_WEIGHT=topk_weights is not None, EVEN_K=k_in % (tiles.block_k * tiles.k_chunks) == 0,
        INPUT_PRECISION=dot_precision(a.dtype), SCALES=scales[6], SUM_TOP_K=sum_top_k, SPLIT_K=tiles.split_k,
        w_desc=w_desc if w_desc is not None else w, TMA_W=w_desc is not None,
        num_tiles=num_tiles, PERSISTENT=tiles.persistent, SCALE_BN=scales[7], SCALE_BK=scales[8], ID_CHECK=id_check,
        SWAP_AB=tiles.swap_ab, NAIVE_GROUP=naive_group, K_CHUNKS=tiles.k_chunks, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **device_assert_options(id_check),
        **_pdl_options(pdl, w.element_size(), _pdl.TRIGGER, _pdl.PREFETCH_K if role == "down" else 0),
        **({} if quant is None else dict(out_scale_ptr=quant[0], stride_os=quant[0].stride(0), QUANT_GROUP=quant[1],
                                         ROUND_TO=quant[2])),
    )


@functools.lru_cache(maxsize=None)
def _pdl_options(role: str, element_size: int, trigger: int = 1, prefetch_k: int = -1) -> dict:
    """What a role in a programmatic dependent launch adds to the launch (the prefetch asks for
    one 128-byte line per ``PREFETCH_LINE`` weight elements). ``trigger`` and ``prefetch_k`` are
    the module settings ``_pdl.TRIGGER`` and ``_pdl.PREFETCH_K``, checked here."""
    if isinstance(trigger, bool) or trigger not in (1, 2):
        fail("moe_kernels.kernels._pdl", "TRIGGER", "must be 1 (as each program starts) or 2 (as it ends)",
             repr(trigger))
    if isinstance(prefetch_k, bool) or not isinstance(prefetch_k, int) or prefetch_k < -1:
        fail("moe_kernels.kernels._pdl", "PREFETCH_K", "must be an int: -1 (all), 0 (none) or a column count",
             repr(prefetch_k))
    if role not in PDL_ROLES:
        fail("_launch", "pdl", f"must be one of {PDL_ROLES}", repr(role))
    options = {"PDL_TRIGGER": trigger} if role.endswith("trigger") else {}
    if role.startswith("wait"):
        options.update(PDL_WAIT=True, PREFETCH_LINE=LINE_BYTES // element_size, PREFETCH_K=prefetch_k, launch_pdl=True)
    return options


#: A GEMM launch's part in a programmatic dependent launch (:func:`_launch`'s ``pdl``).
PDL_ROLES = ("", "trigger", "wait", "wait+trigger")


# ----------------------------------------------------------------------------------------------
# The three stages: checked public functions, each over an unchecked one the layer calls
# ----------------------------------------------------------------------------------------------


def expert_gate_up(hidden_states: torch.Tensor, w1: torch.Tensor, blocks: BlockAssignment, top_k: int, *,
                   tiles: GemmTiles, out: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                   w_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """GEMM 1 with SiLU-and-mul in its epilogue: row ``a`` of the result (``[T*k, F]``) is
    ``silu(w1[e][:F] @ x_t) * (w1[e][F:] @ x_t)`` for assignment ``a`` = (token ``t``, expert ``e``).

    Rows follow the assignment order of ``topk_ids.flatten()``; ``blocks`` comes from
    :func:`assign_blocks` for the same ``topk_ids``. With ``tiles.split_k > 1`` (K split, the
    partial sums added with fp32 atomics, so the last bits vary from run to run) rows that no block
    holds are written as zeros; unsplit, they keep what ``out`` held. fp8 inputs come with their scales
    (``a_scale`` from the weights' :meth:`~moe_kernels.kernels.formats.WeightFormat.quantize_activations`,
    ``w_scale`` the weight's) and write ``out_dtype`` (default bf16). A naive map built with
    ``validate_ids`` has its ids checked by GEMM 2 by default (:data:`NAIVE_ID_CHECK_IN`), not here.
    """
    func = "expert_gate_up"
    fmt = check_operands(func, "hidden_states", hidden_states, "w1", w1, a_scale, w_scale)
    check_int(func, "top_k", top_k, lo=1)
    if w1.shape[2] != hidden_states.shape[1] or w1.shape[1] % 2 or w1.shape[1] == 0:
        fail(func, "w1", f"must have shape [E, 2F, d={hidden_states.shape[1]}] with 2F even and > 0",
             f"shape {tuple(w1.shape)}")
    fmt.check_gated(func, "w1", w1)   # (a tile's up half reads one scale block: it must start one)
    numel = hidden_states.shape[0] * top_k
    check_blocks(func, blocks, numel)
    tiles = check_tiles(func, tiles)
    f = w1.shape[1] // 2
    out = check_out(func, out, (numel, f), hidden_states, dtype=output_dtype(hidden_states, out_dtype))
    return gate_up(hidden_states, w1, blocks, top_k, tiles=tiles, out=out, a_scale=a_scale, w_scale=w_scale, fmt=fmt)


def gate_up(x, w1, blocks, top_k, *, tiles, out, a_scale, w_scale, fmt, pdl: str = "", quant=None):
    """:func:`expert_gate_up` without its checks (``out`` given, ``fmt`` known; ``pdl`` and
    ``quant`` as in :func:`_launch`: with ``quant``, Triton only)."""
    tiles = fmt.gemm_tiles(tiles)
    if not use_triton(x, w1, out):
        xf, wf = dequantized(x, w1, a_scale, w_scale, fmt)
        return out.copy_(rows_reference(xf, wf, blocks, x.shape[0] * top_k, top_k))
    rerun = lambda x, w, out: gate_up(x, w, blocks, top_k, tiles=tiles, out=out, a_scale=a_scale,  # noqa: E731
                                      w_scale=w_scale, fmt=fmt, pdl=pdl, quant=quant)
    if in_float32_under_interpreter(rerun, out, x, w1) is None:
        scales = fmt.scale_arguments(x, w1, a_scale, w_scale)
        if tiles.split_k == 1:
            _launch(x, w1, out, None, blocks, n_out=w1.shape[1] // 2, top_k=top_k, gated=True, tiles=tiles,
                    scales=scales, pdl=pdl, quant=quant)
        else:
            # Split over K: each K slice adds its gate and up partial products into fp32 [rows, 2F]
            # (an ungated GEMM over all 2F rows of w1, summing into its own row), then SiLU·mul
            # in a launch of its own (moe_kernels.kernels.activation). Rows no block holds stay 0.
            if quant is not None:
                fail("gate_up", "quant", "must be None when tiles.split_k > 1 (the epilogue sees partial sums)",
                     "a quantising epilogue")
            sums = torch.zeros((out.shape[0], w1.shape[1]), device=out.device, dtype=torch.float32)
            # (no PDL trigger: the SiLU·mul launch after it waits for it whole anyway)
            _launch(x, w1, sums, None, blocks, n_out=w1.shape[1], top_k=top_k, gated=False, tiles=tiles,
                    scales=scales, sum_top_k=1, role="gate_up")
            silu_mul_rows(sums, out)
    return out


def expert_down(intermediate: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, blocks: BlockAssignment, *,
                tiles: GemmTiles, out: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                w_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                sum_slots: bool = False) -> torch.Tensor:
    """GEMM 2: row ``a`` of the result is ``topk_weights.flatten()[a] * (w2[e] @ intermediate[a])``.

    ``intermediate`` is :func:`expert_gate_up`'s ``[T*k, F]`` (or its fp8 requantisation, with
    ``a_scale``); the result is ``[T, k, d]`` (assignment order), the routing weight applied in fp32
    before the cast. With ``sum_slots`` the epilogue adds the rows of token ``t`` into row ``t`` of
    an fp32 ``out [T, d]`` instead (atomics; zeros unless given), and ``tiles.split_k`` may exceed 1.
    A naive map built with ``validate_ids`` has its ids checked here by default, on a GPU (a device
    assert; :data:`NAIVE_ID_CHECK_IN`).
    """
    func = "expert_down"
    fmt = check_operands(func, "intermediate", intermediate, "w2", w2, a_scale, w_scale)
    check_tensor(func, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=intermediate.device)
    num_tokens, top_k = topk_weights.shape
    if intermediate.shape[0] != num_tokens * top_k:
        fail(func, "intermediate", f"must have T*k = {num_tokens * top_k} rows (one per assignment)",
             f"shape {tuple(intermediate.shape)}")
    if w2.shape[2] != intermediate.shape[1] or w2.shape[1] == 0:
        fail(func, "w2", f"must have shape [E, d, F={intermediate.shape[1]}] with d >= 1", f"shape {tuple(w2.shape)}")
    check_blocks(func, blocks, num_tokens * top_k)
    tiles = check_tiles(func, tiles)
    d = w2.shape[1]
    if sum_slots:
        if out is None:   # the epilogue adds into it
            out = torch.zeros(num_tokens, d, dtype=torch.float32, device=intermediate.device)
        out = check_out(func, out, (num_tokens, d), intermediate, dtype=torch.float32)
    else:
        if tiles.split_k != 1:
            fail(func, "tiles.split_k", "must be 1 unless sum_slots=True (K slices are added with atomics)",
                 tiles.split_k)
        out = check_out(func, out, (num_tokens, top_k, d), intermediate, dtype=output_dtype(intermediate, out_dtype))
    return down(intermediate, w2, topk_weights.contiguous(), blocks, tiles=tiles, out=out, a_scale=a_scale,
                w_scale=w_scale, fmt=fmt, sum_slots=sum_slots)


def down(y, w2, topk_weights, blocks, *, tiles, out, a_scale, w_scale, fmt, sum_slots, pdl: str = ""):
    """:func:`expert_down` without its checks (``out`` given, ``topk_weights`` contiguous, or None:
    one slot per row, weight 1; ``pdl`` as in :func:`_launch`)."""
    tiles = fmt.gemm_tiles(tiles)
    num_tokens, top_k = (y.shape[0], 1) if topk_weights is None else topk_weights.shape
    d = w2.shape[1]
    if not use_triton(y, w2, out):
        yf, wf = dequantized(y, w2, a_scale, w_scale, fmt)
        weights = torch.ones(num_tokens, device=y.device) if topk_weights is None else topk_weights.reshape(-1).float()
        per_slot = rows_reference(yf, wf, blocks, num_tokens * top_k, 1, weights)
        per_slot = per_slot.view(num_tokens, top_k, d)
        return out.add_(per_slot.sum(1)) if sum_slots else out.copy_(per_slot.view(out.shape))
    rerun = lambda y, w, out: down(y, w, topk_weights, blocks, tiles=tiles, out=out, a_scale=a_scale,  # noqa: E731
                                   w_scale=w_scale, fmt=fmt, sum_slots=sum_slots, pdl=pdl)
    if in_float32_under_interpreter(rerun, out, y, w2) is None:
        _launch(y, w2, out.view(-1, d), topk_weights, blocks, n_out=d, top_k=1, gated=False, tiles=tiles,
                scales=fmt.scale_arguments(y, w2, a_scale, w_scale), sum_top_k=top_k if sum_slots else 0, pdl=pdl)
    return out


# ----------------------------------------------------------------------------------------------
# The torch reference of the two GEMMs (used without Triton, and by the tests)
# ----------------------------------------------------------------------------------------------


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
    config: MoEConfig | None = None,
    blocks: BlockAssignment | None = None,
    naive_block_assignment: bool | None = None,
    validate_ids: bool = True,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, d]``: ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t)``.

    ``w1`` is ``[E, 2F, d]`` (gate rows, then up rows), ``w2`` is ``[E, d, F]``, ``hidden_states``
    ``[T, d]``, ``topk_weights`` / ``topk_ids`` ``[T, k]`` (0-based expert ids).

    ``config`` defaults to :func:`moe_kernels.kernels.config.get_config`; ``block_size_m``
    overrides its M tile. ``blocks`` passes a precomputed :func:`assign_blocks` result (its
    ``block_m`` wins), e.g. to time the GEMMs without the alignment. ``naive_block_assignment``
    forces the small-batch path on or off (default: vLLM's rule, see :func:`assign_blocks`, and for block-fp8
    weights at most ``blocks.NAIVE_MAX_TOKENS_BLOCK_FP8`` tokens). A
    config with ``one_launch`` tiles runs both GEMMs in one launch
    (:mod:`moe_kernels.kernels.one_launch`, :mod:`moe_kernels.kernels.two_phase`), which needs no
    block map: ``block_size_m`` and ``naive_block_assignment`` then change nothing, and a
    ``blocks`` given runs the two GEMMs.
    ``validate_ids`` checks that every id lies in ``[0, E)``: on the CPU with an immediate
    ValueError; on a GPU inside a kernel that reads the ids (the alignment, or GEMM 2 for tiny
    batches) as a device-side assert, which costs no launch and no host sync and can be
    captured in a CUDA graph. Ids out of range never become addresses, checked or not
    (unchecked, they add nothing).

    fp8 weights (``float8_e4m3fn`` ``w1``/``w2`` with ``w1_scale``/``w2_scale``, one of the
    formats of :mod:`moe_kernels.kernels.formats`) run W8A8: the activations are quantised on the
    fly before GEMM 1 (1x128 groups for 128x128 weight blocks, per token otherwise), GEMM 1 writes
    bf16 (or ``hidden_states.dtype``), which is requantised the same way before GEMM 2, as vLLM's
    ``fused_experts`` does.

    Under the Triton interpreter (no GPU), each bf16 stage is computed in float32 and its result
    rounded to bf16 once, because the interpreter's bf16 dot is wrong.

    On a GPU, from the third call with the same argument signature (shapes, strides, dtypes,
    alignment, options) the call replays its recorded launches (:mod:`moe_kernels._replay`): the
    checks and lookups of the first calls hold for it, and the host work falls to the launches.
    """
    if blocks is None:   # (a given block map is checked against the ids at every call)
        tensors = (hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale)
        options = (block_size_m, config, naive_block_assignment, validate_ids)
        return _PLANS.run(tensors, options, lambda: _fused_experts(
            hidden_states, w1, w2, topk_weights, topk_ids, block_size_m=block_size_m, config=config, blocks=None,
            naive_block_assignment=naive_block_assignment, validate_ids=validate_ids, w1_scale=w1_scale,
            w2_scale=w2_scale))
    return _fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, block_size_m=block_size_m, config=config,
                          blocks=blocks, naive_block_assignment=naive_block_assignment, validate_ids=validate_ids,
                          w1_scale=w1_scale, w2_scale=w2_scale)


#: fused_experts' recorded calls, by argument signature.
_PLANS = CallPlans("fused_experts", pinned=(1, 2, 5, 6))   # a CUDA graph reads w1, w2 and their scales in place


def _fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, *, block_size_m, config, blocks,
                   naive_block_assignment, validate_ids, w1_scale, w2_scale):
    """:func:`fused_experts`, eagerly: its checks, then :func:`run_experts`."""
    func = "fused_experts"
    num_tokens, top_k, num_experts, d, f = check_moe_inputs(func, hidden_states, w1, w2, topk_weights, topk_ids)
    fmt = WeightFormat.of_pair(func, w1, w2, w1_scale, w2_scale)
    if block_size_m is not None:
        check_block_m(func, "block_size_m", block_size_m)
    if config is None:
        config = get_config(num_tokens, num_experts, f, d, fmt.element or hidden_states.dtype, hidden_states.device)
    else:
        check_config(func, config)
    if blocks is not None:
        check_blocks(func, blocks, num_tokens * top_k)
        if validate_ids:   # no kernel of this call reads the ids: check them here (no host sync on a GPU)
            check_ids_in_range(func, "topk_ids", topk_ids, num_experts)
    elif naive_block_assignment is not None and not isinstance(naive_block_assignment, bool):
        fail(func, "naive_block_assignment", "must be True, False or None", repr(naive_block_assignment), TypeError)
    return run_experts(hidden_states, w1, w2, topk_weights, topk_ids, fmt=fmt, config=config, w1_scale=w1_scale,
                       w2_scale=w2_scale, blocks=blocks, block_m=block_size_m, naive=naive_block_assignment,
                       ids="validate" if validate_ids else "unchecked", func=func)


def run_experts(hidden_states, w1, w2, topk_weights, topk_ids, *, fmt, config: MoEConfig, w1_scale=None,
                w2_scale=None, blocks=None, block_m=None, naive=None, ids: str = "validate",
                func: str = "fused_experts", activations=None, add=None, after_router: bool = False) -> torch.Tensor:
    """:func:`fused_experts` after its checks: what :class:`~moe_kernels.layer.MoELayer` calls.

    ``ids`` says what is known of ``topk_ids``: ``"validate"`` (check them where they are first
    read), ``"trusted"`` (in range by construction: the layer's own routing; nothing to check)
    or ``"unchecked"`` (the caller declined the check: the ``[T, k, d]`` buffer starts at zero,
    so that an id outside ``[0, E)``, which lands in no block, adds nothing). ``activations``:
    ``fmt.quantize_activations(hidden_states)`` when the caller has it already (a shared expert
    reads the same); ``add``: a ``[T, d]`` tensor the top-k sum adds in fp32 (a shared expert's
    output), instead of a separate addition, or a callable that returns it, called where the sum first needs it:
    after GEMM 2's launch (a shared expert on a side stream joins there:
    :class:`~moe_kernels.layer_shared.SharedApart`). Where both GEMMs are one launch, its kernel adds a tensor in
    its fp32 sum, but a callable's result is added after the launch, in the output dtype (one rounding more), so
    that the launch need not wait for it. A config with ``one_launch`` tiles and no ``blocks``
    runs both GEMMs in one launch (:mod:`moe_kernels.kernels.one_launch`: fp8 as W8A16;
    :mod:`moe_kernels.kernels.two_phase`: block fp8 as W8A8, quantising in the kernel; both ignore
    ``activations``), where its kernel takes the format (:func:`runs_in_one_launch`). ``after_router``:
    the kernel before this call on the stream is the chained router's last launch, which lets the next
    launch start early (:mod:`moe_kernels.kernels.chained_routing`'s ``launch_next``): GEMM 1 launches
    as its programmatic dependent and waits for its memory before its first load, where GEMM 1 is
    this call's first launch (Hopper; :func:`gemm1_launches_first`; elsewhere plain launches, with the
    same numbers).
    """
    if blocks is None and runs_in_one_launch(config, fmt):   # both GEMMs in one launch (no block map)
        # Its kernel reads a tensor addend; a callable one (a layer's shared expert, forked or not) is added after
        # the launch, which then need not wait for a side stream.
        later = add if callable(add) else None
        out = run_one_launch(hidden_states, w1, w2, topk_weights, topk_ids, fmt=fmt, tiles=config.one_launch,
                             w1_scale=w1_scale, w2_scale=w2_scale, ids=ids, func=func, add=None if later else add)
        return out if later is None else out.add_(later())
    num_tokens, top_k = topk_ids.shape
    d = w2.shape[1]
    blocks_given = blocks is not None
    if blocks is None:
        blocks = build_blocks(func, topk_ids, block_m or config.block_m, w2.shape[0], naive, ids == "validate",
                              block_fp8=fmt.scales == "block")
    summed = config.sum_in_gemm
    device, out_dtype = hidden_states.device, hidden_states.dtype
    if summed:   # the epilogue adds into fp32 [T, d], which must start at zero
        per_slot = torch.zeros((num_tokens, d), device=device, dtype=torch.float32)
    else:
        per_slot = (torch.zeros if ids == "unchecked" else torch.empty)((num_tokens, top_k, d), device=device,
                                                                       dtype=out_dtype)
    x, x_scale = fmt.quantize_activations(hidden_states) if activations is None else activations
    # GEMM 2 as a programmatic dependent of GEMM 1 (moe_kernels.kernels._pdl), where the GPU can.
    pdl = "trigger" if config.pdl and pdl_available(device) else ""
    # GEMM 1 as a programmatic dependent of the router's last launch (which let it launch early).
    waits = after_router and pdl_available(device) and gemm1_launches_first(
        config, fmt, blocks_given=blocks_given, naive=blocks.naive, activations_given=activations is not None)
    first = ("wait+" + pdl if pdl else "wait") if waits else pdl
    if _streams(config, fmt, x, w1, out_dtype):   # both GEMMs as one stream of tiles
        _streamed(x, w1, w2, topk_weights, blocks, top_k, config=config, fmt=fmt, x_scale=x_scale, w1_scale=w1_scale,
                  w2_scale=w2_scale, out=per_slot, out_dtype=out_dtype)
    else:
        if _quantizes_in_gemm(config, fmt, x, w1, out_dtype):
            y, y_scale = _gate_up_quantized(x, w1, blocks, top_k, config=config, fmt=fmt, a_scale=x_scale,
                                            w_scale=w1_scale, out_dtype=out_dtype, pdl=first)
        else:
            intermediate = torch.empty((num_tokens * top_k, w1.shape[1] // 2), device=device, dtype=out_dtype)
            gate_up(x, w1, blocks, top_k, tiles=config.gate_up, out=intermediate, a_scale=x_scale, w_scale=w1_scale,
                    fmt=fmt, pdl=first)
            y, y_scale = fmt.quantize_activations(intermediate)
        down(y, w2, topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous(), blocks,
             tiles=config.down, out=per_slot, a_scale=y_scale, w_scale=w2_scale, fmt=fmt, sum_slots=summed,
             pdl="wait" if pdl else "")
    add = add() if callable(add) else add   # (joined here: everything before ran beside it)
    if summed:   # the addend joins the fp32 sum before its one rounding
        return (per_slot if add is None else per_slot.add_(add)).to(out_dtype)
    if top_k == 1 and add is None:   # one slot per token: nothing to sum
        return per_slot.view(num_tokens, d)
    return sum_slots(per_slot, add=add)


def gemm1_launches_first(config: MoEConfig, fmt: WeightFormat, *, blocks_given: bool, naive: bool,
                         activations_given: bool) -> bool:
    """Whether :func:`run_experts`'s first launch is GEMM 1's own, so that GEMM 1 can be a programmatic dependent of
    the kernel before the call: a block map given, or the naive one (built without a launch); not both GEMMs in one
    launch, nor as one stream; no zeroed fp32 sum; no activation quantiser (16-bit weights, or ``activations``
    given); GEMM 1 unsplit (a split one starts from a zeroed buffer).

        >>> from moe_kernels.kernels.formats import FORMATS
        >>> tiles = GemmTiles(64, 128)
        >>> gemm1_launches_first(MoEConfig(16, tiles, tiles), FORMATS["none"], blocks_given=True, naive=False,
        ...                      activations_given=False)
        True
        >>> gemm1_launches_first(MoEConfig(16, tiles, tiles), FORMATS["block"], blocks_given=True, naive=False,
        ...                      activations_given=False)   # (the quantiser launches first)
        False
    """
    return ((blocks_given or naive) and not (naive and runs_in_one_launch(config, fmt)) and config.stream_lag is None
            and not config.sum_in_gemm and config.gate_up.split_k == 1 and (activations_given or not fmt.quantized))


def _streams(config: MoEConfig, fmt: WeightFormat, x: torch.Tensor, w1: torch.Tensor, out_dtype) -> bool:
    """Whether both GEMMs run as one stream of tiles (``MoEConfig.stream_lag``): compiled or
    interpreted Triton with 16/32-bit weights, or on a GPU with fp8 block weights whose GEMM 1 tile
    is whole quantisation groups (the stream's GEMM 1 always quantises GEMM 2's input in its
    epilogue). Elsewhere the two launches run, with the same numbers."""
    if config.stream_lag is None or config.sum_in_gemm or not use_triton(x, w1) or interpreted_bf16(x, w1):
        return False
    if not fmt.quantized:
        return True
    return (not INTERPRET and fmt.activations == "group" and (w1.shape[1] // 2) % fmt.block[1] == 0
            and fmt.gemm_tiles(config.gate_up).block_n % fmt.block[1] == 0)


def _streamed(x, w1, w2, topk_weights, blocks, top_k, *, config, fmt, x_scale, w1_scale, w2_scale, out, out_dtype):
    """Both GEMMs as one stream of tiles into ``out`` ``[T, k, d]`` (fp8: GEMM 1's epilogue
    quantises ``h`` in 1 x 128 groups, as with ``quant_in_gemm``)."""
    from .streamed_pair import streamed_pair   # (it builds on this module's tile)

    numel, f = x.shape[0] * top_k, w1.shape[1] // 2
    quant = None
    if fmt.quantized:
        group = fmt.block[1]
        h = torch.empty((numel, f), device=x.device, dtype=FP8)
        quant = (torch.empty((numel, f // group), device=x.device, dtype=torch.float32), group, _ROUND_TO[out_dtype])
    else:
        h = torch.empty((numel, f), device=x.device, dtype=x.dtype)
    check = ("", blocks.id_check) if NAIVE_ID_CHECK_IN == "down" else (blocks.id_check, "")
    streamed_pair(x, w1, w2, topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous(), blocks,
                  top_k, gate_up=config.gate_up, down=config.down, lag=config.stream_lag, out=out, h=h,
                  x_scale=x_scale, w1_scale=w1_scale, w2_scale=w2_scale, fmt=fmt, quant=quant, id_check=check)


def _quantizes_in_gemm(config: MoEConfig, fmt: WeightFormat, x: torch.Tensor, w1: torch.Tensor, out_dtype) -> bool:
    """Whether GEMM 1's epilogue quantises GEMM 2's input (``MoEConfig.quant_in_gemm``): fp8 with
    1 x G activation groups (the block format), an output tile of whole groups, and Triton."""
    return (config.quant_in_gemm and config.gate_up.split_k == 1 and fmt.activations == "group"
            and fmt.gemm_tiles(config.gate_up).block_n % fmt.block[1] == 0 and (w1.shape[1] // 2) % fmt.block[1] == 0
            and use_triton(x, w1)
            # The interpreter rounds fp32 -> bf16 by truncation inside a kernel (the unfused path rounds
            # to nearest, in torch): under it, bf16 activations keep the two launches.
            and not (INTERPRET and out_dtype == torch.bfloat16))


#: The dtype name GEMM 1's epilogue rounds to before quantising, as the unfused path writes it.
_ROUND_TO = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: ""}


def _gate_up_quantized(x, w1, blocks, top_k, *, config, fmt, a_scale, w_scale, out_dtype, pdl):
    """GEMM 1 writing GEMM 2's fp8 input and its scales (the same numbers as GEMM 1 into
    ``out_dtype`` followed by the group quantiser). Under the interpreter the kernel stores the
    clamped fp32 values and torch casts them (the interpreter's fp8 rounding is wrong near powers
    of two: :mod:`moe_kernels.kernels.quant`)."""
    numel, f, group = x.shape[0] * top_k, w1.shape[1] // 2, fmt.block[1]
    y = torch.empty((numel, f), device=x.device, dtype=torch.float32 if INTERPRET else FP8)
    y_scale = torch.empty((numel, f // group), device=x.device, dtype=torch.float32)
    gate_up(x, w1, blocks, top_k, tiles=config.gate_up, out=y, a_scale=a_scale, w_scale=w_scale, fmt=fmt, pdl=pdl,
            quant=(y_scale, group, _ROUND_TO[out_dtype]))
    return (y.to(FP8) if INTERPRET else y), y_scale


def dense_expert(hidden_states, w1, w2, *, fmt, config: MoEConfig, w1_scale=None, w2_scale=None, weight=None,
                 activations=None) -> torch.Tensor:
    """One expert that every token uses (a shared expert, ``w1 [2F, d]``, ``w2 [d, F]``) through
    the same two grouped GEMMs as the routed experts, on :func:`~moe_kernels.kernels.blocks.dense_blocks`:
    no alignment, no index reads, no top-k sum. ``weight`` (float32 ``[T, 1]``, e.g. Qwen2-MoE's
    sigmoid gate) multiplies each row in GEMM 2's epilogue; ``activations`` as in :func:`run_experts`.
    """
    num_tokens, d = hidden_states.shape[0], w2.shape[0]
    device, out_dtype = hidden_states.device, hidden_states.dtype
    blocks = dense_blocks(num_tokens, config.block_m, hidden_states)
    x, x_scale = fmt.quantize_activations(hidden_states) if activations is None else activations
    intermediate = torch.empty((num_tokens, w1.shape[0] // 2), device=device, dtype=out_dtype)
    scales = (None, None) if w1_scale is None else (w1_scale[None], w2_scale[None])
    gate_up(x, w1[None], blocks, 1, tiles=config.gate_up, out=intermediate, a_scale=x_scale, w_scale=scales[0],
            fmt=fmt)
    y, y_scale = fmt.quantize_activations(intermediate)
    out = torch.empty((num_tokens, d), device=device, dtype=out_dtype)
    # One slot per row and a plain store: a K split (split_k > 1) would need the atomic sum.
    down(y, w2[None], None if weight is None else weight.reshape(num_tokens, 1).contiguous(), blocks,
         tiles=separate_sum_tiles(config), out=out, a_scale=y_scale, w_scale=scales[1], fmt=fmt,
         sum_slots=False)
    return out


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    *,
    block_size_m: int | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """The whole routed layer from router logits: ``fused_topk`` (softmax top-k), then
    :func:`fused_experts`. ``gating_output`` is ``[T, E]`` with ``E`` = ``w1``'s expert count."""
    from .routing import fused_topk

    func = "fused_moe"
    check_tensor(func, "w1", w1, ndim=3)
    check_tensor(func, "gating_output", gating_output, ndim=2)
    if gating_output.shape[1] != w1.shape[0]:
        fail(func, "gating_output", f"must have one column per expert of w1 (E={w1.shape[0]})",
             f"shape {tuple(gating_output.shape)}")
    topk_weights, topk_ids = fused_topk(hidden_states, gating_output, topk, renormalize)
    # The ids come from our own top-k over E logits, so the range check is skipped.
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, block_size_m=block_size_m,
                         config=config, validate_ids=False)
