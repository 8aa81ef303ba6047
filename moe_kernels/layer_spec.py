"""What one MoE layer is: its tensors (:class:`LayerWeights`) and its routing rules (:class:`Routing`).

Data, with the checks that keep it consistent and the conversions done once at load time
(fusing the shared expert in as expert ``E``, quantising to fp8). :mod:`moe_kernels.layer` runs a
layer from these; :mod:`moe_kernels.checkpoint` builds them from a Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch

from ._checks import FLOAT_DTYPES, check_int, check_number, check_tensor, fail
from .kernels.grouped_routing import grouped_topk, grouped_topk_reference
from .kernels.routing import fused_topk, fused_topk_reference
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
              reference: bool = False):
        """``(topk_weights, topk_ids)`` from the router logits (the torch reference when asked)."""
        if self.num_expert_group is not None or bias is not None:
            fn = grouped_topk_reference if reference else grouped_topk
            return fn(hidden_states, logits, self.top_k, self.renormalize, self.num_expert_group or 1,
                      self.topk_group or 1, scoring_func=self.scoring_func,
                      routed_scaling_factor=self.routed_scaling_factor, e_score_correction_bias=bias)
        fn = fused_topk_reference if reference else fused_topk
        weights, ids = fn(hidden_states, logits, self.top_k, self.renormalize, self.scoring_func)
        return (weights * self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else weights), ids


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One MoE layer's tensors. ``w13 [E, 2F, d]`` (gate rows, then up rows) and ``w2 [E, d, F]``
    are the routed experts, ``gate [E, d]`` the router, ``bias [E]`` DeepSeek-V3's selection-only
    correction bias, ``shared_w13 [2S, d]``/``shared_w2 [d, S]`` the shared expert(s) as one FFN.
    With ``shared_fused`` the shared expert is stored as expert ``E`` of ``w13``/``w2`` instead.
    fp8 experts carry their ``*_scale`` tensors (``weight_scale_inv``, :mod:`moe_kernels.kernels.quant`)."""

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

    @property
    def granularity(self) -> str | None:
        """The fp8 scheme of the expert weights, or None for 16/32-bit ones."""
        return None if self.w13_scale is None else {3: "block", 2: "channel", 1: "tensor"}[self.w13_scale.dim()]

    def quantized(self, granularity: str = "block") -> "LayerWeights":
        """These weights in fp8 (routed and shared experts; the router and the bias stay float32)."""
        from .kernels.quant import quantize_weight

        w13, w13_scale = quantize_weight(self.w13, granularity)
        w2, w2_scale = quantize_weight(self.w2, granularity)
        shared = {}
        if self.shared_w13 is not None:
            (s13, s13_scale), (s2, s2_scale) = (quantize_weight(w[None], granularity)
                                                for w in (self.shared_w13, self.shared_w2))
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
        """Every tensor's rank, dtype, device and shape, against each other and (when given) against
        ``hidden_states``; the names in the messages are this class's field names."""
        device = hidden_states.device if hidden_states is not None else None
        check_tensor(func, "gate", self.gate, ndim=2, dtypes=FLOAT_DTYPES, device=device)
        device = self.gate.device
        num_experts, d = self.gate.shape
        if hidden_states is not None and d != hidden_states.shape[1]:
            fail(func, "gate", f"must be [E, d={hidden_states.shape[1]}]", f"shape {tuple(self.gate.shape)}")
        dtypes = (hidden_states.dtype,) if hidden_states is not None else FLOAT_DTYPES
        # fp8 experts (with their scales, checked by the kernels) multiply activations quantised on the fly
        dtypes += (torch.float8_e4m3fn,) if self.w13_scale is not None else ()
        check_tensor(func, "w13", self.w13, ndim=3, dtypes=dtypes, device=device)
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
        if self.bias is not None:
            check_tensor(func, "bias", self.bias, ndim=1, dtypes=FLOAT_DTYPES, device=device)
            if self.bias.shape[0] != num_experts:
                fail(func, "bias", f"must have one entry per routed expert ({num_experts})",
                     f"shape {tuple(self.bias.shape)}")
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
