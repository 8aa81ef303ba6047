"""Weight formats: how expert weights are stored, and what a GEMM must do to multiply them.

A format says three things, the same three that vLLM's quantisation configs and a checkpoint's
``quantization_config`` say:

* the element type of the stored weights: 16/32-bit floats as they are, or fp8 e4m3;
* the layout of the weight scales: none, one per ``block`` of rows x columns (DeepSeek-V3's
  128 x 128 ``weight_scale_inv``), one per output row (``channel``), or one per expert matrix
  (``tensor``);
* how the activations are quantised on the fly to meet them: one scale per token and per
  ``block[1]`` channels (``group``), or one scale per token (``token``).

Every decision that depends on the format asks the format object, once: the GEMM core's scale
branch (:attr:`WeightFormat.scale_code` and the block edges it indexes by), the K step
(:meth:`WeightFormat.gemm_tiles`), the quantisers, the tuned table's key and the float64
reference. :class:`~moe_kernels.layer_spec.LayerWeights` carries its format; a function handed raw
tensors detects it with :meth:`WeightFormat.of`, which accepts a scale tensor only of the exact
shape its format prescribes (so a scale tensor of some other scheme, MXFP4's ``[E, N, K/32]``
say, is an error, not a misread block format). Adding a format is one entry in :data:`FORMATS`
plus its branch in the GEMM core.

No format here lets one token's values reach another token's output: every activation scale is
per token (per tensor activation scales would let one ``inf`` in one request turn every token of
the batch into NaN), so the ``tensor`` format pairs one weight scale per expert with per-token
activation scales.

    >>> import torch
    >>> fp8 = FORMATS["block"]
    >>> fp8.name, fp8.scale_shape(2, 256, 384), fp8.activations
    ('fp8-block', (2, 2, 3), 'group')
    >>> q, s = fp8.quantize_weight(torch.randn(2, 256, 384))
    >>> WeightFormat.of("example", "w", q, s) is fp8
    True
    >>> WeightFormat.of("example", "w", torch.randn(2, 256, 384), None).name
    'unquantized'
    >>> fp8.table_key(torch.bfloat16), UNQUANTIZED.table_key(torch.bfloat16)
    ('float8_e4m3fn', 'bfloat16')
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .._checks import FLOAT_DTYPES, check_tensor, fail
from .quant import (FP8, dequantize_activations, dequantize_weight, quantize_activations,
                    quantize_weight)


@functools.lru_cache(maxsize=256)
def _fp8_tiles(tiles, top: int):
    """``tiles`` with an fp8 K step (see :meth:`WeightFormat.gemm_tiles`), kept per tile set:
    ``dataclasses.replace`` would otherwise cost every GEMM launch several microseconds."""
    block_k = min(top, max(32, tiles.block_k))
    return tiles if block_k == tiles.block_k else dataclasses.replace(tiles, block_k=block_k)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """One way of storing expert weights (see the module docstring)."""

    name: str
    #: Stored element type; None: the activations' own 16/32-bit dtype, no scales.
    element: torch.dtype | None
    #: Weight scale layout: "block", "channel", "tensor" (None: no scales).
    scales: str | None
    #: Rows x columns (N x K) of one weight scale block ("block" scales only).
    block: tuple[int, int] | None
    #: Activation quantisation: "group" (1 x block[1] per token), "token" (None: none).
    activations: str | None
    #: The GEMM core's ``SCALES`` branch: 0 none, 1 block (inside the K loop), 2 per row and
    #: channel, 3 per row and expert (both after the loop).
    scale_code: int

    @property
    def quantized(self) -> bool:
        return self.element is not None

    def scale_shape(self, experts: int, n: int, k: int) -> tuple[int, ...] | None:
        """The shape of the scales of ``[experts, n, k]`` weights (None: no scales)."""
        if self.scales == "block":
            return (experts, -(-n // self.block[0]), -(-k // self.block[1]))
        if self.scales == "channel":
            return (experts, n)
        if self.scales == "tensor":
            return (experts,)
        return None

    def table_key(self, activation_dtype: torch.dtype) -> str:
        """The dtype part of a tuned table's name. The three fp8 formats share the fp8 tables:
        same element, same K loop; the tiles were tuned with block scales."""
        return str(self.element if self.quantized else activation_dtype).replace("torch.", "")

    # ---- the numbers ------------------------------------------------------------------------------

    def quantize_weight(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``w [E, N, K]`` in this format, with its scales (``(w, None)`` unquantised)."""
        if not self.quantized:
            return w, None
        return quantize_weight(w, self.scales, block=self.block)

    def quantize_activations(self, x: torch.Tensor, *, reference: bool = False):
        """Activations ``[T, K]`` ready to multiply weights of this format: ``(x, None)``
        unquantised, else fp8 with float32 scales (``reference``: the torch quantiser)."""
        if not self.quantized:
            return x, None
        return quantize_activations(x, self.activations, reference=reference, group=self._group)

    def dequantize_weight(self, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return w if not self.quantized else dequantize_weight(w, scale, block=self.block)

    def dequantize_activations(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return x if not self.quantized else dequantize_activations(x, scale, self.activations, group=self._group)

    @property
    def _group(self) -> int:
        return self.block[1] if self.block else 128

    # ---- what the kernels need ----------------------------------------------------------------------

    def gemm_tiles(self, tiles):
        """Tiles for this format: fp8 K steps of 32..``block[1]`` (the fp8 MMA's K is 32, and a
        K step must not straddle two scale blocks); others unchanged."""
        if not self.quantized:
            return tiles
        return _fp8_tiles(tiles, self.block[1] if self.block else 128)

    def scale_arguments(self, a: torch.Tensor, w: torch.Tensor, a_scale, w_scale) -> tuple:
        """The GEMM core's scale arguments ``(a_scale, stride_as, w_scale, stride_wse,
        stride_wsn, stride_wsk, SCALES, SCALE_BN, SCALE_BK)``: row ``r`` of ``A`` reads its scales
        at ``a_scale + r * stride_as``, expert ``e`` at ``w_scale + e * stride_wse``. Unquantised
        inputs pass any tensor for the unused pointers."""
        if self.scales is None:
            return a, 0, w, 0, 0, 0, 0, 128, 128
        if self.scales == "block":
            return (a_scale, a_scale.stride(0), w_scale, w_scale.stride(0), w_scale.stride(1), w_scale.stride(2),
                    1, self.block[0], self.block[1])
        stride_wse = w_scale.stride(0)
        return a_scale, 1, w_scale, stride_wse, 1, 0, self.scale_code, 128, 128

    # ---- detection and checks -------------------------------------------------------------------------

    @staticmethod
    def of(func: str, name: str, w: object, scale: object, scale_name: str | None = None) -> "WeightFormat":
        """The format of weights ``w [E, N, K]`` with scales ``scale`` (None for 16/32-bit
        weights). Only an exact scale shape is recognised; anything else is an error naming
        ``scale_name`` (default ``<name>_scale``) and the shapes that would have been accepted."""
        scale_name = scale_name or f"{name}_scale"
        check_tensor(func, name, w, ndim=3, dtypes=FLOAT_DTYPES + (FP8,), last_dim_contiguous=True)
        if w.dtype != FP8:
            if scale is not None:
                fail(func, scale_name, f"must be None for {str(w.dtype).replace('torch.', '')} weights (scales belong "
                     "to fp8 weights)", "a tensor")
            return UNQUANTIZED
        check_tensor(func, scale_name, scale, dtypes=(torch.float32,), device=w.device, contiguous=True)
        e, n, k = w.shape
        shape = tuple(scale.shape)
        for fmt in FORMATS.values():
            if fmt.quantized and fmt.scale_shape(e, n, k) == shape:
                fmt.check_weight_shape(func, name, w)
                return fmt
        wanted = ", ".join(f"{fmt.scale_shape(e, n, k)} ({key})" for key, fmt in FORMATS.items() if fmt.quantized)
        fail(func, scale_name, f"must have the shape of one fp8 format's scales for {name} of shape {tuple(w.shape)}: "
             f"{wanted}", f"shape {shape}")

    def check_weight_shape(self, func: str, name: str, w: torch.Tensor) -> None:
        """Block scales need K a multiple of the block's K edge (activations are quantised in
        groups of that width)."""
        if self.scales == "block" and w.shape[2] % self.block[1]:
            fail(func, name, f"must have K = {w.shape[2]} a multiple of {self.block[1]} for {self.block[0]}x"
                 f"{self.block[1]} block scales (activations are quantised in 1x{self.block[1]} groups)",
                 f"shape {tuple(w.shape)}")

    def check_gated(self, func: str, name: str, w1: torch.Tensor) -> None:
        """GEMM 1's ``[E, 2F, K]``: with block scales the up half must start a new block."""
        if self.scales == "block" and (w1.shape[1] // 2) % self.block[0]:
            fail(func, name, f"must have F a multiple of {self.block[0]} for block scales (the up half starts a "
                 "new block)", f"shape {tuple(w1.shape)}")

    @staticmethod
    def of_pair(func: str, w1: torch.Tensor, w2: torch.Tensor, w1_scale, w2_scale) -> "WeightFormat":
        """The one format of both expert weights (they must agree)."""
        fmt = WeightFormat.of(func, "w1", w1, w1_scale)
        other = WeightFormat.of(func, "w2", w2, w2_scale)
        if other is not fmt:
            fail(func, "w2_scale" if fmt.quantized else "w2", f"must be in w1's format ({fmt.name})", other.name)
        fmt.check_gated(func, "w1", w1)
        return fmt

    @staticmethod
    def named(func: str, name: str, key: object) -> "WeightFormat":
        """``FORMATS[key]`` for a user's string, or an error listing the keys."""
        if not isinstance(key, str) or key not in FORMATS:
            fail(func, name, f"must be one of {', '.join(map(repr, FORMATS))}", repr(key))
        return FORMATS[key]

    def __repr__(self) -> str:
        return f"WeightFormat({self.name!r})"


UNQUANTIZED = WeightFormat("unquantized", None, None, None, None, 0)
FP8_BLOCK = WeightFormat("fp8-block", FP8, "block", (128, 128), "group", 1)
FP8_CHANNEL = WeightFormat("fp8-channel", FP8, "channel", None, "token", 2)
FP8_TENSOR = WeightFormat("fp8-tensor", FP8, "tensor", None, "token", 3)

#: Every format, by the short name ``MoELayer.quantized`` and the benchmarks use.
FORMATS = {"none": UNQUANTIZED, "block": FP8_BLOCK, "channel": FP8_CHANNEL, "tensor": FP8_TENSOR}
