"""A/B of the programmatic dependent launch on a GPU: where GEMM 1 signals (as each program starts
or ends, moe_kernels.kernels._pdl.TRIGGER) and how many K columns GEMM 2 prefetches before it
waits (_pdl.PREFETCH_K), against the plain launch, timing run_experts replayed from a CUDA graph
(L2 flushed; the lower of two interleaved round medians). fp8 rows also try the fused quantiser.

    PYTHONPATH=. python tools/pdl_ab.py [model batches formats]   # e.g. qwen3-30b-a3b 1,8 none,block

Writes $OUT/pdl_ab.json when OUT is set. Its run at 1125c7f is kept, with its provenance added, as
results/nvidia-h200/pdl-ab.json (session 11 of notes/perf-fused-moe.md).
"""
import dataclasses, json, os, sys
import torch
from moe_kernels.model.shapes import MODELS
from moe_kernels.bench.problems import make_batch, make_weights
from moe_kernels.bench.timing import graphed, median_ms
from moe_kernels.kernels import _pdl
from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.config import get_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import run_experts

dev = "cuda" if torch.cuda.is_available() else "cpu"
plan = {"qwen3-30b-a3b": [1, 8], "deepseek-v3": [1]}
if len(sys.argv) > 1:
    plan = {sys.argv[1]: [int(b) for b in sys.argv[2].split(",")]}
models = list(plan)
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "block"]
VARIANTS = {"off": None, "t1-p0": (1, 0), "t1-p256": (1, 256), "t2-p0": (2, 0)}
out = []
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
for fname in formats:
    fmt = FORMATS[fname]
    for key in models:
        model = MODELS[key]
        if dev == "cpu":
            model = dataclasses.replace(model, hidden_size=256, moe_intermediate_size=128, num_experts=8, top_k=2)
        w1, w2 = make_weights(model, dtype, 0, dev)
        w1, w1s = fmt.quantize_weight(w1); w2, w2s = fmt.quantize_weight(w2)
        for batch in plan[key]:
            hidden, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, dev)
            base = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size, fmt.element or dtype, dev)
            cfgs = [(q, dataclasses.replace(base, quant_in_gemm=q, gate_up=dataclasses.replace(base.gate_up, block_n=max(128, base.gate_up.block_n)) if q else base.gate_up))
                    for q in ((False, True) if fname == "block" else (False,))]
            blocks = assign_blocks(ids, base.block_m, model.num_experts, validate_ids=False)
            rounds = {}
            for rnd in range(2):
                for q, cfg in cfgs:
                    for name, v in VARIANTS.items():
                        c = dataclasses.replace(cfg, pdl=v is not None)
                        if v:
                            _pdl.TRIGGER, _pdl.PREFETCH_K = v
                        try:
                            fn = graphed(lambda c=c: run_experts(hidden, w1, w2, weights, ids, fmt=fmt, config=c, w1_scale=w1s, w2_scale=w2s, blocks=blocks, ids="trusted"))
                            ms = median_ms(fn, 2, 10 if dev == "cuda" else 1)
                        except Exception as e:
                            ms = float("inf"); print("ERR", key, batch, name, q, str(e)[:200])
                        rounds.setdefault((q, name), []).append(ms)
            res = {f"{'q ' if q else ''}{n}": round(min(v) * 1e3, 1) for (q, n), v in rounds.items()}
            print(fname, key, batch, json.dumps(res), flush=True)
            out.append({"format": fname, "model": key, "batch": batch, "us_lower_of_two_rounds": res})
if os.environ.get("OUT"):
    json.dump(out, open(os.path.join(os.environ["OUT"], "pdl_ab.json"), "w"), indent=1)
