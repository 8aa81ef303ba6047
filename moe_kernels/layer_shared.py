"""The shared expert inside a layer: beside the routed experts, or among them as slot ``E``.

A layer built with ``shared_expert="separate"`` keeps the shared FFN apart and runs it as its own two
GEMMs; one built with ``"fused"`` stacks it after the routed experts (expert ``E``, a copy made once, at
load time) and appends it to every token's ids; one built with ``"auto"`` stacks it the same way (one of
the routed width; a wider one, Qwen2-MoE's, stays apart) and, per batch
(:func:`~moe_kernels.kernels.shared_choice.choose_shared_slot`, measured), either appends the slot or
runs the stacked expert ``E`` apart, through views of the stacked tensors: no second copy of its weights.

A shared expert run apart is :class:`SharedApart`: its two GEMMs on the layer's stream after the router, or, while a
CUDA graph is captured and :data:`SHARED_BESIDE` says so, on a side stream forked at the layer's start, where they
run under the router (and the routed experts) instead of after it. A call the package records for its own replays
(:mod:`moe_kernels._replay`) runs it first, on its own inputs, marked: the CUDA graph a replay is captured into runs
that stretch on a side stream forked at the layer's start (:mod:`moe_kernels._replay_fork`), as a captured layer does.

    >>> import torch
    >>> from moe_kernels import MoELayer
    >>> layer = MoELayer.random("deepseek-v3", hidden_size=32, intermediate_size=16, dtype=torch.float32,
    ...                         device="cpu", seed=0, shared_expert="auto")
    >>> w13, w2, _, _ = shared_tensors(layer.weights)
    >>> w13.data_ptr() == layer.weights.w13[256].data_ptr(), tuple(w2.shape)
    (True, (32, 16))
"""

from __future__ import annotations

import torch

from . import _replay_graphs
from ._checks import fail
from ._replay import recording_now
from ._replay_fork import side_stream_stretch
from .kernels.config import TABLE_REACH, ConfigChoice, choose_config, gpu_of
from .kernels.index_gather import dense_expert
from .kernels.routing import router_logits
from .kernels.shared import shared_ffn
from .layer_spec import LayerWeights

#: Up to this many tokens a separate 16/32-bit shared expert runs as the routed experts' two GEMMs
#: on a dense block map (two launches) instead of cuBLAS (two GEMMs and four elementwise torch
#: operations). On the H200 (DeepSeek-V3's 88 MB shared expert, CUDA graphs) the two take the same
#: GPU time at 1-8 tokens (40.2 and 34.8 us against cuBLAS's 36.0 and 36.3) while the six torch
#: operations cost 110-140 us of host time per call; at 64 tokens the dense path's default tiles
#: are 1.6x slower (54.4 against 34.8 us), so larger batches keep cuBLAS. fp8 always runs dense.
DENSE_SHARED_MAX_TOKENS = 16
#: The same limit where a GPU was measured further on its own E=1 table, which it then needs: above
#: ``DENSE_SHARED_MAX_TOKENS`` a shared expert runs dense only on a tuned entry (:func:`dense_shared_choice`). The H100
#: (``bench shared``, DeepSeek-V3 bf16, ``shared-expert-s48.json``: the shared expert alone, not yet in the layer): the
#: dense path took 38.6 and 42.3 us at 32 and 64 tokens against cuBLAS's 45.2 and 47.3, the same at 128 and 256 (44.8
#: against 44.4, 51.0 against 50.9) and more at 512 (92.2 against 71.6).
DENSE_SHARED_MAX_TOKENS_BY_GPU = {"NVIDIA H100 80GB HBM3": 64}


def dense_shared_max_tokens(device_name: str | None) -> int:
    """Up to how many tokens a separate 16/32-bit shared expert may run dense on the GPU named ``device_name``
    (None: off a GPU), not on cuBLAS (above 16 tokens only on a tuned entry: :func:`dense_shared_choice`).

        >>> dense_shared_max_tokens("NVIDIA H100 80GB HBM3"), dense_shared_max_tokens("NVIDIA H200")
        (64, 16)
    """
    return DENSE_SHARED_MAX_TOKENS_BY_GPU.get(device_name, DENSE_SHARED_MAX_TOKENS)


def dense_shared_choice(func: str, w: LayerWeights, num_tokens: int, activation_dtype: torch.dtype, device,
                        device_name: str | None) -> ConfigChoice | None:
    """The tiles of a shared expert run apart on the dense block map (its E=1 table's entry within
    ``TABLE_REACH``, else the default tiles), or None where it runs as cuBLAS GEMMs: fp8 weights always dense;
    16/32-bit ones up to ``DENSE_SHARED_MAX_TOKENS`` tokens, and above that up to the GPU's own
    :func:`dense_shared_max_tokens` on a tuned entry only (the default tiles were slower than cuBLAS there)."""
    quantized = w.format.quantized
    if not quantized and num_tokens > dense_shared_max_tokens(gpu_of(func, device, device_name)[1]):
        return None
    choice = choose_config(num_tokens, 1, shared_tensors(w)[1].shape[1], w.w2.shape[1],
                           w.format.element or activation_dtype, device, device_name=device_name, reach=TABLE_REACH)
    return choice if quantized or num_tokens <= DENSE_SHARED_MAX_TOKENS or choice.source == "table" else None


#: While a CUDA graph is captured (read at each call), where a shared expert run apart goes: None, on the layer's
#: stream after the router (as in an uncaptured call); "experts", on a side stream forked at the layer's start
#: (computing its own gate and quantised activations there), under the router and the routed GEMMs, joined where
#: index-gather's top-k sum reads it (after GEMM 2's launch; after the launch where both GEMMs are one, which then
#: does not add it in its fp32 sum: one addition more) or, in the other layouts, before the launch that adds it.
#: Why: at decode its 44 MB (fp8) stream at the read rate, but in line it cost DeepSeek-V3's fp8 layer 39.2-55.4 us
#: at 1-64 tokens over a 14 us floor on an H100, on the default tiles (``shared-routed-tiles-ab-s44.json``,
#: ``-s44b.json``): two launches' ramps and tails, while the router's few latency-bound programs leave the read
#: bandwidth idle. Forked it cost 19.3-31.5 us at 1-256 tokens (51.7 at 512, over a 38.5 us FLOP floor) against
#: 39.3-51.9 in line (66.0 at 512; ``shared-beside-ab-s45.json``, ``-s45b.json``);
#: joined before the routed GEMMs instead, under the router only, it moved by -4.8 to +4.7 us (that mode is gone).
#: Where the routed GEMMs are one launch (two-phase), the join came before it, under the router only: DeepSeek-V3's
#: bf16 layer at one token saved 5 us (``replay-fork-ab-s46c.json``); it now comes after it. SGLang 0.5.23
#: does the same while it captures a decode graph (``forward_normal_dual_stream``,
#: ``sglang/srt/models/deepseek_v2.py``: forked before the gate, the shared expert issued on the side stream after
#: the routed experts, joined after them). Only inside a capture: an uncaptured call's host time is longer than any
#: overlap. (The package's replays record it first, marked: their own CUDA graph forks it at the layer's start,
#: :mod:`moe_kernels._replay_fork`; a plain replay runs its launches in order on one stream.)
SHARED_BESIDE = "experts"
BESIDE = (None, "experts")
#: The side stream's priority (lower runs first). The default, 0: at -1 the shared expert's programs took SMs from
#: the routed GEMMs as theirs finished, and on the H100 cost DeepSeek-V3's fp8 layer more from 16 tokens up (26.7
#: against 21.9 us at 64 tokens, 32.8 against 24.5 at 256) and 0.3-3.1 us less at 1-8 (-5 as -1); at 0 they queue
#: behind the programs already launched and fill the routed GEMM's last wave (``shared-priority-ab-s46*.json``).
SIDE_PRIORITY = _replay_graphs.FORK_PRIORITY   # (the replays' graphs fork onto a stream of the same priority)
_side_streams = {}   # (device, priority) -> the side stream, made once (one per device: one capture at a time)


def shared_tensors(w: LayerWeights):
    """The shared expert's ``(w13, w2, w13_scale, w2_scale)``: its own tensors, or for stacked weights
    views of expert ``E`` (scales None for 16/32-bit weights)."""
    if w.shared_fused:
        e = w.num_experts
        return (w.w13[e], w.w2[e], None if w.w13_scale is None else w.w13_scale[e],
                None if w.w2_scale is None else w.w2_scale[e])
    return w.shared_w13, w.shared_w2, w.shared_w13_scale, w.shared_w2_scale


def runs_apart(w: LayerWeights, shared_slot: bool) -> bool:
    """Whether a call runs a shared expert on its own GEMMs: one kept apart, or a stacked one this batch does
    not take as a slot."""
    return w.shared_w13 is not None or (w.shared_fused and not shared_slot)


def with_shared_slot(topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: LayerWeights, shared_gate):
    """The router's ``[T, k]`` weights and ids with the shared expert as slot ``k + 1``: id ``E``, weight 1
    (or its sigmoid gate). Made at every call (not kept in the plan): a CUDA graph captures the fill with
    the call."""
    column = torch.ones_like(topk_weights[:, :1]) if shared_gate is None else shared_gate
    return (torch.cat([topk_weights, column], dim=1),
            torch.cat([topk_ids, torch.full_like(topk_ids[:, :1], w.num_experts)], dim=1))


def shared_expert_output(plan, hidden_states: torch.Tensor, w: LayerWeights, shared_gate, activations):
    """The shared expert run apart, ``[T, d]`` (times Qwen2-MoE's sigmoid gate, if any): the routed
    experts' GEMMs (W8A8 in fp8) on a dense block map (one expert, every token: no alignment, no top-k
    sum) with the plan's own tiles, or cuBLAS GEMMs where the plan has none (16/32-bit weights above
    :func:`dense_shared_max_tokens` tokens)."""
    w13, w2, w13_scale, w2_scale = shared_tensors(w)
    if plan.shared_choice is None:
        shared = shared_ffn(hidden_states, w13, w2)
        return shared if shared_gate is None else shared.mul_(shared_gate.to(shared.dtype))
    return dense_expert(hidden_states, w13, w2, fmt=plan.format, config=plan.shared_choice.config,
                        w1_scale=w13_scale, w2_scale=w2_scale, weight=shared_gate, activations=activations)


def forks_here(device, captured: bool | None = None, *, call_bytes: int = 0) -> bool:
    """Whether a shared expert run apart on ``device`` forks onto a side stream: :data:`SHARED_BESIDE` is set and a
    CUDA graph is being captured on the device's current stream, or the call is being recorded for the package's
    replays, whose CUDA graphs fork it (:class:`SharedApart`; unless those graphs are off, or a call whose
    activations are ``call_bytes`` will never have one: its input and output copies past
    ``_replay_graphs.MAX_GRAPH_COPY_BYTES``); or, given, ``captured``: a plan shown as inside a capture or not, on
    any machine. What a plan must know: its slot's crossover differs (so an ``"auto"`` layer's first call of a
    signature, eager, may run the slot where the recorded call and its replays run the shared expert apart: the
    same output up to rounding). Checks the setting."""
    if SHARED_BESIDE not in BESIDE:
        fail("moe_kernels.layer_shared", "SHARED_BESIDE", f"must be one of {BESIDE}", repr(SHARED_BESIDE))
    if SHARED_BESIDE is None or captured is not None:
        return SHARED_BESIDE is not None and bool(captured)
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if recording_now() is not None:
        return _replay_graphs.ENABLED and 2 * call_bytes <= _replay_graphs.MAX_GRAPH_COPY_BYTES
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def shared_gate_of(hidden_states: torch.Tensor, w: LayerWeights):
    """Qwen2-MoE's sigmoid gate on its shared expert, ``[T, 1]``, or None (no gate)."""
    return None if w.shared_gate is None else torch.sigmoid(router_logits(hidden_states, w.shared_gate))


class SharedApart:
    """A shared expert run apart (:func:`shared_expert_output`): in line, where :meth:`run_in_line` is called (after
    the router, on the gate and the quantised activations the routed experts read), or, where :func:`forks_here`,
    on a side stream from its construction to its join (computing its gate and activations there), or, in a call
    recorded for the package's replays, on the layer's stream at its construction, the same way, marked. :meth:`for_sum`
    hands the output to index-gather's top-k sum (a callable that joins, when forked); :meth:`add_to` adds it to
    another layout's output.

    Memory: the side stream reads ``hidden_states`` and the weights (kept alive by ``self.run`` until the join) and
    allocates from the capture's pool; its output, freed on the side stream, can only be reused by a later side
    allocation, which comes after the next fork, which waits for the main stream."""

    def __init__(self, plan, hidden_states: torch.Tensor, w: LayerWeights):
        self.run = (plan, hidden_states, w)
        self.side, self.output, self.summed, self.recorded_first = None, None, False, False
        if SHARED_BESIDE is not None and hidden_states.is_cuda:
            key = (hidden_states.device, SIDE_PRIORITY)
            if key not in _side_streams:   # (made outside a capture where it can: the warm-up before one)
                _side_streams[key] = torch.cuda.Stream(hidden_states.device, priority=SIDE_PRIORITY)
            if forks_here(hidden_states.device, call_bytes=hidden_states.nbytes):
                self.recorded_first = recording_now() is not None
                self.side = None if self.recorded_first else _side_streams[key]
        if self.side is not None:   # the fork: the side stream starts after everything before the layer
            self.side.wait_stream(torch.cuda.current_stream(hidden_states.device))
            with torch.cuda.stream(self.side):
                self.output = shared_expert_output(plan, hidden_states, w, shared_gate_of(hidden_states, w), None)
        elif self.recorded_first:
            # Recorded for the package's replays: first, on its own gate and activations, marked, so that the
            # replay's CUDA graph forks it where a captured layer does, at the layer's start (_replay_fork).
            with side_stream_stretch(recording_now()):
                self.output = shared_expert_output(plan, hidden_states, w, shared_gate_of(hidden_states, w), None)

    @property
    def own_inputs(self) -> bool:
        """Whether it computes its own gate and activations (forked, or recorded first): the layer's need not."""
        return self.side is not None or self.recorded_first

    def run_in_line(self, shared_gate, activations) -> None:
        if not self.own_inputs:
            self.output = shared_expert_output(*self.run, shared_gate, activations)

    def join(self) -> torch.Tensor:
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.side = None
        return self.output

    def for_sum(self):
        """The output for index-gather's top-k sum to add, as a callable that joins (where forked) and returns it,
        which :func:`~moe_kernels.kernels.index_gather.run_experts` calls where the sum needs it: after GEMM 2's
        launch, or after the launch where both GEMMs are one (added then, not in its kernel). Always a callable, so
        that a call in line, a recorded one (the replays' graph joins at that call) and a forked one add it the same
        way, to the same bits."""
        self.summed = True
        return self.join

    def add_to(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.summed else out.add_(self.join())
