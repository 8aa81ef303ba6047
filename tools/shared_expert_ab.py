"""Issue 19: what DeepSeek-V3's shared expert adds to the whole layer at decode, run beside the routed experts
or fused among them as slot E, against its read floor.

``MoELayer(x)`` on the same random weights three ways: the routed layer alone (the shared expert left out), the
shared expert ``"separate"`` (the routed experts' kernels on a dense block map with its E=1 table, or cuBLAS where
the plan says so; its output joins GEMM 2's top-k sum) and ``"fused"`` (expert E of the stacked weights, every
token's last slot: the E+1 table ``bench tune --fused-shared`` wrote where one covers the batch, else the routed one;
the plan's table is recorded). bf16 and fp8 block weights. Beside them a plain read of the shared expert's two
weight tensors, one launch each (``ceilings.weight_reader``). Each call replayed from a CUDA graph with the L2
flushed before each replay, four rounds, every other one in reverse order, the lowest round median kept
(``timing.time_lowest``); the two layers with a shared expert are checked against each other.

What the shared expert costs is the layer with it minus the routed layer; its floor is its weight bytes over the
read bandwidth measured in the same run (the larger of that and its FLOPs over the dense GEMM rate of its format,
bf16 or block-scaled fp8, measured in the same run: at 512 tokens DeepSeek-V3's shared expert is 45 GFLOP). Issue
19 asks for at most 1.2 times that floor at 512 tokens or fewer.

    PYTHONPATH=. python tools/shared_expert_ab.py [batches] [formats] [name]   # GPU: records <name>.json
                                                                            # (default shared-expert-ab)
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/shared_expert_ab.py    # CPU: a small shape, the checks only

``SHARED_AB_GROUP_M=4,8`` adds, for each value, the routed-only and fused layers on their plan's config with that
``group_m`` in both GEMMs ("routed only g8", "fused g8"). The tile order is the question: with ``group_m`` 1 a
program walks one M block's N tiles, so slot E's several M blocks (every token is in it) read its weights at
different times, each from HBM; walking ``group_m`` M blocks down one N tile reads each tile about together, so
the later reads can come from the L2.

``SHARED_AB_PRIORITY=0,-1`` adds, for each forked candidate, the same with the side stream at that priority
("separate beside experts p0"; CUDA's priorities on Hopper: 0, the default, down to -5, the highest).

``SHARED_AB_TILES=<record>`` (with ``SHARED_AB_BESIDE``) adds, for each batch, the separate layer forked with other
tiles for the shared expert ("forked tiles 0", "forked tiles 1", ...): from that ``bench tune --shared --record``
record's tried tiles at the batch, the ``SHARED_AB_TOP`` (default 4) fastest of each GEMM, each with the other GEMM's
fastest tiles of the same M tile. The tuner times each GEMM alone; forked, the shared expert shares the GPU with the
router and the routed GEMMs, and other tiles may hide better (session 48). Each candidate's config is recorded.

``SHARED_AB_CUBLAS=1`` adds, for 16-bit weights where the plan runs the shared expert apart on the dense block map,
the same layer with it on cuBLAS instead ("cublas in line", and "cublas forked" with ``SHARED_AB_BESIDE``): the
layer's per-GPU limit between the two (``layer_shared.dense_shared_max_tokens``).

``SHARED_AB_BESIDE=experts`` adds the separate layer captured with ``layer_shared.SHARED_BESIDE`` set to it
("separate beside experts"): the shared expert on a side stream forked at the layer's start, under the router and the
routed GEMMs, joined where their top-k sum reads it (:mod:`moe_kernels.layer_shared`). "separate" itself runs in line
(``SHARED_BESIDE`` None), as every record before session 45 did; the fork is the layer's default since. (Session 45
also timed "router", joined before the routed GEMMs: ``shared-beside-ab-s45.json``; that mode is gone.)
"""
import dataclasses
import os
import sys

import torch

from moe_kernels import MoELayer, layer_shared
from moe_kernels.layer import run_layer
from moe_kernels.bench.ceilings import measure_fp8_gemm_rate, measure_gemm_rate, measure_read_bandwidth, weight_reader
from moe_kernels.bench.fp8 import measure_block_scaled_rate
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels.config import GemmTiles
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import device_slug, load, record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
batches = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
formats = sys.argv[2].split(",") if len(sys.argv) > 2 else ["block", "none"]   # fp8 first: the layer engines run
record_name = sys.argv[3] if len(sys.argv) > 3 else "shared-expert-ab"
group_ms = [int(g) for g in os.environ.get("SHARED_AB_GROUP_M", "").split(",") if g]
besides = [way for way in os.environ.get("SHARED_AB_BESIDE", "").split(",") if way]
priorities = [int(p) for p in os.environ.get("SHARED_AB_PRIORITY", "").split(",") if p]
tiles_record = os.environ.get("SHARED_AB_TILES")
tiles_top = int(os.environ.get("SHARED_AB_TOP", "4"))
on_cublas = os.environ.get("SHARED_AB_CUBLAS", "") not in ("", "0")
if tiles_record and not besides:
    raise SystemExit("SHARED_AB_TILES times the forked shared expert: set SHARED_AB_BESIDE too")
model = MODELS["deepseek-v3"]
shrink = {} if device == "cuda" else {"hidden_size": 128, "intermediate_size": 128}
if device == "cpu":
    batches = [1, 5]
dtype = torch.bfloat16 if device == "cuda" else torch.float32   # (the interpreter's bf16 dot is wrong)
d = shrink.get("hidden_size", model.hidden_size)
f = shrink.get("intermediate_size", model.moe_intermediate_size)
ceilings = ({"read_bandwidth": measure_read_bandwidth(), "gemm_rate_bf16": measure_gemm_rate(),
             # (torch's block-scaled fp8 GEMM where it has one, else its per-tensor fp8 rate)
             "gemm_rate_fp8_block_scaled": measure_block_scaled_rate() or measure_fp8_gemm_rate()} if device == "cuda"
            else {"read_bandwidth": 1.0, "gemm_rate_bf16": 1.0, "gemm_rate_fp8_block_scaled": 1.0})
rows = []


def regrouped(cfg, group_m):
    """``cfg`` with ``group_m`` M blocks walked down each N tile, in both GEMMs."""
    return dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, group_m=group_m),
                               down=dataclasses.replace(cfg.down, group_m=group_m))


def beside(way, call, priority=None):
    """``call()`` with ``layer_shared.SHARED_BESIDE`` set to ``way`` (None: the shared expert in line; else forked
    onto a side stream, joining as ``way`` says, while a graph is captured), on a side stream of ``priority``
    (None: ``layer_shared.SIDE_PRIORITY``'s)."""
    old = layer_shared.SHARED_BESIDE, layer_shared.SIDE_PRIORITY
    layer_shared.SHARED_BESIDE = way
    layer_shared.SIDE_PRIORITY = old[1] if priority is None else priority
    try:
        return call()
    finally:
        layer_shared.SHARED_BESIDE, layer_shared.SIDE_PRIORITY = old


def tried_configs(batch, fmt, base):
    """Other configs for the shared expert at ``batch`` from ``tiles_record``'s tried tiles (the module's docstring):
    ``base`` (the plan's) with each GEMM's ``tiles_top`` fastest tiles and the other GEMM's fastest of that M tile."""
    entries = [e for e in load(tiles_record, device=device_slug(torch.cuda.get_device_name()))["data"]["entries"]
               if e["M"] == batch and e["format"] == fmt and e["E"] == 1]   # (a shared expert's tuning only)
    if not entries:
        raise SystemExit(f"SHARED_AB_TILES: {tiles_record} has no shared-expert ({fmt}) entry at {batch} tokens")
    tried = sorted((t for e in entries for t in e["tried"] if t.get("ms")), key=lambda t: t["ms"])
    fastest = {}   # (gemm, block_m) -> its fastest tiles
    for t in tried:
        fastest.setdefault((t["gemm"], t["block_m"]), t["tiles"])
    configs = []
    for gemm, other in (("gate_up", "down"), ("down", "gate_up")):
        for t in [t for t in tried if t["gemm"] == gemm][:tiles_top]:
            if (other, t["block_m"]) in fastest:
                tiles = {gemm: GemmTiles(**t["tiles"]), other: GemmTiles(**fastest[other, t["block_m"]])}
                config = dataclasses.replace(base, block_m=t["block_m"], **tiles)
                if config != base and config not in configs:
                    configs.append(config)
    return configs


def plan_note(layer, batch):
    plan = layer.plan(batch, dtype=dtype)
    return {"layout": plan.layout, "naive_blocks": plan.naive_blocks, "config_source": plan.choice.source,
            "table": plan.choice.table,
            "entry": plan.choice.entry, "config": dataclasses.asdict(plan.config),
            "shared_config_source": None if plan.shared_choice is None else plan.shared_choice.source,
            "shared_entry": None if plan.shared_choice is None else plan.shared_choice.entry}


for fmt in formats:
    layers = {"separate": MoELayer.random(model, dtype=dtype, device=device, seed=0, **shrink)}
    if fmt != "none":
        layers["separate"] = layers["separate"].quantized(fmt)
    weights, routing = layers["separate"].weights, layers["separate"].routing
    layers["routed only"] = MoELayer(dataclasses.replace(weights, shared_w13=None, shared_w2=None,
                                                         shared_w13_scale=None, shared_w2_scale=None), routing)
    layers["fused"] = MoELayer(weights, routing, shared_expert="fused")   # (a copy of the experts: 11-23 GB)
    shared_bytes = sum(t.numel() * t.element_size() for t in (weights.shared_w13, weights.shared_w2))
    read = weight_reader(weights.shared_w13, weights.shared_w2) if device == "cuda" else None
    for batch in batches:
        x = torch.randn(batch, d, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(batch))
        candidates = {name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}
        candidates["separate"] = lambda: beside(None, lambda: layers["separate"](x))   # (in line; the default forks)
        if os.environ.get("SHARED_AB_ROUTED_TILES"):   # the slot on the routed experts' own entry
            routed_cfg = layers["routed only"].plan(batch, dtype=dtype).config
            candidates["fused on routed tiles"] = lambda cfg=routed_cfg: layers["fused"](x, config=cfg)
        for g in group_ms:   # the plan's config in another tile order (the module's docstring)
            for name in ("routed only", "fused"):
                cfg = regrouped(layers[name].plan(batch, dtype=dtype).config, g)
                candidates[f"{name} g{g}"] = lambda layer=layers[name], cfg=cfg: layer(x, config=cfg)
            plan = layers["separate"].plan(batch, dtype=dtype)
            if plan.shared_choice is not None:   # the shared expert's own dense launch in that order
                choice = dataclasses.replace(plan.shared_choice, config=regrouped(plan.shared_choice.config, g))
                candidates[f"separate g{g}"] = (lambda plan=dataclasses.replace(plan, shared_choice=choice):
                                                beside(None, lambda: run_layer(plan, x, weights, routing)))
        for way in besides:   # (read while the candidate's graph is captured)
            candidates[f"separate beside {way}"] = lambda way=way: beside(way, lambda: layers["separate"](x))
            for p in priorities:   # the side stream at another priority (a stream per priority, made at its first use)
                candidates[f"separate beside {way} p{p}"] = lambda way=way, p=p: beside(
                    way, lambda: layers["separate"](x), p)
        tried_tiles = {}   # name -> the shared expert's config of a "forked tiles" candidate
        plan = layers["separate"].plan(batch, dtype=dtype, captured=True)
        if tiles_record and besides and plan.shared_choice is not None:
            for i, cfg in enumerate(tried_configs(batch, fmt, plan.shared_choice.config)):
                choice = dataclasses.replace(plan.shared_choice, config=cfg, source="argument")
                tried_tiles[f"forked tiles {i}"] = dataclasses.asdict(cfg)
                candidates[f"forked tiles {i}"] = (lambda plan=dataclasses.replace(plan, shared_choice=choice): beside(
                    besides[0], lambda: run_layer(plan, x, weights, routing)))
        for captured, name in ((False, "cublas in line"), (True, "cublas forked")):   # (SHARED_AB_CUBLAS)
            plan = layers["separate"].plan(batch, dtype=dtype, captured=captured)
            if on_cublas and fmt == "none" and plan.shared_choice is not None and (besides or not captured):
                candidates[name] = (lambda plan=dataclasses.replace(plan, shared_choice=None), way=besides[0] if
                                    captured else None: beside(way, lambda: run_layer(plan, x, weights, routing)))
        if read is not None:
            candidates["shared read"] = read
        reference = layers["separate"](x)
        unchecked = ("routed only", "shared read", *(f"routed only g{g}" for g in group_ms))
        lowest, rounds, errors, rel = time_lowest(candidates, reference, tolerance=3e-2, warmup_ms=5, rep_ms=30,
                                                  unchecked=unchecked, rounds=4, alternate=True)
        rate = ceilings["gemm_rate_bf16" if fmt == "none" else "gemm_rate_fp8_block_scaled"]
        floor_us = 1e6 * max(shared_bytes / ceilings["read_bandwidth"], batch * 6 * d * f / rate)
        cost = {way: lowest[way] - lowest["routed only"] for way in ("separate", "fused")
                if way in lowest and "routed only" in lowest}
        if "fused on routed tiles" in lowest:
            cost["fused on routed tiles"] = lowest["fused on routed tiles"] - lowest["routed only"]
        cost.update({f"fused g{g}": lowest[f"fused g{g}"] - lowest[f"routed only g{g}"] for g in group_ms})
        cost.update({f"separate g{g}": lowest[f"separate g{g}"] - lowest["routed only"] for g in group_ms
                     if f"separate g{g}" in lowest})
        cost.update({name: us - lowest["routed only"] for name, us in lowest.items()
                     if name.startswith(("separate beside ", "forked tiles ", "cublas ")) and "routed only" in lowest})
        row = {"format": fmt, "batch": batch, "us": lowest, "rounds_us": rounds, "errors": errors,
               "rel_err_vs_separate": rel, "shared_bytes": shared_bytes, "shared_floor_us": floor_us,
               "shared_cost_us": cost, "shared_cost_over_floor": {way: c / floor_us for way, c in cost.items()},
               "plans": {name: plan_note(layer, batch) for name, layer in layers.items()},
               "forked_tiles": tried_tiles}
        rows.append(row)
        record_tool(record_name, rows, {"model": "deepseek-v3", "batches": batches, "formats": formats,
                                               "group_m_variants": group_ms, "beside": besides,
                                               "side_priorities": priorities, "tiles_record": tiles_record,
                                               "tiles_top": tiles_top,
                                               "rounds": 4, "order": "reversed every other round",
                                               "ceilings": ceilings, "dtype": str(dtype)})
        print(f"{fmt:<5} {batch:>4}: " + "  ".join(f"{name} {us:8.1f}" for name, us in lowest.items())
              + " us | shared costs " + "  ".join(f"{way} {c:6.1f} us ({c / floor_us:4.2f}x floor {floor_us:.1f})"
                                                   for way, c in cost.items())
              + f" | fused table {row['plans']['fused']['table']}" + (f"  errors {errors}" if errors else ""),
              flush=True)
    del layers, weights, read
    if device == "cuda":
        torch.cuda.empty_cache()
