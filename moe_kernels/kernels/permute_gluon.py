"""The permute layout's GEMMs on the Gluon kernels (Triton 3.6, Hopper), which the layer's layout choices name
at prefill (fp8 from 1,024 or 2,048 tokens; bf16 on the H100; ``layout-choices.json``): which
kernel a call takes (:func:`gemm_kernel`, the switches below) and the calls themselves (:func:`experts`).
Block-fp8 segments of 128 rows take :mod:`moe_kernels.kernels.gluon_block_fp8`'s kernel (per tile or on its
persistent grid, GEMM 1 optionally quantising GEMM 2's input, half tiles, GEMM 2 storing by TMA); bf16 segments
of 128 rows the bf16 persistent kernel (:mod:`moe_kernels.kernels.gluon_bf16`); segments of 16, 32 or 64 rows
(decode), fp8 or bf16, the transposed kernel (:mod:`moe_kernels.kernels.gluon_transposed`). Where a Gluon kernel
cannot run a call, the Triton kernel does and the launch record says why.
"""

from __future__ import annotations

import torch

from .._checks import fail
from .._runtime import note_launch
from .combine import unpermute

#: Which kernel runs the two GEMMs of a block-fp8 ``permute_experts`` (read at each call): "triton"
#: (:func:`~moe_kernels.kernels.contiguous_gemm.grouped_gemm_contiguous`) or "gluon"
#: (:func:`~moe_kernels.kernels.gluon_block_fp8.block_fp8_grouped`, each K step's promotion under the
#: next MMA: 619-885 TFLOP/s on the H200 where the Triton kernel ran 558-744, the GEMMs alone, 16,384
#: tokens; segments of 16-64 rows take its transposed grid). "gluon" applies SiLU·mul in GEMM 1's epilogue
#: (on the persistent grid GEMM 1 also quantises GEMM 2's input). The switch stays "triton" for a direct call;
#: the layer's layout choices ask for "gluon" per call (``permute_experts(gemm=)``) where measured. Where it
#: cannot run (no Triton 3.6 Gluon, not sm_90, bf16 activations only, segments of 16, 32, 64 or 128 rows, F
#: and d multiples of 128) the call takes the Triton kernel and its launch record says why; a config's
#: ``gather_rows`` and ``sum_in_gemm`` (the Triton tiles' choices) are left aside, and the record names them.
#: Like ``combine.UNPERMUTE_BODY``, a plan recorded before a change keeps its kernel (the Gluon kernels launch
#: through the package's shortcut, so a recorded call replays them).
FP8_GEMM = "triton"
#: The same for bf16 weights: "gluon" runs both GEMMs of a call with segments of 16, 32 or 64 rows (decode) on
#: the transposed kernel (:func:`~moe_kernels.kernels.gluon_transposed.grouped_transposed`), and with segments of
#: 128 rows (prefill) on the bf16 persistent kernel (:func:`~moe_kernels.kernels.gluon_bf16.bf16_grouped`); off
#: until timed (the layout choices ask for it per call where measured).
BF16_GEMM = "triton"
#: The bf16 persistent kernel's tiles, (weight rows a tile, TMA stages), for GEMM 1 (gated: half gate rows, half
#: up rows) and GEMM 2; GEMM 2 takes 128-row tiles where d is not a multiple of 256.
#: (GEMM 1 on 4 stages fills 224 KiB: on the H200, ``prefill-gemm-ab-gluon-bf16.json``, with the two-accumulator
#: GEMM 1 of that run, it ran from 1% faster at Qwen3-30B-A3B 4,096 tokens to 13% slower at DeepSeek-V3 16,384.)
BF16_TILES = {"gate_up": (256, 3), "down": (256, 3)}
#: GEMM 1 on 4 stages instead where the experts average at least this many rows (two 128-row tiles; None: never):
#: on an H100 (session 34, ``layer-layout-ab-bf16-g1s4-s34.json``, ``-one-pass-tma1-s34.json``) the layer gained
#: 3-6% at DeepSeek-V3 8,192-16,384 tokens (256-512 rows an expert) and 1-3% on Qwen3-30B-A3B at 4,096-16,384
#: (256-1,024), but took 20% longer at DeepSeek-V3 4,096 (128 rows an expert; 4 stages collapsed there in session 33
#: too, not yet explained). Timed on the H100 only: on the H200 GEMM 1 then held two accumulators (the note above).
BF16_GEMM1_DEEP_FROM_ROWS = 256
#: On its 4 stages GEMM 1 also stores by TMA: in the same H100 run (``layer-layout-ab-bf16-defaults-s34.json``) the
#: layer gained 3.7% at DeepSeek-V3 16,384 tokens and 2% at 8,192 with it, +-0.6% on Qwen3-30B-A3B; on 3 stages
#: (DeepSeek-V3 4,096) the TMA store lost 4.8%, hence BF16_TMA_STORE_GEMM1 off.
BF16_TMA_STORE_GEMM1_DEEP = True
#: bf16 GEMM 2 stores each whole tile by one TMA copy under the next tile's MMAs (as GLUON_TMA_STORE in fp8).
BF16_TMA_STORE = True
#: The same for bf16 GEMM 1 (its activated tile). Off: in the layer on an H100 (``layer-layout-ab-bf16*-s33.json``)
#: it gained 3% at Qwen3-30B-A3B 16,384 tokens and lost 1-3% at every other batch of both models.
BF16_TMA_STORE_GEMM1 = False
#: bf16 GEMM 1 gathers its rows from the tokens (``bf16_grouped(row_assignments=)``: ``cp.async`` pointer copies of
#: each row, the weights by TMA) instead of reading the one-pass scatter's packed copy, where the experts average at
#: most this many rows (None: never). On an H100 (``gather-gemm1-ab-s35.json``, GEMM 1 alone, against the scatter and
#: GEMM 1 on packed rows) it was 10-14% faster at 32-128 rows an expert, where the packed tiles read mostly padding,
#: from 4% slower to 8% faster at 128-256, and 9-14% slower from 256-512, where GEMM 1 is compute-bound and the
#: copies add to each warp's serial stream (Nsight Compute: 21-24% more instructions); in the layer
#: (``layer-layout-ab-bf16-gathered-s35.json``, ``-defaults-s35.json``) 6-10% faster at 1,024-2,048 tokens and 1-2%
#: at DeepSeek-V3's 4,096.
BF16_GATHER_GEMM1_UP_TO_ROWS = 128
#: bf16 on the persistent kernel: a segment's last tile with at most 64 real rows multiplies 64 rows. Off: in the
#: layer on an H100 (``layer-layout-ab-bf16*-s33.json``) 0.2-2.3% faster on Qwen3-30B-A3B, 8-14% slower on
#: DeepSeek-V3 from 4,096 tokens (one switch for both).
BF16_HALF_TILES = False
#: With FP8_GEMM = "gluon" (or a layout choice's gemm): both GEMMs on the Gluon kernel's persistent grid (one
#: program per SM walking the tiles of the rows used, its loads running ahead across tiles), else one program a
#: tile. On since session 30: on an H100 the routed fp8 layer took 2-8% less time than with one program a tile
#: (both with the one-pass input), and 6-18% less with GLUON_QUANTIZE_IN_GEMM1 too
#: (``results/nvidia-h100-80gb-hbm3/layer-layout-ab-s30b.json``), once a step's TMA addresses no longer waited
#: on a read of the tile's expert.
GLUON_PERSISTENT = True
#: With GLUON_PERSISTENT: GEMM 1 writes GEMM 2's input in fp8 with its scales (its epilogue quantises; no bf16
#: ``[M_pad, F]`` and no quantiser launch). On since session 30 (1-5% less time in the same run).
GLUON_QUANTIZE_IN_GEMM1 = True
#: With FP8_GEMM = "gluon" (one program a tile or the persistent grid): a segment's last tile with at most 64
#: real rows multiplies 64 rows (half tiles: the MMA work of each segment rounded up to 64 rows instead of 128).
#: Off: in the layer on an H100 (session 30, with GEMM 1 quantising) it ran Qwen3-30B-A3B 0-2% faster and
#: DeepSeek-V3 3-10% slower, though GEMM 2 alone gained 1-7% on the persistent grid (``gluon-block-fp8-ab-s30*.json``).
GLUON_HALF_TILES = False
#: Half tiles in GEMM 2 only (GEMM 1 keeps whole tiles). GEMM 2 alone at 16,384 tokens on the persistent grid with
#: its TMA store (``gluon-block-fp8-ab-s31.json``): on the H200 818 TFLOP/s against 775 for DeepSeek-V3 and 821
#: against 809 for Qwen3-30B-A3B; on an H100 824 against 821 and 790 against 810. Off until timed in the layer.
GLUON_HALF_TILES_GEMM2 = False
#: With GLUON_PERSISTENT: GEMM 2 stores each whole tile by one asynchronous TMA copy, under the next tile's MMAs
#: (padding rows written too; nothing reads them). On since session 31: GEMM 2 alone at 16,384 tokens on an H100
#: ran 810 TFLOP/s against 739 with pointer stores for Qwen3-30B-A3B (its six K steps a tile leave the epilogue a
#: large share) and 821 against 750 for DeepSeek-V3 (``results/nvidia-h100-80gb-hbm3/gluon-block-fp8-ab-s31.json``).
GLUON_TMA_STORE = True
#: The transposed kernel's TMA stages (segments of 16-64 rows; fp8: 6 take 116 KiB at 16 rows).
TRANSPOSED_STAGES = 6
#: fp8 on the transposed kernel: GEMM 1 writes GEMM 2's input in fp8 with its scales (a program takes the two
#: 64-column tiles of each 128-column group; no quantiser launch between the GEMMs). Off until timed.
TRANSPOSED_QUANTIZE_IN_GEMM1 = False


def refusal(fmt, align, activation_dtype, w1, w2, device=None) -> str | None:
    """Why no Gluon kernel can run these GEMMs (a sentence), or None where one can; ``device`` None leaves out
    whether the Gluon kernels run on the device itself (a plan for a named GPU, from any machine). The layer's plan
    asks this before it takes a layout choice naming the Gluon GEMMs, :func:`gemm_kernel` at every call."""
    from .gluon_block_fp8 import available

    f, d = w2.shape[2], w2.shape[1]
    aligns = (16, 32, 64, 128)
    return (available(device) if device is not None else None) or next((reason for refused, reason in (
        (fmt.quantized and fmt.block != (128, 128), "weights not in 128 x 128 blocks"),
        (not fmt.quantized and (fmt.name != "unquantized" or w1.dtype != torch.bfloat16), "weights not bf16"),
        (activation_dtype != torch.bfloat16, "activations not bf16"),
        (align not in aligns, f"segments of {align} rows, not {', '.join(map(str, aligns))}"),
        (f % 128 or d % 128, "F or d not a multiple of 128"),
        (not (w1.is_contiguous() and w2.is_contiguous()), "weights not contiguous"),
        (w1.data_ptr() % 16 or w2.data_ptr() % 16, "weights not on 16-byte boundaries")) if refused), None)


def gemm_kernel(fmt, config, align, hidden_states, w1, w2, asked=None) -> str:
    """"gluon" where ``asked`` (None: :data:`FP8_GEMM` for block-fp8 weights, :data:`BF16_GEMM` for bf16 ones)
    asks for it and a Gluon kernel can run this call, else "triton" (the launch record, ``permute.fp8_gemm`` or
    ``permute.bf16_gemm``, says why not)."""
    if asked is None:
        name, switch = ("FP8_GEMM", FP8_GEMM) if fmt.quantized else ("BF16_GEMM", BF16_GEMM)
        where = "moe_kernels.kernels.permute_gluon"
    else:
        name, switch, where = "gemm", asked, "permute_experts"
    if switch not in ("triton", "gluon"):
        fail(where, name, "must be 'triton' or 'gluon'", repr(switch))
    if switch == "triton":
        return "triton"
    why = refusal(fmt, align, hidden_states.dtype, w1, w2, hidden_states.device)
    # (the Triton tiles' own epilogue choices, which a Gluon call leaves aside: it copies the rows and gathers back)
    unused = [name for name in ("gather_rows", "sum_in_gemm") if getattr(config, name) and not why]
    note_launch("permute.fp8_gemm" if fmt.quantized else "permute.bf16_gemm", kernel="triton" if why else "gluon",
                refused=why, unused=unused)
    return "triton" if why else "gluon"


def gathers_gemm1(fmt, align, hidden_states, num_assignments: int, num_experts: int) -> bool:
    """Whether the Gluon GEMM 1 reads its rows from the tokens, so that the permutation copies none: bf16 on 128-row
    segments, rows that start on 16 bytes, the experts averaging at most :data:`BF16_GATHER_GEMM1_UP_TO_ROWS` rows
    (from the shapes: no read of the routing).

        >>> from moe_kernels.kernels.formats import FORMATS
        >>> x = torch.zeros(4, 7168, dtype=torch.bfloat16)   # (only its strides and alignment are read)
        >>> [gathers_gemm1(FORMATS["none"], 128, x, tokens * 8, 256) for tokens in (2048, 8192)]   # DeepSeek-V3
        [True, False]
    """
    return (BF16_GATHER_GEMM1_UP_TO_ROWS is not None and num_assignments <= BF16_GATHER_GEMM1_UP_TO_ROWS * num_experts
            and not fmt.quantized and align == 128 and hidden_states.stride(1) == 1
            and hidden_states.stride(0) % 8 == 0 and hidden_states.data_ptr() % 16 == 0)


def experts(rows, rows_scale, w1, w1_scale, w2, w2_scale, permuted, topk_weights, fmt, align, gathered=False):
    """Both GEMMs of :func:`~moe_kernels.kernels.permute.permute_experts` on a Gluon kernel (where
    :func:`gemm_kernel` said "gluon"), then the gather back: segments of 16, 32 or 64 rows (decode; bf16 always)
    on the transposed kernel, block-fp8 segments of 128 rows on the 128-row one. ``gathered``
    (:func:`gathers_gemm1`): ``rows`` are the tokens ``[T, d]``, which GEMM 1 gathers."""
    if align != 128:
        return _transposed_experts(rows, rows_scale, w1, w1_scale, w2, w2_scale, permuted, topk_weights, fmt, align)
    if not fmt.quantized:
        return _bf16_experts(rows, w1, w2, permuted, topk_weights, gathered)
    return _fp8_experts(rows, rows_scale, w1, w1_scale, w2, w2_scale, permuted, topk_weights)


def _bf16_experts(rows, w1, w2, permuted, topk_weights, gathered=False):
    """Both bf16 GEMMs on the persistent kernel (:data:`BF16_TILES`, GEMM 1's stages and store by
    :func:`gate_up_stages`): GEMM 1 gated (``silu(gate) * up`` in its epilogue, ``[M_pad, F]``; ``gathered``: its
    rows read from the tokens ``rows``), GEMM 2 into ``[M_pad, d]`` (by TMA with :data:`BF16_TMA_STORE`; a TMA store
    writes the padding rows too, which only padding rows read), then the gather back."""
    from .gluon_bf16 import bf16_grouped

    (n1, stages1), (n2, stages2) = BF16_TILES["gate_up"], BF16_TILES["down"]
    stages1, tma1 = gate_up_stages(stages1, topk_weights.numel(), w1.shape[0], n1)
    if w2.shape[1] % n2:   # (d not a multiple of the tile: 128 columns, the stages that fit)
        n2, stages2 = 128, min(stages2 + 1, 4)
    half, used = BF16_HALF_TILES, permuted.rows_used
    gather = dict(row_assignments=permuted.row_assignments, top_k=topk_weights.shape[1]) if gathered else {}
    activated = bf16_grouped(rows, w1, permuted.m_indices, used, gated=True, block_n=n1, stages=stages1,
                             half_tiles=half, tma_store=tma1, validate_ids=False, **gather)
    y = bf16_grouped(activated, w2, permuted.m_indices, used, block_n=n2, stages=stages2, half_tiles=half,
                     tma_store=BF16_TMA_STORE, validate_ids=False)
    return unpermute(y, permuted.src2dst, topk_weights)


def gate_up_stages(stages: int, num_assignments: int, num_experts: int, block_n: int = 256) -> tuple[int, bool]:
    """The bf16 GEMM 1's ``(TMA stages, TMA store)``: the table's ``stages`` and :data:`BF16_TMA_STORE_GEMM1`, or, where
    the experts average at least :data:`BF16_GEMM1_DEEP_FROM_ROWS` rows (from the shapes alone: no read of the
    routing), 4 stages with the store :data:`BF16_TMA_STORE_GEMM1_DEEP` asks for, where they fit in shared memory
    beside that epilogue (else beside the other, else the table's).

        >>> gate_up_stages(3, 16384 * 8, 256), gate_up_stages(3, 4096 * 8, 256)   # DeepSeek-V3: 512 and 128 rows
        ((4, True), (3, False))
    """
    from .gluon_bf16 import SHARED_LIMIT, shared_bytes

    plain = (stages, BF16_TMA_STORE_GEMM1)
    if BF16_GEMM1_DEEP_FROM_ROWS is None or num_assignments < BF16_GEMM1_DEEP_FROM_ROWS * num_experts:
        return plain
    for tma_store in dict.fromkeys((BF16_TMA_STORE_GEMM1_DEEP or BF16_TMA_STORE_GEMM1, BF16_TMA_STORE_GEMM1)):
        if shared_bytes(block_n, 4, gated=True, half_tiles=BF16_HALF_TILES, tma_store=tma_store) <= SHARED_LIMIT:
            return max(stages, 4), tma_store
    return plain


def _fp8_experts(rows, rows_scale, w1, w1_scale, w2, w2_scale, permuted, topk_weights):
    """Both GEMMs on the 128-row Gluon kernel: GEMM 1 gated (``silu(gate) * up`` in its epilogue, bf16
    ``[M_pad, F]``), the quantiser (or GEMM 1 quantising), GEMM 2 into bf16 ``[M_pad, d]``, the gather back.
    Neither GEMM writes a padding row (GEMM 2 does with GLUON_TMA_STORE: nothing reads them); what the quantiser
    makes of them stays in their own rows."""
    from .gluon_block_fp8 import block_fp8_grouped

    # (permute wrote m_indices: one expert per 128-row tile, ids in [0, E) or -1; no read-back)
    rows_used = permuted.rows_used if GLUON_PERSISTENT else None
    half = GLUON_HALF_TILES
    if rows_used is not None and GLUON_QUANTIZE_IN_GEMM1:
        a, a_scale = block_fp8_grouped(rows, rows_scale, w1, w1_scale, permuted.m_indices, gated=True,
                                       validate_ids=False, rows_used=rows_used, quantize_output=True, half_tiles=half)
    else:
        activated = block_fp8_grouped(rows, rows_scale, w1, w1_scale, permuted.m_indices, gated=True,
                                      validate_ids=False, rows_used=rows_used, half_tiles=half)
        a, a_scale = _quantized(activated, rows_used)
    y = block_fp8_grouped(a, a_scale, w2, w2_scale, permuted.m_indices, validate_ids=False, rows_used=rows_used,
                          half_tiles=half or GLUON_HALF_TILES_GEMM2, tma_store=GLUON_TMA_STORE and rows_used is not None)
    return unpermute(y, permuted.src2dst, topk_weights)


def _transposed_experts(rows, rows_scale, w1, w1_scale, w2, w2_scale, permuted, topk_weights, fmt, align):
    """Both GEMMs on the transposed kernel (tiles of 128 weight rows by ``align`` tokens); in fp8 GEMM 2's
    input quantised between them, or by GEMM 1 (:data:`TRANSPOSED_QUANTIZE_IN_GEMM1`)."""
    from .gluon_transposed import grouped_transposed

    used = permuted.rows_used
    fused = fmt.quantized and TRANSPOSED_QUANTIZE_IN_GEMM1
    gemm1 = grouped_transposed(rows, w1, permuted.m_indices, used, x_scale=rows_scale, w_scale=w1_scale,
                               gated=True, block_t=align, stages=TRANSPOSED_STAGES, validate_ids=False,
                               quantize_output=fused)
    if fused:
        a, a_scale = gemm1
    else:
        a, a_scale = _quantized(gemm1, used) if fmt.quantized else (gemm1, None)
    y = grouped_transposed(a, w2, permuted.m_indices, used, x_scale=a_scale, w_scale=w2_scale, block_t=align,
                           stages=TRANSPOSED_STAGES, validate_ids=False)
    return unpermute(y, permuted.src2dst, topk_weights)


def _quantized(activated, rows_used):
    """GEMM 2's block-fp8 input (1 x 128 groups): the rows below ``rows_used`` only where it is given (the
    persistent and transposed grids read no row past it; ``M_pad`` is sized for the worst routing)."""
    from .quant import per_token_group_quant_fp8

    return per_token_group_quant_fp8(activated, 128, rows_used=rows_used)
