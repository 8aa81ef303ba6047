"""What the experts calls of one decode step saw and returned, to explain a logits difference.

``bench model`` compares each implementation's logits with the first implementation's. In bf16 the
implementations round differently (ours keeps GEMM 1's ``silu(gate) * up`` in fp32 and rounds once;
transformers' ``grouped_mm`` rounds the ``[rows, 2N]`` product, then SiLU, then the product), so the
first MoE layer's outputs differ by a rounding; from the second MoE layer on, the inputs differ too,
and a token whose k-th and (k+1)-th router scores were nearly tied can take another expert, which
changes its output by far more than a rounding. Two numbers tell these apart:

* ``first_layer_rel_err``: the first MoE layer's experts output against a float64 evaluation of the
  same call (its own inputs, ids and weights; :func:`~moe_kernels.reference.moe_reference`) over
  the first :data:`REFERENCE_TOKENS` tokens. Every implementation gets the same inputs there, so
  this is each one's own error, comparable across implementations.
* ``routing_agreement``: per MoE layer, the fraction of tokens routed to the same set of experts as
  in the reference implementation's step.

:func:`recording_experts_calls` hooks the experts modules for one step::

    with recording_experts_calls(model) as calls:
        logits = step()
    calls.ids          # per MoE layer: the sorted [T, k] expert ids of that step
    calls.first_layer_rel_err()
"""

from __future__ import annotations

import contextlib

import torch

#: Tokens of the first MoE layer evaluated in float64 (each upcasts the experts it touches).
REFERENCE_TOKENS = 16


class ExpertsCalls:
    """The calls one step made: each layer's sorted ids, and the first layer's call in full
    (its first :data:`REFERENCE_TOKENS` tokens)."""

    def __init__(self):
        self.ids: list[torch.Tensor] = []
        self.first = None   # (module, hidden_states, top_k_index, top_k_weights, output), sliced

    def record(self, module, args, kwargs, output) -> None:
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = list(args) + [kwargs[n] for n in names[len(args):]]
        hidden, index, weights = values[:3]
        self.ids.append(torch.sort(index.detach(), dim=-1).values.cpu())
        if self.first is None:
            n = REFERENCE_TOKENS
            self.first = (module, hidden[:n].detach().clone(), index[:n].detach().clone(),
                          weights[:n].detach().clone(), output[:n].detach().clone())

    def first_layer_rel_err(self) -> float | None:
        """``||out - ref|| / ||ref||`` of the first MoE layer's output over its first tokens, with
        ``ref`` in float64 from the module's weights as the kernels read them."""
        if self.first is None:
            return None
        from ..integrations.transformers import check_experts

        module, hidden, index, weights, output = self.first
        plan = check_experts(module)
        with torch.no_grad():   # (the module's weights are parameters)
            return self._rel_err(plan, hidden, index, weights, output)

    @staticmethod
    def _rel_err(plan, hidden, index, weights, output) -> float:
        from ..reference import moe_reference, moe_reference_fp8

        if plan.w1_scale is None:
            ref = moe_reference(hidden, plan.w1, plan.w2, weights, index)
        else:
            ref = moe_reference_fp8(hidden, plan.w1, plan.w2, weights, index, w1_scale=plan.w1_scale,
                                    w2_scale=plan.w2_scale, granularity=plan.format.removeprefix("fp8-"),
                                    intermediate_dtype=output.dtype)   # (GEMM 1 writes the layer's dtype)
        return float(torch.linalg.norm(output.double() - ref) / torch.linalg.norm(ref))

    def agreement(self, other: "ExpertsCalls") -> list[float]:
        """Per MoE layer, the fraction of tokens whose expert set equals ``other``'s."""
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
