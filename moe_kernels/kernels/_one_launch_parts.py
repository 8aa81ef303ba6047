"""What the two one-launch kernels share (:mod:`moe_kernels.kernels.one_launch`,
:mod:`moe_kernels.kernels.two_phase`): how a kernel rounds ``h`` to the activations' dtype, the scale
tensors' strides, the torch reference of both, and the two registers a unit timeline reads.

    >>> import torch
    >>> scale_strides(torch.ones(4, 2, 3)), scale_strides(torch.ones(4, 8)), scale_strides(None)
    ((6, 3, 1), (8, 1, 0), (0, 0, 0))
"""

from __future__ import annotations

import torch

from .._checks import device_id_check
from .._runtime import HAS_TRITON, kernel, tl
from ._gemm_operands import in_float32_under_interpreter
from .formats import WeightFormat

#: How a kernel rounds ``h`` before GEMM 2: to the activations' dtype (its ``ROUND``).
ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

if HAS_TRITON:

    @kernel
    def _rounded(v, ROUND: tl.constexpr):
        """``v`` (float32) rounded to nearest even in fp16 (``ROUND == 1``) or bf16 (2), as float32.
        bf16 by its bits: the interpreter's float32 -> bf16 conversion truncates."""
        if ROUND == 1:
            return v.to(tl.float16).to(tl.float32)
        elif ROUND == 2:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return v

    @kernel
    def _now():
        """The GPU's global nanosecond clock (for a timeline of units)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.program_id(0)], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @kernel
    def _sm():
        """The SM this program runs on."""
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [tl.program_id(0)], dtype=tl.int32,
                                         is_pure=False, pack=1)


def settled_without_launch(run, hidden_states, w1, w2, topk_weights, topk_ids, *, reference: bool, fmt, w1_scale,
                           w2_scale, ids: str, func: str, add, tiles) -> tuple[torch.Tensor, bool]:
    """``(out, done)``: a one-launch call's ``[T, d]`` output buffer, and whether it is already
    filled without the kernel: by the torch reference (``reference``; the two-phase kernel's W8A8
    for fp8 block weights), with nothing to compute (no tokens, ``d`` or ``F`` zero), or under the
    interpreter with bf16 (``run``, the caller itself, in float32, rounded once)."""
    num_experts, d, f = w2.shape
    num_tokens = topk_ids.shape[0]
    out = torch.empty((num_tokens, d), device=hidden_states.device, dtype=hidden_states.dtype)
    if reference:
        if ids == "validate":
            device_id_check(func, "topk_ids", topk_ids, num_experts)
        w8a8 = fmt.quantized and tiles.phases == 2
        return out.copy_(one_launch_reference(hidden_states, w1, w2, topk_weights, topk_ids, fmt=fmt,
                                              w1_scale=w1_scale, w2_scale=w2_scale, add=add,
                                              quantize_activations=w8a8)), True
    if num_tokens == 0 or d == 0:
        return out, True
    if f == 0:
        return (out.zero_() if add is None else out.copy_(add)), True

    def rerun(x, w1, w2, *extra, out):   # the interpreter's bf16: the same launch in float32, rounded once
        out.copy_(run(x, w1, w2, topk_weights, topk_ids, fmt=fmt, w1_scale=w1_scale, w2_scale=w2_scale, ids=ids,
                      func=func, add=extra[0] if extra else None, _round_to=hidden_states.dtype, tiles=tiles))

    widened = in_float32_under_interpreter(rerun, out, hidden_states, w1, w2, *(() if add is None else (add,)))
    return out, widened is not None


def scale_strides(scale) -> tuple[int, int, int]:
    """(expert, row, column) strides of a scale tensor: ``[E, N/128, K/128]``, ``[E, N]`` or ``[E]``."""
    if scale is None:
        return 0, 0, 0
    strides = scale.stride()
    return (strides + (0, 0))[:3]


def one_launch_reference(hidden_states, w1, w2, topk_weights, topk_ids, *, fmt=None, w1_scale=None,
                         w2_scale=None, add=None, quantize_activations: bool = False) -> torch.Tensor:
    """Torch reference for :func:`one_launch_experts`: float32 products of the dequantised weights
    with the unquantised activations (W8A16 for fp8), ``h`` rounded to the activations' dtype,
    float32 sums; a bad id adds nothing. ``quantize_activations``: ``x`` and each rounded ``h``
    quantised by ``fmt`` first (W8A8, as :mod:`moe_kernels.kernels.two_phase` runs fp8)."""
    fmt = fmt or WeightFormat.of_pair("one_launch_reference", w1, w2, w1_scale, w2_scale)
    num_experts, d, f = w2.shape

    def as_quantized(a):   # [rows, K] in the activations' dtype -> float32, through fp8 if asked
        return fmt.dequantize_activations(*fmt.quantize_activations(a, reference=True)).float() \
            if quantize_activations else a.float()

    x = as_quantized(hidden_states)
    out = torch.zeros(hidden_states.shape[0], d, dtype=torch.float32, device=hidden_states.device)
    for token, (row_ids, row_weights) in enumerate(zip(topk_ids.tolist(), topk_weights.float())):
        for expert, weight in zip(row_ids, row_weights):
            if not 0 <= expert < num_experts:
                continue
            gate_up = fmt.dequantize_weight(w1[expert:expert + 1], None if w1_scale is None else
                                            w1_scale[expert:expert + 1])[0].float() @ x[token]
            h = torch.nn.functional.silu(gate_up[:f]) * gate_up[f:]
            h = as_quantized(h.to(hidden_states.dtype)[None])[0] * weight
            down = fmt.dequantize_weight(w2[expert:expert + 1], None if w2_scale is None else
                                         w2_scale[expert:expert + 1])[0].float()
            out[token] += down @ h
    return (out if add is None else out + add.float()).to(hidden_states.dtype)
