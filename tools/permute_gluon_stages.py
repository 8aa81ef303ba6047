"""Issue 18: where the fp8 permute layer's time goes with both GEMMs on the Gluon kernel.

``layer-layout-ab.json`` (session 27) timed DeepSeek-V3's routed fp8 layer at 16,384 tokens at 668 TFLOP/s on the
permute layout with the Gluon GEMMs ("permute gluon"), where the two GEMMs alone ran at about 800: 2.5 ms of the
17.3 are not GEMM. This times each stage of that call alone, as ``MoELayer(x)`` runs it: the route (gate, top-k,
weights), the activations' quantiser, the permutation (alignment and scatter of the fp8 rows), the scales'
gather, GEMM 1 gated, the quantiser of its output, GEMM 2, the gather back, and the whole layer. Each stage is
replayed from a CUDA graph of one call (``timing.graph_us``; the L2 is not flushed: every stage's input is fresh
from the one before, as in the layer), inputs made once before. The bytes each stage must move and their time at
the read bandwidth measured in the same process stand beside it. The default path's stages (session 31: the
one-pass input, GEMM 1 quantising GEMM 2's input, GEMM 2 storing by TMA) are summed beside the three-step ones.

    PYTHONPATH=. python tools/permute_gluon_stages.py [models] [batches]   # GPU: records permute-gluon-stages.json
"""
import dataclasses
import sys

import torch

from moe_kernels import MoELayer
from moe_kernels.bench.ceilings import measure_read_bandwidth
from moe_kernels.bench.timing import graph_us
from moe_kernels.kernels import permute as permute_module, permute_gluon
from moe_kernels.kernels.combine import unpermute
from moe_kernels.kernels.gluon_block_fp8 import block_fp8_grouped
from moe_kernels.kernels.quant_scatter import quantize_scatter
from moe_kernels.layer_router import route
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import record_tool


def owner(name):
    """The module that holds switch ``name`` (the one-pass input is the permutation's; the rest the Gluon GEMMs')."""
    return permute_module if name == "ONE_PASS_FP8_INPUT" else permute_gluon

models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 16384]
bandwidth = measure_read_bandwidth()
rows = []
for key in models:
    model = dataclasses.replace(MODELS[key], num_shared_experts=0)
    layer = MoELayer.random(model, dtype=torch.bfloat16, device="cuda", seed=0).quantized("block")
    layer.layout = "permute"
    layers = {variant: MoELayer(layer.weights, layer.routing, layout="permute")   # (plans and graphs of their own)
              for variant in ((False, False, False, False), (False, False, True, True), (True, False, False, True),
                              (True, True, False, True), (True, True, True, True))}
    w, fmt = layer.weights, layer.weights.format
    d, f, k, E = model.hidden_size, model.moe_intermediate_size, model.top_k, model.num_experts
    for batch in batches:
        x = torch.randn(batch, d, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
        plan = layer.plan(batch)
        topk_weights, topk_ids, _ = route(plan, x, w, layer.routing)
        xq, xs = fmt.quantize_activations(x)
        permuted = permute_module.permute(xq, topk_ids, E, validate_ids=False)
        rows_scale = permute_module._permute_scales(xs, permuted, k)
        activated = block_fp8_grouped(permuted.rows, rows_scale, w.w13, w.w13_scale, permuted.m_indices, gated=True,
                                      validate_ids=False)
        a, a_scale = fmt.quantize_activations(activated)
        y = block_fp8_grouped(a, a_scale, w.w2, w.w2_scale, permuted.m_indices, validate_ids=False)
        m_pad = permuted.m_indices.shape[0]
        tk = batch * k

        def whole(persistent, fused=False, half=False, one_pass=None):
            one_pass = persistent if one_pass is None else one_pass   # (the persistent variants: one-pass input)

            def call():
                names = ("FP8_GEMM", "GLUON_PERSISTENT", "GLUON_QUANTIZE_IN_GEMM1", "ONE_PASS_FP8_INPUT",
                         "GLUON_HALF_TILES")
                saved = [getattr(owner(n), n) for n in names]
                for n, value in zip(names, ("gluon", persistent, fused, one_pass, half)):
                    setattr(owner(n), n, value)
                try:
                    return layers[persistent, fused, half, one_pass](x)
                finally:
                    for n, value in zip(names, saved):
                        setattr(owner(n), n, value)
            return call
        used = permuted.rows_used
        stages = {   # name: (call, bytes it must move)
            "route": (lambda: route(plan, x, w, layer.routing), batch * d * 2 + E * d * 2),
            "quantize x": (lambda: fmt.quantize_activations(x), batch * d * 3),
            "permute": (lambda: permute_module.permute(xq, topk_ids, E, validate_ids=False), batch * d + tk * d),
            "permute scales": (lambda: permute_module._permute_scales(xs, permuted, k), tk * d // 128 * 8),
            "gemm 1 gated": (lambda: block_fp8_grouped(permuted.rows, rows_scale, w.w13, w.w13_scale,
                                                       permuted.m_indices, gated=True, validate_ids=False),
                             w.w13.numel() + tk * d + tk * f * 2),
            "quantize gemm 1": (lambda: fmt.quantize_activations(activated), m_pad * f * 3),
            "gemm 2": (lambda: block_fp8_grouped(a, a_scale, w.w2, w.w2_scale, permuted.m_indices,
                                                 validate_ids=False), w.w2.numel() + tk * f + tk * d * 2),
            "unpermute": (lambda: unpermute(y, permuted.src2dst, topk_weights), tk * d * 2 + batch * d * 2),
            # the one-pass input (session 27): the alignment alone, then each token quantised once to its rows
            "permute, indices only": (lambda: permute_module.permute(x, topk_ids, E, validate_ids=False, copy=False),
                                      None),
            "quantize_scatter": (lambda: quantize_scatter(x, permuted.src2dst, m_pad), batch * d * 2 + tk * d),
            "gemm 1 gated persistent": (lambda: block_fp8_grouped(permuted.rows, rows_scale, w.w13, w.w13_scale,
                                                                  permuted.m_indices, gated=True, validate_ids=False,
                                                                  rows_used=used), None),
            "gemm 2 persistent": (lambda: block_fp8_grouped(a, a_scale, w.w2, w.w2_scale, permuted.m_indices,
                                                            validate_ids=False, rows_used=used), None),
            "gemm 2 persistent tma store": (lambda: block_fp8_grouped(
                a, a_scale, w.w2, w.w2_scale, permuted.m_indices, validate_ids=False, rows_used=used, tma_store=True),
                None),
            "gemm 1 gated persistent quantising": (lambda: block_fp8_grouped(
                permuted.rows, rows_scale, w.w13, w.w13_scale, permuted.m_indices, gated=True, validate_ids=False,
                rows_used=used, quantize_output=True), None),
            # half tiles (session 28): a segment's last tile of at most 64 real rows multiplies 64 rows
            "gemm 1 gated persistent half": (lambda: block_fp8_grouped(
                permuted.rows, rows_scale, w.w13, w.w13_scale, permuted.m_indices, gated=True, validate_ids=False,
                rows_used=used, half_tiles=True), None),
            "gemm 2 persistent half": (lambda: block_fp8_grouped(a, a_scale, w.w2, w.w2_scale, permuted.m_indices,
                                                                 validate_ids=False, rows_used=used, half_tiles=True),
                                       None),
            # half tiles with one program a tile (session 30)
            "gemm 1 gated half": (lambda: block_fp8_grouped(permuted.rows, rows_scale, w.w13, w.w13_scale,
                                                            permuted.m_indices, gated=True, validate_ids=False,
                                                            half_tiles=True), None),
            "gemm 2 half": (lambda: block_fp8_grouped(a, a_scale, w.w2, w.w2_scale, permuted.m_indices,
                                                      validate_ids=False, half_tiles=True), None),
            "layer": (whole(False), None),
            "layer one-pass half": (whole(False, half=True, one_pass=True), None),
            "layer persistent": (whole(True), None),
            "layer persistent quantising": (whole(True, True), None),
            "layer persistent quantising half": (whole(True, True, True), None),
        }
        us = {name: graph_us(call) for name, (call, _) in stages.items()}
        floor = {name: nbytes / bandwidth * 1e6 for name, (_, nbytes) in stages.items() if nbytes}
        parts = sum(us[name] for name in ("route", "quantize x", "permute", "permute scales", "gemm 1 gated",
                                          "quantize gemm 1", "gemm 2", "unpermute"))
        # the stages of what the defaults run (session 31): the one-pass input, GEMM 1 quantising, GEMM 2's TMA store
        default_parts = sum(us[name] for name in ("route", "permute, indices only", "quantize_scatter",
                                                  "gemm 1 gated persistent quantising", "gemm 2 persistent tma store",
                                                  "unpermute"))
        flops = batch * k * 6 * d * f
        row = {"model": key, "batch": batch, "m_pad": m_pad, "us": us, "bytes_floor_us": floor, "sum_of_stages_us": parts,
               "sum_of_default_stages_us": default_parts,
               "routed_flops": flops, "layer_tflops": flops / (us["layer"] * 1e-6) / 1e12}
        rows.append(row)
        record_tool("permute-gluon-stages", rows, {"models": models, "batches": batches,
                                                   "read_bandwidth_bytes_per_s": bandwidth,
                                                   "timing": "CUDA graph of one call, L2 not flushed"})
        print(f"{key} {batch} (M_pad {m_pad}): layer {us['layer']:.1f} us = {row['layer_tflops']:.0f} TFLOP/s, "
              f"persistent {us['layer persistent']:.1f} us = {flops / us['layer persistent'] / 1e6:.0f}, "
              f"quantising {us['layer persistent quantising']:.1f} = "
              f"{flops / us['layer persistent quantising'] / 1e6:.0f}, "
              f"the three-step stages sum {parts:.1f}, the default path's {default_parts:.1f}", flush=True)
        for name, v in us.items():
            print(f"    {name:<16} {v:9.1f} us" + (f"   bytes floor {floor[name]:8.1f}" if name in floor else ""))
        del permuted, activated, a, y
    del layer, layers
    torch.cuda.empty_cache()
