"""Unpermute A/B (issue 18): the permute layout's gather back, two ways, against the index-gather
layout's top-k sum over the same bytes, and the whole experts call with each.

``unpermute`` reads each token's ``k`` expert rows from the packed segments, weights them and sums
them into the token's row. On the H200 (``layout-stages.json``) it took 2.4 times as long as the
index-gather layout's ``moe_sum``, which reads and writes the same bytes from a ``[T, k, d]`` buffer
(DeepSeek-V3 at 8,192 tokens: 595 against 245 us; Qwen3-30B-A3B: 189 against 71), and ``moe_sum``
ran at the copy bandwidth. The two kernels differ in shape: ``unpermute`` loads the ``k`` rows as one
``[k, 512]`` tile and sums it across warps (shared memory, barriers), ``moe_sum`` adds one
1024-column chunk per slot in registers. ``combine.UNPERMUTE_BODY`` picks the body:

  unpermute tile     today's body ("tile")
  unpermute slots    the slot loop ("slots"): one 16-byte load per thread per row, no barrier
  moe_sum            the index-gather sum over a [T, k, d] buffer: the same bytes, read in order
  experts tile / experts slots   permute_experts (the H200 tables' tiles, 128-row segments) with each

Each candidate is replayed from a CUDA graph of one call, the L2 flushed before each replay, two rounds
in alternating order, the lower round median kept; bytes over time against the read bandwidth measured
in the same process.

    PYTHONPATH=. python tools/unpermute_ab.py [models] [batches]
    # e.g. qwen3-30b-a3b,deepseek-v3 4096,16384   (records results/<device>/unpermute-ab.json)
"""
import sys

import torch

from moe_kernels.bench.ceilings import ReadFloor
from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels import combine
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.permute import permute, permute_experts
from moe_kernels.results import print_timings, record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 16384]
ALIGN = 128 if device == "cuda" else 32
floor = ReadFloor(device)
rows = []


def with_body(body, call):
    """``call`` with ``combine.UNPERMUTE_BODY`` set to ``body`` while it runs (and is captured)."""
    def run():
        saved, combine.UNPERMUTE_BODY = combine.UNPERMUTE_BODY, body
        try:
            return call()
        finally:
            combine.UNPERMUTE_BODY = saved
    return run


def save():
    return record_tool("unpermute-ab", rows, {"models": models, "batches": batches, "align": ALIGN,
                                              "read_bandwidth": floor.bandwidth,
                                              "default_body": combine.UNPERMUTE_BODY})


for key in models:
    model, dtype, w1, _, w2, _ = tool_weights(key, FORMATS["none"], device)
    e, k, d = model.num_experts, model.top_k, model.hidden_size
    for batch in batches:
        x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
        permuted = permute(x, ids, e, align=ALIGN, validate_ids=False)
        g = torch.Generator(device=device).manual_seed(batch)
        y = torch.randn(permuted.rows.shape[0], d, device=device, dtype=dtype, generator=g)   # GEMM 2's rows
        slots = torch.randn(batch, k, d, device=device, dtype=dtype, generator=g)               # [T, k, d]
        moved = (batch * k + batch) * d * y.element_size()   # k rows read and one written per token
        stages = {body: with_body(body, lambda: combine.unpermute(y, permuted.src2dst, weights))
                  for body in ("tile", "slots")}
        us, rounds, errors, rel = time_lowest(
            {"unpermute tile": stages["tile"], "unpermute slots": stages["slots"],
             "moe_sum": lambda: combine.moe_sum(slots)},
            combine.unpermute_reference(y, permuted.src2dst, weights).float(), tolerance=1e-2, warmup_ms=2,
            rep_ms=30, unchecked=("moe_sum",), alternate=True)
        experts = {f"experts {body}": with_body(body, lambda: permute_experts(x, w1, w2, weights, ids, align=ALIGN,
                                                                                validate_ids=False))
                   for body in ("tile", "slots")}
        reference = experts["experts tile"]().float()
        us_e, rounds_e, errors_e, rel_e = time_lowest(experts, reference, tolerance=1e-2, warmup_ms=2, rep_ms=30,
                                                      alternate=True)
        floor_us = moved / floor.bandwidth * 1e6
        row = {"model": key, "batch": batch, "bytes_moved": moved, "floor_us": floor_us, "us": {**us, **us_e},
               "rounds_us": {**rounds, **rounds_e}, "rel_err": {**rel, **rel_e}, "errors": {**errors, **errors_e}}
        rows.append(row)
        save()
        print_timings(f"{key} {batch} tokens ({moved / 1e6:.0f} MB moved, {floor_us:.1f} us at the read bandwidth):",
                      row["us"], {}, row["errors"])
print("unpermute A/B done", flush=True)
