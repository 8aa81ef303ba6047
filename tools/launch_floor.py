"""What one more kernel in a CUDA graph costs the GPU, with no work in it: the floor under every
launch of the layer's prologue (gate, routing, alignment) and of a decode step's GEMMs.

A chain of ``L`` tiny kernels, each reading the buffer the one before wrote and writing the next
(``y = x + 1``, so they must run in order), is captured in one CUDA graph and replayed, for
``L = 1 .. 8``: back to back (20 chains in one graph, replayed: the primary figure) and with the L2
flushed before each replay of one chain (``triton.testing.do_bench``, as the sweeps time; coarse,
since CUDA events resolve about 0.5 us). After timing, each chain's values are checked on the GPU. A straight line through
(``L``, time) gives the cost per kernel (slope) and what the graph costs once (intercept). Two
grids: one program (a router at one token), and one program per SM (a GEMM's launch and drain).
Then the same chains with Hopper's programmatic dependent launch (each kernel waits with
``griddepcontrol.wait`` and lets the next one launch at once), which overlaps a kernel's launch
with the previous one's run.

Issue 19 asks for gate + routing + alignment in 5 us; with three launches that is 1.7 us each, with
their work. This measures whether the launches alone fit.

    PYTHONPATH=. python tools/launch_floor.py          # on a GPU: prints, and records launch-floor.json
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/launch_floor.py   # CPU: checks the chain's values only
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

from moe_kernels._runtime import tl, triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:   # a Triton before 3.4: no PDL rows
    gdc_launch_dependents = gdc_wait = None

LENGTHS = (1, 2, 3, 4, 6, 8)
ELEMENTS = 128   # per program: one 512-byte read and write


@triton.jit
def _add_one(x_ptr, y_ptr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()                 # the previous kernel's writes are visible after this
        gdc_launch_dependents()    # and the next kernel may launch now
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)


def chain(buffers, length: int, programs: int, pdl: bool):
    """``length`` dependent launches: buffer i+1 = buffer i + 1."""
    extra = {"launch_pdl": True} if pdl else {}
    for i in range(length):
        _add_one[(programs,)](buffers[i], buffers[i + 1], PDL=pdl, BLOCK=ELEMENTS, **extra)


def fit(points):
    """Least-squares line through (length, us): (per kernel, once)."""
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def check_values(device) -> None:
    for programs in (1, 3):
        buffers = [torch.zeros(programs * ELEMENTS, device=device) for _ in range(max(LENGTHS) + 1)]
        chain(buffers, max(LENGTHS), programs, pdl=False)
        if not torch.equal(buffers[-1], torch.full_like(buffers[-1], float(max(LENGTHS)))):
            raise SystemExit(f"the chain of {max(LENGTHS)} kernels computed {buffers[-1][:4].tolist()}, not {max(LENGTHS)}")


def main() -> int:
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    check_values(device)
    if device == "cpu":
        print("chain values correct (no GPU: nothing timed)")
        return 0
    from triton.testing import do_bench

    from moe_kernels.bench.cli import write_record
    from moe_kernels.bench.timing import graph_us, graphed
    from moe_kernels.kernels._pdl import pdl_available

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pdl_modes = (False, True) if pdl_available(torch.device("cuda")) and gdc_wait is not None else (False,)
    rows = []
    data = {"lengths": list(LENGTHS), "elements_per_program": ELEMENTS, "sms": sms, "rows": rows,
            "method": "a chain of dependent y = x + 1 kernels in one CUDA graph, timed two ways, each the lower of "
                      "two rounds, and a least-squares line through (length, us). back_to_back (the primary "
                      "figure): 20 chains in one graph, replayed, time per chain; its us_once is the graph's own "
                      "cost divided by 20. flushed: one chain per graph, do_bench's median with the L2 flushed "
                      "before each replay (only the chain's first 512-byte read misses; CUDA events resolve "
                      "about 0.5 us, so these are coarse)"}
    for programs in (1, sms):
        buffers = [torch.zeros(programs * ELEMENTS, device=device) for _ in range(max(LENGTHS) + 1)]
        for pdl in pdl_modes:
            points = {"back_to_back": [], "flushed": []}
            row = {"programs": programs, "pdl": pdl}
            try:
                for length in LENGTHS:
                    run = lambda length=length: chain(buffers, length, programs, pdl)   # noqa: E731
                    replay = graphed(run)
                    # two rounds of each, back to back; the lower median, as the sweeps report
                    warm = [graph_us(run, calls=20, replays=20) for _ in range(2)]
                    if None in warm:
                        raise RuntimeError(f"a chain of {length} could not be captured")
                    points["back_to_back"].append((length, min(warm)))
                    points["flushed"].append(
                        (length, min(float(do_bench(replay, warmup=5, rep=30, return_mode="median")) * 1e3
                                     for _ in range(2))))
                    # the chain still computes: a missing wait (PDL) would look fast and be wrong
                    for b in buffers:
                        b.zero_()
                    run()
                    if not torch.equal(buffers[length], torch.full_like(buffers[length], float(length))):
                        raise RuntimeError(f"the chain of {length} (PDL {pdl}) computed {buffers[length][:2].tolist()}")
            except Exception as error:   # recorded; the other rows still run
                row["error"] = repr(error)[:300]
                print(f"{programs:>4} program(s), PDL {pdl}: {row['error']}", flush=True)
            for how, pts in points.items():
                if len(pts) >= 2:
                    per_kernel, once = fit(pts)
                    row[how] = {"us_by_length": {str(n): round(t, 3) for n, t in pts},
                                "us_per_kernel": round(per_kernel, 3), "us_once": round(once, 3),
                                "residuals_us": [round(t - (once + per_kernel * n), 3) for n, t in pts]}
            rows.append(row)
            if "back_to_back" in row:
                print(f"{programs:>4} program(s), PDL {'on ' if pdl else 'off'}: "
                      + "; ".join(f"{how}: {row[how]['us_per_kernel']:.2f} us a kernel + {row[how]['us_once']:.2f} "
                                  f"({', '.join(f'{n}: {t:.1f}' for n, t in row[how]['us_by_length'].items())})"
                                  for how in points if how in row), flush=True)
            write_record("launch-floor", data, None)   # after each row: a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
