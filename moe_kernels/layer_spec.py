"""What one MoE layer is: its tensors (:class:`LayerWeights`) and its routing rules (:class:`Routing`).

Data, with the checks that keep it consistent and the conversions done once at load time
(fusing the shared expert in as expert ``E``, quantising to fp8). :mod:`moe_kernels.layer` runs a
layer from these; :mod:`moe_kernels.checkpoint` builds them from a Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch

from ._checks import FLOAT_DTYPES, check_int, check_number, check_tensor, fail
from .kernels.formats import WeightFormat
from .kernels.grouped_routing import grouped_topk, grouped_topk_checked, grouped_topk_reference
from .kernels.quant import FP8
from .kernels.routing import fused_topk, fused_topk_reference, topk_checked
from .model.shapes import MoEModel


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a model picks and weighs its experts (the config keys in the comments)."""

    top_k: int                               # num_experts_per_tok
    scoring_func: str = "softmax"            # scoring_func: "softmax" or "sigmoid"
    renormalize: bool = True                 # norm_topk_prob
    num_expert_group: int | None = None      # n_group (None: plain top-k)
    topk_group: int | None = None            # topk_group
    routed_scaling_factor: float = 1.0       # routed_scaling_factor

    def __post_init__(self):
        # Checked once here, not at every forward: a NaN factor or a misspelt scoring function would
        # otherwise surface, if at all, as a wrong output.
        func = "Routing"
        check_int(func, "top_k", self.top_k, lo=1)
        if self.scoring_func not in ("softmax", "sigmoid"):
            fail(func, "scoring_func", "must be 'softmax' or 'sigmoid'", repr(self.scoring_func))
        if not isinstance(self.renormalize, bool):
            fail(func, "renormalize", "must be a bool", type(self.renormalize).__name__, TypeError)
        if self.num_expert_group is not None:
            check_int(func, "num_expert_group", self.num_expert_group, lo=1)
        if self.topk_group is not None:
            check_int(func, "topk_group", self.topk_group, lo=1, hi=self.num_expert_group,
                      what_hi="num_expert_group" if self.num_expert_group is not None else None)
        check_number(func, "routed_scaling_factor", self.routed_scaling_factor, gt=0)

    @staticmethod
    def of(model: MoEModel) -> "Routing":
        grouped = model.num_expert_groups > 1
        return Routing(model.top_k, model.scoring_func, model.norm_topk_prob,
                       model.num_expert_groups if grouped else None, model.topk_groups if grouped else None,
                       model.routed_scaling_factor)

    def route(self, hidden_states: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None = None, *,
              reference: bool = False, checked: bool = False):
        """``(topk_weights, topk_ids)`` from the router logits (the torch reference when asked).
        ``checked``: these rules were checked against this layer once (:meth:`check_against`), so
        the kernels' own argument checks are skipped."""
        grouped = self.num_expert_group is not None or bias is not None
        if reference:
            fn = grouped_topk_reference if grouped else fused_topk_reference
        elif checked:
            fn = grouped_topk_checked if grouped else topk_checked
        else:
            fn = grouped_topk if grouped else fused_topk
        if grouped:
            return fn(hidden_states, logits, self.top_k, self.renormalize, self.num_expert_group or 1,
                      self.topk_group or 1, scoring_func=self.scoring_func,
                      routed_scaling_factor=self.routed_scaling_factor, e_score_correction_bias=bias)
        weights, ids = fn(hidden_states, logits, self.top_k, self.renormalize, self.scoring_func)
        return (weights * self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else weights), ids

    def check_against(self, func: str, gate: torch.Tensor, bias: torch.Tensor | None) -> None:
        """These rules against a layer's router ``gate [E, d]`` and ``bias``: what the routing
        kernels would check at every call, checked once (on empty logits)."""
        num_experts = gate.shape[0]
        if self.top_k > num_experts:
            fail(func, "routing", f"must have top_k <= the number of routed experts E={num_experts}",
                 f"top_k={self.top_k}")
        empty = torch.empty(0, num_experts, device=gate.device)
        self.route(empty[:, :1], empty, bias)


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One MoE layer's tensors, checked against each other when built. ``w13 [E, 2F, d]`` (gate
    rows, then up rows) and ``w2 [E, d, F]`` are the routed experts, ``gate [E, d]`` the router,
    ``bias [E]`` DeepSeek-V3's selection-only correction bias, ``shared_w13 [2S, d]``/``shared_w2
    [d, S]`` the shared expert(s) as one FFN, ``shared_gate [1, d]`` Qwen2-MoE's sigmoid gate on
    the shared expert's output (``shared_expert_gate``). With ``shared_fused`` the shared expert
    is stored as expert ``E`` of ``w13``/``w2`` instead. fp8 experts carry their ``*_scale``
    tensors (``weight_scale_inv``); :attr:`format` (:mod:`moe_kernels.kernels.formats`) is
    detected from them, once, here."""

    gate: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    bias: torch.Tensor | None = None
    shared_w13: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    shared_w13_scale: torch.Tensor | None = None
    shared_w2_scale: torch.Tensor | None = None
    shared_fused: bool = False
    shared_gate: torch.Tensor | None = None
    format: WeightFormat = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "format", self._check("LayerWeights"))

    @property
    def granularity(self) -> str | None:
        """The fp8 weight-scale layout (``"block"``, ``"channel"``, ``"tensor"``), or None."""
        return self.format.scales

    def quantized(self, granularity: str = "block") -> "LayerWeights":
        """These weights in fp8 (routed and shared experts; the router, the bias and the shared
        gate stay as they are), in the format ``FORMATS[granularity]``."""
        fmt = WeightFormat.named("LayerWeights.quantized", "granularity", granularity)
        if not fmt.quantized:
            return self
        if self.format.quantized:
            fail("LayerWeights.quantized", "self", "must hold 16/32-bit experts to quantise", self.format.name)
        w13, w13_scale = fmt.quantize_weight(self.w13)
        w2, w2_scale = fmt.quantize_weight(self.w2)
        shared = {}
        if self.shared_w13 is not None:
            (s13, s13_scale), (s2, s2_scale) = (fmt.quantize_weight(w[None]) for w in (self.shared_w13, self.shared_w2))
            shared = dict(shared_w13=s13[0], shared_w2=s2[0], shared_w13_scale=s13_scale[0], shared_w2_scale=s2_scale[0])
        return dataclasses.replace(self, w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, **shared)

    @property
    def num_experts(self) -> int:
        """Routed experts ``E`` (the router's width)."""
        return self.gate.shape[0]

    def fuse_shared(self) -> "LayerWeights":
        """The shared expert appended as expert ``E`` (a copy of the expert tensors: do it once, at
        load time, as SGLang's loader does). Needs a shared FFN of the routed width ``F``."""
        if self.shared_fused or self.shared_w13 is None:
            return self
        if tuple(self.shared_w13.shape) != tuple(self.w13.shape[1:]):
            fail("LayerWeights.fuse_shared", "shared_w13", f"must have one routed expert's shape "
                 f"{tuple(self.w13.shape[1:])} to become expert E", f"shape {tuple(self.shared_w13.shape)}")
        scales = {}
        if self.w13_scale is not None:
            scales = dict(w13_scale=torch.cat([self.w13_scale, self.shared_w13_scale[None]]),
                          w2_scale=torch.cat([self.w2_scale, self.shared_w2_scale[None]]))
        return dataclasses.replace(self, w13=torch.cat([self.w13, self.shared_w13[None]]),
                                   w2=torch.cat([self.w2, self.shared_w2[None]]), shared_w13=None, shared_w2=None,
                                   shared_w13_scale=None, shared_w2_scale=None, shared_fused=True, **scales)

    def check(self, func: str, hidden_states: torch.Tensor | None = None) -> None:
        """The tensors against each other (done at construction) and, when given, against
        ``hidden_states``: its width, dtype and device (what every call must check)."""
        self._check(func)
        if hidden_states is not None:
            check_hidden(func, hidden_states, self)

    def _check(self, func: str) -> WeightFormat:
        """Every tensor's rank, dtype, device and shape, against each other; the names in the
        messages are this class's field names. Returns the experts' format."""
        check_tensor(func, "gate", self.gate, ndim=2, dtypes=FLOAT_DTYPES)
        device = self.gate.device
        check_tensor(func, "w13", self.w13, ndim=3, dtypes=FLOAT_DTYPES + (FP8,), device=device)
        check_tensor(func, "w2", self.w2, ndim=3, device=device)
        num_experts, d = self.gate.shape
        # Three tensors carry the width d: the one that disagrees with the other two is blamed.
        if d != self.w13.shape[2] and self.w13.shape[2] == self.w2.shape[1]:
            fail(func, "gate", f"must be [E, d={self.w13.shape[2]}] (the width of w13 and w2)",
                 f"shape {tuple(self.gate.shape)}")
        dtype = self.w13.dtype
        experts = num_experts + (1 if self.shared_fused else 0)
        two_f = self.w13.shape[1]
        if self.w13.shape[0] != experts or self.w13.shape[2] != d or two_f == 0 or two_f % 2:
            fail(func, "w13", f"must be [E={experts}, 2F, d={d}] with 2F even and > 0 "
                 f"({'routed experts plus the shared one' if self.shared_fused else 'one per router row'})",
                 f"shape {tuple(self.w13.shape)}")
        check_tensor(func, "w2", self.w2, ndim=3, dtypes=(dtype,), device=device)
        if tuple(self.w2.shape) != (experts, d, two_f // 2):
            fail(func, "w2", f"must be [E={experts}, d={d}, F={two_f // 2}] to match w13", f"shape {tuple(self.w2.shape)}")
        fmt = WeightFormat.of(func, "w13", self.w13, self.w13_scale)
        if WeightFormat.of(func, "w2", self.w2, self.w2_scale) is not fmt:
            fail(func, "w2_scale", f"must describe w2 in w13's format ({fmt.name})", "another format")
        fmt.check_gated(func, "w13", self.w13)
        if self.bias is not None:
            check_tensor(func, "bias", self.bias, ndim=1, dtypes=FLOAT_DTYPES, device=device)
            if self.bias.shape[0] != num_experts:
                fail(func, "bias", f"must have one entry per routed expert ({num_experts})",
                     f"shape {tuple(self.bias.shape)}")
        if not isinstance(self.shared_fused, bool):
            fail(func, "shared_fused", "must be a bool", type(self.shared_fused).__name__, TypeError)
        if (self.shared_w13 is None) != (self.shared_w2 is None):
            fail(func, "shared_w2" if self.shared_w2 is None else "shared_w13",
                 "must be given together with the other shared-expert weight", "only one of the two")
        if self.shared_w13 is not None:
            check_tensor(func, "shared_w13", self.shared_w13, ndim=2, dtypes=(dtype,), device=device)
            two_s = self.shared_w13.shape[0]
            if self.shared_w13.shape[1] != d or two_s == 0 or two_s % 2:
                fail(func, "shared_w13", f"must be [2S, d={d}] with 2S even and > 0", f"shape {tuple(self.shared_w13.shape)}")
            check_tensor(func, "shared_w2", self.shared_w2, ndim=2, dtypes=(dtype,), device=device)
            if tuple(self.shared_w2.shape) != (d, two_s // 2):
                fail(func, "shared_w2", f"must be [d={d}, S={two_s // 2}] to match shared_w13",
                     f"shape {tuple(self.shared_w2.shape)}")
            for name, w, scale in (("shared_w13", self.shared_w13, self.shared_w13_scale),
                                   ("shared_w2", self.shared_w2, self.shared_w2_scale)):
                if WeightFormat.of(func, name, w[None], None if scale is None else scale[None], f"{name}_scale") is not fmt:
                    fail(func, f"{name}_scale", f"must describe {name} in the experts' format ({fmt.name})",
                         "another format")
            fmt.check_gated(func, "shared_w13", self.shared_w13[None])
        elif self.shared_w13_scale is not None or self.shared_w2_scale is not None:
            fail(func, "shared_w13_scale", "must be None without a shared expert", "a tensor")
        if self.shared_gate is not None:
            if self.shared_w13 is None and not self.shared_fused:
                fail(func, "shared_gate", "must come with a shared expert (shared_w13/shared_w2)", "a gate alone")
            check_tensor(func, "shared_gate", self.shared_gate, ndim=2, dtypes=FLOAT_DTYPES, device=device)
            if tuple(self.shared_gate.shape) != (1, d):
                fail(func, "shared_gate", f"must be [1, d={d}] (Qwen2-MoE's shared_expert_gate)",
                     f"shape {tuple(self.shared_gate.shape)}")
        return fmt


def check_hidden(func: str, hidden_states: object, weights: LayerWeights) -> None:
    """One call's activations against a checked layer: ``[T, d]``, the layer's float dtype (fp8
    experts take any), on its device, rows contiguous."""
    if not isinstance(hidden_states, torch.Tensor):
        fail(func, "hidden_states", "must be a torch.Tensor", type(hidden_states).__name__, TypeError)
    if hidden_states.dim() != 2 or hidden_states.shape[1] != weights.gate.shape[1]:
        fail(func, "hidden_states", f"must be [T, d={weights.gate.shape[1]}]", f"shape {tuple(hidden_states.shape)}")
    dtypes = FLOAT_DTYPES if weights.format.quantized else (weights.w13.dtype,)
    if hidden_states.dtype not in dtypes:
        check_tensor(func, "hidden_states", hidden_states, dtypes=dtypes)
    if hidden_states.device != weights.gate.device:
        fail(func, "hidden_states", f"must be on device {weights.gate.device} (where the layer's weights are)",
             hidden_states.device)
    if hidden_states.shape[1] > 1 and hidden_states.shape[0] > 0 and hidden_states.stride(1) != 1:
        fail(func, "hidden_states", "must be contiguous in its last dimension", f"strides {hidden_states.stride()}")
