"""Which layout a batch runs when the layer chooses (``layout="auto"``): measured crossovers, as data.

Index-gather runs every batch unless a measurement says otherwise. For one GPU, expert shape and
weight dtype, ``configs/layout-choices.json`` may name another layout, the tiles it was measured
with, the token count from which it ran the experts faster than index-gather at every batch
measured, and the record that showed it. On the H200, DeepSeek-V3's bf16 experts run 8-10%
faster from 4,096 tokens on the permute layout with TMA loads of both operands on a persistent
grid (``results/nvidia-h200/prefill-ab.json``: 8202 against 8943 us at 4,096 tokens, 21937
against 24232 at 16,384; index-gather was faster at 1,024, and 2,048 was not measured):

    >>> import torch
    >>> choice = choose_layout(4096, 256, 2048, 7168, torch.bfloat16, "cpu", device_name="NVIDIA H200")
    >>> choice.layout, choice.config.down.persistent, choice.source
    ('permute', 1, 'layout-choices.json')
    >>> choose_layout(1024, 256, 2048, 7168, torch.bfloat16, "cpu", device_name="NVIDIA H200").layout
    'index_gather'

Without an entry (another GPU, shape or dtype, or no GPU) the choice is index-gather, with the
tiles its own lookup gives (``config`` None).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import torch

from .._checks import check_device, check_int, fail
from .config import CONFIG_DIR, MoEConfig, _device_name, check_config
from .layouts import LAYOUTS

__all__ = ["AUTO", "CHOICES_FILE", "LayoutChoice", "check_layout", "choose_layout", "load_choices"]

CHOICES_FILE = CONFIG_DIR / "layout-choices.json"
#: ``layout=AUTO``: the layer picks the layout by batch (:func:`choose_layout`).
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """The layout a batch runs, the tiles measured with it (None: its table lookup decides) and
    where the choice came from (``"default"``, or the file that holds the measurement)."""

    layout: str
    config: MoEConfig | None
    source: str


def shape_key(device_name: str, E: int, N: int, K: int, dtype: torch.dtype) -> str:
    """The key of one (GPU, shape, dtype) in the choices file: a tuned table's name without its layout."""
    return f"device={device_name.replace(' ', '_')},E={E},N={N},K={K},dtype={str(dtype).replace('torch.', '')}"


@functools.lru_cache(maxsize=None)
def load_choices() -> dict[str, tuple[int, str, MoEConfig]]:
    """``{shape key: (from_tokens, layout, config)}`` from :data:`CHOICES_FILE` ({} if there is none);
    every entry checked, an error naming the file and the entry otherwise."""
    func = "load_choices"
    if not CHOICES_FILE.exists():
        return {}
    try:
        entries = json.loads(CHOICES_FILE.read_text())["choices"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        fail(func, str(CHOICES_FILE), "must be JSON with a 'choices' object", repr(error))
    choices = {}
    for key, entry in entries.items():
        where = f"{CHOICES_FILE.name}[{key!r}]"
        try:
            layout, start = entry["layout"], entry["from_tokens"]
            config = MoEConfig.from_dict(entry["config"])
        except (KeyError, TypeError, ValueError) as error:
            fail(func, where, "must have 'layout', 'from_tokens' and a valid 'config'", repr(error))
        if layout not in LAYOUTS:
            fail(func, f"{where}.layout", f"must be one of {', '.join(map(repr, LAYOUTS))}", repr(layout))
        check_int(func, f"{where}.from_tokens", start, lo=1)
        choices[key] = (start, layout, check_config(func, config, layout=layout))
    return choices


@functools.lru_cache(maxsize=4096)
def choose_layout(M: int, E: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str, *,
                  device_name: str | None = None) -> LayoutChoice:
    """The layout for ``M`` tokens over ``E`` experts with ``F = N``, ``d = K`` and weights of ``dtype``
    (the table key: fp8 for fp8 weights) on ``device``'s GPU (or as on ``device_name``, whatever
    ``device`` is: how a CPU test pins what an H200 would run)."""
    func = "choose_layout"
    check_int(func, "M", M, lo=0)
    device = check_device(func, "device", device, must_exist=device_name is None)
    if device_name is None and device.type == "cuda":
        device_name = _device_name(device.index)
    found = load_choices().get(shape_key(device_name, E, N, K, dtype)) if device_name else None
    if found is not None and M >= found[0]:
        return LayoutChoice(found[1], found[2], CHOICES_FILE.name)
    return LayoutChoice("index_gather", None, "default")


def check_layout(func: str, layout: object, fmt) -> None:
    """``layout`` names a layout that runs ``fmt`` weights, or is :data:`AUTO` (the layer chooses
    by batch, among layouts that run them)."""
    if layout == AUTO:
        return
    if not isinstance(layout, str) or layout not in LAYOUTS:
        fail(func, "layout", f"must be one of {', '.join(map(repr, LAYOUTS))} or {AUTO!r}", repr(layout))
    LAYOUTS[layout].check_format(func, fmt)
