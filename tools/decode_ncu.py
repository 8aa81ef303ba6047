"""Issue 17: Nsight Compute's view of one decode call, the two-GEMM path against the two-phase one launch.

Runs, for each model, fp8 block weights at ``batch`` tokens: three warm-up rounds, then one round of the tuned
two-GEMM call (``fused_experts`` with its table's tiles and the block map made beforehand: quantiser, GEMM 1,
quantiser, GEMM 2, top-k sum as the table says) and of the two-phase kernel at ``tiles`` (rows of GEMM 1, rows of
GEMM 2, warps, stages, programs per SM). Meant to run under ``ncu`` (which flushes the caches before each
kernel, as the timings do), e.g.::

    ncu --csv --section SpeedOfLight --section Occupancy --section LaunchStats --metrics \\
        smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,... \\
        python tools/decode_ncu.py qwen3-30b-a3b 1 64,128,8,3,2[,1] > ncu.csv   # (,1: swap_ab)
    python tools/decode_ncu.py --summarize ncu.csv   # per kernel: time, DRAM, occupancy, the largest stalls
    python tools/decode_ncu.py --record <name> <a record of the same call> fp8=ncu.csv ...   # the CSVs as a record

``tiles`` ``none`` profiles the two-GEMM call alone (batches where no one-launch kernel applies, 512 tokens, say),
and ``DECODE_NCU_FORMAT=none`` takes bf16 weights instead of fp8 block weights. Each round launches the call's
kernels in the same order, so ``ncu -k regex:... --launch-skip`` can keep to the last round.
"""
import csv
import os
import sys

import torch

from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.config import OneLaunchTiles, get_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.one_launch import one_launch_experts


_TIME_UNITS = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3, "s": 1e6,
               "second": 1e6}
_BYTE_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def kernel_metrics(path: str) -> list[dict]:
    """The kernels of the CSV ncu wrote, in launch order: name, time (us), DRAM throughput (% of peak), DRAM bytes
    read and written, achieved occupancy (%), registers per thread, and every warp stall reason measured (cycles
    per issued instruction), each converted from the unit ncu gave it.
    """
    text = open(path).read()
    rows = list(csv.DictReader(text[text.index('"ID"'):].splitlines()))
    kernels = {}
    for r in rows:
        kernels.setdefault(r["ID"], {"name": r["Kernel Name"]})[r["Metric Name"]] = (
            r["Metric Value"].replace(",", ""), r.get("Metric Unit") or "")

    def value(m, metric, units=None):
        if metric not in m:
            return None
        number, unit = m[metric]
        return float(number) * (units[unit] if units else 1.0) if _is_number(number) else None

    out = []
    for m in kernels.values():
        out.append({"name": m["name"], "time_us": value(m, "Duration", _TIME_UNITS),
                    "dram_pct": value(m, "DRAM Throughput"),
                    "read_bytes": value(m, "dram__bytes_read.sum", _BYTE_UNITS),
                    "written_bytes": value(m, "dram__bytes_write.sum", _BYTE_UNITS),
                    "occupancy_pct": value(m, "Achieved Occupancy"), "registers": value(m, "Registers Per Thread"),
                    "stalls": {k.split("stalled_")[1].split("_per_")[0]: float(v[0]) for k, v in m.items()
                               if k != "name" and "issue_stalled_" in k and _is_number(v[0])}})
    return out


def summarize(path: str) -> None:
    """One line per profiled kernel of the CSV ncu wrote: time, DRAM throughput and bytes, achieved occupancy,
    registers, and the four largest warp stall reasons (cycles per issued instruction)."""
    for k in kernel_metrics(path):
        stalls = sorted(((v, name) for name, v in k["stalls"].items()), reverse=True)[:4]
        print(k["name"][:40], "|", k["time_us"], "us |", k["dram_pct"], "% DRAM |", k["read_bytes"], "bytes read |",
              k["written_bytes"], "written |", k["occupancy_pct"], "% occupancy |", k["registers"], "registers |",
              ", ".join(f"{name} {v:.2f}" for v, name in stalls))


def record(name: str, sibling: str, csvs: list[str]) -> None:
    """``results/<device>/<name>.json`` from the CSVs (``label=path`` each) of one device call, with the provenance
    of ``sibling``, a record that the same call wrote (ncu's CSV holds no commit): its command replaced by the
    ``ncu`` profile's and the CSVs named."""
    import json
    from pathlib import Path

    sibling_rec = json.loads(Path(sibling).read_text())
    provenance = dict(sibling_rec["provenance"], command="ncu --csv --clock-control none ... python "
                      "tools/decode_ncu.py (see each CSV's first lines)", provenance_from=sibling)
    data = {"csv": {}, "kernels": {}}
    for item in csvs:
        label, _, path = item.partition("=")
        data["csv"][label], data["kernels"][label] = path, kernel_metrics(path)
    out = Path(sibling).parent / f"{name}.json"
    out.write_text(json.dumps({"provenance": provenance, "data": data}, indent=1) + "\n")
    print("recorded", out)


if sys.argv[1:2] == ["--summarize"]:
    summarize(sys.argv[2])
    sys.exit(0)
if sys.argv[1:2] == ["--record"]:   # --record <name> <a record of the same call> <label>=<csv> ...
    record(sys.argv[2], sys.argv[3], sys.argv[4:])
    sys.exit(0)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b"]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
# (a sixth value 1: swap_ab, the weights on the MMA's M side)
tiles_arg = sys.argv[3] if len(sys.argv) > 3 else "64,128,8,3,2"
tiles = None
if tiles_arg != "none":
    f, d, warps, stages, per_sm, *swap = (int(v) for v in tiles_arg.split(","))
    tiles = OneLaunchTiles(f, d, warps, stages, phases=2, programs_per_sm=per_sm, swap_ab=bool(swap and swap[0]))
fmt = FORMATS[os.environ.get("DECODE_NCU_FORMAT", "block")]
device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
for key in models:
    model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device)
    x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
    config = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size, w1.dtype, x.device)
    blocks = assign_blocks(ids, config.block_m, model.num_experts, validate_ids=False)
    for _ in range(4):   # (the profile: the last round's kernels)
        fused_experts(x, w1, w2, weights, ids, config=config, blocks=blocks, validate_ids=False, w1_scale=w1s,
                      w2_scale=w2s)
        if tiles is not None:
            one_launch_experts(x, w1, w2, weights, ids, tiles=tiles, validate_ids=False, w1_scale=w1s, w2_scale=w2s)
    if device == "cuda":
        torch.cuda.synchronize()
    print(key, batch, config.to_dict(), tiles.as_dict() if tiles else None, flush=True)
    del w1, w2, w1s, w2s
