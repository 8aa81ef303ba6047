"""Where a layer's shared expert runs when the layer chooses (``shared_expert="auto"``): measured, as data.

A shared expert can run beside the routed experts (its own two GEMMs, on the dense block map) or among them,
as expert ``E`` in every token's last slot (one more row a token in the routed GEMMs). Fused, its weights join
the routed experts' single stream of weight reads, so at a few tokens it costs little more than its bytes; as
the batch grows, every M block of its rows reads its whole weight (from HBM unless the L2 still holds it), and
the slot's advantage goes (not profiled: what the measurements below are consistent with). Which is faster is
measured per GPU, routed-expert shape and weight format (``tools/shared_expert_ab.py``: the layer with the
shared expert left out, separate and fused), and ``shared-choices.json`` beside this module keeps, per key,
the largest batch up to which the slot ran faster (``slot_up_to_tokens``), with the record that showed it.
On the H100, DeepSeek-V3's fp8 block layer (the slot as the layer runs it: its E+1 table at 1-2 tokens, the routed
table's tiles from 3; the separate shared expert then on the default tiles: the H100 had no E=1 table): the shared
expert cost 20.2, 29.8, 38.6, 26.2, 31.5 and 37.6 us fused at 1, 2, 4, 16, 32 and 64 tokens against 40.7, 39.2,
42.9, 55.4, 51.6 and 52.2 separate, and at 128 and 512 tokens 69.4 and 122.3 fused against 45.6 and 68.8 separate
(``results/nvidia-h100-80gb-hbm3/shared-routed-tiles-ab-s44.json`` and ``-s44b.json``; at 8 tokens the layer without
the slot runs the naive block map and the one with it aligns, hence a negative difference). On its own E=1 table
(session 47) the separate shared expert cost 31.5, 29.7 and 36.8 us at 1, 8 and 64 tokens against the slot's 19.7,
24.8 and 40.8 (``shared-ab-tuned-s47.json``), so the entry's crossover is 32 tokens now: at 16 and 32 the slot cost
25.6 and 31.5 us against 31.6 and 35.0 apart (``shared-crossover-fp8-s48.json``). The slot is taken on the
index-gather layout only (where it was measured): a layer whose ``layout="auto"`` picks another layout runs the
shared expert apart.

    >>> choose_shared_slot(8, 256, 2048, 7168, "fp8-block", "cpu", device_name="NVIDIA H100 80GB HBM3")
    True
    >>> choose_shared_slot(512, 256, 2048, 7168, "fp8-block", "cpu", device_name="NVIDIA H100 80GB HBM3")
    False

Without an entry (another GPU, shape or format, or no GPU) the shared expert runs separately, as a layer
built with ``shared_expert="separate"`` runs it.

While a CUDA graph is captured, a shared expert run apart forks onto a side stream (:mod:`moe_kernels.layer_shared`,
``SHARED_BESIDE``), where it runs under the router and the routed GEMMs and costs much less: an entry's ``beside``
object holds the crossover measured that way (``choose_shared_slot(..., beside=True)``, what a layer asks inside a
capture), and an entry without one answers with its in-line crossover. On the H100, DeepSeek-V3's fp8 layer: the
shared expert beside cost 24.4, 26.9, 19.3, 20.0, 21.7, 20.6, 24.1, 23.9, 31.5 and 51.7 us at 1, 2, 4, 8, 16, 32,
64, 128, 256 and 512 tokens, against the slot's 19.9 at one token and 30.5, 38.0, 26.1, 29.3 and 39.8 at 2, 4,
16, 32 and 64 (``shared-beside-ab-s45.json``, ``-s45b.json``): the slot at one token only. (At 8 the slot's whole
layer had beaten the forked one, 885.4 against 905.5 us, on the aligned block map where the routed layer alone ran
the naive one; once both aligned, the fork cost 17.6 us there against the slot's 24.9: ``shared-beside-ab-s46.json``.)
On the H200 (session 49, ``shared-beside-ab-s49-h200*.json``) the fork cost 12.2-14.2 us at 2-16 tokens against the
slot's 21.9-53.5, and the two tied at one token over three runs (15.2-15.8 us each): the slot there too.

    >>> [m for m in (1, 2, 4, 8, 16) if choose_shared_slot(m, 256, 2048, 7168, "fp8-block", "cpu",
    ...                                                      device_name="NVIDIA H100 80GB HBM3", beside=True)]
    [1]
    >>> [m for m in (1, 2, 4, 8, 16) if choose_shared_slot(m, 256, 2048, 7168, "fp8-block", "cpu",
    ...                                                      device_name="NVIDIA H200", beside=True)]
    [1]

A ``beside`` crossover of 0 takes the slot at no batch: DeepSeek-V3's bf16 layer on the H100, where the forked
shared expert added 23.8-23.9 us at one token against the slot's 32.9-33.0 (two runs, ``shared-crossover-bf16-s48.json``
and ``shared-ab-bf16-s48.json``), while in line the slot still wins there (33.0 against 39.1):

    >>> [choose_shared_slot(1, 256, 2048, 7168, "unquantized", "cpu", device_name="NVIDIA H100 80GB HBM3",
    ...                     beside=beside) for beside in (False, True)]
    [True, False]
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .._checks import check_bool, check_int, fail
from .config import gpu_of
from .formats import FORMATS
from .layout_choice import choice_entries, shape_key

__all__ = ["SHARED_CHOICES_FILE", "choose_shared_slot", "forget_shared_choices", "load_beside_choices",
           "load_shared_choices"]

SHARED_CHOICES_FILE = Path(__file__).resolve().parent / "shared-choices.json"


@functools.lru_cache(maxsize=None)
def load_shared_choices() -> dict[str, int]:
    """``{shape key: slot_up_to_tokens}`` from :data:`SHARED_CHOICES_FILE` ({} if there is none); every entry
    checked (a key that ends with a weight format's name, a positive token count, the record it came from), an
    error naming the file and the entry otherwise."""
    func = "load_shared_choices"
    choices = {}
    for key, where, _, entry in choice_entries(func, SHARED_CHOICES_FILE):
        if not isinstance(entry, dict) or not isinstance(entry.get("measured"), dict) \
                or not entry["measured"].get("records"):
            fail(func, where, "must be an object with 'slot_up_to_tokens' and 'measured' naming its records",
                 repr(entry)[:120])
        choices[key] = check_int(func, f"{where}.slot_up_to_tokens", entry.get("slot_up_to_tokens"), lo=1)
    return choices


@functools.lru_cache(maxsize=None)
def load_beside_choices() -> dict[str, int]:
    """``{shape key: slot_up_to_tokens}`` of the entries' ``beside`` objects: the crossover against a shared
    expert forked onto a side stream, measured in captured graphs; checked as :func:`load_shared_choices` checks an
    entry, except that 0 is allowed (the fork measured faster from one token: the slot at no batch)."""
    func = "load_beside_choices"
    load_shared_choices()   # (every entry checked first)
    choices = {}
    for key, where, _, entry in choice_entries(func, SHARED_CHOICES_FILE):
        beside = entry.get("beside")
        if beside is None:
            continue
        if not isinstance(beside, dict) or not isinstance(beside.get("measured"), dict) \
                or not beside["measured"].get("records"):
            fail(func, f"{where}.beside", "must be an object with 'slot_up_to_tokens' and 'measured' naming its "
                 "records", repr(beside)[:120])
        # 0: the forked shared expert was measured faster from one token (the slot at no batch)
        choices[key] = check_int(func, f"{where}.beside.slot_up_to_tokens", beside.get("slot_up_to_tokens"), lo=0)
    return choices


def choose_shared_slot(M: int, E: int, N: int, K: int, fmt_name: str, device: torch.device | str, *,
                       device_name: str | None = None, beside: bool = False) -> bool:
    """Whether ``M`` tokens run the shared expert as slot ``E`` of the routed GEMMs (``E`` routed experts of
    ``F = N``, ``d = K``, weights in the format named ``fmt_name``) on ``device``'s GPU, or as on
    ``device_name`` (a GPU's name, from any machine): True up to the entry's ``slot_up_to_tokens`` (with
    ``beside``, against a shared expert forked onto a side stream: its ``beside`` crossover, where it has one),
    False above it, wherever there is no entry, and at every batch (``M`` = 0 too) where the crossover is 0."""
    func = "choose_shared_slot"
    check_int(func, "M", M, lo=0)
    for name, value in (("E", E), ("N", N), ("K", K)):
        check_int(func, name, value, lo=1)
    check_bool(func, "beside", beside)
    names = sorted({f.name for f in FORMATS.values()})
    if fmt_name not in names:
        fail(func, "fmt_name", f"must be a weight format's name, one of {names}", repr(fmt_name))
    _, device_name = gpu_of(func, device, device_name)
    if device_name is None:
        return False
    key = shape_key(device_name, E, N, K, fmt_name)
    up_to = load_beside_choices().get(key) if beside else None
    up_to = load_shared_choices().get(key) if up_to is None else up_to
    return up_to is not None and 0 < up_to and M <= up_to


def forget_shared_choices() -> None:
    """Read the choices file again at the next choice (after it changed)."""
    load_shared_choices.cache_clear()
    load_beside_choices.cache_clear()
