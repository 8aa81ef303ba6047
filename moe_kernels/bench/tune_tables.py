"""The tuner's output: the tuned tables the kernels load (``moe_kernels/kernels/configs/``), each
with a ``measured`` block that says where every entry comes from.

A run that tunes some token counts rewrites those entries and keeps the others; the block names
this run (its record, the token counts it tuned) and, under ``other_token_counts``, one flat list
of the earlier runs the kept entries come from (:func:`sources_of`), never a nested chain.

    >>> sources_of({"method": "run A", "tuned_token_counts": [1, 8]}, [8])
    [{'tokens': [8], 'measured': {'method': 'run A', 'tuned_token_counts': [1, 8]}}]
"""

from __future__ import annotations

import json

import torch

def write_tables(entries: list[dict], dtype: torch.dtype, record: str, weight_format: str, log,
                 shared: bool = False, fused_shared: bool = False) -> None:
    """One table per tuned shape: the best config at each token count tuned (merged into the
    entries an existing table has at other token counts). ``shared``: the entries tuned a shared
    expert (``tune --shared``), ``fused_shared`` the routed experts with the shared one as slot ``E``
    (``tune --fused-shared``), which the ``measured`` block says."""
    from ..kernels.config import MoEConfig, load_table, table_name, write_table

    device = torch.cuda.get_device_name()
    by_shape: dict = {}
    for entry in entries:
        by_shape.setdefault((entry["E"], entry["N"], entry["K"]), {})[entry["M"]] = MoEConfig.from_dict(entry["config"])
    for (e, n, k), configs in by_shape.items():
        name = table_name(device, e, n, k, dtype, "index_gather")
        old = load_table(name) or {}
        kept = sorted(set(old) - set(configs))
        routing, method = ("uniform (top-k of iid normal logits)",
                           "python -m moe_kernels.bench tune --write-tables (GEMM 1 and GEMM 2 with its top-k sum timed "
                           "separately, each replayed from a CUDA graph, L2 flushed)")
        if shared:
            routing, method = ("none: one expert that every token uses (a shared expert)",
                               "python -m moe_kernels.bench tune --shared --write-tables (GEMM 1 and GEMM 2 on the "
                               "dense block map timed separately, each replayed from a CUDA graph, L2 flushed)")
        if fused_shared:
            routing = ("uniform top-k of the routed experts, then the shared expert (id E, weight 1) in every "
                       "token's last slot")
            method = method.replace("--write-tables", "--fused-shared --write-tables")
        measured = {"device": device, "torch": torch.__version__, "triton": _triton_version(), "routing": routing,
                    "weights": "bf16" if weight_format == "none" else f"fp8, format {weight_format!r} "
                               "(128x128 block scales, 1x128 activation groups)",
                    "method": method,
                    "record": record, "tuned_token_counts": sorted(configs)}
        earlier = _table_measured(name)
        notes = {key: value for key, value in earlier.items() if is_note(value)}
        if kept:   # say where the entries this run did not tune come from
            measured["other_token_counts"] = sources_of({key: value for key, value in earlier.items()
                                                         if key not in notes}, kept)
        measured.update(kept_notes(notes, kept))
        path = write_table(device, e, n, k, dtype, "index_gather", {**old, **configs}, measured)
        log(f"wrote {path}")


def is_note(value) -> bool:
    """A note in a table's ``measured`` block: a change made by hand or by an A/B after a tuning run,
    ``{"tokens": [...], "change": ..., "record": ..., ...}``, about the entries at those token counts."""
    return isinstance(value, dict) and isinstance(value.get("tokens"), list)


def kept_notes(notes: dict, kept: list[int]) -> dict:
    """The notes about entries a new run keeps: each with its token counts cut to the kept ones, and
    dropped when none is left (the run replaced every entry it was about).

        >>> kept_notes({"a": {"tokens": [256, 512], "change": "x"}, "b": {"tokens": [512]}}, [1, 256])
        {'a': {'tokens': [256], 'change': 'x'}}
    """
    out = {}
    for key, note in notes.items():
        tokens = [t for t in note["tokens"] if t in kept]
        if tokens:
            out[key] = {**note, "tokens": tokens}
    return out


def sources_of(measured: dict, tokens: list[int]) -> list[dict]:
    """Where the entries at ``tokens`` of a table whose ``measured`` block is given came from: a
    flat list of ``{"tokens": [...], "measured": <the run's block, without its own sources>}``.
    A block that lists ``tuned_token_counts`` covers those; its ``other_token_counts`` the rest. An
    older block lists neither: its record's entries say which token counts it tuned (if the record
    is here), and entries it did not tune come from earlier runs this file no longer describes."""
    own = {key: value for key, value in measured.items() if key != "other_token_counts"}
    tuned = measured.get("tuned_token_counts")
    if tuned is None and measured.get("record"):
        tuned = _record_token_counts(measured["record"])
    groups: dict = {}

    def add(token, block):
        key = json.dumps(block, sort_keys=True)
        groups.setdefault(key, {"tokens": [], "measured": block})["tokens"].append(token)

    earlier = {"method": "an earlier tuning run (see this file's git history)"}
    for token in tokens:
        if tuned is None or token in tuned:
            add(token, own if measured else earlier)
            continue
        for group in measured.get("other_token_counts") or []:
            if isinstance(group, dict) and token in group.get("tokens", ()):
                add(token, group["measured"])
                break
        else:
            add(token, earlier)
    return list(groups.values())


def _record_token_counts(record: str) -> list[int] | None:
    """The token counts a tuning record (``results/<device>/<name>.json``) tuned, if it is here."""
    from ..results import RESULTS_DIR

    path = RESULTS_DIR.parent / record
    try:
        return sorted({entry["M"] for entry in json.loads(path.read_text())["data"]["entries"]})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _table_measured(name: str) -> dict:
    """The ``measured`` block of an existing table (empty if none)."""
    from ..kernels.config import CONFIG_DIR

    path = CONFIG_DIR / f"{name}.json"
    return json.loads(path.read_text()).get("measured", {}) if path.exists() else {}


def _triton_version() -> str:
    import triton

    return triton.__version__
