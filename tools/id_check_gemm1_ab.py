"""What the id check costs each GEMM (issue 16): at decode batches small enough for the naive
block map there is no alignment launch, so ``validate_ids=True`` puts its device assert in one of
the two GEMMs (``index_gather.NAIVE_ID_CHECK_IN``), whose checked build is compiled with
``debug=True``. This times the same call with a block map that carries the check and one that does
not (``fused_experts(..., blocks=..., validate_ids=False)``: nothing else differs), the check in
GEMM 1 and in GEMM 2; each replayed from a CUDA graph with L2 flushed, in interleaved rounds (every
order of the three in turn); the median of the round differences is kept, as ``bench layer``'s id
check does. Then each replay once more under the profiler: every kernel's time and the gap before
it, to place the difference.

    PYTHONPATH=. python tools/id_check_gemm1_ab.py [models] [batches] [formats] [rounds]
    # e.g. qwen3-30b-a3b,deepseek-v3 1,2 none,block 41   (records results/<device>/id-check-gemm1.json)
"""
import itertools
import statistics
import sys

import torch

from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.timing import graphed, median_ms
from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.config import get_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2]
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "block"]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 41



def kernel_times(replay, replays: int = 7) -> list[dict]:
    """Each kernel of one graph replay, in order, from the profiler's CUDA activity (L2 flushed before
    each replay): its name, its duration and the gap since the previous kernel ended (medians of
    ``replays``), so that a difference between two variants can be placed in a kernel or a gap."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    runs = []
    for _ in range(replays):
        flush.zero_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "memset" not in e.name.lower()),
                         key=lambda e: e.time_range.start)
        runs.append([(e.name.split("(")[0][:40], e.time_range.start, e.time_range.end) for e in kernels])
    if not runs or len({len(r) for r in runs}) != 1:
        return []
    out = []
    for i in range(len(runs[0])):
        out.append({"name": runs[0][i][0],
                    "us": statistics.median(r[i][2] - r[i][1] for r in runs),
                    "gap_us": statistics.median((r[i][1] - r[i - 1][2]) if i else 0.0 for r in runs)})
    return out


from moe_kernels.kernels import index_gather  # noqa: E402

VARIANTS = ("unchecked", "gate_up", "down")   # no check; the check in GEMM 1; the check in GEMM 2
SETTING = index_gather.NAIVE_ID_CHECK_IN   # (put back after each problem's captures)
ORDERS = list(itertools.permutations(VARIANTS))   # (every 6 rounds, each variant in each place twice)

rows = []
for fname in formats:
    fmt = FORMATS[fname]
    for key in models:
        model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device, num_experts=16)
        e, d, f = model.num_experts, model.hidden_size, model.moe_intermediate_size
        for batch in batches:
            x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
            config = get_config(batch, e, f, d, w1.dtype, x.device)
            maps = {checked: assign_blocks(ids, config.block_m, e, validate_ids=checked) for checked in (True, False)}
            if not maps[True].naive:
                print(f"{key} {fname} {batch}: the aligned map (the check sits in the alignment): skipped")
                continue

            def call(variant):
                # The setting is read as the GEMMs launch: a graph keeps what its capture read.
                index_gather.NAIVE_ID_CHECK_IN = "gate_up" if variant == "unchecked" else variant
                return fused_experts(x, w1, w2, weights, ids, config=config, blocks=maps[variant != "unchecked"],
                                     validate_ids=False, w1_scale=w1s, w2_scale=w2s)

            outputs = {v: call(v) for v in VARIANTS}
            same = all(torch.equal(outputs[v], outputs["unchecked"]) for v in VARIANTS)
            replays = {v: graphed(lambda v=v: call(v)) if device == "cuda" else (lambda v=v: call(v))
                       for v in VARIANTS}
            index_gather.NAIVE_ID_CHECK_IN = SETTING
            times = {v: [] for v in VARIANTS}
            for i in range(rounds):
                for v in ORDERS[i % len(ORDERS)]:
                    times[v].append(median_ms(replays[v], 1, 5) * 1e3 if device == "cuda" else 1.0)
            diff = {v: statistics.median(a - b for a, b in zip(times[v], times["unchecked"])) for v in VARIANTS[1:]}
            row = {"model": key, "format": fname, "batch": batch, "id_check": maps[True].id_check != "",
                   "checked_us": statistics.median(times["gate_up"]),
                   "unchecked_us": statistics.median(times["unchecked"]),
                   "difference_us": diff["gate_up"], "checked_in_down_us": statistics.median(times["down"]),
                   "difference_down_us": diff["down"], "rounds": rounds, "outputs_equal": same}
            if device == "cuda":   # where the difference sits: inside a kernel, or between two
                try:   # (a profiler that cannot see graph kernels must not cost the timings above)
                    row["kernels"] = {v: kernel_times(replays[v]) for v in VARIANTS}
                except Exception as error:  # noqa: BLE001
                    row["kernels"], row["kernels_error"] = {}, repr(error)[:300]
                    print(f"   kernels: {row['kernels_error']}", flush=True)
                for name, kernels in row["kernels"].items():
                    print(f"   {name:>9}: " + "; ".join(f"{k['name']} {k['us']:.2f} us (gap before {k['gap_us']:.2f})"
                                                       for k in kernels), flush=True)
            rows.append(row)
            print(f"{key} {fname} {batch}: unchecked {row['unchecked_us']:.2f} us; checked in GEMM 1 "
                  f"{row['checked_us']:.2f} ({diff['gate_up']:+.2f}), in GEMM 2 {row['checked_in_down_us']:.2f} "
                  f"({diff['down']:+.2f}) (medians of {rounds} rounds), equal outputs {same}", flush=True)

from moe_kernels.results import record  # noqa: E402

path = record("id-check-gemm1", {"rows": rows, "config": {"models": models, "batches": batches, "formats": formats,
                                                          "rounds": rounds}})
print(f"recorded {path}")
