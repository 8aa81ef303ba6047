"""fp8 W8A8 experts against bf16, batch 1..16384, both models: ``python -m moe_kernels.bench fp8``.

For each model and batch, from CUDA-graph replays (``do_bench`` flushes the L2 before each):

* ``bf16 GEMMs``: our bf16 index-gather layer (both GEMMs and the sum, block map precomputed);
* ``fp8 block GEMMs`` / ``fp8 channel GEMMs``: the same with fp8 weights (128x128 block scales,
  or per-channel), the activation quantiser before GEMM 1 and the requantisation before GEMM 2
  included;
* ``fp8 block permute``: the permute layout in fp8 (its copy moves fp8 rows); up to
  :data:`~moe_kernels.bench.sweep.DECODE_ONLY_MAX_BATCH` tokens where the Gluon kernels run, also
  ``fp8 block permute gluon a16``: its 16-row segments on the transposed Gluon kernel (decode); from
  :data:`PREFILL_GLUON_MIN_BATCH` tokens ``fp8 block permute gluon``: its 128-row segments on the
  Gluon kernels, as the layer's fp8 layout choices run them at prefill (the persistent grid, GEMM 1
  quantising GEMM 2's input, GEMM 2 storing by TMA: ``permute_gluon``'s switches);
* ``torch _scaled_grouped_mm``: PyTorch's fp8 grouped GEMM (rowwise scales, the only ones it has
  on sm90) over the same permuted segments, the activation quantisers included;
* ``quantiser``: the 1x128 activation quantiser alone, at the layer's width.

Beside the ``bf16 GEMMs`` and ``fp8 block GEMMs`` rows of each batch up to
:data:`READ_BOUND_MAX_BATCH` (where the layer streams weights), two plain reads of as many bytes, the
yardstick for a kernel that streams them under this timing: ``read_same_bytes_s``, one read kernel
over the row's bytes (interpolated in the read-time curve ``ceilings["read_by_size"]`` measured in
the same run, as the bf16 sweep does; past the curve's largest size, 4 GiB, it is that read's
bandwidth, i.e. the floor), and ``read_two_launches_s``, measured per row: as many bytes as GEMM 1's
weights, then as GEMM 2's, read by two launches of the read kernel in one CUDA graph (not chained by
PDL, which the GEMMs are), as the two GEMMs stream them (:func:`~moe_kernels.bench.ceilings.weight_reader`
over the first ``experts_touched`` experts of each weight tensor; no scales, no activations).

Floors use ceilings measured in the same run: fp8 bytes of the touched experts over the read
bandwidth, FLOPs over the fp8 rate of ``torch._scaled_mm`` (per-tensor scales) and, for
reference, of a block-scaled ``_scaled_mm`` (1x128 activations, 128x128 weights) on 8192^3.
Every fp8 layout is checked against the quantised float64 reference before it is timed.
``--record`` writes ``results/<device>/fp8-sweep.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..model.costs import count_work, read_seconds
from ..model.shapes import MODELS
from .cli import add_record_arguments, add_run_arguments, write_record
from .problems import make_batch, make_weights
from .timing import graphed, median_ms, rel_err


def measure_block_scaled_rate(n: int = 8192) -> float | None:
    """FLOP/s of torch's block-scaled fp8 GEMM (DeepSeek's 1x128 / 128x128 scales), if it has one."""
    from .ceilings import _median_ms
    from ..kernels.quant import per_token_group_quant_fp8, quantize_weight

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_weight(torch.randn(1, n, n, device="cuda"), "block")
    aq, as_ = per_token_group_quant_fp8(a)
    scale_a = as_.t().contiguous().t()          # 1x128 scales, M-major, as _scaled_mm wants
    try:
        run = lambda: torch._scaled_mm(aq, wq[0].t(), scale_a=scale_a, scale_b=ws[0].t(),  # noqa: E731
                                       out_dtype=torch.bfloat16)
        run()
    except (RuntimeError, TypeError):
        return None
    return 2 * n**3 / (_median_ms(run) * 1e-3)


def _scaled_grouped_mm_layer(hidden, w1q, w1s, w2q, w2s, weights, ids, num_experts):
    """PyTorch's fp8 grouped GEMM over permuted segments, rowwise scales (per token, per channel)."""
    from ..kernels.combine import unpermute
    from ..kernels.permute import permute
    from ..kernels.quant import quantize_activations

    xq, xs = quantize_activations(hidden, "token")
    p = permute(xq, ids, num_experts, align=16, validate_ids=False)
    offs = torch.cumsum((p.segment_counts + 15) // 16 * 16, 0, dtype=torch.int32)
    row_scale = torch.ones(p.rows.shape[0] + 1, device=hidden.device)
    dst = torch.where(p.src2dst.flatten() >= 0, p.src2dst.flatten().long(), p.rows.shape[0])
    row_scale.index_copy_(0, dst, xs[torch.arange(dst.numel(), device=dst.device) // ids.shape[1]])
    h = torch._scaled_grouped_mm(p.rows, w1q.transpose(-2, -1), row_scale[:-1], w1s, offs=offs,
                                 out_dtype=torch.bfloat16)
    f = w2q.shape[2]
    act = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
    aq, a_s = quantize_activations(act, "token")
    y = torch._scaled_grouped_mm(aq, w2q.transpose(-2, -1), a_s, w2s, offs=offs, out_dtype=torch.bfloat16)
    return unpermute(y, p.src2dst, weights)


#: Smallest batch timed with the prefill Gluon GEMMs (``fp8 block permute gluon``): the rows from 1,024 tokens
#: show the crossover (the layer's choices take them from 1,024 or 2,048 tokens on both GPUs).
PREFILL_GLUON_MIN_BATCH = 1024

#: Largest batch whose rows get the read bounds: decode, where the layer streams its weights.
READ_BOUND_MAX_BATCH = 512


def decode_bounds(work, gemm1_weights: torch.Tensor, gemm2_weights: torch.Tensor, bandwidth: float) -> dict:
    """For the decode tools in ``tools/``: ``floor_us`` (the touched experts' weight bytes over ``bandwidth``,
    bytes/s, measured in the same process) and ``two_reads_us`` (:func:`read_bounds`' two launches)."""
    return {"floor_us": work.bytes / bandwidth * 1e6,
            "two_reads_us": read_bounds(work, gemm1_weights, gemm2_weights, None, 5, 25)["read_two_launches_s"] * 1e6}


def read_bounds(work, gemm1_weights: torch.Tensor, gemm2_weights: torch.Tensor, curve, warmup_ms: float,
                rep_ms: float) -> dict:
    """A row's two reads of its own bytes (see the module's docstring), in seconds: one read kernel
    over ``work.bytes`` (from ``curve``, a measured read-time curve; absent without one), and two
    launches reading the first ``work.experts_touched`` experts of each GEMM's ``[E, ...]`` weights."""
    from .ceilings import weight_reader

    touched = work.experts_touched
    out = {"read_same_bytes_s": read_seconds(curve, work.bytes)} if curve else {}
    reader = weight_reader(gemm1_weights[:touched], gemm2_weights[:touched])
    out["read_two_launches_s"] = median_ms(graphed(reader), warmup_ms, rep_ms) * 1e-3
    return out


def sweep(models, batches, *, seed, warmup_ms, rep_ms, ceilings, log=print) -> list[dict]:
    from ..kernels.blocks import assign_blocks, use_naive_block_assignment
    from ..kernels.config import get_config
    from ..kernels.gluon_block_fp8 import available
    from ..kernels.formats import FORMATS, UNQUANTIZED
    from ..kernels.index_gather import fused_experts
    from ..kernels.one_launch import runs_in_one_launch
    from ..kernels.permute import permute_experts
    from .sweep import DECODE_ONLY_MAX_BATCH
    from ..kernels.quant import per_token_group_quant_fp8, quantize_weight
    from ..reference import moe_reference_fp8

    read, rate8, rate16 = ceilings["read_bandwidth"], ceilings["gemm_rate_fp8"], ceilings["gemm_rate_bf16"]
    gluon = available("cuda") is None
    rows = []
    for key, model in models.items():
        w1, w2 = make_weights(model, torch.bfloat16, seed)
        fp8 = {g: (quantize_weight(w1, g), quantize_weight(w2, g)) for g in ("block", "channel")}
        for batch in batches:
            hidden, _, weights, ids = make_batch(model, batch, torch.bfloat16, seed + batch)
            cfg = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size,
                             torch.bfloat16, hidden.device)
            blocks = assign_blocks(ids, cfg.block_m, model.num_experts, validate_ids=False)
            # fp8 runs its own tiles (vLLM's block-fp8 heuristic: K steps of 128, M tiles of 16 or 64).
            cfg8 = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size,
                              torch.float8_e4m3fn, hidden.device)
            blocks8 = assign_blocks(ids, cfg8.block_m, model.num_experts, validate_ids=False,   # (block fp8's rule)
                                    naive=use_naive_block_assignment(batch, model.top_k, model.num_experts,
                                                                     block_fp8=True))
            blocks8c = assign_blocks(ids, cfg8.block_m, model.num_experts, validate_ids=False)   # (vLLM's rule)
            (b1, b1s), (b2, b2s) = fp8["block"]
            (c1, c1s), (c2, c2s) = fp8["channel"]
            # (a table entry that runs both GEMMs in one launch needs no block map: none is passed then)
            one16, one8 = runs_in_one_launch(cfg, UNQUANTIZED), runs_in_one_launch(cfg8, FORMATS["block"])
            calls = {
                "bf16 GEMMs": (lambda: fused_experts(hidden, w1, w2, weights, ids, config=cfg,
                                                     blocks=None if one16 else blocks, validate_ids=False), 2, None),
                "fp8 block GEMMs": (lambda: fused_experts(hidden, b1, b2, weights, ids, config=cfg8,
                                                          blocks=None if one8 else blocks8, validate_ids=False,
                                                          w1_scale=b1s, w2_scale=b2s), 1,
                                    (b1, b2, b1s, b2s, "block")),
                "fp8 channel GEMMs": (lambda: fused_experts(hidden, c1, c2, weights, ids, config=cfg8, blocks=blocks8c,
                                                            validate_ids=False, w1_scale=c1s, w2_scale=c2s), 1,
                                      (c1, c2, c1s, c2s, "channel")),
                "fp8 block permute": (lambda: permute_experts(hidden, b1, b2, weights, ids, validate_ids=False,
                                                             w1_scale=b1s, w2_scale=b2s), 1,
                                      (b1, b2, b1s, b2s, "block")),
                "torch _scaled_grouped_mm": (lambda: _scaled_grouped_mm_layer(hidden, c1, c1s, c2, c2s, weights, ids,
                                                                              model.num_experts), 1,
                                             (c1, c2, c1s, c2s, "channel")),
                "quantiser": (lambda: per_token_group_quant_fp8(hidden), 1, None),
            }
            if gluon and batch <= DECODE_ONLY_MAX_BATCH:
                calls["fp8 block permute gluon a16"] = (
                    lambda: permute_experts(hidden, b1, b2, weights, ids, validate_ids=False, w1_scale=b1s,
                                            w2_scale=b2s, align=16, gemm="gluon"), 1, (b1, b2, b1s, b2s, "block"))
            if gluon and batch >= PREFILL_GLUON_MIN_BATCH:   # what the layer's fp8 layout choices run at prefill
                calls["fp8 block permute gluon"] = (
                    lambda: permute_experts(hidden, b1, b2, weights, ids, validate_ids=False, w1_scale=b1s,
                                            w2_scale=b2s, align=128, gemm="gluon"), 1, (b1, b2, b1s, b2s, "block"))
            read_weights = {"bf16 GEMMs": (w1, w2), "fp8 block GEMMs": (b1, b2)}
            for name, (call, bytes_per_weight, quantised) in calls.items():
                work = count_work(model, ids, bytes_per_weight)
                rate = rate16 if bytes_per_weight == 2 else rate8
                floor = max(work.bytes / read, work.flops / rate)
                row = {"model": key, "batch": batch, "layout": name, "experts_touched": work.experts_touched,
                       "bytes": work.bytes, "flops": work.flops, "floor_s": floor}
                if name in ("bf16 GEMMs", "fp8 block GEMMs"):   # (both GEMMs in one launch, by the table?)
                    row["one_launch"] = one16 if name == "bf16 GEMMs" else one8
                if name == "quantiser":
                    row.update(bytes=3 * hidden.numel(), flops=0, floor_s=3 * hidden.numel() / read)
                try:
                    out = call()
                    if quantised is not None:
                        q1, q2, s1, s2, g = quantised
                        if batch <= 256:   # the float64 reference grows slow beyond
                            ref = moe_reference_fp8(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2,
                                                    granularity=g, intermediate_dtype=hidden.dtype)
                            row["rel_err_vs_quantised_reference"] = rel_err(out, ref)
                        row["rel_err_vs_bf16"] = rel_err(out, calls["bf16 GEMMs"][0]())
                    del out
                    row["time_s"] = median_ms(graphed(call), warmup_ms, rep_ms) * 1e-3
                except Exception as err:  # noqa: BLE001 - one path failing must not stop the sweep
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                if name in read_weights and batch <= READ_BOUND_MAX_BATCH:
                    try:   # (a read that fails is the read's error, not the layout's)
                        row.update(read_bounds(work, *read_weights[name], ceilings.get("read_by_size"),
                                               warmup_ms, rep_ms))
                    except Exception as err:  # noqa: BLE001
                        row["read_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                rows.append(row)
                t = row.get("time_s")
                log(f"{key:<14} {batch:>6} {name:<26} " + (f"{t * 1e6:>10.1f} us {t / row['floor_s']:>6.2f}x floor "
                    f"{row['flops'] / t / 1e12:>7.1f} TFLOP/s" if t else row.get("error", ""))
                    + "".join(f" {label} {row[field] / row['floor_s']:.2f}x" for field, label in (
                        ("read_same_bytes_s", "read"), ("read_two_launches_s", "two reads")) if field in row)
                    + (f" read failed: {row['read_error']}" if "read_error" in row else ""))
            torch.cuda.empty_cache()
        del w1, w2, fp8
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench fp8", description=__doc__.splitlines()[0])
    add_run_arguments(parser, warmup_ms=5.0, rep_ms=30.0)
    add_record_arguments(parser, "fp8-sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels.bench fp8: needs a CUDA GPU", file=sys.stderr)
        return 2
    from .ceilings import measure_fp8_gemm_rate, measure_gemm_rate, measure_read_bandwidth, measure_read_time_by_size

    started = time.perf_counter()
    ceilings = {"read_bandwidth": measure_read_bandwidth(), "gemm_rate_bf16": measure_gemm_rate(),
                "gemm_rate_fp8": measure_fp8_gemm_rate(), "gemm_rate_fp8_block_scaled": measure_block_scaled_rate()}
    print({k: (f"{v / 1e12:.2f}" if v else v) for k, v in ceilings.items()}, "(TB/s, TFLOP/s)", flush=True)
    ceilings["read_by_size"] = measure_read_time_by_size()
    models = {m: MODELS[m] for m in args.models}
    rows = sweep(models, args.batches, seed=args.seed, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                 ceilings=ceilings, log=lambda line: print(line, flush=True))
    data = {"config": {"batches": args.batches, "seed": args.seed, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
                       "routing": "uniform: top-k of iid normal logits"},
            "ceilings": ceilings, "rows": rows, "wall_s": time.perf_counter() - started}
    if args.record:
        write_record(args.name or "fp8-sweep", data, args.results_dir)
    return 0
