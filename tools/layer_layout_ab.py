"""Issue 18: the whole routed layer at prefill on each layout, and what ``layout="auto"`` picks.

``layout-choices.json`` sends DeepSeek-V3's fp8-block layer to the permute layout from 4,096 tokens,
chosen from the experts call alone (``prefill-gemm-ab-gathered.json``). This times the layer as a
caller runs it, ``MoELayer(x)``: the gate, the routing, the alignment or the permutation, the
quantisers (fp8), both GEMMs and the top-k sum. Rows: Qwen3-30B-A3B and DeepSeek-V3 (its shared
expert left out: the routed layer of issue 18's targets), bf16 and fp8 block weights, each batch, on
``index_gather``, ``permute`` and ``auto`` (the plan's layout and table entry recorded), and for fp8
``permute gluon``: the permute layout with both GEMMs on the Gluon kernel (``permute_gluon.FP8_GEMM``; and
``GLUON_ROWS``: with the one-pass fp8 input, ``permute.ONE_PASS_FP8_INPUT``; on the persistent grid,
``permute_gluon.GLUON_PERSISTENT``; GEMM 1 writing GEMM 2's fp8 input, ``permute_gluon.GLUON_QUANTIZE_IN_GEMM1``; and with half
tiles (a segment's last tile of at most 64 real rows multiplying 64 rows), ``permute_gluon.GLUON_HALF_TILES``; each
a layer of its own (the same weights), so that no plan or graph recorded with the other kernel is replayed; the record says which kernel
ran, or why the Gluon one could not). Each call is
replayed from a CUDA graph of one call with the L2 flushed before each replay, four rounds
interleaved, every other one in reverse order (in the first run, 4e65cda, two rounds in one order had
two identical plans 6.6% apart: the later one always ran after the slowest candidate), the lowest
round median kept (``timing.time_lowest``); each layout's output is checked
against the index-gather layer's. TFLOP/s over the routed GEMMs' FLOPs (``T k 6 d F``).

    PYTHONPATH=. python tools/layer_layout_ab.py [models] [batches]   # GPU: records layer-layout-ab.json
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/layer_layout_ab.py   # CPU: a small shape, the checks only
    (LAYER_AB_FORMATS=block: the fp8 rows only; LAYER_AB_LAYOUTS=index_gather,auto: those layouts only;
    LAYER_AB_GLUON_ROWS=0: no "permute gluon ..." rows, or the names of those to run, comma-separated;
    LAYER_AB_BF16_GLUON=0: no "permute gluon bf16" row; LAYER_AB_BF16_ROWS: the names of the bf16 rows to run;
    LAYER_AB_AUTO_COPIED=1: "auto copied input", "auto" without the one-pass bf16 input)

``permute gluon bf16`` (bf16, on an sm_90 GPU with Triton 3.6): the layer planned as a layout choice naming the
permute layout on 128-row segments with the Gluon GEMMs (``kernels/gluon_bf16.py``, ``permute_gluon.BF16_TILES``)
would plan it, a layer of its own; ``... half``: with ``permute_gluon.BF16_HALF_TILES``, ``... tma1``: with
``BF16_TMA_STORE_GEMM1``, ``... copied input``: without ``permute.ONE_PASS_BF16_INPUT`` (the permutation's copy, which
reads each token once a row, instead of ``quant_scatter.scatter_rows``), ``... gemm1 s3``: GEMM 1 on the table's
3 stages at every batch (``BF16_GEMM1_DEEP_FROM_ROWS`` None), ``... session 33``: both, ``... gemm1 s4 pointer
store``: GEMM 1's 4 stages without its TMA store (``BF16_TMA_STORE_GEMM1_DEEP`` off), ``... gathered``: GEMM 1
reading its rows from the tokens at every batch (``BF16_GATHER_GEMM1_UP_TO_ROWS``: no scatter of the input),
``... packed``: at none.
"""
import dataclasses
import os
import sys

import torch

from moe_kernels import MoELayer
from moe_kernels._runtime import record_launches
from moe_kernels.kernels import permute as permute_module, permute_gluon
from moe_kernels.bench.timing import time_lowest
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import record_tool


def owner(name):
    """The module that holds switch ``name`` (the one-pass input is the permutation's; the rest the Gluon GEMMs')."""
    return permute_module if name == "ONE_PASS_FP8_INPUT" else permute_gluon

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 4096, 16384]
if device == "cpu":
    batches = [3, 40]
LAYOUTS = tuple(os.environ.get("LAYER_AB_LAYOUTS", "index_gather,permute,auto").split(","))
if "index_gather" not in LAYOUTS:
    sys.exit("LAYER_AB_LAYOUTS must include index_gather (every row is checked against it)")
FORMATS = os.environ.get("LAYER_AB_FORMATS", "none,block").split(",")   # (bf16 "none", fp8 "block")
GLUON_ROWS = (   # name, GLUON_PERSISTENT, GLUON_QUANTIZE_IN_GEMM1, ONE_PASS_FP8_INPUT, GLUON_HALF_TILES,
    #              GLUON_HALF_TILES_GEMM2
    ("permute gluon", False, False, False, False, False), ("permute gluon one-pass", False, False, True, False, False),
    ("permute gluon one-pass half", False, False, True, True, False),
    ("permute gluon persistent", True, False, True, False, False),
    ("permute gluon persistent half", True, False, True, True, False),
    ("permute gluon persistent quantising", True, True, True, False, False),
    ("permute gluon persistent quantising half", True, True, True, True, False),
    ("permute gluon persistent quantising gemm2-half", True, True, True, False, True))
ROWS_ASKED = os.environ.get("LAYER_AB_GLUON_ROWS", "1")   # 1: every row; 0: none; else row names, comma-separated
if ROWS_ASKED == "0":   # (the layouts' rows only, e.g. at decode)
    GLUON_ROWS = ()
elif ROWS_ASKED != "1":
    unknown = set(ROWS_ASKED.split(",")) - {row[0] for row in GLUON_ROWS}
    if unknown:
        sys.exit(f"LAYER_AB_GLUON_ROWS names no such row: {sorted(unknown)}")
    GLUON_ROWS = tuple(row for row in GLUON_ROWS if row[0] in ROWS_ASKED.split(","))
ROUNDS = 4
BF16_GLUON = os.environ.get("LAYER_AB_BF16_GLUON", "1") == "1" and device == "cuda"
if BF16_GLUON:   # (where the Gluon kernel runs: sm_90 with Triton 3.6; elsewhere the plan would not take it)
    from moe_kernels.kernels.gluon_block_fp8 import available

    BF16_GLUON = available(device) is None


# name: the switches the row sets (permute_gluon's BF16_HALF_TILES, BF16_TMA_STORE_GEMM1 and BF16_GEMM1_DEEP_FROM_ROWS,
# permute's ONE_PASS_BF16_INPUT); a switch not named keeps the package's value
BF16_ROWS = {"permute gluon bf16": {}, "permute gluon bf16 half": {"BF16_HALF_TILES": True},
             "permute gluon bf16 tma1": {"BF16_TMA_STORE_GEMM1": True},
             "permute gluon bf16 session 33": {"ONE_PASS_BF16_INPUT": False, "BF16_GEMM1_DEEP_FROM_ROWS": None},
             "permute gluon bf16 copied input": {"ONE_PASS_BF16_INPUT": False},
             "permute gluon bf16 gemm1 s3": {"BF16_GEMM1_DEEP_FROM_ROWS": None},
             "permute gluon bf16 gemm1 s4 pointer store": {"BF16_TMA_STORE_GEMM1_DEEP": False},
             "permute gluon bf16 gathered": {"BF16_GATHER_GEMM1_UP_TO_ROWS": 10 ** 9},
             "permute gluon bf16 packed": {"BF16_GATHER_GEMM1_UP_TO_ROWS": None}}
BF16_ASKED = os.environ.get("LAYER_AB_BF16_ROWS")   # the names of the bf16 rows to run, comma-separated (absent: all)
if BF16_ASKED:
    unknown = set(BF16_ASKED.split(",")) - set(BF16_ROWS)
    if unknown:
        sys.exit(f"LAYER_AB_BF16_ROWS names no such row: {sorted(unknown)}")
    BF16_ROWS = {name: switches for name, switches in BF16_ROWS.items() if name in BF16_ASKED.split(",")}
# LAYER_AB_AUTO_COPIED=1 (bf16): "auto copied input", a layer of its own on "auto" without the one-pass input, for
# where "auto" runs the permute layout's Triton GEMMs (the H200's DeepSeek-V3 from 4,096 tokens)
AUTO_COPIED = os.environ.get("LAYER_AB_AUTO_COPIED") == "1"


def bf16_call(own, x, switches):
    """``own(x)`` with the bf16 Gluon path's ``switches`` set for the call (and restored after it)."""
    from moe_kernels.kernels import permute

    def call():
        saved = {name: getattr(permute if name == "ONE_PASS_BF16_INPUT" else permute_gluon, name) for name in switches}
        for name, value in switches.items():
            setattr(permute if name == "ONE_PASS_BF16_INPUT" else permute_gluon, name, value)
        try:
            return own(x)
        finally:
            for name, value in saved.items():
                setattr(permute if name == "ONE_PASS_BF16_INPUT" else permute_gluon, name, value)
    return call


def bf16_gluon_layer(layer, batch):
    """A layer of its own whose plan at ``batch`` is what a layout choice of the permute layout, 128-row segments
    and the Gluon GEMMs gives (the plan is made here, once, and kept by the layer)."""
    import moe_kernels.layer as layer_module
    from moe_kernels.kernels.layout_choice import LayoutChoice

    own = MoELayer(layer.weights, layer.routing, layout="permute")
    config = own.plan(batch).config.with_block_m(128)
    own = MoELayer(layer.weights, layer.routing, layout="auto")
    chosen, layer_module.choose_layout = layer_module.choose_layout, lambda *a, **k: LayoutChoice(
        "permute", config, 1, 128, "gluon")
    try:
        plan = own.plan(batch)
    finally:
        layer_module.choose_layout = chosen
    assert (plan.layout, plan.align, plan.gemm) == ("permute", 128, "gluon"), plan
    return own


def auto_note(plan):
    """What "auto" ran: its layout (and the permute layout's segments and GEMM kernel) and its tiles' source."""
    segments = f" a{plan['align']} {plan['gemm']}" if plan["align"] else ""
    return f"  (auto -> {plan['layout']}{segments}, {plan['config_source']})"
rows = []

for key in models:
    model = dataclasses.replace(MODELS[key], num_shared_experts=0)   # the routed layer alone
    shrink = {} if device == "cuda" else {"hidden_size": 128, "intermediate_size": 128}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32   # (the interpreter's bf16 dot is wrong)
    base = MoELayer.random(model, dtype=dtype, device=device, seed=0, **shrink)
    d = shrink.get("hidden_size", model.hidden_size)
    f = shrink.get("intermediate_size", model.moe_intermediate_size)
    for fmt in FORMATS:
        layer = base if fmt == "none" else base.quantized("block")
        gluon_layers = {} if fmt == "none" else {row[0]: MoELayer(layer.weights, layer.routing) for row in GLUON_ROWS}
        for batch in batches:
            x = torch.randn(batch, d, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(batch))
            plans, candidates = {}, {}
            for layout in LAYOUTS:
                layer.layout = layout
                plan = layer.plan(batch)
                plans[layout] = {"layout": plan.layout, "config_source": plan.choice.source,
                                 "config": dataclasses.asdict(plan.config), "align": plan.align, "gemm": plan.gemm}

                def call(layout=layout):
                    layer.layout = layout
                    return layer(x)
                candidates[layout] = call

            def gluon_call(persistent, fused, one_pass, half, half2, layer_of_its_own):
                def call():
                    names = ("FP8_GEMM", "GLUON_PERSISTENT", "GLUON_QUANTIZE_IN_GEMM1", "ONE_PASS_FP8_INPUT",
                             "GLUON_HALF_TILES", "GLUON_HALF_TILES_GEMM2")
                    saved = [getattr(owner(n), n) for n in names]
                    for n, value in zip(names, ("gluon", persistent, fused, one_pass, half, half2)):
                        setattr(owner(n), n, value)
                    try:
                        return layer_of_its_own(x)
                    finally:
                        for n, value in zip(names, saved):
                            setattr(owner(n), n, value)
                return call
            if gluon_layers:
                for name, persistent, fused, one_pass, half, half2 in GLUON_ROWS:
                    own = gluon_layers[name]
                    own.layout = "permute"
                    with record_launches() as launches:
                        gluon_call(persistent, fused, one_pass, half, half2, own)()
                    plans[name] = {"fp8_gemm": [s for n, s in launches if n == "permute.fp8_gemm"],
                                   "gemms": [s for n, s in launches if n == "gluon_block_fp8.gemm"]}
                    candidates[name] = gluon_call(persistent, fused, one_pass, half, half2, own)
            if AUTO_COPIED and fmt == "none":
                auto_layer = MoELayer(layer.weights, layer.routing, layout="auto")
                call = bf16_call(auto_layer, x, {"ONE_PASS_BF16_INPUT": False})
                with record_launches() as launches:
                    call()
                plans["auto copied input"] = {"one_pass_input": [s for n, s in launches if n == "quant_scatter"],
                                              "launches": sorted({n for n, _ in launches})}
                candidates["auto copied input"] = call
            for name, switches in (BF16_ROWS.items() if fmt == "none" and BF16_GLUON else ()):
                call = bf16_call(bf16_gluon_layer(layer, batch), x, switches)
                with record_launches() as launches:
                    call()
                plans[name] = {"bf16_gemm": [s for n, s in launches if n == "permute.bf16_gemm"],
                               "gathered": [s.get("gathered") for n, s in launches if n == "gluon_bf16.gemm"],
                               "gemms": [s for n, s in launches if n == "gluon_bf16.gemm"],
                               "one_pass_input": [s for n, s in launches if n == "quant_scatter"]}
                candidates[name] = call
            reference = candidates["index_gather"]()
            lowest, rounds, errors, rel = time_lowest(candidates, reference, tolerance=3e-2, warmup_ms=5, rep_ms=30,
                                                      unchecked=("index_gather",), rounds=ROUNDS, alternate=True)
            flops = batch * model.top_k * 6 * d * f
            row = {"model": key, "format": fmt, "batch": batch, "us": lowest, "rounds_us": rounds, "errors": errors,
                   "rel_err_vs_index_gather": rel, "plans": plans, "routed_flops": flops,
                   "tflops": {name: flops / (us * 1e-6) / 1e12 for name, us in lowest.items()}}
            rows.append(row)
            record_tool("layer-layout-ab", rows, {"models": models, "batches": batches, "layouts": LAYOUTS,
                                                  "rounds": ROUNDS, "order": "reversed every other round",
                                                  "shared_expert": "left out", "dtype": str(dtype)})
            print(f"{key:<14} {fmt:<5} {batch:>6}: " + "  ".join(
                f"{name} {us:9.1f} us {row['tflops'][name]:6.1f} TFLOP/s" for name, us in lowest.items())
                + (auto_note(plans["auto"]) if "auto" in plans else "")
                + (f"  errors {errors}" if errors else ""), flush=True)
        del layer, gluon_layers
    del base
    if device == "cuda":
        torch.cuda.empty_cache()
