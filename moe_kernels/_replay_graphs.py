"""A replayed call as one CUDA graph: the host work of a decode call down to a few API calls.

A replay (:mod:`moe_kernels._replay`) still launches every kernel from Python: an fp8 call is five
to seven launches at 9-15 microseconds of host time each on the H200's host, 80-130 us in all,
against 30-40 us of GPU time at batch 1. A CUDA graph launches them all with one call. So when a
plan has been replayed once on a set of *pinned* inputs (the weights, which the caller keeps in
place), the next call with the same weights (the fourth of the signature) captures the replay
into a graph, and from then on a call is:

1. copy each *copied* input (the activations, ids and routing weights, which are new tensors at
   every call) into a static buffer the graph reads;
2. ``graph.replay()`` on the caller's current stream;
3. clone the graph's static output: the caller gets a fresh tensor, as from every other path.

About five host API calls whatever the number of kernels. Pinned inputs are read where they are:
a graph is kept per tuple of their addresses (a model's layers call one plan with 48 different
weight sets: 48 graphs), so a call whose weights sit elsewhere takes another graph or the plain
replay, never a stale address. (An entry point that pins nothing, like ``MoELayer``, has its
weights as the plan's constants.) An entry point must not write into its copied inputs: the
graph would write the static copy.

**Memory.** The graphs of one (device, stream) allocate their intermediates from one private
pool, shared: safe because nothing outlives a replay in the pool. Each graph's last nodes copy
its result into a static output buffer outside the pool (one per plan and stream), the call
clones that buffer before it lets go of the plan's lock, and the static inputs are outside the
pool too; replays of one stream run one after another. So a stream's graphs hold one working
set (the largest captured plan's intermediates, kept until that stream's last graph goes, which
``torch.cuda.empty_cache`` cannot return), beside what the caching allocator already keeps from
the eager calls. Plans above :data:`MAX_GRAPH_BYTES` of intermediates keep the plain replay, and so
do plans whose copied inputs and output exceed :data:`MAX_GRAPH_COPY_BYTES` (prefill: the copies cost
the device more than the host time a graph saves, which the device's own time hides there). The
static inputs and outputs add up over plans (a server's many prefill lengths): they share a
budget, :data:`MAX_STATIC_BYTES` per process, and a new graph that needs room first drops the
graphs of the plans used least recently (a dropped plan waits longer before it captures again,
so that two plans that do not fit together do not recapture at every call).

**When not.** Out of memory, a call replays plainly and tries again later. A capture that fails
otherwise (an operation a capture does not allow) leaves that plan and stream with the plain
replay for good, and, if CUDA rejected the capture, the whole stream (its pool may be left
unusable). A copied input whose elements overlap (``expand``) or a result that shares an input's
memory never graphs. A call on another stream builds its own static buffers and graphs; a lock
per (plan, stream) keeps two threads' copy-replay-clone sequences apart, and one capture runs at
a time in the process. ``MOE_KERNELS_REPLAY_GRAPHS=0`` turns graphs off (the plain replay
remains).

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

#: Plans whose intermediates (every buffer the call makes, counted once per storage) exceed this
#: many bytes keep the plain replay. DeepSeek-V3's layer at 16,384 tokens makes about 3.3 GB.
MAX_GRAPH_BYTES = int(os.environ.get("MOE_KERNELS_REPLAY_GRAPH_MAX_MB", 4096)) * 2**20
#: Plans whose copied inputs and output exceed this many bytes keep the plain replay. A graph's call
#: copies them three times (the inputs into the static buffers, the result into the static output, the
#: clone), moving about three times these bytes twice (read and write) on the device, to save the plain
#: replay's host time, 80-130 us, which only shows where the device would otherwise wait for the host:
#: calls of a few hundred microseconds or less. At 8 MiB (Qwen3-30B-A3B about 1,000 tokens in bf16,
#: DeepSeek-V3 about 290) the copies take some 8 us and the call's device time is already over 300 us;
#: at 16,384 tokens they took 133 us (Qwen3-30B-A3B, bf16) and 462 us (DeepSeek-V3, fp8) of an H100's
#: time a call (``results/nvidia-h100-80gb-hbm3/layer-profile-s35.json``), 3-5% of the layer.
MAX_GRAPH_COPY_BYTES = int(os.environ.get("MOE_KERNELS_REPLAY_GRAPH_MAX_COPY_MB", 8)) * 2**20
#: Static input and output buffers kept for graphs, over all plans and streams of the process.
MAX_STATIC_BYTES = 4 * 2**30
#: Graphs per plan and stream (one per set of pinned addresses) before new ones stop being made.
MAX_GRAPHS_PER_PLAN = 256
#: Replays on the same pinned addresses, the capturing one included, before a graph exists: 2 is
#: one plain replay, then the capture (a one-off call never pays for a capture).
REPLAYS_BEFORE_GRAPH = 2
ENABLED = os.environ.get("MOE_KERNELS_REPLAY_GRAPHS", "1") != "0"
#: The priority of the stream a captured replay forks a marked stretch onto, and of the stream a captured layer forks
#: its shared expert onto (``layer_shared.SIDE_PRIORITY``, which says why it is the default).
FORK_PRIORITY = 0

_lock = threading.RLock()   # the budget and the capture sides (reentrant: a finalizer may run under it)
_capture_lock = threading.Lock()   # one capture at a time in the process (captures are rare)
static_bytes = 0            # held by the static buffers of every live plan (see MAX_STATIC_BYTES)
_holders = collections.OrderedDict()   # id -> weakref to a _StreamGraphs holding static bytes, least recent first
_captures = {}              # (device, stream pointer) -> _CaptureSide
_broken = set()             # (device, stream pointer) where a capture failed: no more graphs there


def split_inputs(num_inputs: int, pinned) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The positions of the inputs a graph copies, and of those it reads in place."""
    pinned = tuple(sorted(set(pinned)))
    return tuple(i for i in range(num_inputs) if i not in pinned), pinned


class _CaptureSide:
    """Where the graphs of one (device, stream) are captured: a side stream (the legacy default
    stream cannot be captured), a lock, and the live graphs, whose pool the next capture shares.
    (A pool whose last graph is gone cannot be captured into again, so the pool is always taken
    from a live graph, or a fresh one is made.)"""

    def __init__(self, device: int):
        self.stream = torch.cuda.Stream(device=device)
        #: where a plan's marked stretch runs inside its graph (moe_kernels._replay_fork), made here, outside a capture
        self.fork_stream = torch.cuda.Stream(device=device, priority=FORK_PRIORITY)
        self.graphs = weakref.WeakSet()
        self.warm_threads = set()

    def live_graph(self):
        """A live graph of this side (whose pool a new capture shares), or None."""
        for graph in list(self.graphs):
            return graph
        return None

    def warm_up(self) -> None:
        """torch gives each thread its own cuBLAS handle, and each (handle, stream) its own
        workspace, made at the first product there. Made inside a capture, the handle fails it and
        the workspace lands in the graph's pool for good: so each thread that captures here first
        runs one small product per dtype (and one with a bias, cuBLASLt's path) on the side stream."""
        thread = threading.get_ident()
        if thread in self.warm_threads:
            return
        for stream in (self.stream, self.fork_stream):   # (a shared expert's cuBLAS products run on the fork's)
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            with torch.cuda.stream(stream):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    a = torch.ones(16, 16, device=stream.device, dtype=dtype)
                    torch.mm(a, a)
                    torch.addmm(a[0], a, a)
                    if dtype != torch.float32:
                        try:   # (the gate's float32-output product, where torch has it)
                            torch.mm(a, a, out_dtype=torch.float32)
                        except (TypeError, RuntimeError):
                            pass
        self.warm_threads.add(thread)


def _capture_side(device: int, stream_ptr: int) -> _CaptureSide:
    with _lock:
        side = _captures.get((device, stream_ptr))
        if side is None:
            side = _captures[(device, stream_ptr)] = _CaptureSide(device)
        return side


def _give_back(cell: list, key: int) -> None:
    """Return the static bytes a _StreamGraphs held (when it is dropped, or when it goes)."""
    global static_bytes
    with _lock:
        static_bytes -= cell[0]
        cell[0] = 0
        _holders.pop(key, None)


class _StreamGraphs:
    """One plan's graphs on one stream: the static inputs and outputs, and a graph per set of
    pinned addresses."""

    def __init__(self, device: int, stream_ptr: int):
        self.device, self.stream_ptr = device, stream_ptr
        self.static_inputs = None   # position -> tensor, for the copied inputs
        self.static_outputs = None  # the clones' sources, outside the pool
        self.graphs = {}            # pinned addresses -> torch.cuda.CUDAGraph
        self.seen = {}              # pinned addresses -> plain replays so far without a graph
        self.backoff = 0            # extra replays to wait before a capture, after a drop or a refusal
        self.refusal = None         # why this plan never graphs on this stream
        self.lock = threading.Lock()
        self.held = [0]             # static bytes counted against MAX_STATIC_BYTES
        weakref.finalize(self, _give_back, self.held, id(self))

    def drop(self) -> None:
        """Forget the graphs and static buffers (to make room for others; rebuilt if used again,
        after a longer wait). The caller holds ``self.lock``."""
        self.static_inputs = self.static_outputs = None
        self.graphs, self.seen = {}, {}
        self.backoff = min(256, 2 * self.backoff + 16)
        _give_back(self.held, id(self))


def _reserve(streams: _StreamGraphs, nbytes: int) -> bool:
    """Count ``nbytes`` of static buffers for ``streams`` against MAX_STATIC_BYTES, dropping the
    graphs of the plans used least recently if that makes them fit, and nothing if it would not.
    The caller holds ``streams.lock``."""
    global static_bytes
    with _lock:
        if static_bytes + nbytes > MAX_STATIC_BYTES:
            chosen, freeing = [], 0
            for key in list(_holders):
                if static_bytes - freeing + nbytes <= MAX_STATIC_BYTES:
                    break
                ref = _holders.get(key)
                other = None if ref is None else ref()
                # (a plan replaying in another thread keeps its graphs: its lock is not waited for)
                if other is not None and other is not streams and other.lock.acquire(blocking=False):
                    chosen.append(other)
                    freeing += other.held[0]
            fits = static_bytes - freeing + nbytes <= MAX_STATIC_BYTES
            for other in chosen:
                try:
                    if fits:
                        other.drop()
                finally:
                    other.lock.release()
            if not fits:
                return False
        static_bytes += nbytes
        streams.held[0] += nbytes
        _holders[id(streams)] = weakref.ref(streams)
        return True


class PlanGraphs:
    """The CUDA graphs of one :class:`~moe_kernels._replay.Plan` (see the module docstring). It
    holds no reference to the plan (the plan holds it), so that a forgotten plan and its weights
    go at once, not at the next cyclic garbage collection."""

    def __init__(self, plan, pinned):
        self.copied, self.pinned = split_inputs(plan.num_inputs, pinned)
        self.output_specs = plan.output_specs
        self.by_stream = {}
        self.refusal = None   # why this plan never graphs
        if plan.returns_input_memory:
            self.refusal = "the result shares memory with an input"
        elif plan.graph_bytes > MAX_GRAPH_BYTES:
            self.refusal = f"{plan.graph_bytes} bytes of intermediates, above MAX_GRAPH_BYTES"

    def __call__(self, plan, tensors):
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
        if streams.refusal is not None or (device, stream_ptr) in _broken:
            return None
        pinned = tuple(None if tensors[i] is None else tensors[i].data_ptr() for i in self.pinned)
        with streams.lock:
            graph = streams.graphs.get(pinned)
            if graph is None:
                seen = streams.seen.get(pinned, 0) + 1
                if seen < REPLAYS_BEFORE_GRAPH + streams.backoff or len(streams.graphs) >= MAX_GRAPHS_PER_PLAN:
                    if len(streams.seen) < 4 * MAX_GRAPHS_PER_PLAN:
                        streams.seen[pinned] = seen
                    return None
                streams.seen.pop(pinned, None)
                graph = self._new_graph(plan, streams, tensors, pinned)
                if graph is None:
                    return None
            elif _holders:
                try:
                    _holders.move_to_end(id(streams))   # the most recently used: dropped last
                except KeyError:
                    pass
            static = streams.static_inputs
            for i in self.copied:
                if tensors[i] is not None:
                    static[i].copy_(tensors[i])
            graph.replay()
            plan.replays += 1
            outputs = tuple(t.clone() for t in streams.static_outputs)
        return outputs if plan.many else outputs[0]

    def _new_graph(self, plan, streams: _StreamGraphs, tensors, pinned):
        """Make the stream's static buffers if it has none, capture a graph on ``pinned``; None
        (and the plain replay) when the budget or the GPU's memory has no room now, or the capture
        fails."""
        if streams.static_inputs is None:
            copied = [tensors[i] for i in self.copied if tensors[i] is not None]
            if any(torch._debug_has_internal_overlap(t) != 0 for t in copied):   # e.g. an expand()ed input
                streams.refusal = "a copied input has overlapping elements"
                return None
            nbytes = sum(t.nbytes for t in copied) + sum(dtype.itemsize * _numel(shape)
                                                          for shape, _, dtype in self.output_specs)
            if nbytes > MAX_GRAPH_COPY_BYTES:   # (the shapes are the plan's: for good)
                self.refusal = f"{nbytes} bytes of copied inputs and outputs, above MAX_GRAPH_COPY_BYTES"
                return None
            if not _reserve(streams, nbytes):
                streams.backoff = min(256, 2 * streams.backoff + 16)
                return None
            try:
                with torch.inference_mode(False):   # (an inference tensor could not be written outside it)
                    streams.static_inputs = {i: torch.empty_strided(tensors[i].shape, tensors[i].stride(),
                                                                    dtype=tensors[i].dtype, device=tensors[i].device)
                                             for i in self.copied if tensors[i] is not None}
                    streams.static_outputs = tuple(torch.empty_strided(shape, stride, dtype=dtype,
                                                                       device=tensors[0].device)
                                                   for shape, stride, dtype in self.output_specs)
            except torch.OutOfMemoryError:   # no room now: the plain replay, and a later try
                streams.drop()
                return None
        try:
            graph = _capture(plan, streams, tensors, self.copied)
        except torch.OutOfMemoryError:
            streams.drop()
            return None
        except Exception as error:  # noqa: BLE001 - any failure leaves the plain replay, which works
            streams.drop()
            cause = error.__context__ or error   # (capture_end's own error hides the first one)
            streams.refusal = f"the capture failed: {type(cause).__name__}: {str(cause)[:200]}"
            return None
        streams.graphs[pinned] = graph
        streams.backoff //= 2
        return graph


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _capture(plan, streams: _StreamGraphs, tensors, copied):
    """Capture the plan's replay on the stream's static inputs and this call's pinned ones, its
    result copied into the static outputs, on the stream's capture side."""
    args = [streams.static_inputs.get(i) if i in copied else tensors[i] for i in range(plan.num_inputs)]
    where = (streams.device, streams.stream_ptr)
    side = _capture_side(*where)
    if side.stream.cuda_stream == streams.stream_ptr:   # (torch's stream pool gave the caller's stream)
        raise RuntimeError("the capture stream is the caller's stream")
    with _capture_lock:
        side.warm_up()
        current = torch.cuda.current_stream()
        side.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        live = side.live_graph()   # (kept referenced until the capture ends: its pool must stay alive)
        pool = torch.cuda.graph_pool_handle() if live is None else live.pool()
        with torch.cuda.stream(side.stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                results = plan.replay(args, fork=side.fork_stream)   # (a marked stretch runs there)
                for static, result in zip(streams.static_outputs, results if plan.many else (results,)):
                    static.copy_(result)   # out of the pool: nothing of this call stays there
                del results
            except BaseException:
                _end_failed_capture(graph, where, pool)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _end_failed_capture(None, where, pool)
                raise
        current.wait_stream(side.stream)
        side.graphs.add(graph)
        del live
    plan.replays -= 1   # (the captured replay ran nothing)
    return graph


def _end_failed_capture(graph, where, pool) -> None:
    """After a capture failed: end it (if ``graph``: the error was raised while capturing). If
    CUDA rejects the capture, ``capture_end`` raises before it tells torch's allocator to stop
    allocating this stream's memory into ``pool``: that is done here, and the stream takes no more
    graphs (its pool may be left in a state no later capture should share)."""
    if graph is not None:
        try:
            graph.capture_end()
            return   # (ended cleanly: the pool is as good as before)
        except Exception:  # noqa: BLE001 - (the allocator is cleaned up below)
            pass
    _broken.add(where)
    with _lock:
        _captures.pop(where, None)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is not None and release is not None:
        try:
            end(where[0], pool)
            release(where[0], pool)
        except Exception:  # noqa: BLE001 - already ended: nothing was left allocating into the pool
            pass
