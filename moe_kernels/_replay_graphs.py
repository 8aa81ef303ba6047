"""A replayed call as one CUDA graph: the host work of a decode call down to a few API calls.

A replay (:mod:`moe_kernels._replay`) still launches every kernel from Python: an fp8 call is five
to seven launches at 9-15 microseconds of host time each on the H200's host, 80-130 us in all,
against 30-40 us of GPU time at batch 1. A CUDA graph launches them all with one call. So once a
plan has replayed on the same *pinned* inputs (the weights, which the caller keeps in place)
twice, its replay is captured into a graph and from then on a call is:

1. copy each *copied* input (the activations, ids and routing weights, which are new tensors at
   every call) into a static buffer the graph reads;
2. ``graph.replay()`` on the caller's current stream;
3. clone the graph's static output: the caller gets a fresh tensor, as from every other path.

About five host API calls whatever the number of kernels. Pinned inputs are read where they are:
a graph is kept per tuple of their addresses (a model's layers call one plan with 48 different
weight sets: 48 graphs), so a call whose weights sit elsewhere takes another graph or the plain
replay, never a stale address.

**Memory.** Every graph of a stream allocates its intermediates from one private pool per
(device, stream), so the graphs share that memory: safe because a graph's result never stays in
the pool. The graph copies it, as its last node, into a static output buffer outside the pool
(one per plan and stream), and the call clones that buffer before any other graph of the stream
can run. The static inputs are outside the pool too. What a stream keeps is therefore one
working set (the largest plan's intermediates: what the caching allocator would keep cached
after an eager call anyway) plus each plan's static inputs and output. Those add up over plans
(a server's many prefill lengths), so they have a budget, :data:`MAX_STATIC_BYTES` for the
process: a new graph that would pass it first drops the graphs of the plans used least recently.
A plan whose buffers exceed :data:`MAX_GRAPH_BYTES` keeps the plain replay.

**When not.** A call on a stream other than the one a plan's static buffers belong to builds its
own set (per stream); a lock per plan keeps two threads' copy-replay-clone sequences apart. The
graph path is off under ``MOE_KERNELS_REPLAY_GRAPHS=0`` (the plain replay remains).

Worked example of the bookkeeping (no GPU needed): a plan of ``fused_experts`` whose inputs are
``(x, w1, w2, weights, ids, None, None)`` pins the weights and copies the rest::

    >>> split_inputs(7, pinned=(1, 2, 5, 6))
    ((0, 3, 4), (1, 2, 5, 6))
"""

from __future__ import annotations

import collections
import os
import threading
import weakref

import torch

#: Plans whose buffers (intermediates and outputs) exceed this many bytes keep the plain replay.
#: DeepSeek-V3's layer at 16,384 tokens needs about 5 GiB.
MAX_GRAPH_BYTES = int(os.environ.get("MOE_KERNELS_REPLAY_GRAPH_MAX_MB", 8192)) * 2**20
#: Static input and output buffers kept for graphs, over all plans and streams of the process.
MAX_STATIC_BYTES = 4 * 2**30
#: Graphs per plan and stream (one per set of pinned addresses) before new ones stop being made.
MAX_GRAPHS_PER_PLAN = 256
#: Replays on the same pinned addresses before a graph is captured (a one-off call never pays it).
REPLAYS_BEFORE_GRAPH = 2
ENABLED = os.environ.get("MOE_KERNELS_REPLAY_GRAPHS", "1") != "0"

_pools = {}            # (device index, stream pointer) -> (pool handle, capture stream)
_pools_lock = threading.RLock()   # (reentrant: a finalizer may run while it is held)
static_bytes = 0       # held by the static buffers of every live plan (see MAX_STATIC_BYTES)
_holders = collections.OrderedDict()   # id -> (weakref to a _StreamGraphs, [its bytes]), least recent first


def _release(key: int, held: list) -> None:
    """A _StreamGraphs went: give its bytes back."""
    global static_bytes
    with _pools_lock:
        static_bytes -= held[0]
        held[0] = 0
        _holders.pop(key, None)


def split_inputs(num_inputs: int, pinned) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The positions of the inputs a graph copies, and of those it reads in place."""
    pinned = tuple(sorted(set(pinned)))
    return tuple(i for i in range(num_inputs) if i not in pinned), pinned


def _stream_pool(device: int, stream_ptr: int):
    """The memory pool and capture stream of ``stream`` on ``device`` (made once)."""
    key = (device, stream_ptr)
    with _pools_lock:
        entry = _pools.get(key)
        if entry is None:
            entry = _pools[key] = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=device))
        return entry


class _StreamGraphs:
    """One plan's graphs on one stream: the static inputs and outputs, and a graph per set of
    pinned addresses."""

    def __init__(self, device: int, stream_ptr: int):
        self.device, self.stream_ptr = device, stream_ptr
        self.static_inputs = None   # position -> tensor, for the copied inputs
        self.static_outputs = None  # the clones' sources, outside the pool
        self.graphs = {}            # pinned addresses -> torch.cuda.CUDAGraph
        self.seen = {}              # pinned addresses -> replays so far without a graph
        self.lock = threading.Lock()

    def drop(self) -> None:
        """Forget the graphs and static buffers (to make room for others; rebuilt if used again)."""
        self.static_inputs = self.static_outputs = None
        self.graphs, self.seen = {}, {}


def _reserve(streams: _StreamGraphs, tensors, copied, plan) -> bool:
    """Count a plan's static buffers on one stream against MAX_STATIC_BYTES, first dropping the
    graphs of the plans used least recently if that is needed to fit (False: it does not fit).
    The bytes are given back when the plan goes, or its graphs are dropped."""
    global static_bytes
    nbytes = sum(tensors[i].untyped_storage().nbytes() for i in copied if tensors[i] is not None)
    nbytes += sum(plan.output_bytes)
    if nbytes > MAX_STATIC_BYTES:
        return False
    with _pools_lock:
        for key in list(_holders):
            if static_bytes + nbytes <= MAX_STATIC_BYTES:
                break
            entry = _holders.get(key)
            other = None if entry is None else entry[0]()
            # (a plan replaying in another thread keeps its graphs: its lock is not waited for)
            if other is not None and other.lock.acquire(blocking=False):
                try:
                    other.drop()
                finally:
                    other.lock.release()
                static_bytes -= entry[1][0]
                entry[1][0] = 0
                _holders.pop(key, None)
        if static_bytes + nbytes > MAX_STATIC_BYTES:
            return False
        static_bytes += nbytes
        held = [nbytes]
        _holders[id(streams)] = (weakref.ref(streams), held)
    weakref.finalize(streams, _release, id(streams), held)
    return True


def _used(streams: _StreamGraphs) -> None:
    """Mark ``streams`` as the most recently used (the last to be dropped)."""
    try:
        _holders.move_to_end(id(streams))
    except KeyError:
        pass


class PlanGraphs:
    """The CUDA graphs of one :class:`~moe_kernels._replay.Plan` (see the module docstring)."""

    def __init__(self, plan, pinned):
        self.plan = plan
        self.copied, self.pinned = split_inputs(plan.num_inputs, pinned)
        self.by_stream = {}
        self.refusal = None   # why this plan never graphs (too big, a result that is an input, ...)
        if any(slot < plan.num_inputs for slot in plan.returned):
            self.refusal = "the result is an input"
        elif plan.graph_bytes > MAX_GRAPH_BYTES:
            self.refusal = f"{plan.graph_bytes} bytes of buffers, above MAX_GRAPH_BYTES"

    def __call__(self, tensors):
        """The call's result through a graph, or None (the caller replays plainly)."""
        if self.refusal is not None or not ENABLED:
            return None
        device = torch._C._cuda_getDevice()
        if tensors[0].get_device() != device:   # (graphs are captured on the current device)
            return None
        stream_ptr = torch._C._cuda_getCurrentRawStream(device)
        streams = self.by_stream.get(stream_ptr)
        if streams is None:
            streams = self.by_stream.setdefault(stream_ptr, _StreamGraphs(device, stream_ptr))
        pinned = tuple(None if tensors[i] is None else tensors[i].data_ptr() for i in self.pinned)
        with streams.lock:
            graph = streams.graphs.get(pinned)
            if graph is None:
                seen = streams.seen.get(pinned, 0) + 1
                if seen < REPLAYS_BEFORE_GRAPH or len(streams.graphs) >= MAX_GRAPHS_PER_PLAN:
                    if len(streams.seen) < 4 * MAX_GRAPHS_PER_PLAN:
                        streams.seen[pinned] = seen
                    return None
                if streams.static_inputs is None and not _reserve(streams, tensors, self.copied, self.plan):
                    return None
                streams.seen.pop(pinned, None)
                graph = streams.graphs[pinned] = self._capture(streams, tensors)
            _used(streams)
            static = streams.static_inputs
            for i in self.copied:
                if tensors[i] is not None:
                    static[i].copy_(tensors[i])
            graph.replay()
            self.plan.replays += 1
            outputs = tuple(t.clone() for t in streams.static_outputs)
        return outputs if self.plan.many else outputs[0]

    def _capture(self, streams: _StreamGraphs, tensors):
        """Capture the plan's replay on the stream's static inputs and this call's pinned ones."""
        plan = self.plan
        if streams.static_inputs is None:
            streams.static_inputs = {i: torch.empty_strided(tensors[i].shape, tensors[i].stride(),
                                                            dtype=tensors[i].dtype, device=tensors[i].device)
                                     for i in self.copied if tensors[i] is not None}
        for i, static in streams.static_inputs.items():   # real ids before the warm-up: garbage could fail
            static.copy_(tensors[i])                         # the device-side id check
        args = [streams.static_inputs.get(i) if i in self.copied else tensors[i] for i in range(plan.num_inputs)]
        pool, capture_stream = _stream_pool(streams.device, streams.stream_ptr)
        current = torch.cuda.current_stream()
        capture_stream.wait_stream(current)
        with torch.cuda.stream(capture_stream):
            # Once outside the capture on the capture stream: cuBLAS makes its workspace for a
            # stream at its first call there, which a capture may not do.
            results = plan.replay(args)
            results = results if plan.many else (results,)
            if streams.static_outputs is None:
                streams.static_outputs = tuple(torch.empty_like(t) for t in results)
            del results
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                results = plan.replay(args)
                for static, result in zip(streams.static_outputs, results if plan.many else (results,)):
                    static.copy_(result)   # out of the pool: the pool's memory is free again after the graph
                del results
            finally:
                graph.capture_end()
        current.wait_stream(capture_stream)
        plan.replays -= 2   # (the two replays above were this capture's, not calls)
        return graph
