"""One whole MoE layer: gate -> routing -> alignment -> grouped GEMMs -> top-k sum -> shared expert.

:func:`moe_layer` is the function, :class:`MoELayer` the ``nn.Module`` that holds a real model's
weights and routing rules. Two model styles cover the chapter:

* Qwen3-30B-A3B: softmax over 128 experts, top-8, the 8 weights renormalised, no shared expert;
* DeepSeek-V3: sigmoid scores plus a selection-only correction bias, 8 groups of which the best 4
  are kept, top-8 inside them, renormalised and scaled by 2.5, plus one shared expert, run as a
  separate dense FFN (vLLM) or fused into the grouped GEMM as expert ``E`` (SGLang).

Any of the three grouped-GEMM layouts runs the experts (``layout``: ``"index_gather"``, ``"permute"``, ``"masked"``;
:mod:`moe_kernels.kernels.layouts` says which runs which weight format, and a layer that asks for an impossible pair
is refused when it is built). The routing comes from this package's own kernels, so its ids are in range by
construction: the layer skips the id check and never synchronises with the host on a GPU, so a decode step can be
captured in a CUDA graph.

Checks are paid once. The weights are checked when they are built (:class:`LayerWeights`), the routing rules against
them when the layer is built, and what a call at ``T`` tokens will run (:class:`LayerPlan`: the layout, the weight
format, the tiles and the table entry they came from, the block map) is chosen at the first call with ``T`` tokens
and kept; later calls check only the activations' shape, dtype and device. :meth:`MoELayer.plan` shows the plan
without running anything, which is how the tests pin the path an fp8 layer takes.

    >>> import torch
    >>> layer = MoELayer.random("deepseek-v3", hidden_size=32, intermediate_size=16,
    ...                         dtype=torch.float32, device="cpu", seed=0)
    >>> x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    >>> out = layer(x)
    >>> out.shape, layer.routing.num_expert_group, layer.weights.num_experts
    (torch.Size([5, 32]), 8, 256)
    >>> bool(torch.linalg.norm(out.double() - layer.reference(x)) / torch.linalg.norm(layer.reference(x)) < 1e-5)
    True
"""

from __future__ import annotations

import dataclasses

import torch

from ._checks import FLOAT_DTYPES, check_bool, check_device, check_dtype, check_int, check_number, fail
from ._replay import CallPlans
from .checkpoint import load_layer
from .layer_router import choose_router, choose_tile_router, gemm1_follows_router, route
from .kernels.config import ConfigChoice, MoEConfig, check_config
from .kernels.blocks import use_naive_block_assignment
from .kernels.config import choose_config, choose_fused_shared_config
from .kernels.formats import WeightFormat
from .kernels.index_gather import run_experts
from .kernels.one_launch import runs_in_one_launch
from .kernels.layout_choice import AUTO, check_layout, choose_layout
from .kernels.layouts import LAYOUTS
from .kernels.permute_gluon import refusal as gluon_refusal
from .kernels.routing import router_logits
from .kernels.shared_choice import choose_shared_slot
from .layer_shared import SharedApart, dense_shared_choice, forks_here, runs_apart, shared_gate_of, with_shared_slot
from .layer_spec import LayerWeights, Routing, check_hidden
from .model.buffers import m_max_token_budget
from .model.shapes import MODELS, MoEModel
from .reference import moe_reference, moe_reference_fp8

SHARED_EXPERT = ("separate", "fused", AUTO)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one call at ``num_tokens`` tokens runs, fixed before it runs: the layout, the weight
    format, the tiles (``choice``: the config and the table entry it came from) and, for the
    index-gather layout, whether the block map is the naive one (no alignment kernel)."""

    num_tokens: int
    layout: str
    format: WeightFormat
    choice: ConfigChoice
    naive_blocks: bool | None
    #: The tiles of a shared expert run apart on the dense block map (one expert, every
    #: token: its own table lookup; fp8 always, 16/32-bit as ``layer_shared.dense_shared_choice`` says);
    #: None when the shared expert runs as cuBLAS GEMMs, as a slot, or there is none.
    shared_choice: ConfigChoice | None = None
    #: The gate and the routing in one router (:mod:`moe_kernels.layer_router`: one launch up to
    #: ``GATE_ROUTING_MAX_TOKENS``, or ``chained`` launches up to ``CHAINED_ROUTER_MAX_TOKENS``), and the alignment too
    #: (``gate_alignment``: an aligned index-gather map, no fused shared slot, which would change the
    #: ids after the routing, at most the router's ``ALIGN_MAX_ASSIGNMENTS`` assignments).
    gate_routing: bool = False
    gate_alignment: bool = False
    chained: bool = False
    #: The permute layout's segment rows and GEMM kernel where the measured choice names them (None: the
    #: call's defaults, 128 rows and the ``permute_gluon`` switch).
    align: int | None = None
    gemm: str | None = None
    #: A stacked shared expert (``shared_expert`` "fused" or "auto") as slot k+1 of the routed GEMMs this batch.
    shared_slot: bool = False
    #: At prefill, gate and routing as one launch of whole-E tiles (layer_router.choose_tile_router).
    tile_router: bool = False

    @property
    def config(self) -> MoEConfig:
        return self.choice.config


def plan_layer(func: str, weights: LayerWeights, routing: Routing, layout: str, num_tokens: int,
               activation_dtype: torch.dtype, device: torch.device, *, config: MoEConfig | None = None,
               device_name: str | None = None, shared_expert: str | None = None,
               captured: bool | None = None) -> LayerPlan:
    """The :class:`LayerPlan` of a call (``config`` given: that config, checked for ``layout``;
    ``layout="auto"``: :func:`~moe_kernels.kernels.layout_choice.choose_layout`'s layout and tiles;
    ``shared_expert="auto"``: a stacked shared expert as a slot where
    :func:`~moe_kernels.kernels.shared_choice.choose_shared_slot` says so, else always, if stacked, with the
    crossover of a forked shared expert where one would fork: ``layer_shared.forks_here(device, captured)``)."""
    e, f, d = weights.num_experts, weights.w2.shape[2], weights.w2.shape[1]
    table_dtype = weights.format.element or activation_dtype
    slot = weights.shared_fused and (shared_expert != AUTO or choose_shared_slot(   # (forked: its own crossover)
        num_tokens, e, f, d, weights.format.name, device, device_name=device_name,
        beside=forks_here(device, captured, call_bytes=num_tokens * d * activation_dtype.itemsize)))
    measured = None
    if layout == AUTO:   # measured for the routed experts alone, with the layer's own tiles: only then
        picked = (choose_layout(num_tokens, e, f, d, weights.format.name, device, device_name=device_name)
                  if config is None and not (slot and shared_expert != AUTO) else None)
        # measured with the Gluon GEMMs (the Triton ones lost to index-gather there): only where they run (for
        # device_name, on that GPU), with these weights, activations and segments
        if picked is not None and picked.gemm == "gluon" and gluon_refusal(
                weights.format, picked.align, activation_dtype, weights.w13, weights.w2,
                None if device_name is not None else device):
            picked = None
        layout = picked.layout if picked is not None else "index_gather"
        measured = picked if picked is not None and picked.config is not None else None
    if shared_expert == AUTO and layout != "index_gather":
        slot = False   # (the slot's crossover was measured on index-gather only)
    measured = None if slot else measured
    m = m_max_token_budget(num_tokens) if layout == "masked" else num_tokens
    choose = choose_fused_shared_config if slot else choose_config   # (slot E: its own table near its entries)
    choice = choose(m, e, f, d, table_dtype, device, layout=layout, device_name=device_name)
    if measured is not None:   # the tiles the crossover was measured with
        choice = ConfigChoice(measured.config, "layout-choice", choice.asked, "layout-choices", measured.from_tokens)
    if config is not None:
        choice = ConfigChoice(check_config(func, config, layout=layout), "argument", choice.asked)
    naive = (use_naive_block_assignment(num_tokens, routing.top_k + slot, e + slot,   # (the slot: one more expert
                                        block_fp8=weights.format.scales == "block")   # and one more top-k)
             if layout == "index_gather" else None)
    shared_choice = (dense_shared_choice(func, weights, num_tokens, activation_dtype, device, device_name)
                     if runs_apart(weights, slot) else None)
    # The router (moe_kernels.layer_router): the two steps, or one router that may align the ids too.
    router = choose_router(num_tokens, weights.gate.dtype == activation_dtype, routing.top_k,
                           naive is False and not slot and not runs_in_one_launch(choice.config, weights.format))
    tiled = choose_tile_router(num_tokens, weights.gate.dtype == activation_dtype, router[0], e)
    permute = (measured.align, measured.gemm) if measured is not None else (None, None)
    return LayerPlan(num_tokens, layout, weights.format, choice, naive, shared_choice, *router, *permute, slot,
                     tiled)


def run_layer(plan: LayerPlan, hidden_states: torch.Tensor, weights: LayerWeights, routing: Routing) -> torch.Tensor:
    """One checked call: gate, routing, (the shared slot), (the shared expert), the experts."""
    w, fmt = weights, plan.format
    apart, in_gemm = runs_apart(w, plan.shared_slot), plan.layout == "index_gather"
    shared = SharedApart(plan, hidden_states, w) if apart else None   # (forked onto a side stream here if captured)
    forked = shared is not None and shared.own_inputs   # (forked, or recorded first for a replay's graph to fork)
    # fp8: the routed and the shared experts read the same quantised activations; quantise once.
    # (both GEMMs in one launch read the unquantised activations: quantised only for a shared expert in line)
    quantize = fmt.quantized and in_gemm and (not runs_in_one_launch(plan.config, fmt) or apart and not forked)
    after_router = gemm1_follows_router(plan, quantize=quantize, launches_between=not forked and (
        shared is not None or w.shared_gate is not None))   # (a shared expert in line, a shared gate)
    topk_weights, topk_ids, blocks = route(plan, hidden_states, w, routing, launch_next=after_router)
    shared_gate = None if forked else shared_gate_of(hidden_states, w)
    if plan.shared_slot:   # the shared expert as slot k+1, id E, weight 1 (or its gate): routed weights are scaled
        topk_weights, topk_ids = with_shared_slot(topk_weights, topk_ids, w, shared_gate)
    activations = fmt.quantize_activations(hidden_states) if quantize else None
    if shared is not None:   # (in line, unless forked: its two GEMMs here, before the experts)
        shared.run_in_line(shared_gate, activations)
    if in_gemm:   # the shared output joins the top-k sum (no separate addition)
        return run_experts(hidden_states, w.w13, w.w2, topk_weights, topk_ids, fmt=fmt, config=plan.config,
                           w1_scale=w.w13_scale, w2_scale=w.w2_scale, naive=plan.naive_blocks, ids="trusted",
                           func="MoELayer", activations=activations, add=shared and shared.for_sum(), blocks=blocks,
                           after_router=after_router)
    scales = dict(w1_scale=w.w13_scale, w2_scale=w.w2_scale) if fmt.quantized else {}
    measured = {name: value for name, value in (("align", plan.align), ("gemm", plan.gemm)) if value is not None}
    out = LAYOUTS[plan.layout].experts()(hidden_states, w.w13, w.w2, topk_weights, topk_ids, config=plan.config,
                                         validate_ids=False, **scales, **measured)
    return out if shared is None else shared.add_to(out)


def moe_layer(hidden_states: torch.Tensor, weights: LayerWeights, *, routing: Routing,
              layout: str = "index_gather", config: MoEConfig | None = None) -> torch.Tensor:
    """The MoE layer's output ``[T, d]`` (the residual add is outside the layer).

    ``config`` overrides the grouped GEMMs' tiles (default: the tuned table for the routed shape,
    else the heuristic); ``layout`` picks the grouped-GEMM layout (``"auto"``: by batch). The
    function form checks the routing rules and plans at every call; :class:`MoELayer` does both once.
    """
    func = "moe_layer"
    if not isinstance(weights, LayerWeights):
        fail(func, "weights", "must be a LayerWeights", type(weights).__name__, TypeError)
    if not isinstance(routing, Routing):
        fail(func, "routing", "must be a Routing", type(routing).__name__, TypeError)
    check_layout(func, layout, weights.format)
    check_hidden(func, hidden_states, weights)
    routing.check_against(func, weights.gate, weights.bias)
    plan = plan_layer(func, weights, routing, layout, hidden_states.shape[0], hidden_states.dtype,
                      hidden_states.device, config=config)
    return run_layer(plan, hidden_states, weights, routing)


class MoELayer(torch.nn.Module):
    """A real model's MoE layer: its tensors (as buffers: inference only) and its routing rules.

    ``layout`` picks the grouped-GEMM layout (``"auto"``: by batch, from measured crossovers,
    :mod:`moe_kernels.kernels.layout_choice`); ``shared_expert`` (``"separate"``, ``"fused"`` or ``"auto"``:
    by batch, from measured crossovers, :mod:`moe_kernels.kernels.shared_choice`; :mod:`moe_kernels.layer_shared`)
    how a shared expert runs ("fused" and "auto" stack it after the routed experts: a copy of the expert
    tensors, made when the layer is built, which holds both until the unstacked ones are let go). Build one
    with :meth:`random` (random weights) or :meth:`from_pretrained_layer` (a Hugging Face checkpoint's layer).
    """

    def __init__(self, weights: LayerWeights, routing: Routing, *, layout: str = "index_gather",
                 shared_expert: str = "separate"):
        super().__init__()
        func = "MoELayer"
        if not isinstance(weights, LayerWeights):
            fail(func, "weights", "must be a LayerWeights", type(weights).__name__, TypeError)
        if not isinstance(routing, Routing):
            fail(func, "routing", "must be a Routing", type(routing).__name__, TypeError)
        check_layout(func, layout, weights.format)
        if shared_expert not in SHARED_EXPERT:
            fail(func, "shared_expert", "must be 'separate', 'fused' or 'auto'", repr(shared_expert))
        routing.check_against(func, weights.gate, weights.bias)
        self.routing, self.layout, self.shared_expert = routing, layout, shared_expert
        self._fields = [f.name for f in dataclasses.fields(LayerWeights) if f.init and f.name != "shared_fused"]
        # ("auto" stacks only a shared expert of the routed width; a wider one, Qwen2-MoE's, runs apart)
        stackable = weights.shared_w13 is None or weights.shared_w13.shape == weights.w13.shape[1:]
        weights = weights.fuse_shared() if shared_expert == "fused" or (shared_expert == AUTO and stackable) \
            else weights
        self._shared_fused = weights.shared_fused
        for name in self._fields:
            self.register_buffer(name, getattr(weights, name))
        self._checked = weights   # the LayerWeights of these buffers, checked; None once they change
        self._plans: dict = {}
        self._replays = CallPlans("MoELayer")   # recorded calls (moe_kernels._replay), forgotten with the plans

    @property
    def weights(self) -> LayerWeights:
        """The layer's tensors as a checked :class:`LayerWeights` (rebuilt, and so re-checked,
        only after the buffers changed: ``.to()``, ``.cuda()``, assignment)."""
        if self._checked is None:
            weights = LayerWeights(**{name: getattr(self, name) for name in self._fields},
                                   shared_fused=self._shared_fused)
            if not isinstance(self.routing, Routing):
                fail("MoELayer", "routing", "must be a Routing", type(self.routing).__name__, TypeError)
            check_layout("MoELayer", self.layout, weights.format)
            self.routing.check_against("MoELayer", weights.gate, weights.bias)
            self._checked, self._plans = weights, {}
            self._replays.clear()
        return self._checked

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half() replace the buffers: check them again at the next call.
        out = super()._apply(fn, *args, **kwargs)
        self._checked = None
        self._replays.clear()   # (the plans hold the old tensors: let them go now)
        return out

    def __setattr__(self, name, value):
        # New buffers, routing rules or layout: checked, and planned, again at the next call.
        if name in ("routing", "layout") or name in self.__dict__.get("_fields", ()):
            self.__dict__["_checked"] = None
            if "_replays" in self.__dict__:
                self._replays.clear()
        if name == "shared_expert" and "shared_expert" in self.__dict__:
            fail("MoELayer", "shared_expert", "must be chosen when the layer is built (fusing copies the weights)",
                 repr(value))
        super().__setattr__(name, value)

    def plan(self, num_tokens: int, *, dtype: torch.dtype | None = None, device=None,
             device_name: str | None = None, captured: bool = False) -> LayerPlan:
        """What a call with ``num_tokens`` tokens of ``dtype`` (default: the experts' dtype, bf16
        for fp8 experts) runs on ``device`` (default: the layer's), chosen and cached at the
        first call. ``device_name`` shows the plan as on that GPU (no cache; nothing runs); ``captured``, as
        inside a CUDA-graph capture (a shared expert apart forks: :mod:`moe_kernels.layer_shared`)."""
        func = "MoELayer.plan"
        check_int(func, "num_tokens", num_tokens, lo=0)
        weights = self.weights
        dtype = dtype or (torch.bfloat16 if weights.format.quantized else weights.w13.dtype)
        check_dtype(func, "dtype", dtype, FLOAT_DTYPES)
        device = weights.gate.device if device is None else torch.device(device)
        check_bool(func, "captured", captured)
        if device_name is not None or captured:
            return plan_layer(func, weights, self.routing, self.layout, num_tokens, dtype, device,
                              device_name=device_name, shared_expert=self.shared_expert, captured=captured)
        return self._plan(num_tokens, dtype, device)

    def _plan(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> LayerPlan:
        key = (num_tokens, dtype, device,   # (inside a capture, or recorded, a plan may differ)
               forks_here(device, call_bytes=num_tokens * self.weights.w2.shape[1] * dtype.itemsize))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 512:   # many batch sizes (prefill): keep the cache bounded
                self._plans.clear()
            plan = self._plans[key] = plan_layer("MoELayer", self.weights, self.routing, self.layout, num_tokens,
                                                 dtype, device, shared_expert=self.shared_expert)
        return plan

    def forward(self, hidden_states: torch.Tensor, *, config: MoEConfig | None = None) -> torch.Tensor:
        weights = self.weights
        if config is None:   # on a GPU, the third call of a signature replays the second's launches
            return self._replays.run((hidden_states,), (), lambda: self._forward(hidden_states, weights, None))
        return self._forward(hidden_states, weights, config)

    def _forward(self, hidden_states, weights, config):
        check_hidden("MoELayer", hidden_states, weights)
        if config is not None:
            plan = plan_layer("MoELayer", weights, self.routing, self.layout, hidden_states.shape[0],
                              hidden_states.dtype, hidden_states.device, config=config,
                              shared_expert=self.shared_expert)
        else:
            plan = self._plan(hidden_states.shape[0], hidden_states.dtype, hidden_states.device)
        return run_layer(plan, hidden_states, weights, self.routing)

    def reference(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer in float64, token by token: the torch reference router on the two-step path's
        float32 logits (the tensor-core gate), then each token's experts (and the shared expert)
        evaluated directly. Up to ``CHAINED_ROUTER_MAX_TOKENS`` the layer itself routes on the split
        gate's logits (:mod:`moe_kernels.layer_router`), the same products summed in another order:
        at a near-tie between two experts (logits within float32 rounding) the two may pick
        differently, as any two float32 GEMMs may."""
        w = self.weights
        check_hidden("MoELayer.reference", hidden_states, w)
        topk_weights, topk_ids = self.routing.route(hidden_states, router_logits(hidden_states, w.gate), w.bias,
                                                    reference=True)
        t = hidden_states.shape[0]
        shared_gate = shared_gate_of(hidden_states, w)
        shared_weight = torch.ones(t, 1, dtype=torch.float64, device=hidden_states.device) if shared_gate is None \
            else shared_gate.double()
        scales = (w.w13_scale, w.w2_scale) if w.format.quantized else ()
        if w.shared_fused:   # one grouped GEMM over E + 1 experts, as the kernels run it
            everyone = torch.full((t, 1), w.num_experts, dtype=torch.int64, device=hidden_states.device)
            experts = [(w.w13, w.w2, torch.cat([topk_weights.double(), shared_weight], 1),
                        torch.cat([topk_ids.long(), everyone], 1), *scales)]
        else:
            experts = [(w.w13, w.w2, topk_weights, topk_ids, *scales)]
            if w.shared_w13 is not None:
                everyone = torch.zeros(t, 1, dtype=torch.int64, device=hidden_states.device)
                shared_scales = (w.shared_w13_scale[None], w.shared_w2_scale[None]) if w.format.quantized else ()
                experts.append((w.shared_w13[None], w.shared_w2[None], shared_weight, everyone, *shared_scales))
        out = 0
        for w13, w2, weights, ids, *scales in experts:
            if scales:   # fp8: the same quantised numbers as the kernels, exact arithmetic
                out = out + moe_reference_fp8(hidden_states, w13, w2, weights, ids, w1_scale=scales[0],
                                              w2_scale=scales[1], granularity=w.granularity,
                                              intermediate_dtype=hidden_states.dtype)
            else:
                out = out + moe_reference(hidden_states, w13, w2, weights, ids)
        return out

    def quantized(self, granularity: str = "block") -> "MoELayer":
        """This layer with fp8 experts (W8A8 in the format ``FORMATS[granularity]``: ``"block"``,
        ``"channel"`` or ``"tensor"``), same routing and layout."""
        # A fused shared expert is expert E of w13/w2: its scales come out of the same call.
        return MoELayer(self.weights.quantized(granularity), self.routing, layout=self.layout,
                        shared_expert=self.shared_expert)

    @classmethod
    def random(cls, model: MoEModel | str, *, dtype: torch.dtype, device, seed: int, hidden_size: int | None = None,
               intermediate_size: int | None = None, bias_std: float = 0.003, **options) -> "MoELayer":
        """``model``'s layer with random weights (``d``/``F`` optionally shrunk; ``E``, ``k`` and
        the groups stay the model's). Expert weights are scaled by one over the square root of
        their fan-in; each router row has unit norm (then rounded to ``dtype``, as checkpoints store
        the gate), so for standard-normal inputs every logit is standard normal and routing is
        uniform in expectation, as the byte model assumes. A sigmoid-scored model gets a small
        random correction bias (``bias_std``): a trained bias offsets a trained gate's
        preferences, and a random gate has none to offset."""
        model = MODELS[model] if isinstance(model, str) and model in MODELS else model
        if not isinstance(model, MoEModel):
            fail("MoELayer.random", "model", f"must be a MoEModel or one of {sorted(MODELS)}", repr(model))
        func = "MoELayer.random"
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if size is not None:
                check_int(func, name, size, lo=1)
        check_dtype(func, "dtype", dtype, FLOAT_DTYPES)
        check_int(func, "seed", seed)
        check_number(func, "bias_std", bias_std, ge=0)
        device = check_device(func, "device", device)
        d = hidden_size or model.hidden_size
        f = intermediate_size or model.moe_intermediate_size
        e, s = model.num_experts, model.num_shared_experts * f
        g = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape, scale=1.0, as_dtype=dtype):
            return torch.randn(*shape, device=device, dtype=as_dtype, generator=g).mul_(scale)

        router = randn(e, d, as_dtype=torch.float32)
        # Rows of unit norm, stored in the layer's dtype as checkpoints store the gate.
        router = (router / torch.linalg.norm(router, dim=1, keepdim=True)).to(dtype)
        bias = randn(e, scale=bias_std, as_dtype=torch.float32) if model.scoring_func == "sigmoid" else None
        weights = LayerWeights(router, randn(e, 2 * f, d, scale=d**-0.5), randn(e, d, f, scale=f**-0.5), bias,
                               randn(2 * s, d, scale=d**-0.5) if s else None, randn(d, s, scale=s**-0.5) if s else None)
        return cls(weights, Routing.of(model), **options)

    @classmethod
    def from_pretrained_layer(cls, source, *, layer: int, config=None, dtype: torch.dtype | None = None,
                              device="cpu", **options) -> "MoELayer":
        """Layer ``layer`` of a Hugging Face checkpoint (see :mod:`moe_kernels.checkpoint`)."""
        weights, routing = load_layer(source, layer=layer, config=config, dtype=dtype, device=device)
        return cls(weights, routing, **options)
