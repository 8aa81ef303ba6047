"""Memory budgets, GPU counts and decode-step traffic (moe_kernels.model.memory) against hand values."""

from __future__ import annotations

import math

import pytest

from moe_kernels.model import costs, memory, shapes

DSV3 = shapes.MODELS["deepseek-v3"]
QWEN = shapes.MODELS["qwen3-30b-a3b"]
H100, H200, B200 = (shapes.GPUS[name] for name in ("H100 SXM", "H200", "B200"))


# ---- units and budgets --------------------------------------------------------------------------


def test_h100_budget_chain():
    budget = memory.memory_budget(H100)
    assert budget.allocator_gib == pytest.approx(79.65, abs=0.005)  # an "80 GB" card as reported
    assert budget.runtime_gib == pytest.approx(0.92 * 81559 / 1024, rel=1e-12)
    assert budget.runtime_gib == pytest.approx(73.28, abs=0.005)
    assert budget.usable_gib == pytest.approx(67.28, abs=0.005)
    assert budget.usable_gb == pytest.approx(72.24, abs=0.005)
    assert budget.usable_bytes == costs.usable_memory_bytes(H100)
    assert budget.usable_bytes == pytest.approx(budget.usable_gib * 2**30, rel=1e-12)


def test_budget_arguments_are_used():
    budget = memory.memory_budget(H200, gpu_memory_utilization=0.5, reserve_gib=0.0)
    assert budget.usable_bytes == pytest.approx(0.5 * H200.memory_bytes, rel=1e-12)
    assert memory.memory_budget(B200).usable_gb == pytest.approx((0.92 * 180e9 - 6 * 2**30) / 1e9, rel=1e-12)


# ---- where the bytes are ------------------------------------------------------------------------


def test_deepseek_v3_routed_experts():
    fp8, bf16 = memory.model_weight_bytes(DSV3, "fp8"), memory.model_weight_bytes(DSV3, "bf16")
    assert fp8.routed_experts / 1e9 == pytest.approx(653.9, abs=0.05)
    assert bf16.routed_experts / 1e9 == pytest.approx(1307.8, abs=0.05)
    assert fp8.routed_experts == 58 * 256 * 3 * 7168 * 2048
    share = memory.routed_parameter_share(DSV3)
    assert share == pytest.approx(0.975, abs=1e-3)  # 97.45%: the source rounds it to 97.5%
    assert fp8.routed_share == pytest.approx(share, rel=1e-12)  # one dtype: bytes share = parameter share
    assert fp8.total == costs.parameter_count(DSV3).total
    assert fp8.shared_experts == 58 * 3 * 7168 * 2048


def test_mixed_dtypes():
    mixed = memory.model_weight_bytes(DSV3, "int4", "bf16")
    p = costs.parameter_count(DSV3)
    assert mixed.routed_experts == p.routed_experts / 2
    assert mixed.shared_experts == 2 * p.shared_experts
    assert mixed.rest == 2 * (p.total - p.routed_experts - p.shared_experts)
    assert memory.model_weight_bytes(QWEN, "mxfp4").routed_experts == pytest.approx(
        costs.parameter_count(QWEN).routed_experts * 4.25 / 8, rel=1e-12)
    assert memory.model_weight_bytes(QWEN, "bf16").shared_experts == 0


# ---- GPU counts ---------------------------------------------------------------------------------


def test_gpu_counts_by_hand():
    h100, h200 = memory.memory_budget(H100), memory.memory_budget(H200)
    fp8_all = memory.model_weight_bytes(DSV3, "fp8").total  # 671.0 GB
    assert memory.gpus_needed(fp8_all, h100) == math.ceil(671.026404352e9 / h100.usable_bytes) == 10
    assert memory.gpus_needed(fp8_all, h200) == 6
    bf16_all = memory.model_weight_bytes(DSV3, "bf16").total  # 1342.1 GB
    assert memory.gpus_needed(bf16_all, h100) == 19
    assert memory.gpus_needed(bf16_all, h200) == 11
    qwen_bf16 = memory.model_weight_bytes(QWEN, "bf16").total  # 61.1 GB: one card of either kind
    assert memory.gpus_needed(qwen_bf16, h100) == 1 and memory.gpus_needed(qwen_bf16, h200) == 1


def test_kv_fraction_raises_the_count():
    h100 = memory.memory_budget(H100)
    qwen_bf16 = memory.model_weight_bytes(QWEN, "bf16").total
    assert memory.gpus_needed(qwen_bf16, h100, kv_cache_fraction=0.25) == 2  # 61.1 GB > 0.75 * 72.2 GB
    counts = [memory.gpus_needed(1e12, h100, kv_cache_fraction=f) for f in (0.0, 0.2, 0.4, 0.6, 0.8)]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    assert memory.gpus_needed(0, h100) == 1


# ---- decode-step traffic ------------------------------------------------------------------------


def test_decode_step_bytes_by_hand():
    p = costs.parameter_count(DSV3)
    step = memory.decode_step(DSV3, 1, H200, "bf16")
    assert step.routed_bytes == pytest.approx(58 * 8 * DSV3.expert_params * 2, rel=1e-12)
    assert step.rest_bytes == (p.total - p.routed_experts - p.embedding) * 2
    assert step.memory_s == pytest.approx(step.weight_bytes / 4.8e12, rel=1e-12)
    saturated = memory.decode_step(DSV3, 4096, H200, "fp8")
    assert saturated.routed_bytes == pytest.approx(p.routed_experts, rel=1e-9)


def test_quantizing_experts_moves_the_floor():
    for batch in (1, 64, 512):
        bf16 = memory.decode_step(DSV3, batch, H200, "bf16", num_gpus=8)
        fp8 = memory.decode_step(DSV3, batch, H200, "fp8", num_gpus=8)
        int4 = memory.decode_step(DSV3, batch, H200, "int4", num_gpus=8)
        assert bf16.floor_s == bf16.memory_s  # memory-bound at every decode batch here
        assert bf16.rest_bytes == fp8.rest_bytes == int4.rest_bytes
        assert fp8.routed_bytes == pytest.approx(bf16.routed_bytes / 2, rel=1e-12)
        assert bf16.floor_s > fp8.floor_s > int4.floor_s
    # The gain grows with the batch: more experts touched, a larger share of the step is experts.
    gains = [memory.decode_step(DSV3, b, H200, "bf16").floor_s / memory.decode_step(DSV3, b, H200, "fp8").floor_s
             for b in (1, 64, 512)]
    assert gains[0] < gains[1] < gains[2] < 2


def test_num_gpus_divides_the_floor():
    one, eight = (memory.decode_step(QWEN, 64, H200, "bf16", num_gpus=n) for n in (1, 8))
    assert eight.weight_bytes == one.weight_bytes
    assert eight.floor_s == pytest.approx(one.floor_s / 8, rel=1e-12)


def test_compute_time_uses_the_dtype_rates():
    step = memory.decode_step(QWEN, 512, H100, "fp8", rest_dtype="bf16")
    routed_flops = QWEN.num_moe_layers * costs.moe_layer_flops(512, QWEN)
    rest_flops = 512 * costs.decode_flops_per_token(QWEN) - routed_flops
    assert step.compute_s == pytest.approx(routed_flops / H100.dense_fp8_flops + rest_flops / H100.dense_bf16_flops,
                                           rel=1e-12)


# ---- bad inputs ---------------------------------------------------------------------------------


def test_bad_inputs():
    h100 = memory.memory_budget(H100)
    with pytest.raises(ValueError, match=r"memory_budget: argument 'gpu_memory_utilization' must be in \(0, 1\], got 1.5"):
        memory.memory_budget(H100, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"memory_budget: argument 'reserve_gib' must be >= 0"):
        memory.memory_budget(H100, reserve_gib=-1)
    with pytest.raises(ValueError, match=r"argument 'reserve_gib' must leave memory on a H100 SXM"):
        memory.memory_budget(H100, reserve_gib=100)
    with pytest.raises(TypeError, match=r"memory_budget: argument 'gpu' must be a moe_kernels.model.shapes.GPU"):
        memory.memory_budget("H100")
    with pytest.raises(ValueError, match=r"gpus_needed: argument 'kv_cache_fraction' must be in \[0, 1\)"):
        memory.gpus_needed(1e9, h100, kv_cache_fraction=1.0)
    with pytest.raises(ValueError, match=r"gpus_needed: argument 'weight_bytes' must be >= 0"):
        memory.gpus_needed(-1, h100)
    with pytest.raises(TypeError, match=r"gpus_needed: argument 'budget' must be a MemoryBudget"):
        memory.gpus_needed(1e9, H100)
    with pytest.raises(ValueError, match=r"decode_step: argument 'batch' must be >= 1"):
        memory.decode_step(DSV3, 0, H200, "fp8")
    with pytest.raises(ValueError, match=r"decode_step: argument 'num_gpus' must be >= 1"):
        memory.decode_step(DSV3, 1, H200, "fp8", num_gpus=0)
    with pytest.raises(ValueError, match=r"model_weight_bytes: argument 'routed_dtype' must be one of"):
        memory.model_weight_bytes(DSV3, "fp6")
