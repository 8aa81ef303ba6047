"""Model and GPU specifications, each with where its numbers come from.

Everything the chapter computes starts here, so every field names its source. Model fields are the
Hugging Face ``config.json`` keys of the published checkpoints (named in ``source``); the routed
expert shapes of DeepSeek-V3 and Qwen3-30B-A3B also appear in vLLM's MoE benchmark table
(vllm-project/vllm, ``benchmarks/kernels/benchmark_moe.py`` model list).

Example::

    >>> m = MODELS["deepseek-v3"]
    >>> m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k
    (7168, 2048, 256, 8)
    >>> m.num_moe_layers, m.expert_params          # 61 layers, first 3 dense; 3*d*F per expert
    (58, 44040192)
    >>> GPUS["H200"].ridge("bf16")                 # FLOP per byte where compute = bandwidth
    206.125
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from numbers import Real

from .._checks import check_number, fail

GB = 1e9  # decimal gigabyte: what datasheets and "671 GB of weights" mean
GiB = 2.0**30  # binary gibibyte: what nvidia-smi, torch and allocators report

BYTES_PER_WEIGHT = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int4": 0.5,
    # OCP MXFP4: 4-bit elements plus one 8-bit shared scale per 32 elements = 4.25 bits.
    "mxfp4": 4.25 / 8,
}


def check_weight_dtype(func: str, name: str, dtype: object) -> float:
    """Bytes per weight of argument ``name`` of ``func``: a dtype name of :data:`BYTES_PER_WEIGHT`,
    or a finite number > 0 of bytes (returned as a float)."""
    if isinstance(dtype, str):
        if dtype not in BYTES_PER_WEIGHT:
            fail(func, name, f"must be one of {sorted(BYTES_PER_WEIGHT)} or a number", repr(dtype))
        return BYTES_PER_WEIGHT[dtype]
    if isinstance(dtype, bool) or not isinstance(dtype, Real):
        fail(func, name, f"must be one of {sorted(BYTES_PER_WEIGHT)} or a number", type(dtype).__name__, TypeError)
    return check_number(func, name, dtype, gt=0)


def bytes_per_weight(dtype: str | float) -> float:
    """Bytes per weight element for a dtype name (or a number of bytes > 0, returned as is)."""
    return check_weight_dtype("bytes_per_weight", "dtype", dtype)


def check_model(func: str, model: object) -> MoEModel:
    """``model`` must be a :class:`MoEModel` (``MODELS[name]`` gives one)."""
    if not isinstance(model, MoEModel):
        hint = f" (MODELS[{model!r}])" if isinstance(model, str) and model in MODELS else ""
        fail(func, "model", f"must be a MoEModel such as MODELS['deepseek-v3']{hint}",
             repr(model) if isinstance(model, str) else type(model).__name__, TypeError)
    return model


def check_gpu(func: str, gpu: object) -> GPU:
    """``gpu`` must be a :class:`GPU` (``GPUS[name]`` gives one)."""
    if not isinstance(gpu, GPU):
        fail(func, "gpu", "must be a moe_kernels.model.shapes.GPU such as GPUS['H200']",
             repr(gpu) if isinstance(gpu, str) else type(gpu).__name__, TypeError)
    return gpu


@dataclass(frozen=True)
class Attention:
    """Attention projection shapes, enough to count their parameters.

    ``kind="mla"`` is DeepSeek's multi-head latent attention (q and kv low-rank projections);
    ``kind="gqa"`` is grouped-query attention with separate q, k, v, o projections.
    """

    kind: str
    num_heads: int
    head_dim: int = 0  # gqa: per-head width of q, k and v
    num_kv_heads: int = 0  # gqa
    qk_norm: bool = False  # gqa: a per-head RMSNorm on q and k (Qwen3)
    q_lora_rank: int | None = None  # mla: None means a direct q projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0  # mla
    qk_nope_head_dim: int = 0  # mla
    qk_rope_head_dim: int = 0  # mla
    v_head_dim: int = 0  # mla

    def __post_init__(self):
        if self.kind not in ("mla", "gqa"):
            fail("Attention", "kind", "must be 'mla' or 'gqa'", repr(self.kind))

    def params(self, d: int) -> int:
        """Parameters of one layer's attention (projections and their internal norms)."""
        if self.kind == "gqa":
            q = d * self.num_heads * self.head_dim
            kv = 2 * d * self.num_kv_heads * self.head_dim
            o = self.num_heads * self.head_dim * d
            norms = 2 * self.head_dim if self.qk_norm else 0
            return q + kv + o + norms
        if self.kind == "mla":
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank is None:
                q = d * self.num_heads * qk_head
            else:  # down-projection, its RMSNorm, up-projection
                q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_head
            kv_down = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_up = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.num_heads * self.v_head_dim * d
            return q + kv_down + kv_up + o
        raise ValueError(f"Attention.params: unknown kind {self.kind!r}")


@dataclass(frozen=True)
class MoEModel:
    """One MoE language model: the fields the chapter uses, with the config keys in comments."""

    name: str
    hidden_size: int  # d: hidden_size
    moe_intermediate_size: int  # F: moe_intermediate_size (per routed expert)
    num_experts: int  # E: n_routed_experts / num_experts / num_local_experts
    top_k: int  # k: num_experts_per_tok
    num_layers: int  # num_hidden_layers
    num_dense_layers: int  # first_k_dense_replace (DeepSeek); 0 when every layer is MoE
    dense_intermediate_size: int  # intermediate_size of the dense MLP layers (0 if none)
    num_expert_groups: int  # n_group (1 = no group-limited routing)
    topk_groups: int  # topk_group
    num_shared_experts: int  # n_shared_experts, each of width moe_intermediate_size
    scoring_func: str  # "softmax" or "sigmoid"
    norm_topk_prob: bool  # renormalise the k selected weights
    routed_scaling_factor: float
    vocab_size: int
    tie_word_embeddings: bool
    attention: Attention
    source: str
    published_total_params: float  # as the model card states, for the reconciliation check
    published_active_params: float

    # --- derived shapes -----------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def expert_params(self) -> int:
        """One expert: gate and up ``[F, d]`` each, down ``[d, F]``: 3·d·F parameters."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_flops_per_token(self) -> int:
        """FLOPs one token spends in one expert: 2 per multiply-add, 3·d·F multiply-adds."""
        return 2 * self.expert_params

    @property
    def gate_params(self) -> int:
        """The router: a d × E linear layer without bias."""
        return self.hidden_size * self.num_experts

    def short(self) -> str:
        return f"{self.name} (d={self.hidden_size}, F={self.moe_intermediate_size}, E={self.num_experts}, k={self.top_k})"


def shared_expert_shape(model: MoEModel) -> MoEModel:
    """The model's shared expert(s) as a one-expert, top-1 shape: what the layer runs on a dense
    block map (every token, one expert of width ``num_shared_experts * F``, the shared experts
    stacked), and what the tuner tunes for it (``bench tune --shared``).

        >>> shared = shared_expert_shape(MODELS["deepseek-v3"])
        >>> shared.num_experts, shared.top_k, shared.moe_intermediate_size, shared.hidden_size
        (1, 1, 2048, 7168)
    """
    if model.num_shared_experts < 1:
        fail("shared_expert_shape", "model", "must have a shared expert (num_shared_experts >= 1)", model.name)
    return dataclasses.replace(model, name=f"{model.name} shared expert", num_experts=1, top_k=1,
                               moe_intermediate_size=model.num_shared_experts * model.moe_intermediate_size,
                               num_expert_groups=1, topk_groups=1, num_shared_experts=0)


@dataclass(frozen=True)
class GPU:
    """Datasheet figures of one GPU. These are leads: the bench measures the real ceilings."""

    name: str
    hbm_bandwidth: float  # bytes/s (decimal TB/s * 1e12)
    dense_bf16_flops: float  # FLOP/s, dense (no 2:4 sparsity)
    dense_fp8_flops: float
    memory_bytes: float  # what the allocator can see (nvidia-smi's total), in bytes
    memory_marketed_gb: float  # the "80 GB" on the box
    source: str

    def peak_flops(self, dtype: str | float) -> float:
        """Dense tensor-core rate for the weights' dtype (fp8 and narrower use the fp8 rate)."""
        return self.dense_fp8_flops if bytes_per_weight(dtype) <= 1.0 else self.dense_bf16_flops

    def ridge(self, dtype: str | float) -> float:
        """Ridge intensity I* in FLOP/byte: below it a kernel is bandwidth-bound."""
        return self.peak_flops(dtype) / self.hbm_bandwidth

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


MODELS: dict[str, MoEModel] = {
    "deepseek-v3": MoEModel(
        name="DeepSeek-V3",
        hidden_size=7168,
        moe_intermediate_size=2048,
        num_experts=256,
        top_k=8,
        num_layers=61,
        num_dense_layers=3,
        dense_intermediate_size=18432,
        num_expert_groups=8,
        topk_groups=4,
        num_shared_experts=1,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        vocab_size=129280,
        tie_word_embeddings=False,
        attention=Attention(
            kind="mla", num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        ),
        source="huggingface.co/deepseek-ai/DeepSeek-V3 config.json; DeepSeek-V3 Technical Report (arXiv 2412.19437)",
        published_total_params=671e9,
        published_active_params=37e9,
    ),
    "qwen3-30b-a3b": MoEModel(
        name="Qwen3-30B-A3B",
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        top_k=8,
        num_layers=48,
        num_dense_layers=0,
        dense_intermediate_size=0,
        num_expert_groups=1,
        topk_groups=1,
        num_shared_experts=0,
        scoring_func="softmax",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        vocab_size=151936,
        tie_word_embeddings=False,
        attention=Attention(kind="gqa", num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True),
        source="huggingface.co/Qwen/Qwen3-30B-A3B config.json and model card",
        published_total_params=30.5e9,
        published_active_params=3.3e9,
    ),
    "qwen3-235b-a22b": MoEModel(
        name="Qwen3-235B-A22B",
        hidden_size=4096,
        moe_intermediate_size=1536,
        num_experts=128,
        top_k=8,
        num_layers=94,
        num_dense_layers=0,
        dense_intermediate_size=0,
        num_expert_groups=1,
        topk_groups=1,
        num_shared_experts=0,
        scoring_func="softmax",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        vocab_size=151936,
        tie_word_embeddings=False,
        attention=Attention(kind="gqa", num_heads=64, num_kv_heads=4, head_dim=128, qk_norm=True),
        source="huggingface.co/Qwen/Qwen3-235B-A22B config.json and model card",
        published_total_params=235e9,
        published_active_params=22e9,
    ),
    "mixtral-8x7b": MoEModel(
        name="Mixtral-8x7B",
        hidden_size=4096,
        moe_intermediate_size=14336,
        num_experts=8,
        top_k=2,
        num_layers=32,
        num_dense_layers=0,
        dense_intermediate_size=0,
        num_expert_groups=1,
        topk_groups=1,
        num_shared_experts=0,
        scoring_func="softmax",
        norm_topk_prob=True,  # softmax over the two selected logits = renormalised top-2
        routed_scaling_factor=1.0,
        vocab_size=32000,
        tie_word_embeddings=False,
        attention=Attention(kind="gqa", num_heads=32, num_kv_heads=8, head_dim=128),
        source="huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json; Mixtral of Experts (arXiv 2401.04088)",
        published_total_params=46.7e9,
        published_active_params=12.9e9,
    ),
    "deepseek-v2-lite": MoEModel(
        name="DeepSeek-V2-Lite",
        hidden_size=2048,
        moe_intermediate_size=1408,
        num_experts=64,
        top_k=6,
        num_layers=27,
        num_dense_layers=1,
        dense_intermediate_size=10944,
        num_expert_groups=1,
        topk_groups=1,
        num_shared_experts=2,
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        vocab_size=102400,
        tie_word_embeddings=False,
        attention=Attention(
            kind="mla", num_heads=16, q_lora_rank=None, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        ),
        source="huggingface.co/deepseek-ai/DeepSeek-V2-Lite config.json; DeepSeek-V2 (arXiv 2405.04434)",
        published_total_params=15.7e9,
        published_active_params=2.4e9,
    ),
}

MiB = 2.0**20

GPUS: dict[str, GPU] = {
    "H100 SXM": GPU(
        name="H100 SXM",
        hbm_bandwidth=3.35e12,
        dense_bf16_flops=989.4e12,
        dense_fp8_flops=1978.9e12,
        memory_bytes=81559 * MiB,  # nvidia-smi total of an "80 GB" H100 SXM: 79.65 GiB
        memory_marketed_gb=80,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5; the sparse figures halved); memory: nvidia-smi",
    ),
    "H200": GPU(
        name="H200",
        hbm_bandwidth=4.8e12,
        dense_bf16_flops=989.4e12,
        dense_fp8_flops=1978.9e12,
        memory_bytes=143771 * MiB,  # nvidia-smi total, read on this project's H200: 140.4 GiB
        memory_marketed_gb=141,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM; compute as H100 SXM); memory: nvidia-smi on our H200",
    ),
    "B200": GPU(
        name="B200",
        hbm_bandwidth=8.0e12,
        dense_bf16_flops=2250e12,
        dense_fp8_flops=4500e12,
        memory_bytes=180e9,  # datasheet figure; the allocator-visible total was not read here
        memory_marketed_gb=180,
        source="NVIDIA HGX B200 datasheet (per GPU: 1.44 TB / 8, 8 TB/s; sparse rates halved)",
    ),
}
