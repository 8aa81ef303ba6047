"""Memory: where an MoE model's bytes are, what one GPU can hold, and what quantizing the experts buys.

Four questions, all answered from the config shapes (:mod:`moe_kernels.model.shapes`) and the byte
model (:mod:`moe_kernels.model.costs`):

1. How much of the model is routed experts? :func:`model_weight_bytes` splits the stored bytes
   into routed experts, shared experts and the rest, with the routed experts in one dtype and
   the rest in another.
2. How much of a GPU is left for weights? :func:`memory_budget` starts from what the allocator
   reports (GiB, binary), takes the runtime's ``gpu_memory_utilization`` share (vLLM's flag,
   0.92 here), subtracts a reserve for activations, CUDA graphs and non-torch allocations
   (6 GiB), and reports the rest in GiB and in decimal GB.
3. How many GPUs hold the weights? :func:`gpus_needed`, with an optional share of the budget
   kept for the KV cache.
4. What does a decode step stream? :func:`decode_step` counts the weight bytes one step reads
   (the routed experts the batch touches, plus every other weight once) and the floor they set
   on an ideal split over ``num_gpus`` GPUs. The routed bytes dominate, so quantizing only the
   experts moves the floor.

Units: bytes everywhere; :data:`~moe_kernels.model.shapes.GB` (1e9) and :data:`~moe_kernels.model.shapes.GiB`
(2**30) convert at the edge.

Worked example, an "80 GB" H100 under vLLM's defaults::

    >>> from moe_kernels.model.shapes import GPUS, MODELS
    >>> budget = memory_budget(GPUS["H100 SXM"])
    >>> round(budget.allocator_gib, 2), round(budget.runtime_gib, 2), round(budget.usable_gib, 2)
    (79.65, 73.28, 67.28)
    >>> round(budget.usable_gb, 2)                   # the same bytes in decimal GB
    72.24
    >>> fp8 = model_weight_bytes(MODELS["deepseek-v3"], "fp8")
    >>> round(fp8.routed_experts / 1e9, 1), round(routed_parameter_share(MODELS["deepseek-v3"]), 4)
    (653.9, 0.9745)
    >>> gpus_needed(fp8.total, budget)               # weights only, no KV cache
    10
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import costs
from .._checks import check_int, check_number, fail
from .shapes import GB, GPU, GiB, MoEModel, bytes_per_weight, check_gpu, check_model, check_weight_dtype

__all__ = [
    "WeightBytes",
    "model_weight_bytes",
    "routed_parameter_share",
    "MemoryBudget",
    "memory_budget",
    "gpus_needed",
    "DecodeStep",
    "decode_step",
]


# --- where the bytes are ------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightBytes:
    """Stored weight bytes of a model by part."""

    routed_experts: float
    shared_experts: float
    rest: float  # attention, dense MLP layers, routers, norms, embedding and output matrices

    @property
    def total(self) -> float:
        return self.routed_experts + self.shared_experts + self.rest

    @property
    def routed_share(self) -> float:
        """The routed experts' fraction of the stored bytes."""
        return self.routed_experts / self.total


def model_weight_bytes(model: MoEModel, routed_dtype: str | float, rest_dtype: str | float | None = None) -> WeightBytes:
    """Bytes to store ``model`` with its routed experts in ``routed_dtype`` and every other
    weight (shared experts included) in ``rest_dtype``; ``None`` means the same dtype throughout.

    Quantization scales are not counted, except that ``"mxfp4"`` carries its 8-bit scale per
    32 elements (:data:`moe_kernels.model.shapes.BYTES_PER_WEIGHT`).
    """
    func = "model_weight_bytes"
    check_model(func, model)
    check_weight_dtype(func, "routed_dtype", routed_dtype)
    rest_dtype = routed_dtype if rest_dtype is None else rest_dtype
    check_weight_dtype(func, "rest_dtype", rest_dtype)
    p = costs.parameter_count(model)
    return WeightBytes(
        routed_experts=costs.weight_bytes(p.routed_experts, routed_dtype),
        shared_experts=costs.weight_bytes(p.shared_experts, rest_dtype),
        rest=costs.weight_bytes(p.total - p.routed_experts - p.shared_experts, rest_dtype),
    )


def routed_parameter_share(model: MoEModel) -> float:
    """The routed experts' fraction of the stored parameters."""
    check_model("routed_parameter_share", model)
    p = costs.parameter_count(model)
    return p.routed_experts / p.total


# --- what one GPU holds ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBudget:
    """One GPU's memory, from what the allocator sees down to what weights and KV cache may use."""

    gpu: str
    allocator_bytes: float  # nvidia-smi's total (torch's total_memory)
    gpu_memory_utilization: float
    reserve_gib: float
    usable_bytes: float  # allocator_bytes * utilization - reserve

    @property
    def allocator_gib(self) -> float:
        return self.allocator_bytes / GiB

    @property
    def runtime_gib(self) -> float:
        """The runtime's share: ``gpu_memory_utilization`` of the allocator's total, in GiB."""
        return self.allocator_gib * self.gpu_memory_utilization

    @property
    def usable_gib(self) -> float:
        return self.usable_bytes / GiB

    @property
    def usable_gb(self) -> float:
        return self.usable_bytes / GB


def memory_budget(gpu: GPU, gpu_memory_utilization: float = 0.92, reserve_gib: float = 6.0) -> MemoryBudget:
    """What one GPU leaves for weights plus KV cache (:func:`moe_kernels.model.costs.usable_memory_bytes`)."""
    func = "memory_budget"
    check_gpu(func, gpu)
    check_number(func, "gpu_memory_utilization", gpu_memory_utilization, gt=0, le=1)
    check_number(func, "reserve_gib", reserve_gib, ge=0)
    usable = costs.usable_memory_bytes(gpu, gpu_memory_utilization, reserve_gib)
    if usable <= 0:
        fail(func, "reserve_gib", f"must leave memory on a {gpu.name} "
             f"({gpu.memory_gib * gpu_memory_utilization:.2f} GiB at this utilization)", reserve_gib)
    return MemoryBudget(gpu.name, gpu.memory_bytes, gpu_memory_utilization, reserve_gib, usable)


def gpus_needed(weight_bytes: float, budget: MemoryBudget, kv_cache_fraction: float = 0.0) -> int:
    """The fewest GPUs whose budgets hold ``weight_bytes``, keeping ``kv_cache_fraction`` of each
    budget free for the KV cache (0: weights only, no room for a single token's cache).

    Assumes the weights split evenly over the GPUs. Real layouts replicate some tensors and
    prefer GPU counts that divide the heads and experts, so the deployable count can be higher.

        >>> from moe_kernels.model.shapes import GPUS
        >>> budget = memory_budget(GPUS["H200"])
        >>> gpus_needed(200e9, budget), gpus_needed(200e9, budget, kv_cache_fraction=0.5)
        (2, 4)
    """
    func = "gpus_needed"
    if not isinstance(budget, MemoryBudget):
        fail(func, "budget", "must be a MemoryBudget (see memory_budget)", type(budget).__name__, TypeError)
    check_number(func, "weight_bytes", weight_bytes, ge=0)
    check_number(func, "kv_cache_fraction", kv_cache_fraction, ge=0, lt=1)
    for_weights = budget.usable_bytes * (1.0 - kv_cache_fraction)
    return max(1, math.ceil(weight_bytes / for_weights))


# --- what a decode step streams ------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeStep:
    """Weight traffic and arithmetic of one decode step, and the floor they set."""

    batch: int
    num_gpus: int
    routed_bytes: float  # the routed experts the batch touches, every MoE layer
    rest_bytes: float  # every other weight, read once (the embedding table is a lookup: excluded)
    memory_s: float
    compute_s: float

    @property
    def weight_bytes(self) -> float:
        return self.routed_bytes + self.rest_bytes

    @property
    def floor_s(self) -> float:
        """The larger of the memory time and the compute time."""
        return max(self.memory_s, self.compute_s)


def decode_step(model: MoEModel, batch: int, gpu: GPU, routed_dtype: str | float,
                rest_dtype: str | float = "bf16", num_gpus: int = 1) -> DecodeStep:
    """The weight bytes one decode step of ``batch`` tokens streams, and its floor on ``num_gpus`` GPUs.

    Routed experts: ``E_touched(B) · 3dF`` per MoE layer in ``routed_dtype``
    (:func:`moe_kernels.model.costs.moe_layer_weight_bytes`, uniform routing). Every other weight is
    read once per step in ``rest_dtype``, except the input embedding table, of which a step
    reads only ``B`` rows. FLOPs are ``2 · N_active`` per token, the routed part at the peak
    rate of ``routed_dtype`` (:meth:`moe_kernels.model.shapes.GPU.peak_flops`) and the rest at that of
    ``rest_dtype``. The ``num_gpus`` GPUs split bytes and FLOPs perfectly. Left out: the KV
    cache reads and attention-score FLOPs, which grow with context length, and activations.

        >>> from moe_kernels.model.shapes import GPUS, MODELS
        >>> qwen = MODELS["qwen3-30b-a3b"]
        >>> bf16 = decode_step(qwen, 64, GPUS["H200"], "bf16")
        >>> fp8 = decode_step(qwen, 64, GPUS["H200"], "fp8")
        >>> round(bf16.weight_bytes / 1e9, 2), round(fp8.weight_bytes / 1e9, 2)
        (59.51, 30.98)
        >>> round(bf16.floor_s * 1e3, 1), round(fp8.floor_s * 1e3, 1)   # milliseconds, memory-bound
        (12.4, 6.5)
    """
    func = "decode_step"
    check_model(func, model)
    check_int(func, "batch", batch, lo=1)
    check_gpu(func, gpu)
    check_weight_dtype(func, "routed_dtype", routed_dtype)
    check_weight_dtype(func, "rest_dtype", rest_dtype)
    check_int(func, "num_gpus", num_gpus, lo=1)
    p = costs.parameter_count(model)
    routed_bytes = model.num_moe_layers * costs.moe_layer_weight_bytes(batch, model, routed_dtype)
    # With tied embeddings the one matrix is also the output projection, read in full.
    streamed_rest = p.total - p.routed_experts - (p.embedding if p.lm_head else 0)
    rest_bytes = streamed_rest * bytes_per_weight(rest_dtype)
    routed_flops = model.num_moe_layers * costs.moe_layer_flops(batch, model)
    rest_flops = batch * costs.decode_flops_per_token(model) - routed_flops
    compute_s = (routed_flops / gpu.peak_flops(routed_dtype) + rest_flops / gpu.peak_flops(rest_dtype)) / num_gpus
    memory_s = (routed_bytes + rest_bytes) / (gpu.hbm_bandwidth * num_gpus)
    return DecodeStep(batch, num_gpus, routed_bytes, rest_bytes, memory_s, compute_s)
