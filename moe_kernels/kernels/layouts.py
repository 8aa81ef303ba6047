"""The three grouped-GEMM layouts, and what each one supports, in one table.

Every layout runs the same two GEMMs on the same tile core (:mod:`moe_kernels.kernels._tile_gemm`);
they differ in how a program finds its rows, and so in which of the optional machinery they are
wired for. :data:`LAYOUTS` is the one place that says so. :class:`~moe_kernels.layer.MoELayer`,
:func:`~moe_kernels.layer.moe_layer`, :func:`~moe_kernels.kernels.config.check_config`,
:func:`~moe_kernels.kernels.config.get_config` and the tuner all ask it, so an unsupported
combination fails when a layer is built, naming the layout and the format:

    >>> from moe_kernels.kernels.formats import FORMATS
    >>> LAYOUTS["permute"].supports(FORMATS["block"]), LAYOUTS["masked"].supports(FORMATS["block"])
    (True, False)
    >>> LAYOUTS["masked"].check_format("MoELayer", FORMATS["block"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: MoELayer: argument 'layout' must be a layout that runs fp8-block weights ... got 'masked' ...
    >>> [name for name, layout in LAYOUTS.items() if layout.tma]   # contiguous or gathered rows, not slabs
    ['index_gather', 'permute']
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from .._checks import fail

_ALL_FORMATS = ("unquantized", "fp8-block", "fp8-channel", "fp8-tensor")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout's entry (see the module docstring)."""

    name: str
    #: ``module:function`` of its experts function, with ``fused_experts``' arguments.
    experts_function: str
    #: The :class:`~moe_kernels.kernels.formats.WeightFormat` names it runs.
    formats: tuple[str, ...]
    #: Tiles through Hopper's tensor-memory accelerator (``GemmTiles.tma``): the weights, and where
    #: a tile's rows are consecutive (permute) the activations too.
    tma: bool
    #: One program per SM walking the tiles (``GemmTiles.persistent``).
    persistent: bool
    #: Tiles computed transposed, weights on the MMA's M side (``GemmTiles.swap_ab``).
    swap_ab: bool
    #: GEMM 2 adds the top-k slots in its epilogue (``MoEConfig.sum_in_gemm``), and may split K.
    sum_in_gemm: bool
    #: GEMM 1 may split K (``gate_up.split_k > 1``): its gate and up sums are added with atomics
    #: into an fp32 buffer, and SiLU·mul runs as a launch of its own.
    split_gate_up: bool
    #: GEMM 2 launched as a programmatic dependent of GEMM 1 (``MoEConfig.pdl``).
    pdl: bool
    #: GEMM 1's epilogue quantises GEMM 2's fp8 activations (``MoEConfig.quant_in_gemm``).
    quant_in_gemm: bool
    #: The shared expert can run as expert ``E`` inside the grouped GEMM.
    fused_shared_expert: bool
    #: The layouts whose tuned tables give its tiles, in order of preference: its own first, then
    #: another layout's entry for the same shape (with the machinery it lacks switched off).
    tables: tuple[str, ...]
    #: What its rows are aligned to: "block_m" (the M tile), "align" (segments of ``align`` rows,
    #: which ``block_m`` must divide) or "slab" (``[E, m_max]`` slabs).
    rows: str
    #: Both GEMMs of a tiny batch in one launch (``MoEConfig.one_launch``,
    #: :mod:`moe_kernels.kernels.one_launch`).
    one_launch: bool = False
    #: Both GEMMs as one stream of tiles (``MoEConfig.stream_lag``, :mod:`moe_kernels.kernels.streamed_pair`).
    streamed: bool = False
    #: GEMM 1 reads its rows through the permutation instead of copied ones (``MoEConfig.gather_rows``).
    gather_rows: bool = False
    #: A segment's last tile with at most half its rows real runs on half the rows (``MoEConfig.short_last_tile``).
    short_last_tile: bool = False

    def supports(self, fmt) -> bool:
        return fmt.name in self.formats

    def check_format(self, func: str, fmt) -> None:
        """Fail, naming this layout and ``fmt``, if this layout cannot run ``fmt`` weights."""
        if not self.supports(fmt):
            able = [name for name, layout in LAYOUTS.items() if layout.supports(fmt)]
            fail(func, "layout", f"must be a layout that runs {fmt.name} weights ({' or '.join(map(repr, able))})",
                 f"{self.name!r} (it runs {', '.join(self.formats)} weights only)")

    def experts(self):
        """The layout's experts function (imported on first use: the kernels import this table)."""
        return _resolve(self.experts_function)


@functools.lru_cache(maxsize=None)
def _resolve(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module, __package__), name)


LAYOUTS = {
    "index_gather": Layout("index_gather", ".index_gather:fused_experts", _ALL_FORMATS, tma=True, persistent=True,
                           swap_ab=True, sum_in_gemm=True, split_gate_up=True, pdl=True, quant_in_gemm=True,
                           fused_shared_expert=True, tables=("index_gather",), rows="block_m", one_launch=True,
                           streamed=True),
    "permute": Layout("permute", ".permute:permute_experts", _ALL_FORMATS, tma=True, persistent=True,
                      swap_ab=True, sum_in_gemm=True, split_gate_up=False, pdl=False, quant_in_gemm=False,
                      fused_shared_expert=True, tables=("permute", "index_gather"), rows="align", gather_rows=True,
                      short_last_tile=True),
    "masked": Layout("masked", ".masked:masked_experts", ("unquantized",), tma=False, persistent=False,
                     swap_ab=False, sum_in_gemm=False, split_gate_up=False, pdl=False, quant_in_gemm=False,
                     fused_shared_expert=True, tables=("masked", "index_gather"), rows="slab"),
}


def layout_named(func: str, name: object) -> Layout:
    """``LAYOUTS[name]``, or an error listing the layouts."""
    if not isinstance(name, str) or name not in LAYOUTS:
        fail(func, "layout", f"must be one of {', '.join(map(repr, LAYOUTS))}", repr(name))
    return LAYOUTS[name]
