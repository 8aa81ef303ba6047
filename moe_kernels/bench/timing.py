"""Timers for GPU calls, and the relative error the benchmarks check outputs with.

Two ways to time a call, and why both are reported:

* :func:`eager_us`: ``triton.testing.do_bench`` around the Python call (CUDA events, L2 flushed
  before each call, median). It includes whatever the host adds (argument checks, the launcher)
  when that is longer than the GPU's queue of work: what a caller that launches kernels one by
  one sees.
* :func:`graph_us`: the same call captured ``calls`` times into a CUDA graph and replayed; the time
  per call is what the GPU spends with launch overhead gone, which is how serving engines run a
  decode step (vLLM and SGLang capture it in CUDA graphs). Returns None for a call that cannot be
  captured (one that synchronises with the host, say).

How the L2 is emptied before each timed call (:func:`l2_flush`, ``MOE_KERNELS_L2_FLUSH``): ``do_bench``
zeroes a 256 MB buffer, which leaves the L2 full of dirty lines (write-back), so the timed call's first
reads also write those lines back to HBM: up to the L2's size more traffic, 2-10 us on an H100 for reads of
16 MB to 1.2 GB (``tools/l2_flush_ab.py``, ``l2-flush-ab.json``). ``clean`` zeroes the same buffer, then reads
another one as large, so the call starts on clean lines, as a layer in a decode step does (what ran
before it, attention, mostly read). ``zero``, ``do_bench``'s own, stays the default: every record before
this option was timed so.

The sweeps and the tuner time with :func:`median_ms` (a ``do_bench`` median in milliseconds),
replaying from a graph of one call made by :func:`graphed`; :func:`rel_err` compares an output
with its reference; :func:`balanced_orders` orders interleaved rounds of several variants so that
none always follows the same one. The A/B scripts in ``tools/`` time with :func:`time_candidates`
and divide by a :class:`~moe_kernels.bench.ceilings.ReadFloor`. The timers need a CUDA GPU.
"""

from __future__ import annotations

import os
import statistics
import warnings
from typing import Callable

import torch


def eager_us(fn, warmup_ms: int = 10, rep_ms: int = 50) -> float:
    return 1e3 * median_ms(fn, warmup_ms, rep_ms)


def captured(fn, calls: int = 20, errors: list | None = None, free_cached: bool = False):
    """A CUDA graph of ``calls`` calls of ``fn`` (compiled and warmed up first), replayed once; or
    None if it cannot be captured (the reason appended to ``errors``, if given: a read-back to the
    host, or out of memory). ``free_cached``: hand the allocator's idle blocks back between the
    warm-up and the capture (the warm-up's blocks belong to its side stream, and the capture
    allocates from a pool of its own: a step that fills most of the GPU needs them back)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm up outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        if free_cached:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():   # a call that launches nothing (the naive block map) is an empty
            warnings.filterwarnings("ignore", "The CUDA Graph is empty")   # graph: timed as such, no warning
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
    except RuntimeError as error:
        torch.cuda.synchronize()
        if errors is not None:
            errors.append(repr(error)[:300])
        return None
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(fn, calls: int = 20, replays: int = 20, errors: list | None = None, free_cached: bool = False):
    """Microseconds per call of ``fn`` replayed from a CUDA graph, or None if it cannot be captured
    (the reason appended to ``errors``, if given: a read-back to the host, or out of memory;
    ``free_cached``: see :func:`captured`)."""
    graph = captured(fn, calls, errors, free_cached)
    if graph is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


#: The L2 flushes :func:`median_ms` knows (see the module's docstring), and the environment variable
#: that picks one (read at each call; unset: ``zero``).
L2_FLUSHES = ("zero", "clean")
L2_FLUSH_ENV = "MOE_KERNELS_L2_FLUSH"
FLUSH_BYTES = 256 * 1024**2   # do_bench's buffer: five times the H100's and H200's 50 MB of L2


def l2_flush() -> str:
    """The flush the timers use now: ``$MOE_KERNELS_L2_FLUSH``, one of :data:`L2_FLUSHES`, or ``zero`` where it
    is unset; any other value is an error that names the variable."""
    mode = os.environ.get(L2_FLUSH_ENV) or "zero"   # (set but empty: unset)
    if mode not in L2_FLUSHES:
        raise ValueError(f"{L2_FLUSH_ENV}: must be one of {L2_FLUSHES} (how the L2 is emptied before each "
                         f"timed call), got {mode!r}")
    return mode


_flush_buffers: dict = {}


def clean_flush(device="cuda") -> Callable:
    """The ``clean`` flush: zero :data:`FLUSH_BYTES` (as ``do_bench`` does), then read another buffer as large
    with the read kernel, so that the L2 is left holding clean lines. Its buffers are made once per device (``"cuda"``
    is the current one, so that a caller who switches GPUs flushes the one it times)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _flush_buffers:
        from .read_kernel import weight_reader

        cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        _flush_buffers[device] = (cache, weight_reader(torch.ones(FLUSH_BYTES // 4, device=device)))
    cache, read_other = _flush_buffers[device]

    def flush():
        cache.zero_()
        read_other()
    return flush


def flushed_median_ms(fn: Callable, flush: Callable, warmup_ms: float, rep_ms: float) -> float:
    """``do_bench``'s loop with ``flush`` as its cache clearing: ``fn`` run for about ``warmup_ms``, then
    the median over about ``rep_ms`` of flush, event, ``fn``, event (at least five samples)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    samples = max(5, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))


def median_ms(fn: Callable, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds of ``fn`` with the L2 flushed before each call: ``triton.testing.do_bench``,
    or with :data:`L2_FLUSH_ENV` = ``clean`` :func:`flushed_median_ms` with :func:`clean_flush`."""
    if l2_flush() == "clean":
        return flushed_median_ms(fn, clean_flush(), warmup_ms, rep_ms)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graphed(fn: Callable) -> Callable:
    """Capture ``fn`` once in a CUDA graph and return its replay (launch overhead removed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def round_order(names: list, round_index: int, alternate: bool) -> list:
    """The order candidates are timed in, in round ``round_index``: as given, or with ``alternate``
    reversed in every odd round, so that no candidate always runs right after the same one (under
    a power cap the clocks a candidate gets follow the work just before it).

        >>> round_order(["a", "b", "c"], 0, True), round_order(["a", "b", "c"], 1, True)
        (['a', 'b', 'c'], ['c', 'b', 'a'])
    """
    return list(reversed(names)) if alternate and round_index % 2 else list(names)


def time_candidates(candidates: dict, reference: torch.Tensor, *, tolerance: float, warmup_ms: float,
                    rep_ms: float, rounds: int = 2, unchecked: tuple = (), alternate: bool = False
                    ) -> tuple[dict, dict, dict]:
    """The A/B scripts' timer (``tools/*_ab.py``): each candidate called once and compared with
    ``reference`` (except those named in ``unchecked``), then replayed from a CUDA graph of one call,
    ``rounds`` rounds interleaved over the candidates (in :func:`round_order`). Returns
    ``(times_us, errors, rel)``: every round's median per candidate, the candidates that failed or
    differ by more than ``tolerance`` (the reason), and each compared candidate's relative error. A
    candidate that fails is kept out of the timing, never stops the others. Without a GPU (the
    interpreter) every time reads 1.0."""
    cuda = torch.cuda.is_available() and reference.is_cuda
    replays, errors, rel = {}, {}, {}
    for name, call in candidates.items():
        try:
            out = call()
            if name not in unchecked:
                rel[name] = rel_err(out, reference)
                if not rel[name] <= tolerance:   # (NaN too: a NaN error compares False with anything)
                    errors[name] = f"rel err {rel[name]:.3g}"
            replays[name] = graphed(call) if cuda else call
        except Exception as error:   # noqa: BLE001 - one candidate failing must not lose the others
            errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    times = {name: [] for name in replays}
    for r in range(rounds):
        for name in round_order(list(replays), r, alternate):
            times[name].append(median_ms(replays[name], warmup_ms, rep_ms) * 1e3 if cuda else 1.0)
    return times, errors, rel


def time_lowest(candidates: dict, reference: torch.Tensor, **kwargs) -> tuple[dict, dict, dict, dict]:
    """:func:`time_candidates` (same arguments) with each candidate's lower round median first:
    ``(lowest_us, rounds_us, errors, rel)``, what the A/B tools report."""
    times, errors, rel = time_candidates(candidates, reference, **kwargs)
    return {name: min(rounds) for name, rounds in times.items()}, times, errors, rel


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` in the Frobenius norm, computed in float32.

        >>> rel_err(torch.tensor([3.0, 4.1]), torch.tensor([3.0, 4.0]))  # doctest: +ELLIPSIS
        0.0199...
    """
    return float(torch.linalg.norm(out.float() - ref.float()) / torch.linalg.norm(ref.float()).clamp_min(1e-30))


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` things in which each thing comes right after each other one equally often
    (a Williams design: ``n`` orders for an even ``n``; for an odd one ``2n``, each order followed
    by its reverse, so that a run cut short is still nearly balanced), and each takes each place
    equally often; rounds in a multiple of ``len(orders)`` complete it.

    >>> balanced_orders(4)
    [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    """
    first, low, high = [0], 1, n - 1
    while len(first) < n:   # 0, 1, n-1, 2, n-2, ...
        first.append(low if len(first) % 2 else high)
        low, high = (low + 1, high) if len(first) % 2 == 0 else (low, high - 1)
    orders = [[(x + shift) % n for x in first] for shift in range(n)] if n else [[]]
    return [o for order in orders for o in (order, order[::-1])] if n % 2 else orders
