"""The tuner's candidates compiled ahead of timing, in parallel processes: ``bench tune`` builds every
configuration it will time once on a tiny problem of the same shape class, so that Triton's on-disk cache holds
them before the first is timed (Triton compiles one kernel per core; DeepSeek-V3's full fp8 search is hundreds).

A job is a dict: the shape (``d``, ``f``, ``top_k``, ``block_m``), the block map (``naive``, ``dense``: a shared
expert's), which GEMM (``gated``; GEMM 2 with ``sum_slots``), the tiles, the weight format and the device. A config
that cannot compile is skipped here and again when timed::

    >>> precompile([], workers=4)   # nothing to build: returns at once
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time

import torch


def _compile_jobs(jobs: list[dict]) -> int:
    """Run each job's kernel once on a tiny problem of the same shape class, so Triton compiles
    it into its on-disk cache; used from worker processes to compile configurations in parallel."""
    from ..kernels.config import GemmTiles
    from ..kernels.blocks import assign_blocks, dense_blocks
    from ..kernels.formats import FORMATS
    from ..kernels.index_gather import down, expert_down, expert_gate_up

    done = 0
    for job in jobs:
        d, f, top_k, block_m = job["d"], job["f"], job["top_k"], job["block_m"]
        tiles = GemmTiles(**job["tiles"])
        fmt = FORMATS[job.get("format", "none")]
        on = dict(device=job["device"], dtype=getattr(torch, job["dtype"]))
        # A naive map's NAIVE_GROUP is a constexpr set by the token count (blocks.naive_group_size): as
        # many tokens as give the timed batch's group (one token: none), else 4.
        group = job.get("naive_group", 0)
        tokens = (max(2, group // top_k) if group else 1) if job["naive"] and not job.get("dense") else 4
        try:
            ids = torch.zeros(tokens, top_k, dtype=torch.int32, device=job["device"])
            if job.get("dense"):   # a shared expert: one expert, every row, no index (as timed)
                blocks = dense_blocks(tokens, block_m, ids)
            else:
                blocks = assign_blocks(ids, block_m, 1, naive=job["naive"], validate_ids=False)   # as timed
            if job.get("dense") and not job["gated"]:
                w, w_scale = fmt.quantize_weight(torch.randn(1, d, f, **on))
                y, y_scale = fmt.quantize_activations(torch.randn(tokens, f, **on))
                down(y, w, None, blocks, tiles=tiles, out=torch.empty(tokens, d, **on), a_scale=y_scale, w_scale=w_scale,
                     fmt=fmt, sum_slots=False)
            elif job["gated"]:
                w, w_scale = fmt.quantize_weight(torch.randn(1, 2 * f, d, **on))
                x, x_scale = fmt.quantize_activations(torch.randn(tokens, d, **on))
                expert_gate_up(x, w, blocks, top_k, tiles=tiles, a_scale=x_scale, w_scale=w_scale,
                               out_dtype=on["dtype"])
            else:
                weights = torch.rand(tokens, top_k, device=job["device"])
                w, w_scale = fmt.quantize_weight(torch.randn(1, d, f, **on))
                y, y_scale = fmt.quantize_activations(torch.randn(tokens * top_k, f, **on))
                expert_down(y, w, weights, blocks, tiles=tiles, a_scale=y_scale, w_scale=w_scale,
                            out_dtype=on["dtype"], sum_slots=job["sum_slots"])
            done += 1
        except Exception:  # noqa: BLE001 - a config that cannot compile is skipped when timed too
            pass
    return done


def precompile(jobs: list[dict], workers: int, log=print) -> None:
    """Compile many configurations in parallel processes (Triton compiles one kernel per core)."""
    if workers <= 1 or not jobs:
        return
    import moe_kernels.bench.tune_compile as this_module  # a picklable reference whatever ran it

    start = time.perf_counter()
    chunks = [jobs[i::workers] for i in range(workers)]
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            done = sum(pool.map(this_module._compile_jobs, chunks))
        log(f"precompiled {done}/{len(jobs)} kernels in {time.perf_counter() - start:.0f} s on {workers} processes")
    except Exception as err:  # noqa: BLE001 - compiling serially later is slower, not wrong
        log(f"parallel precompile failed ({err}); kernels compile on first use")
