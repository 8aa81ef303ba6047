"""Which layout a batch runs when the layer chooses (``layout="auto"``): measured crossovers, as data.

Index-gather runs every batch unless a measurement says otherwise. For one GPU, routed-expert
shape and weight format, ``layout-choices.json`` beside this module may name another layout, the
tiles it was measured with, the token count from which it runs (the first batch at which it was
measured clearly faster than index-gather; the entry's ``note`` says why there), and the record
that showed it. On the H200, DeepSeek-V3's bf16 experts run 8-10% faster from 4,096 tokens on the
permute layout with TMA loads of both operands on a persistent grid
(``results/nvidia-h200/prefill-ab.json``: 8202 against 8943 us at 4,096 tokens, 21937 against
24232 at 16,384; index-gather was faster at 1,024, and at 2,048 the permute layout was 2% faster
in one run, ``prefill-ab-2048.json``, not enough to move the switch). The fp8 block layers of DeepSeek-V3 and
Qwen3-30B-A3B run the permute layout with both GEMMs on the Gluon kernel (``"gemm": "gluon"``) from 1,024 tokens
(Qwen3) and 2,048 (DeepSeek-V3) on both GPUs (the H200: ``layer-layout-ab-gluon.json``, DeepSeek-V3 5767 against
6997 us at 4,096 tokens, and ``fp8-sweep-s33.json`` down to 1,024; the H100:
``results/nvidia-h100-80gb-hbm3/fp8-sweep.json`` and ``fp8-sweep-h200-tables-s36.json``). On the H100 the bf16
layers run the permute layout with the bf16 Gluon GEMMs from 1,024 tokens (Qwen3) and 2,048 (DeepSeek-V3)
(``layer-layout-ab-bf16*-s33.json``, ``-s35.json``, ``layer-layout-ab-bf16-tables-s36.json``; GEMM 1 gathering its
rows where the experts average at most 128). Until session 36 the H100 had no index-gather table of its own and
ran the default tiles, and its fp8 decode ran on the transposed Gluon kernel (16-row segments); with the H200's
tables copied for it index-gather was faster there, and those entries went. The layer takes an entry naming the Gluon
GEMMs only where they run (:func:`~moe_kernels.kernels.permute_gluon.refusal`: bf16 activations and weights they
can read, Triton 3.6 on sm_90): with the Triton GEMMs the permute layout lost to index-gather.

    >>> choice = choose_layout(4096, 256, 2048, 7168, "unquantized", "cpu", device_name="NVIDIA H200")
    >>> choice.layout, choice.config.down.persistent, choice.from_tokens
    ('permute', 1, 4096)
    >>> choose_layout(1024, 256, 2048, 7168, "unquantized", "cpu", device_name="NVIDIA H200").layout
    'index_gather'
    >>> choose_layout(4096, 256, 2048, 7168, "fp8-block", "cpu", device_name="NVIDIA H200").layout
    'permute'

Without an entry (another GPU, shape or format, or no GPU) the choice is index-gather, with the
tiles its own lookup gives (``config`` None). The layer asks only when it was given no tiles and
its shared expert is not fused as a slot (a case the crossovers were not measured in).

A key may hold a list of entries, each from its own ``from_tokens`` up to the next's: a batch takes
the last entry that starts at or below it. An ``index_gather`` entry may leave ``config`` null (its
table's tiles). A ``permute`` entry may name its segments' ``align`` (16, 32, 64 or 128; 128 if
absent) and the ``gemm`` kernel, "triton" or "gluon" (:func:`~moe_kernels.kernels.permute.
permute_experts`' ``gemm``; absent: the module's switch): decode on the transposed Gluon kernel is
segments of 16 rows with ``"gemm": "gluon"``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch

from .._checks import check_int, fail
from .config import MoEConfig, check_config, gpu_of
from .formats import FORMATS
from .layouts import LAYOUTS

__all__ = ["AUTO", "CHOICES_FILE", "LayoutChoice", "check_layout", "choose_layout", "forget_choices", "load_choices"]

CHOICES_FILE = Path(__file__).resolve().parent / "layout-choices.json"
#: ``layout=AUTO``: the layer picks the layout by batch (:func:`choose_layout`).
AUTO = "auto"
#: The permute layout's segment alignment, which the measured tiles' M tile must divide.
_ALIGN = 128


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """The layout a batch runs, the tiles measured with it (None: its table lookup decides), from how
    many tokens the measurement chose it (None: the default), and for the permute layout its segments'
    rows and GEMM kernel (None: the call's defaults)."""

    layout: str
    config: MoEConfig | None
    from_tokens: int | None = None
    align: int | None = None
    gemm: str | None = None


def shape_key(device_name: str, E: int, N: int, K: int, fmt_name: str) -> str:
    """The key of one (GPU, routed-expert shape, weight format) in the choices file."""
    return f"device={device_name.replace(' ', '_')},E={E},N={N},K={K},format={fmt_name}"


@functools.lru_cache(maxsize=None)
def load_choices() -> dict[str, tuple[LayoutChoice, ...]]:
    """``{shape key: its entries as LayoutChoices, by from_tokens}`` from :data:`CHOICES_FILE` ({} if
    there is none); every entry checked (a layout that runs the key's format, tiles valid for it, an
    align and a GEMM kernel the layout takes, no two from the same batch), an error naming the file and
    the entry otherwise."""
    func = "load_choices"
    choices = {}
    for key, where, fmt_name, ranges in choice_entries(func, CHOICES_FILE):
        ranges = ranges if isinstance(ranges, list) else [ranges]
        checked = sorted((_entry(func, f"{where}[{i}]" if len(ranges) > 1 else where, entry, fmt_name)
                          for i, entry in enumerate(ranges)), key=lambda choice: choice.from_tokens)
        starts = [choice.from_tokens for choice in checked]
        if not checked:
            fail(func, where, "must hold at least one entry", ranges)
        if len(set(starts)) < len(starts):
            fail(func, where, "must hold entries from distinct from_tokens", starts)
        choices[key] = tuple(checked)
    return choices


def choice_entries(func: str, path: Path):
    """``(key, where, format name, entry)`` for each entry of a measured-choices file's ``choices`` object
    (none if there is no such file), each key checked to end with ``format=<a weight format's name>``; an
    error naming the file otherwise. ``where`` names the entry in errors."""
    if not path.exists():
        return
    try:
        entries = json.loads(path.read_text())["choices"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        fail(func, str(path), "must be JSON with a 'choices' object", repr(error))
    if not isinstance(entries, dict):
        fail(func, f"{path.name}['choices']", "must be an object of shape keys", type(entries).__name__)
    for key, entry in entries.items():
        where = f"{path.name}[{key!r}]"
        fmt_name = key.rsplit("format=", 1)[-1]
        if fmt_name not in {f.name for f in FORMATS.values()}:
            fail(func, where, "must end with format=<a weight format's name>", repr(key))
        yield key, where, fmt_name, entry


def _entry(func: str, where: str, entry, fmt_name: str) -> LayoutChoice:
    """One entry of the choices file, checked."""
    try:
        layout, start = entry["layout"], entry["from_tokens"]
        config = entry["config"]
        config = None if config is None and layout == "index_gather" else MoEConfig.from_dict(config)
        align, gemm = entry.get("align"), entry.get("gemm")
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        fail(func, where, "must have 'layout', 'from_tokens' and a valid 'config'", repr(error))
    if layout not in LAYOUTS or fmt_name not in LAYOUTS[layout].formats:
        fail(func, f"{where}.layout", f"must be a layout that runs {fmt_name} weights", repr(layout))
    check_int(func, f"{where}.from_tokens", start, lo=1)
    aligned = LAYOUTS[layout].rows == "align"
    if align is not None and (check_int(func, f"{where}.align", align) not in (16, 32, 64, 128) or not aligned):
        fail(func, f"{where}.align", "must be 16, 32, 64 or 128, on a layout of aligned segments (permute)",
             repr(align))
    if gemm is not None and (layout != "permute" or gemm not in ("triton", "gluon")):
        fail(func, f"{where}.gemm", "must be 'triton' or 'gluon', on the permute layout", repr(gemm))
    if config is not None:
        config = check_config(func, config, layout=layout, align=(align or _ALIGN) if aligned else None)
    return LayoutChoice(layout, config, start, align, gemm)


def choose_layout(M: int, E: int, N: int, K: int, fmt_name: str, device: torch.device | str, *,
                  device_name: str | None = None) -> LayoutChoice:
    """The layout for ``M`` tokens over ``E`` experts with ``F = N``, ``d = K`` and weights in the
    format named ``fmt_name``, on ``device``'s GPU (or as on ``device_name``, whatever ``device`` is:
    how a CPU test pins what an H200 would run)."""
    func = "choose_layout"
    check_int(func, "M", M, lo=0)
    _, device_name = gpu_of(func, device, device_name)
    return _choose(M, E, N, K, fmt_name, device_name)


@functools.lru_cache(maxsize=4096)
def _choose(M, E, N, K, fmt_name, device_name) -> LayoutChoice:
    entries = load_choices().get(shape_key(device_name, E, N, K, fmt_name), ()) if device_name else ()
    started = [choice for choice in entries if M >= choice.from_tokens]
    return started[-1] if started else LayoutChoice("index_gather", None)


def forget_choices() -> None:
    """Read the choices file again at the next choice (after it changed)."""
    load_choices.cache_clear()
    _choose.cache_clear()


def check_layout(func: str, layout: object, fmt) -> None:
    """``layout`` names a layout that runs ``fmt`` weights, or is :data:`AUTO` (the layer chooses
    by batch, among layouts that run them)."""
    if layout == AUTO:
        return
    if not isinstance(layout, str) or layout not in LAYOUTS:
        fail(func, "layout", f"must be one of {', '.join(map(repr, LAYOUTS))} or {AUTO!r}", repr(layout))
    LAYOUTS[layout].check_format(func, fmt)
