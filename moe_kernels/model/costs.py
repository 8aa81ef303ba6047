"""The byte model: what one MoE layer reads, computes and pads, as a function of the batch.

Assumption throughout: uniform routing with independent tokens. Each token picks ``k`` distinct
experts of ``E`` uniformly, so a given expert is *missed* by one token with probability
``1 - k/E`` exactly, and by a batch of ``B`` tokens with probability ``(1 - k/E)**B``. This is a
reference model, not a bound: skewed routing touches fewer distinct experts (fewer bytes) while
loading the busiest expert more (more time in the largest group).

Units are explicit: FLOP counts are plain numbers, bytes are bytes, time is seconds. Convert with
:data:`moe_kernels.model.shapes.GB` (1e9, datasheets) or :data:`moe_kernels.model.shapes.GiB` (2**30,
allocators) at the edge.

Worked example, DeepSeek-V3 (E = 256, k = 8) in fp8 on an H100::

    >>> from moe_kernels.model.shapes import MODELS, GPUS
    >>> m, gpu = MODELS["deepseek-v3"], GPUS["H100 SXM"]
    >>> round(experts_touched(1, 256, 8), 6), round(experts_touched(64, 256, 8), 1)
    (8.0, 222.4)
    >>> round(batch_for_fraction(0.5, 256, 8), 2)      # half of the experts at about 22 tokens
    21.83
    >>> round(moe_intensity(1, 256, 8, 1.0), 6)        # batch 1: 2 FLOP per weight byte, like dense
    2.0
    >>> round(ridge_batch_moe(256, 8, gpu.ridge("fp8"), 1.0))   # where the expert GEMM turns compute-bound
    9451
"""

from __future__ import annotations

import math

import torch
from dataclasses import dataclass

from .._checks import ID_DTYPES, check_int, check_number, check_tensor
from .shapes import GPU, MoEModel, bytes_per_weight, check_gpu, check_model, check_weight_dtype


# --- how many experts a batch touches -----------------------------------------------------------
def _check_routing(func: str, num_experts: int, top_k: int) -> None:
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "top_k", top_k, lo=1, hi=num_experts, what_hi="num_experts")


def _check_batch(func: str, batch: float, *, positive: bool = False) -> float:
    """A real-valued batch: finite and >= 0 (> 0 where the function divides by it)."""
    return check_number(func, "batch", batch, **({"gt": 0} if positive else {"ge": 0}))


def experts_touched(batch: float, num_experts: int, top_k: int) -> float:
    """Expected number of distinct experts a batch of ``batch`` tokens routes to.

    ``E * (1 - (1 - k/E)**B)``, computed as ``-E * expm1(B * log1p(-k/E))`` so that it stays
    accurate when k/E is small. Limits: ``k`` at ``B = 1``, ``E`` as ``B -> inf``. When k = E every
    token touches every expert.
    """
    _check_routing("experts_touched", num_experts, top_k)
    _check_batch("experts_touched", batch)
    if top_k == num_experts:
        return float(num_experts) if batch > 0 else 0.0
    return -num_experts * math.expm1(batch * math.log1p(-top_k / num_experts))


def batch_for_fraction(fraction: float, num_experts: int, top_k: int) -> float:
    """The (real-valued) batch at which the expected touched fraction reaches ``fraction``.

    Solving ``1 - (1 - k/E)**B = f`` gives ``B = ln(1 - f) / ln(1 - k/E)``. The smallest integer
    batch that reaches ``f`` is the ceiling of this.
    """
    _check_routing("batch_for_fraction", num_experts, top_k)
    check_number("batch_for_fraction", "fraction", fraction, gt=0, lt=1)
    if top_k == num_experts:
        return 1.0
    return math.log1p(-fraction) / math.log1p(-top_k / num_experts)


# --- FLOPs, bytes, intensity ----------------------------------------------------------------------
def moe_layer_flops(batch: float, model: MoEModel) -> float:
    """Routed-expert FLOPs of one layer: ``B · k · 6 · d · F`` (3 matrices, 2 FLOPs per MAC)."""
    _check_batch("moe_layer_flops", batch)
    check_model("moe_layer_flops", model)
    return batch * model.top_k * model.expert_flops_per_token


def moe_layer_weight_bytes(batch: float, model: MoEModel, dtype: str | float) -> float:
    """Compulsory routed-expert weight traffic of one layer: ``E_touched(B) · 3 d F · b_w``."""
    func = "moe_layer_weight_bytes"
    check_model(func, model)
    _check_batch(func, batch)
    bytes_per_w = check_weight_dtype(func, "dtype", dtype)
    touched = experts_touched(batch, model.num_experts, model.top_k)
    return touched * model.expert_params * bytes_per_w


def moe_intensity(batch: float, num_experts: int, top_k: int, bytes_per_w: float) -> float:
    """Arithmetic intensity (FLOP per weight byte) of a MoE layer at batch B.

    ``F / Q = (B k 6 d F) / (E_touched(B) 3 d F b_w) = 2 B k / (b_w E_touched(B))``: d and F
    cancel. At B = 1 this is ``2 / b_w`` (a GEMV); for large B it tends to ``2 B k / (b_w E)``,
    the dense slope ``2 B / b_w`` divided by ``E / k``. Activations (O(B·d) bytes) are ignored
    against the O(E·d·F) weights.
    """
    _check_batch("moe_intensity", batch, positive=True)
    check_number("moe_intensity", "bytes_per_w", bytes_per_w, gt=0)
    return 2.0 * batch * top_k / (bytes_per_w * experts_touched(batch, num_experts, top_k))


def dense_intensity(batch: float, bytes_per_w: float) -> float:
    """A dense layer reads its weights once for the whole batch: ``2 B / b_w`` FLOP per byte."""
    _check_batch("dense_intensity", batch)
    check_number("dense_intensity", "bytes_per_w", bytes_per_w, gt=0)
    return 2.0 * batch / bytes_per_w


def ridge_batch_dense(ridge: float, bytes_per_w: float) -> float:
    """Batch where a dense GEMM reaches the ridge intensity I*: ``M* = I* · b_w / 2``."""
    check_number("ridge_batch_dense", "ridge", ridge, gt=0)
    check_number("ridge_batch_dense", "bytes_per_w", bytes_per_w, gt=0)
    return ridge * bytes_per_w / 2.0


def ridge_batch_moe(num_experts: int, top_k: int, ridge: float, bytes_per_w: float) -> float:
    """Batch where the MoE layer reaches the ridge: solves ``moe_intensity(B) = I*`` exactly.

    Because the intensity approaches the line ``2 B k / (b_w E)`` from above, the answer is
    essentially ``M* · E / k`` (the dense crossover times E/k) whenever that batch is large
    enough to touch every expert, which it always is for real GPUs.
    """
    func = "ridge_batch_moe"
    _check_routing(func, num_experts, top_k)
    # A NaN ridge would end the search at once and return 1.0 as if it were an answer.
    check_number(func, "ridge", ridge, gt=0)
    check_number(func, "bytes_per_w", bytes_per_w, gt=0)
    lo, hi = 1.0, 1.0
    if moe_intensity(lo, num_experts, top_k, bytes_per_w) >= ridge:
        return 1.0
    while moe_intensity(hi, num_experts, top_k, bytes_per_w) < ridge:
        hi *= 2.0
    for _ in range(200):  # bisection to machine precision; the function is increasing in B
        mid = 0.5 * (lo + hi)
        if moe_intensity(mid, num_experts, top_k, bytes_per_w) < ridge:
            lo = mid
        else:
            hi = mid
    return hi


def step_time_weight_streaming(batch: float, model: MoEModel, dtype: str | float, bandwidth: float) -> float:
    """Seconds per decode step spent streaming routed-expert weights, all MoE layers, at ``bandwidth``."""
    check_model("step_time_weight_streaming", model)
    check_number("step_time_weight_streaming", "bandwidth", bandwidth, gt=0)
    return model.num_moe_layers * moe_layer_weight_bytes(batch, model, dtype) / bandwidth


# --- padding -------------------------------------------------------------------------------------
def _binomial_pmf(n: int, p: float) -> list[float]:
    """P(X = m) for m = 0..n, X ~ Binomial(n, p), computed in log space (n can be large)."""
    if p <= 0.0:
        return [1.0] + [0.0] * n
    if p >= 1.0:
        return [0.0] * n + [1.0]
    logp, logq = math.log(p), math.log1p(-p)
    lg = math.lgamma
    return [math.exp(lg(n + 1) - lg(m + 1) - lg(n - m + 1) + m * logp + (n - m) * logq) for m in range(n + 1)]


def expected_padded_rows(batch: int, num_experts: int, top_k: int, block: int) -> float:
    """Expected rows after rounding every expert's row count up to a multiple of ``block``.

    Under uniform routing, expert e's row count is ``m_e ~ Binomial(B, k/E)`` (each token picks it
    with probability k/E, independently). By linearity of expectation the total is
    ``E · Σ_m P(m_e = m) · ceil(m / block) · block``: exact, no approximation. The real rows are
    ``B · k``; the padding factor is the ratio.
    """
    func = "expected_padded_rows"
    check_int(func, "batch", batch, lo=0)
    _check_routing(func, num_experts, top_k)
    check_int(func, "block", block, lo=1)
    pmf = _binomial_pmf(batch, top_k / num_experts)
    per_expert = sum(prob * (-(-m // block)) * block for m, prob in enumerate(pmf))
    return num_experts * per_expert


def padding_factor(batch: int, num_experts: int, top_k: int, block: int) -> float:
    """Expected padded rows over real rows (``B · k``); 1.0 means no padding."""
    check_int("padding_factor", "batch", batch, lo=1)
    return expected_padded_rows(batch, num_experts, top_k, block) / (batch * top_k)


def padding_factor_small_batch_limit(batch: int, num_experts: int, top_k: int, block: int) -> float:
    """The decode-regime approximation: every touched expert costs one whole tile.

    ``block · E_touched(B) / (B · k)``, valid while the mean rows per expert ``B k / E`` is well
    below ``block`` (then almost no expert needs a second tile).
    """
    _check_batch("padding_factor_small_batch_limit", batch, positive=True)
    check_int("padding_factor_small_batch_limit", "block", block, lo=1)
    return block * experts_touched(batch, num_experts, top_k) / (batch * top_k)


# --- parameter counts ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model by part; ``total`` is what is stored, ``active`` what one token uses."""

    embedding: int
    lm_head: int
    attention: int
    norms: int
    dense_mlp: int
    gates: int
    shared_experts: int
    routed_experts: int
    routed_active: int

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.norms + self.dense_mlp
                + self.gates + self.shared_experts + self.routed_experts)

    @property
    def active(self) -> int:
        """Parameters one token's forward pass multiplies with (its embedding row is a lookup,
        counted here as the model cards do: the whole embedding matrix)."""
        return self.total - self.routed_experts + self.routed_active

    @property
    def active_excluding_embeddings(self) -> int:
        return self.active - self.embedding - self.lm_head


def parameter_count(model: MoEModel) -> ParamCount:
    """Count parameters from the config shapes alone (biases: none in these models).

    Norms are RMSNorm weights: two per layer plus the final one (attention-internal norms are
    counted in ``attention``). The routing correction bias of DeepSeek-V3 (E per layer) is a
    buffer and is left out (15k values).
    """
    check_model("parameter_count", model)
    d = model.hidden_size
    moe_layers, dense_layers = model.num_moe_layers, model.num_dense_layers
    embedding = model.vocab_size * d
    return ParamCount(
        embedding=embedding,
        lm_head=0 if model.tie_word_embeddings else embedding,
        attention=model.num_layers * model.attention.params(d),
        norms=model.num_layers * 2 * d + d,
        dense_mlp=dense_layers * 3 * d * model.dense_intermediate_size,
        gates=moe_layers * model.gate_params,
        shared_experts=moe_layers * model.num_shared_experts * model.expert_params,
        routed_experts=moe_layers * model.num_experts * model.expert_params,
        routed_active=moe_layers * model.top_k * model.expert_params,
    )


def decode_flops_per_token(model: MoEModel) -> float:
    """``2 · N_active`` (embedding lookup excluded; the output projection included)."""
    check_model("decode_flops_per_token", model)
    p = parameter_count(model)
    return 2.0 * (p.active - p.embedding)


# --- memory -----------------------------------------------------------------------------------------
def weight_bytes(params: float, dtype: str | float) -> float:
    """Bytes to store ``params`` weights in ``dtype`` (see :data:`shapes.BYTES_PER_WEIGHT`)."""
    check_number("weight_bytes", "params", params, ge=0)
    return params * bytes_per_weight(dtype)


def usable_memory_bytes(gpu: GPU, gpu_memory_utilization: float = 0.92, reserve_gib: float = 6.0) -> float:
    """Bytes left for weights and KV cache on one GPU.

    The runtime may use ``gpu_memory_utilization`` of what the allocator sees (vLLM's flag), minus
    a reserve for activations, CUDA graphs and non-torch allocations.
    """
    from .shapes import GiB

    func = "usable_memory_bytes"
    check_gpu(func, gpu)
    check_number(func, "gpu_memory_utilization", gpu_memory_utilization, gt=0, le=1)
    check_number(func, "reserve_gib", reserve_gib, ge=0)
    return gpu.memory_bytes * gpu_memory_utilization - reserve_gib * GiB


def roofline_time(flops: float, nbytes: float, gpu_flops: float, bandwidth: float) -> float:
    """The floor: the larger of compute time and memory time (seconds)."""
    func = "roofline_time"
    check_number(func, "flops", flops, ge=0)
    check_number(func, "nbytes", nbytes, ge=0)
    check_number(func, "gpu_flops", gpu_flops, gt=0)
    check_number(func, "bandwidth", bandwidth, gt=0)
    return max(flops / gpu_flops, nbytes / bandwidth)


def shared_expert_byte_overhead(batch: float, num_experts: int, top_k: int, num_shared_experts: int = 1) -> float:
    """Shared-expert weight bytes over the routed bytes a batch reads: ``n_s / E_touched(B)``.

    Same-size experts, uniform routing (:func:`experts_touched`): ``n_s / k``
    at batch 1, falling to ``n_s / E`` once every routed expert is touched.
    """
    check_int("shared_expert_byte_overhead", "num_shared_experts", num_shared_experts, lo=1)
    _check_batch("shared_expert_byte_overhead", batch, positive=True)
    return num_shared_experts / experts_touched(batch, num_experts, top_k)


def shared_expert_byte_share(batch: float, num_experts: int, top_k: int, num_shared_experts: int = 1) -> float:
    """The shared experts' fraction of all expert bytes read: ``n_s / (E_touched(B) + n_s)``.

    ``1/(k+1)`` at batch 1 with one shared expert, ``1/(E+1)`` at saturation.
    """
    check_int("shared_expert_byte_share", "num_shared_experts", num_shared_experts, lo=1)
    _check_batch("shared_expert_byte_share", batch, positive=True)
    return num_shared_experts / (experts_touched(batch, num_experts, top_k) + num_shared_experts)


@dataclass(frozen=True)
class Work:
    """What one layer must move and compute at least, for the ids actually drawn."""

    experts_touched: int
    bytes: float
    flops: float

    def floor_seconds(self, bandwidth: float, gemm_rate: float) -> float:
        return max(self.bytes / bandwidth, self.flops / gemm_rate)


def count_work(model: MoEModel, topk_ids: torch.Tensor, bytes_per_element: float) -> Work:
    """Bytes of the experts touched (plus activations in and out) and FLOPs of the expert GEMMs,
    for the ids actually drawn: the floor every measurement is reported against.

        >>> from moe_kernels.model.shapes import MODELS
        >>> work = count_work(MODELS["qwen3-30b-a3b"], torch.tensor([[0, 5], [5, 9]]), bytes_per_element=2)
        >>> work.experts_touched                      # experts 0, 5 and 9
        3
        >>> work.flops == 4 * 2 * 3 * 2048 * 768      # four assignments
        True
        >>> work.bytes == 3 * 3 * 2048 * 768 * 2 + 2 * 2 * 2048 * 2
        True
        >>> round(work.floor_seconds(bandwidth=4e12, gemm_rate=700e12) * 1e6, 2)   # memory-bound
        7.08
    """
    func = "count_work"
    check_model(func, model)
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES)
    check_number(func, "bytes_per_element", bytes_per_element, gt=0)
    touched = int(torch.unique(topk_ids).numel())
    num_tokens = topk_ids.shape[0]
    weight_bytes = touched * model.expert_params * bytes_per_element
    activation_bytes = 2 * num_tokens * model.hidden_size * bytes_per_element
    return Work(touched, weight_bytes + activation_bytes, topk_ids.numel() * model.expert_flops_per_token)


def dense_work(model: MoEModel, num_tokens: int, bytes_per_element: float) -> Work:
    """The dense comparison: ``[B k, d] @ [d, 3F]``, the same FLOPs as the layer, one weight."""
    check_model("dense_work", model)
    check_int("dense_work", "num_tokens", num_tokens, lo=0)
    check_number("dense_work", "bytes_per_element", bytes_per_element, gt=0)
    rows, d, cols = num_tokens * model.top_k, model.hidden_size, 3 * model.moe_intermediate_size
    return Work(1, (rows * d + d * cols + rows * cols) * bytes_per_element, 2.0 * rows * d * cols)


def read_seconds(curve: list[dict], nbytes: float) -> float:
    """Seconds a plain streaming read of ``nbytes`` takes, from a measured curve of
    ``{"bytes", "seconds"}`` points (``bench ceilings``: one kernel per size, replayed from a CUDA
    graph): interpolated linearly in time between the two nearest sizes, and at the curve's last
    bandwidth past its end. A layer that reads few bytes cannot beat this, whatever its kernel:
    launch, ramp and tail are in it.

        >>> curve = [{"bytes": 1e6, "seconds": 4e-6}, {"bytes": 3e6, "seconds": 6e-6}]
        >>> round(read_seconds(curve, 2e6) * 1e6, 3), round(read_seconds(curve, 6e6) * 1e6, 3)
        (5.0, 12.0)
    """
    points = sorted((p["bytes"], p["seconds"]) for p in curve)
    if nbytes >= points[-1][0]:
        return nbytes * points[-1][1] / points[-1][0]
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, s0), (b1, s1) in zip(points, points[1:]):
        if b0 <= nbytes <= b1:
            return s0 + (s1 - s0) * (nbytes - b0) / (b1 - b0)
    raise AssertionError("unreachable: the sizes are sorted")
