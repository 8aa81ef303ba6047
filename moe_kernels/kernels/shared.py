"""The shared expert: one dense FFN every token uses, run beside the routed experts or among them.

DeepSeek-V3 adds to each MoE layer one *shared* expert, a gated FFN of the routed experts' width
``F`` that every token passes through with weight 1. There are two ways to run it:

* **separate**: the routed experts in their grouped GEMM (:func:`moe_with_shared_separate` calls
  :func:`moe_kernels.kernels.index_gather.fused_experts`), plus the shared FFN as a dense module
  (:func:`shared_expert_separate`), and the two outputs added. vLLM does this on NVIDIA GPUs: its
  DeepSeek model builds the shared expert as its own ``DeepseekV2MLP``
  (vllm-project/vllm ``vllm/model_executor/models/deepseek_v2.py``).
* **fused**: store the shared expert as routed expert number ``E`` (:func:`stack_shared_expert`,
  done once at load time), append it to every token's top-k with weight 1
  (:func:`moe_kernels.kernels.routing.append_shared_expert`), and run top-(k+1) in one grouped GEMM
  (:func:`moe_with_shared_fused`). SGLang does this for DeepSeek-V3
  (sgl-project/sglang ``python/sglang/srt/models/deepseek_v2.py``, ``num_fused_shared_experts``).

Both compute the same function. The separate shared FFN is plain torch (``F.linear``, that is a
cuBLAS GEMM on a GPU), not :func:`fused_experts` with one expert: a matrix every token multiplies
by is a dense GEMM, and routing all tokens to "expert 0" would only add an alignment pass and
index gathers around the same product. It is also what vLLM runs.

What the shared expert costs in weight bytes depends on how many routed experts the batch
touches (:func:`moe_kernels.model.costs.shared_expert_byte_overhead`): at batch 1 it adds ``1/k``
to the routed bytes, once all ``E`` are touched only ``1/E``.

Worked example: four routed experts, top-2, ``F = 8``, ``d = 16``::

    >>> import torch
    >>> from moe_kernels.reference import moe_reference
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.randn(3, 16, generator=g)
    >>> w1, w2 = torch.randn(4, 16, 16, generator=g) / 4, torch.randn(4, 16, 8, generator=g) / 3
    >>> w1_shared, w2_shared = torch.randn(16, 16, generator=g) / 4, torch.randn(16, 8, generator=g) / 3
    >>> ids = torch.tensor([[0, 3], [1, 3], [2, 0]])
    >>> weights = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.3, 0.7]])
    >>> separate = moe_with_shared_separate(x, w1, w2, weights, ids, w1_shared, w2_shared)
    >>> w1_all, w2_all = stack_shared_expert(w1, w2, w1_shared, w2_shared)
    >>> w1_all.shape                                  # the shared expert is expert 4
    torch.Size([5, 16, 16])
    >>> fused = moe_with_shared_fused(x, w1_all, w2_all, weights, ids)
    >>> bool(torch.allclose(separate, fused, atol=1e-5))
    True
"""

from __future__ import annotations

import torch

from .._checks import check_ids_in_range, check_int, check_tensor, fail
from .config import MoEConfig, choose_fused_shared_config
from .index_gather import fused_experts
from .routing import append_shared_expert

__all__ = [
    "shared_expert_separate",
    "moe_with_shared_separate",
    "stack_shared_expert",
    "moe_with_shared_fused",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_shared_weights(func: str, hidden_states: torch.Tensor, w1_shared, w2_shared) -> int:
    """Checks ``w1_shared [2F_s, d]`` and ``w2_shared [d, F_s]`` against the hidden states; returns F_s."""
    d = hidden_states.shape[1]
    check_tensor(func, "w1_shared", w1_shared, ndim=2, dtypes=(hidden_states.dtype,), device=hidden_states.device)
    check_tensor(func, "w2_shared", w2_shared, ndim=2, dtypes=(hidden_states.dtype,), device=hidden_states.device)
    two_f = w1_shared.shape[0]
    if w1_shared.shape[1] != d or two_f == 0 or two_f % 2:
        fail(func, "w1_shared", f"must have shape [2F, d={d}] with 2F even and > 0",
             f"shape {tuple(w1_shared.shape)}")
    if tuple(w2_shared.shape) != (d, two_f // 2):
        fail(func, "w2_shared", f"must have shape [d={d}, F={two_f // 2}]", f"shape {tuple(w2_shared.shape)}")
    return two_f // 2


def shared_expert_separate(hidden_states: torch.Tensor, w1_shared: torch.Tensor,
                           w2_shared: torch.Tensor) -> torch.Tensor:
    """The shared expert as a dense gated FFN: ``w2_shared @ (silu(gate) * up)`` for every token.

    ``hidden_states`` is ``[T, d]``; ``w1_shared`` is ``[2F_s, d]`` (gate rows, then up rows, the
    layout of one routed expert's ``w1``) and ``w2_shared`` is ``[d, F_s]``; ``F_s`` may differ
    from the routed width (a model with ``n`` shared experts can store them as one FFN of width
    ``n F``, as vLLM does). Three torch ops: the gate/up GEMM, SiLU times up, the down GEMM;
    the result has the input's dtype.

        >>> x = torch.tensor([[1.0, 2.0]])
        >>> w1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])    # gate = x0, up = x1 (F_s = 1)
        >>> shared_expert_separate(x, w1, torch.tensor([[1.0], [-1.0]]))   # silu(1) * 2 = 1.4621
        tensor([[ 1.4621, -1.4621]])
    """
    func = "shared_expert_separate"
    check_tensor(func, "hidden_states", hidden_states, ndim=2, dtypes=_FLOAT_DTYPES)
    _check_shared_weights(func, hidden_states, w1_shared, w2_shared)
    return shared_ffn(hidden_states, w1_shared, w2_shared)


def shared_ffn(hidden_states: torch.Tensor, w1_shared: torch.Tensor, w2_shared: torch.Tensor) -> torch.Tensor:
    """:func:`shared_expert_separate` for weights already checked (a layer checks them once)."""
    f_shared = w2_shared.shape[1]
    gate_up = torch.nn.functional.linear(hidden_states, w1_shared)
    activation = torch.nn.functional.silu(gate_up[:, :f_shared]) * gate_up[:, f_shared:]
    return torch.nn.functional.linear(activation, w2_shared)


def moe_with_shared_separate(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                             w1_shared: torch.Tensor, w2_shared: torch.Tensor, *,
                             config: MoEConfig | None = None, validate_ids: bool = True) -> torch.Tensor:
    """Routed experts (:func:`fused_experts`) plus the shared FFN (:func:`shared_expert_separate`).

    Arguments as :func:`fused_experts` (``w1 [E, 2F, d]``, ``w2 [E, d, F]``, ``topk_* [T, k]``)
    and :func:`shared_expert_separate`. The sum is taken in the input dtype: torch adds two bf16
    tensors in fp32 and rounds once. ``validate_ids=False`` skips the id range check (a host
    sync), as needed inside a CUDA graph.
    """
    func = "moe_with_shared_separate"
    check_tensor(func, "hidden_states", hidden_states, ndim=2, dtypes=_FLOAT_DTYPES)
    _check_shared_weights(func, hidden_states, w1_shared, w2_shared)
    routed = fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, config=config, validate_ids=validate_ids)
    return routed.add_(shared_expert_separate(hidden_states, w1_shared, w2_shared))


def stack_shared_expert(w1: torch.Tensor, w2: torch.Tensor, w1_shared: torch.Tensor,
                        w2_shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert tensors with the shared expert appended as expert ``E``: ``[E+1, 2F, d]``, ``[E+1, d, F]``.

    A copy of every weight, so an engine does it once when loading the checkpoint (SGLang's
    DeepSeek loader renames ``mlp.shared_experts`` to ``mlp.experts.256``), never per step. The
    shared FFN must have the routed width ``F`` to become one more slot.

        >>> w1_all, w2_all = stack_shared_expert(torch.zeros(3, 8, 4), torch.zeros(3, 4, 4),
        ...                                      torch.ones(8, 4), torch.ones(4, 4))
        >>> tuple(w1_all.shape), tuple(w2_all.shape), float(w1_all[3].sum())
        ((4, 8, 4), (4, 4, 4), 32.0)
    """
    func = "stack_shared_expert"
    check_tensor(func, "w1", w1, ndim=3, dtypes=_FLOAT_DTYPES)
    check_tensor(func, "w2", w2, ndim=3, dtypes=(w1.dtype,), device=w1.device)
    check_tensor(func, "w1_shared", w1_shared, ndim=2, dtypes=(w1.dtype,), device=w1.device)
    check_tensor(func, "w2_shared", w2_shared, ndim=2, dtypes=(w1.dtype,), device=w1.device)
    if tuple(w1_shared.shape) != tuple(w1.shape[1:]):
        fail(func, "w1_shared", f"must have the shape of one routed expert's w1 {tuple(w1.shape[1:])}",
             f"shape {tuple(w1_shared.shape)}")
    if tuple(w2_shared.shape) != tuple(w2.shape[1:]):
        fail(func, "w2_shared", f"must have the shape of one routed expert's w2 {tuple(w2.shape[1:])}",
             f"shape {tuple(w2_shared.shape)}")
    return torch.cat([w1, w1_shared[None]]), torch.cat([w2, w2_shared[None]])


def moe_with_shared_fused(hidden_states: torch.Tensor, w1_with_shared: torch.Tensor,
                          w2_with_shared: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                          shared_weight: float | torch.Tensor = 1.0, config: MoEConfig | None = None,
                          validate_ids: bool = True) -> torch.Tensor:
    """Routed and shared experts in one grouped GEMM: top-k plus the shared slot, ``k + 1`` per token.

    ``w1_with_shared`` / ``w2_with_shared`` come from :func:`stack_shared_expert` (``E`` routed
    experts, then the shared one); ``topk_ids`` hold routed ids in ``[0, E)``. The shared expert
    is spliced in as id ``E`` with ``shared_weight`` by :func:`append_shared_expert` (see there
    for when a weight other than 1 is right).

    ``config`` defaults to :func:`~moe_kernels.kernels.config.choose_fused_shared_config`'s tiles: the
    table tuned for this problem (``E + 1`` experts, top-``(k+1)``) where one covers the batch (within
    ``TABLE_REACH`` of its entries), else the routed shape's (the extra slot is not a reason to fall back
    to the untuned default). ``validate_ids``
    checks that the routed ids lie in ``[0, E)``; an id equal to ``E`` would silently select the
    shared expert.
    """
    func = "moe_with_shared_fused"
    hidden = check_tensor(func, "hidden_states", hidden_states, ndim=2, dtypes=_FLOAT_DTYPES,
                          last_dim_contiguous=True)
    num_tokens, d = hidden.shape
    check_tensor(func, "w1_with_shared", w1_with_shared, ndim=3, dtypes=(hidden.dtype,), device=hidden.device)
    check_tensor(func, "w2_with_shared", w2_with_shared, ndim=3, dtypes=(hidden.dtype,), device=hidden.device)
    num_routed = w1_with_shared.shape[0] - 1
    two_f = w1_with_shared.shape[1]
    if num_routed < 1 or w1_with_shared.shape[2] != d or two_f == 0 or two_f % 2:
        fail(func, "w1_with_shared", f"must hold E >= 1 routed experts and the shared one, [E+1, 2F, d={d}] "
             "with 2F even and > 0", f"shape {tuple(w1_with_shared.shape)}")
    if tuple(w2_with_shared.shape) != (num_routed + 1, d, two_f // 2):
        fail(func, "w2_with_shared", f"must have shape [E+1={num_routed + 1}, d={d}, F={two_f // 2}] to match "
             "w1_with_shared", f"shape {tuple(w2_with_shared.shape)}")
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), device=hidden.device)
    if topk_ids.shape[0] != num_tokens:
        fail(func, "topk_ids", f"must have one row per token ({num_tokens})", f"shape {tuple(topk_ids.shape)}")
    check_int(func, "topk_ids.shape[1]", topk_ids.shape[1], lo=1, hi=num_routed,
              what_hi="the number of routed experts, w1_with_shared.shape[0] - 1")
    check_tensor(func, "topk_weights", topk_weights, ndim=2, dtypes=_FLOAT_DTYPES, device=hidden.device)
    if topk_weights.shape != topk_ids.shape:
        fail(func, "topk_weights", f"must have the shape of topk_ids {tuple(topk_ids.shape)} (routed slots "
             "only: the shared slot is appended here)", f"shape {tuple(topk_weights.shape)}")
    if validate_ids:
        check_ids_in_range(func, "topk_ids", topk_ids, num_routed)
    # The spliced weights are float32 whatever the routed ones are (fused_experts accepts any float dtype).
    weights, ids = append_shared_expert(topk_weights.float(), topk_ids, num_routed, shared_weight=shared_weight)
    if config is None:
        config = choose_fused_shared_config(hidden_states.shape[0], num_routed, w1_with_shared.shape[1] // 2,
                                            w1_with_shared.shape[2], hidden_states.dtype, hidden_states.device).config
    return fused_experts(hidden_states, w1_with_shared, w2_with_shared, weights, ids, config=config,
                         validate_ids=False)


