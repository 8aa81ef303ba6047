"""A capacity-factor layer against the dropless layer on a GPU: ``python -m moe_kernels.bench capacity``.

A capacity layer (GShard's rule, :mod:`moe_kernels.model.capacity`) gives every expert a buffer
of ``C = ceil(alpha * B * k / E)`` rows and drops the assignments that overflow it. Its GEMMs run
over the whole ``[E, C, d]`` buffer whatever the routing (static shapes are the point of it), so
they compute ``E * C`` rows and read every expert's weights. The dropless layer (index-gather)
computes the batch's ``B * k`` rows and reads only the experts the batch touches. At decode the
difference is the chapter's thesis in one number: a capacity layer at one token reads all 256 of
DeepSeek-V3's experts to compute 8 rows.

For each model, batch and ``alpha`` the command lays both out (outside the timed regions: the
alignment for the dropless layer; for the capacity layer each kept assignment's row copied into
its slot of the buffer), checks the capacity GEMMs against torch on one expert's slots, times
both pairs of GEMMs (CUDA-graph replays, L2 flushed, as the sweep times), and records ``C``, the rows each computes,
the experts each reads and the assignments the rule drops on this routing (uniform: the top-k
of iid normal logits). bf16 weights. ``--record`` writes ``results/<device>/capacity.json``.

    >>> from moe_kernels.model.shapes import MODELS
    >>> plan = capacity_plan(MODELS["deepseek-v3"], 1, 1.25)
    >>> plan["capacity"], plan["rows_computed"], plan["experts_read"]
    (1, 256, 256)
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..model.capacity import expert_capacity
from ..model.shapes import MODELS, MoEModel
from .cli import add_record_arguments, add_run_arguments, start_run, write_record

BATCHES = (1, 8, 64, 512, 4096)
ALPHAS = (1.0, 1.25, 2.0)


def capacity_plan(model: MoEModel, batch: int, alpha: float) -> dict:
    """What a capacity layer computes for ``batch`` tokens at ``alpha``, before any routing: its
    capacity ``C``, the ``E * C`` rows its GEMMs run over, and the experts whose weights they read
    (all of them)."""
    capacity = expert_capacity(batch, model.top_k, model.num_experts, alpha)
    return {"capacity": capacity, "rows_computed": model.num_experts * capacity, "experts_read": model.num_experts}


def measure(key: str, batch: int, alpha: float, w1: torch.Tensor, w2: torch.Tensor, seed: int, *,
            warmup_ms: float = 5.0, rep_ms: float = 30.0) -> dict:
    """One (model, batch, alpha) point: both layouts, a check, both times, the counts."""
    from ..kernels import masked
    from ..kernels.blocks import assign_blocks
    from ..kernels.config import get_config, separate_sum_tiles
    from ..kernels.index_gather import expert_down, expert_gate_up
    from ..model.capacity import capacity_assign, expert_queue_positions
    from .problems import make_batch
    from .timing import graphed, median_ms, rel_err

    model = MODELS[key]
    E, k, d, F = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
    plan = capacity_plan(model, batch, alpha)
    C = plan["capacity"]
    hidden, _, weights, ids = make_batch(model, batch, w1.dtype, seed, w1.device)

    # The capacity layer's buffer: each kept assignment's token row in its expert's slot.
    keep = capacity_assign(ids, E, C)
    slots = expert_queue_positions(ids, E)
    buffer = torch.zeros(E, C, d, dtype=w1.dtype, device=w1.device)
    kept = keep.nonzero(as_tuple=True)
    buffer[ids[kept].long(), slots[kept]] = hidden[kept[0]]
    full = torch.full((E,), C, dtype=torch.int32, device=w1.device)   # static shapes: every slot computed
    act = torch.empty(E, C, F, dtype=w1.dtype, device=w1.device)
    out = torch.empty(E, C, d, dtype=w1.dtype, device=w1.device)

    def capacity_gemms():
        masked.grouped_gemm_masked(buffer, w1, full, silu_mul=True, out=act)
        masked.grouped_gemm_masked(act, w2, full, out=out, which="down")

    capacity_gemms()   # checked on the busiest expert's slots against torch, before timing
    busiest = int(torch.bincount(ids[kept].long(), minlength=E).argmax())
    gate, up = (buffer[busiest].float() @ w1[busiest].float().T).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).to(w1.dtype).float() @ w2[busiest].float().T
    error = rel_err(out[busiest], want)
    if not error < 2e-2:
        raise AssertionError(f"{key} B={batch} alpha={alpha}: capacity GEMMs off by {error:.2e}")

    # The dropless layer's GEMMs on the same routing (block map made outside the timed region).
    cfg = get_config(batch, E, F, d, w1.dtype, w1.device)
    blocks = assign_blocks(ids, cfg.block_m, E, validate_ids=False)
    inter = expert_gate_up(hidden, w1, blocks, k, tiles=cfg.gate_up)
    per_slot = expert_down(inter, w2, weights, blocks, tiles=separate_sum_tiles(cfg))

    def dropless_gemms():
        expert_gate_up(hidden, w1, blocks, k, tiles=cfg.gate_up, out=inter)
        expert_down(inter, w2, weights, blocks, tiles=separate_sum_tiles(cfg), out=per_slot)

    times = {name: 1e3 * median_ms(graphed(fn), warmup_ms, rep_ms)
             for name, fn in (("dropless GEMMs", dropless_gemms), ("capacity GEMMs", capacity_gemms))}
    touched = int(torch.unique(ids).numel())
    row = {"model": key, "batch": batch, "alpha": alpha, "seed": seed, **plan,
           "rows_real": batch * k, "experts_touched": touched,
           "dropped": int((~keep).sum()), "tokens_losing_an_expert": int((~keep).any(dim=1).sum()),
           "expert_weight_bytes": 3 * d * F * w1.element_size(), "times_us": times, "check_rel_err": error}
    print(f"{key:14s} B={batch:5d} alpha={alpha:4.2f} C={C:5d} rows {E * C:7d} vs {batch * k:6d}  experts "
          f"{E:3d} vs {touched:3d}  dropped {row['dropped']:5d}  "
          + "  ".join(f"{name} {t:9.1f} us" for name, t in times.items()),
          flush=True)
    del buffer, act, out, inter, per_slot
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench capacity", description=__doc__.splitlines()[0])
    add_run_arguments(parser, warmup_ms=5.0, rep_ms=30.0)
    parser.set_defaults(batches=list(BATCHES))
    add_record_arguments(parser, "capacity")
    args, config = start_run(parser, argv, torch.bfloat16)
    if config is None:
        return 2
    from .problems import make_weights

    rows = []
    for key in args.models:
        w1, w2 = make_weights(MODELS[key], torch.bfloat16, args.seed)
        for batch in args.batches:
            for alpha in ALPHAS:
                rows.append(measure(key, batch, alpha, w1, w2, seed=args.seed + batch, warmup_ms=args.warmup_ms,
                                    rep_ms=args.rep_ms))
        del w1, w2
        torch.cuda.empty_cache()
    if args.record:
        config.update(alphas=list(ALPHAS), timing="CUDA-graph replay, L2 flushed, do_bench median")
        write_record(args.name or "capacity", {"config": config, "rows": rows}, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
