"""One whole MoE layer: gate -> routing -> alignment -> grouped GEMMs -> top-k sum -> shared expert.

:func:`moe_layer` is the function, :class:`MoELayer` the ``nn.Module`` that holds a real model's
weights and routing rules. Two model styles cover the chapter:

* Qwen3-30B-A3B: softmax over 128 experts, top-8, the 8 weights renormalised, no shared expert;
* DeepSeek-V3: sigmoid scores plus a selection-only correction bias, 8 groups of which the best 4
  are kept, top-8 inside them, renormalised and scaled by 2.5, plus one shared expert, run as a
  separate dense FFN (vLLM) or fused into the grouped GEMM as expert ``E`` (SGLang).

Any of the three grouped-GEMM layouts runs the experts (``layout``: ``"index_gather"``,
``"permute"``, ``"masked"``). The routing comes from this package's own kernels, so its ids are
in range by construction: the layer skips the id check and never synchronises with the host on a
GPU, so a decode step can be captured in a CUDA graph.

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

from ._checks import FLOAT_DTYPES, check_dtype, check_int, check_number, check_tensor, fail
from .checkpoint import load_layer
from .kernels.config import MoEConfig, get_config
from .kernels.index_gather import fused_experts
from .kernels.masked import masked_experts
from .kernels.permute import permute_experts
from .kernels.routing import append_shared_expert, gate
from .kernels.shared import shared_expert_separate
from .layer_spec import LayerWeights, Routing
from .model.shapes import MODELS, MoEModel
from .reference import moe_reference, moe_reference_fp8

LAYOUTS = {"index_gather": fused_experts, "permute": permute_experts, "masked": masked_experts}
SHARED_EXPERT = ("separate", "fused")


def moe_layer(hidden_states: torch.Tensor, weights: LayerWeights, *, routing: Routing,
              layout: str = "index_gather", config: MoEConfig | None = None) -> torch.Tensor:
    """The MoE layer's output ``[T, d]`` (the residual add is outside the layer).

    ``config`` overrides the grouped GEMMs' tiles (default: the tuned table for the routed shape,
    else the heuristic); ``layout`` picks the grouped-GEMM layout.
    """
    func = "moe_layer"
    check_tensor(func, "hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES)
    if not isinstance(weights, LayerWeights):
        fail(func, "weights", "must be a LayerWeights", type(weights).__name__, TypeError)
    if not isinstance(routing, Routing):
        fail(func, "routing", "must be a Routing", type(routing).__name__, TypeError)
    if layout not in LAYOUTS:
        fail(func, "layout", f"must be one of {', '.join(map(repr, LAYOUTS))}", repr(layout))
    weights.check(func, hidden_states)
    num_experts = weights.num_experts
    if routing.top_k > num_experts:
        fail(func, "routing", f"must have top_k <= the number of routed experts E={num_experts}",
             f"top_k={routing.top_k}")
    logits = gate(hidden_states, weights.gate)
    topk_weights, topk_ids = routing.route(hidden_states, logits, weights.bias)
    if weights.shared_fused:  # the shared expert as slot k+1, id E, weight 1 (the routed weights are scaled)
        topk_weights, topk_ids = append_shared_expert(topk_weights, topk_ids, num_experts)
    if config is None and layout == "index_gather":
        # The tables are keyed by the routed shape; a fused shared slot is no reason to fall back.
        t, d = hidden_states.shape
        config = get_config(t, num_experts, weights.w2.shape[2], d, hidden_states.dtype, hidden_states.device)
    fp8 = {} if weights.w13_scale is None else dict(w1_scale=weights.w13_scale, w2_scale=weights.w2_scale)
    out = LAYOUTS[layout](hidden_states, weights.w13, weights.w2, topk_weights, topk_ids, config=config,
                          validate_ids=False, **fp8)
    if weights.shared_w13 is None:
        return out
    if weights.shared_w13_scale is None:
        return out + shared_expert_separate(hidden_states, weights.shared_w13, weights.shared_w2)
    # An fp8 shared expert: the same W8A8 GEMMs with one expert every token picks, weight 1.
    t = hidden_states.shape[0]
    everyone = torch.zeros(t, 1, dtype=torch.int32, device=hidden_states.device)
    ones = torch.ones(t, 1, dtype=torch.float32, device=hidden_states.device)
    return out + fused_experts(hidden_states, weights.shared_w13[None], weights.shared_w2[None], ones, everyone,
                               validate_ids=False, w1_scale=weights.shared_w13_scale[None],
                               w2_scale=weights.shared_w2_scale[None])


class MoELayer(torch.nn.Module):
    """A real model's MoE layer: its tensors (as buffers: inference only) and its routing rules.

    ``layout`` picks the grouped-GEMM layout; ``shared_expert`` (``"separate"`` or ``"fused"``)
    how a shared expert runs. Build one with :meth:`random` (a model's shape, random weights) or
    :meth:`from_pretrained_layer` (one layer of a Hugging Face checkpoint).
    """

    def __init__(self, weights: LayerWeights, routing: Routing, *, layout: str = "index_gather",
                 shared_expert: str = "separate"):
        super().__init__()
        if not isinstance(weights, LayerWeights):
            fail("MoELayer", "weights", "must be a LayerWeights", type(weights).__name__, TypeError)
        if not isinstance(routing, Routing):
            fail("MoELayer", "routing", "must be a Routing", type(routing).__name__, TypeError)
        weights.check("MoELayer")
        if layout not in LAYOUTS:
            fail("MoELayer", "layout", f"must be one of {', '.join(map(repr, LAYOUTS))}", repr(layout))
        if shared_expert not in SHARED_EXPERT:
            fail("MoELayer", "shared_expert", "must be 'separate' or 'fused'", repr(shared_expert))
        self.routing, self.layout, self.shared_expert = routing, layout, shared_expert
        self._fields = [f.name for f in dataclasses.fields(LayerWeights) if f.name != "shared_fused"]
        weights = weights.fuse_shared() if shared_expert == "fused" else weights
        self._shared_fused = weights.shared_fused
        for name in self._fields:
            self.register_buffer(name, getattr(weights, name))

    @property
    def weights(self) -> LayerWeights:
        return LayerWeights(**{name: getattr(self, name) for name in self._fields}, shared_fused=self._shared_fused)

    def forward(self, hidden_states: torch.Tensor, *, config: MoEConfig | None = None) -> torch.Tensor:
        return moe_layer(hidden_states, self.weights, routing=self.routing, layout=self.layout, config=config)

    def reference(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer in float64, token by token: the torch reference router on the same float32
        logits, then each token's experts (and the shared expert) evaluated directly."""
        w = self.weights
        logits = gate(hidden_states, w.gate)
        topk_weights, topk_ids = self.routing.route(hidden_states, logits, w.bias, reference=True)
        routed = w.num_experts
        scales = (w.w13_scale, w.w2_scale) if w.granularity else ()
        if w.shared_fused:   # one grouped GEMM over E + 1 experts, as the kernels run it
            topk_weights, topk_ids = append_shared_expert(topk_weights, topk_ids, routed)
            experts = [(w.w13, w.w2, topk_weights, topk_ids, *scales)]
        else:
            experts = [(w.w13, w.w2, topk_weights, topk_ids, *scales)]
            if w.shared_w13 is not None:
                everyone = torch.zeros(hidden_states.shape[0], 1, dtype=torch.int64, device=hidden_states.device)
                ones = torch.ones(hidden_states.shape[0], 1, dtype=torch.float64, device=hidden_states.device)
                shared_scales = (w.shared_w13_scale[None], w.shared_w2_scale[None]) if w.granularity else ()
                experts.append((w.shared_w13[None], w.shared_w2[None], ones, everyone, *shared_scales))
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
        """This layer with fp8 experts (W8A8 at ``granularity``), same routing and layout."""
        # A fused shared expert is expert E of w13/w2: its scales come out of the same call.
        return MoELayer(self.weights.quantized(granularity), self.routing, layout=self.layout,
                        shared_expert=self.shared_expert)

    @classmethod
    def random(cls, model: MoEModel | str, *, dtype: torch.dtype, device, seed: int, hidden_size: int | None = None,
               intermediate_size: int | None = None, bias_std: float = 0.003, **options) -> "MoELayer":
        """``model``'s layer with random weights (``d``/``F`` optionally shrunk; ``E``, ``k`` and
        the groups stay the model's). Expert weights are scaled by one over the square root of
        their fan-in; each router row has unit norm, so for standard-normal inputs every logit is
        standard normal and routing is uniform in expectation, as the byte model assumes. A
        sigmoid-scored model gets a small random correction bias (``bias_std``): a trained bias
        offsets a trained gate's preferences, and a random gate has none to offset."""
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
        d = hidden_size or model.hidden_size
        f = intermediate_size or model.moe_intermediate_size
        e, s = model.num_experts, model.num_shared_experts * f
        g = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape, scale=1.0, as_dtype=dtype):
            return torch.randn(*shape, device=device, dtype=as_dtype, generator=g).mul_(scale)

        router = randn(e, d, as_dtype=torch.float32)
        router /= torch.linalg.norm(router, dim=1, keepdim=True)
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
