"""What the experts calls of one decode step saw and returned, to explain a logits difference.

``bench model`` compares each implementation's logits with the first implementation's. In bf16 the
implementations round differently (ours keeps GEMM 1's ``silu(gate) * up`` in fp32 and rounds once;
transformers' ``grouped_mm`` rounds the ``[rows, 2N]`` product, then SiLU, then the product), so the
first MoE layer's outputs differ by a rounding. From the second MoE layer on the inputs differ too,
and a token whose router scores sit close to the top-k boundary can take another expert, which
changes its output by far more than a rounding. Two numbers tell these apart:

* ``first_layer_rel_err``: the first MoE layer's experts output against a float64 evaluation of the
  same call (its own inputs, ids and weights; :func:`~moe_kernels.reference.moe_reference`) over
  its first :data:`REFERENCE_TOKENS` tokens. Every implementation gets the same inputs there, so
  for 16-bit weights this is each one's own error, comparable across implementations. (For fp8
  weights the reference is :func:`~moe_kernels.reference.moe_reference_fp8`, which quantises the
  activations as this package does: an implementation that quantises otherwise is measured against
  our quantisation, not against its own.)
* ``routing_agreement``: per MoE layer, the fraction of tokens routed to the same set of experts as
  in the reference implementation's step. In the first MoE layer it is 1 by construction (identical
  inputs); below 1 later means the roundings above moved a token across the top-k boundary.

:func:`recording_experts_calls` hooks the experts modules for one step::

    with recording_experts_calls(model) as calls:
        logits = step()
    calls.ids          # per MoE layer: the sorted [T, k] expert ids of that step
    calls.first_layer_rel_err()
"""

from __future__ import annotations

import contextlib

import torch

from .._checks import fail

#: Tokens of the first MoE layer evaluated in float64 (each upcasts the experts it touches, one at
#: a time: 350 MB for a DeepSeek-V3 expert).
REFERENCE_TOKENS = 16

_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")


class ExpertsCalls:
    """The calls one step made: each layer's sorted ids, and the first layer's call in full
    (its first :data:`REFERENCE_TOKENS` tokens).

        >>> a, b = ExpertsCalls(), ExpertsCalls()
        >>> a.ids = [torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 3]])]
        >>> b.ids = [torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 4]])]
        >>> a.agreement(b)   # the second token took expert 4 for 3 in the second layer
        [1.0, 0.5]
    """

    def __init__(self):
        self.ids: list[torch.Tensor] = []
        self.first = None   # (module, hidden_states, top_k_index, top_k_weights, output), sliced

    def record(self, module, args, kwargs, output) -> None:
        """A forward hook with keyword arguments (``register_forward_hook(..., with_kwargs=True)``):
        transformers calls an experts module as ``experts(hidden_states, top_k_index, top_k_weights)``,
        positionally in the releases seen so far, so the three may come in ``args``, ``kwargs`` or
        both."""
        missing = [n for n in _ARGUMENTS[len(args):] if n not in kwargs]
        if missing:
            fail("recording_experts_calls", "the experts call",
                 f"must pass {', '.join(_ARGUMENTS)} (positionally or by name); missing {missing}",
                 f"{len(args)} positional, keywords {sorted(kwargs)}")
        hidden, index, weights = (list(args) + [kwargs[n] for n in _ARGUMENTS[len(args):]])[:3]
        index = index.reshape(-1, index.shape[-1])   # tokens on the first axis, whatever the model's layout
        self.ids.append(torch.sort(index.detach(), dim=-1).values.cpu())
        if self.first is None:
            n = REFERENCE_TOKENS
            d = hidden.shape[-1]
            self.first = (module, hidden.reshape(-1, d)[:n].detach().clone(), index[:n].detach().clone(),
                          weights.reshape(index.shape)[:n].detach().clone(),
                          output.reshape(-1, output.shape[-1])[:n].detach().clone())

    def first_layer_rel_err(self) -> float | None:
        """``||out - ref|| / ||ref||`` of the first MoE layer's output over its first tokens, with
        ``ref`` in float64 from the module's weights as the kernels read them (None: no call)."""
        if self.first is None:
            return None
        from ..integrations.transformers import check_experts
        from ..reference import moe_reference, moe_reference_fp8

        module, hidden, index, weights, output = self.first
        plan = check_experts(module)
        with torch.no_grad():   # (the module's weights are parameters)
            if plan.w1_scale is None:
                ref = moe_reference(hidden, plan.w1, plan.w2, weights, index)
            else:
                ref = moe_reference_fp8(hidden, plan.w1, plan.w2, weights, index, w1_scale=plan.w1_scale,
                                        w2_scale=plan.w2_scale, granularity=plan.format.removeprefix("fp8-"),
                                        intermediate_dtype=output.dtype)   # (GEMM 1 writes the layer's dtype)
            return float(torch.linalg.norm(output.double() - ref) / torch.linalg.norm(ref))

    def agreement(self, other: "ExpertsCalls") -> list[float]:
        """Per MoE layer, the fraction of tokens whose expert set equals ``other``'s."""
        if len(self.ids) != len(other.ids):
            fail("ExpertsCalls.agreement", "other", f"must hold as many MoE layers' calls as this step "
                 f"({len(self.ids)})", len(other.ids))
        return [float((a == b).all(dim=-1).double().mean()) for a, b in zip(self.ids, other.ids)]


@contextlib.contextmanager
def recording_experts_calls(model):
    """Hook every experts module of ``model`` for the duration of the block; yields the
    :class:`ExpertsCalls` they fill (in the order the layers run)."""
    from ..integrations.transformers import _experts_modules

    calls = ExpertsCalls()
    handles = [m.register_forward_hook(calls.record, with_kwargs=True) for m in _experts_modules(model)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
