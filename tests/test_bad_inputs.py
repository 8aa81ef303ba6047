"""A catalogue of bad inputs to the public API: no silent wrong answers, no crashes.

Every row of :data:`BAD_INPUTS` is one bad call and what it must raise: the exception type and the
argument the message blames, in the package's form ``"<function>: argument '<name>' <expected>, got
<actual>"`` (see :mod:`moe_kernels._checks`). A row that only checked "it raises" would let an
``IndexError`` from deep inside torch pass for a check, so both are asserted. The rows cover wrong
types, wrong ranks, dtypes, shapes and devices (``meta`` tensors stand in for "another device"),
non-contiguous inner dimensions, expert ids out of range with validation on, ``k > E``, NaN, inf and
non-positive scalars where none makes sense, non-power-of-two tiles, bad names of layouts, models
and policies, bad ``out=`` buffers and bad checkpoints.

:data:`GOOD_EDGES` are inputs at the edge that must give the *right answer* rather than an error:
empty batches in every layout, duplicate ids with validation off, out-of-range rows that must add
nothing. Each computes the result and the float64 reference
(:func:`moe_kernels.reference.moe_reference`, or the function's own documented rule).

"""

import math
import re

import pytest
import torch

from moe_kernels import (GemmTiles, LayerWeights, MODELS, MoEConfig, MoELayer, Routing, append_shared_expert,
                         fused_experts, fused_moe, fused_topk, gate, get_config, grouped_topk, load_layer,
                         masked_experts, moe_align_block_size, moe_layer, moe_reference, moe_sum,
                         moe_with_shared_fused, moe_with_shared_separate, permute_experts, stack_shared_expert,
                         unpermute)
from moe_kernels.kernels.blocks import (BlockAssignment, assign_blocks, check_alignment, naive_block_assignment,
                                        naive_padded_rows, use_naive_block_assignment)
from moe_kernels.kernels.config import choose_config
from moe_kernels.kernels.dropping import moe_with_capacity
from moe_kernels.kernels.index_gather import expert_down, expert_gate_up
from moe_kernels.kernels.masked import grouped_gemm_masked, masked_dispatch
from moe_kernels.bench.baselines import torch_grouped_mm_experts
from moe_kernels.bench.ceilings import weight_reader
from moe_kernels.kernels.permute import grouped_gemm_contiguous, permute
from moe_kernels.kernels.shared import shared_expert_separate
from moe_kernels.model import buffers, capacity, costs, memory, shapes, skew
from moe_testing import DEVICE, SMALL_TILES, TOLERANCE, make_problem, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")

NAN, INF = float("nan"), float("inf")

# ---- one small problem, and its bad variants ---------------------------------------------------
# T = 3 tokens, E = 4 experts, k = 2, d = 32, F = 16, float32 (ids int64).
X, W1, W2, TW, TI = make_problem(3, 4, 2, seed=0)
E = W1.shape[0]
W1S, W2S = torch.randn(32, 32, device=DEVICE) / 6, torch.randn(32, 16, device=DEVICE) / 4   # a shared FFN, F = 16
W1ALL, W2ALL = stack_shared_expert(W1, W2, W1S, W2S)
GATE_W = torch.randn(E, 32, device=DEVICE)
LOGITS = torch.randn(3, E, device=DEVICE)
LOGITS8 = torch.randn(3, 8, device=DEVICE)
BIAS8 = torch.randn(8, device=DEVICE) / 10
GOOD = dict(hidden_states=X, w1=W1, w2=W2, topk_weights=TW, topk_ids=TI)
BLOCKS = assign_blocks(TI, 16, E, naive=False)
TILES = GemmTiles(16, 16)
INTER = torch.randn(6, 16, device=DEVICE)        # [T*k, F]: expert_down's input
ROWS = torch.randn(32, 32, device=DEVICE)        # a packed [M_pad, K] buffer of two 16-row segments
M_IDX = torch.tensor([0] * 16 + [1] * 16, dtype=torch.int32, device=DEVICE)
SLABS = torch.randn(E, 8, 32, device=DEVICE)     # masked [E, m_max, K]
MASKED_M = torch.tensor([3, 0, 8, 1], dtype=torch.int32, device=DEVICE)
H200 = shapes.GPUS["H200"]
DSV3 = MODELS["deepseek-v3"]
PI4 = skew.inclusion_probabilities(skew.zipf_popularity(4, 1.0), 2)   # sums to k = 2


def meta(t):
    """The same tensor on another device (meta tensors have a device and no data)."""
    return torch.empty_like(t, device="meta")


def col_major(t):
    """The same values with a non-unit stride along the last dimension."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def ids_of(value, like=TI):
    return torch.full_like(like, value)


def layer_weights(**changes):
    fields = dict(gate=GATE_W, w13=W1, w2=W2)
    return LayerWeights(**{**fields, **changes})


# fp8 (per-channel: d = 32 is no multiple of 128) experts of the same problem.
FP8_WEIGHTS = LayerWeights(GATE_W, W1, W2).quantized("channel")


def checkpoint(layer=0, d=8, f=6, e=4):
    """A tiny Qwen-style state dict and its config (the loader's doctest, as a fixture)."""
    gen = torch.Generator().manual_seed(0)
    state = {f"model.layers.{layer}.mlp.gate.weight": torch.randn(e, d, generator=gen)}
    for i in range(e):
        for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            state[f"model.layers.{layer}.mlp.experts.{i}.{name}.weight"] = torch.randn(shape, generator=gen)
    config = {"hidden_size": d, "moe_intermediate_size": f, "num_experts": e, "num_experts_per_tok": 2,
              "norm_topk_prob": True}
    return state, config


STATE, CONFIG = checkpoint()
BUDGET = memory.memory_budget(H200)


def case(case_id, fn, exc, name, *args, **kwargs):
    """One row: ``fn(*args, **kwargs)`` must raise ``exc`` whose message blames argument ``name``."""
    return pytest.param(fn, args, kwargs, exc, name, id=case_id)


BAD_INPUTS = [
    # ---- gate ------------------------------------------------------------------------------------
    case("gate-hidden-not-a-tensor", gate, TypeError, "hidden_states", X.tolist(), GATE_W),
    case("gate-hidden-3d", gate, ValueError, "hidden_states", X[None], GATE_W),
    case("gate-hidden-int", gate, TypeError, "hidden_states", X.long(), GATE_W),
    case("gate-weight-1d", gate, ValueError, "gate_weight", X, GATE_W[0]),
    case("gate-weight-wrong-d", gate, ValueError, "gate_weight", X, GATE_W[:, :16]),
    case("gate-weight-other-device", gate, ValueError, "gate_weight", X, meta(GATE_W)),
    case("gate-weight-float64", gate, TypeError, "gate_weight", X, GATE_W.double()),
    # ---- fused_topk ------------------------------------------------------------------------------
    case("fused_topk-hidden-none", fused_topk, TypeError, "hidden_states", None, LOGITS, 2, True),
    case("fused_topk-logits-3d", fused_topk, ValueError, "gating_output", X, LOGITS[None], 2, True),
    case("fused_topk-logits-int", fused_topk, TypeError, "gating_output", X, LOGITS.long(), 2, True),
    case("fused_topk-logits-rows", fused_topk, ValueError, "gating_output", X, LOGITS[:2], 2, True),
    case("fused_topk-logits-other-device", fused_topk, ValueError, "gating_output", X, meta(LOGITS), 2, True),
    case("fused_topk-logits-column-major", fused_topk, ValueError, "gating_output", X, col_major(LOGITS), 2, True),
    case("fused_topk-topk-0", fused_topk, ValueError, "topk", X, LOGITS, 0, True),
    case("fused_topk-topk>E", fused_topk, ValueError, "topk", X, LOGITS, E + 1, True),
    case("fused_topk-topk-float", fused_topk, TypeError, "topk", X, LOGITS, 2.0, True),
    case("fused_topk-topk-bool", fused_topk, TypeError, "topk", X, LOGITS, True, True),
    case("fused_topk-renormalize-str", fused_topk, TypeError, "renormalize", X, LOGITS, 2, "yes"),
    case("fused_topk-scoring-relu", fused_topk, ValueError, "scoring_func", X, LOGITS, 2, True, "relu"),
    # ---- grouped_topk (8 experts) ------------------------------------------------------------------
    case("grouped_topk-groups-not-dividing", grouped_topk, ValueError, "num_expert_group", X, LOGITS8, 2, True, 3, 1),
    case("grouped_topk-groups>E", grouped_topk, ValueError, "num_expert_group", X, LOGITS8, 2, True, 16, 1),
    case("grouped_topk-groups-0", grouped_topk, ValueError, "num_expert_group", X, LOGITS8, 2, True, 0, 1),
    case("grouped_topk-topk_group>groups", grouped_topk, ValueError, "topk_group", X, LOGITS8, 2, True, 4, 5),
    case("grouped_topk-topk_group-0", grouped_topk, ValueError, "topk_group", X, LOGITS8, 2, True, 4, 0),
    case("grouped_topk-topk>kept-experts", grouped_topk, ValueError, "topk", X, LOGITS8, 3, True, 4, 1),
    case("grouped_topk-scale-nan", grouped_topk, ValueError, "routed_scaling_factor", X, LOGITS8, 2, True, 4, 2,
         routed_scaling_factor=NAN),
    case("grouped_topk-scale-inf", grouped_topk, ValueError, "routed_scaling_factor", X, LOGITS8, 2, True, 4, 2,
         routed_scaling_factor=INF),
    case("grouped_topk-scale-0", grouped_topk, ValueError, "routed_scaling_factor", X, LOGITS8, 2, True, 4, 2,
         routed_scaling_factor=0.0),
    case("grouped_topk-scale-negative", grouped_topk, ValueError, "routed_scaling_factor", X, LOGITS8, 2, True, 4,
         2, routed_scaling_factor=-2.5),
    case("grouped_topk-scale-str", grouped_topk, TypeError, "routed_scaling_factor", X, LOGITS8, 2, True, 4, 2,
         routed_scaling_factor="2.5"),
    case("grouped_topk-bias-length", grouped_topk, ValueError, "e_score_correction_bias", X, LOGITS8, 2, True, 4, 2,
         e_score_correction_bias=BIAS8[:4]),
    case("grouped_topk-bias-2d", grouped_topk, ValueError, "e_score_correction_bias", X, LOGITS8, 2, True, 4, 2,
         e_score_correction_bias=BIAS8[None]),
    case("grouped_topk-bias-other-device", grouped_topk, ValueError, "e_score_correction_bias", X, LOGITS8, 2, True,
         4, 2, e_score_correction_bias=meta(BIAS8)),
    case("grouped_topk-bias-int", grouped_topk, TypeError, "e_score_correction_bias", X, LOGITS8, 2, True, 4, 2,
         e_score_correction_bias=BIAS8.long()),
    case("grouped_topk-bias-strided", grouped_topk, ValueError, "e_score_correction_bias", X, LOGITS8, 2, True, 4, 2,
         e_score_correction_bias=torch.randn(16, device=DEVICE)[::2]),
    case("grouped_topk-bias-one-expert-per-group", grouped_topk, ValueError, "num_expert_group", X, LOGITS8, 2,
         True, 8, 2, e_score_correction_bias=BIAS8),
    # ---- append_shared_expert ----------------------------------------------------------------------
    case("append_shared-weights-fp16", append_shared_expert, TypeError, "topk_weights", TW.half(), TI, E),
    case("append_shared-ids-float", append_shared_expert, TypeError, "topk_ids", TW, TI.float(), E),
    case("append_shared-ids-shape", append_shared_expert, ValueError, "topk_ids", TW, TI[:, :1], E),
    case("append_shared-ids-other-device", append_shared_expert, ValueError, "topk_ids", TW, meta(TI), E),
    case("append_shared-num_experts-0", append_shared_expert, ValueError, "num_experts", TW, TI, 0),
    case("append_shared-num_shared-0", append_shared_expert, ValueError, "num_shared_experts", TW, TI, E, 0),
    case("append_shared-weight-str", append_shared_expert, TypeError, "shared_weight", TW, TI, E,
         shared_weight="one"),
    case("append_shared-weight-nan", append_shared_expert, ValueError, "shared_weight", TW, TI, E,
         shared_weight=NAN),
    case("append_shared-weight-tensor-length", append_shared_expert, ValueError, "shared_weight", TW, TI, E,
         shared_weight=torch.ones(2, device=DEVICE)),
    case("append_shared-weight-tensor-fp16", append_shared_expert, TypeError, "shared_weight", TW, TI, E,
         shared_weight=torch.ones(3, device=DEVICE, dtype=torch.float16)),
    # ---- moe_align_block_size ----------------------------------------------------------------------
    case("align-ids-not-a-tensor", moe_align_block_size, TypeError, "topk_ids", TI.tolist(), 16, E),
    case("align-ids-float", moe_align_block_size, TypeError, "topk_ids", TI.float(), 16, E),
    case("align-ids-1d", moe_align_block_size, ValueError, "topk_ids", TI.flatten(), 16, E),
    case("align-block-0", moe_align_block_size, ValueError, "block_size", TI, 0, E),
    case("align-block-float", moe_align_block_size, TypeError, "block_size", TI, 16.0, E),
    case("align-num_experts-0", moe_align_block_size, ValueError, "num_experts", TI, 16, 0),
    case("align-ids-negative", moe_align_block_size, ValueError, "topk_ids", ids_of(-1), 16, E),
    case("align-ids>=E", moe_align_block_size, ValueError, "topk_ids", ids_of(E), 16, E),
    # ---- blocks ----------------------------------------------------------------------------------
    case("assign_blocks-block_m-24", assign_blocks, ValueError, "block_m", TI, 24, E),
    case("assign_blocks-block_m-8", assign_blocks, ValueError, "block_m", TI, 8, E),
    case("assign_blocks-block_m-str", assign_blocks, TypeError, "block_m", TI, "16", E),
    case("assign_blocks-num_experts-0", assign_blocks, ValueError, "num_experts", TI, 16, 0),
    case("assign_blocks-ids-float", assign_blocks, TypeError, "topk_ids", TI.float(), 16, E),
    case("assign_blocks-aligned-ids-negative", assign_blocks, ValueError, "topk_ids", ids_of(-1), 16, E,
         naive=False),
    case("assign_blocks-naive-ids>=E", assign_blocks, ValueError, "topk_ids", ids_of(E), 16, E, naive=True),
    case("BlockAssignment-block_m-24", BlockAssignment, ValueError, "block_m", 24, BLOCKS.expert_ids,
         BLOCKS.sorted_token_ids, BLOCKS.num_tokens_post_padded, BLOCKS.num_m_blocks),
    case("BlockAssignment-expert_ids-list", BlockAssignment, TypeError, "expert_ids", 16, [0, 1], None, None, 2),
    case("naive_block_assignment-block-0", naive_block_assignment, ValueError, "block_size", TI, 0),
    case("naive_block_assignment-ids-float", naive_block_assignment, TypeError, "topk_ids", TI.float(), 16),
    case("use_naive-num_tokens-negative", use_naive_block_assignment, ValueError, "num_tokens", -1, 2, E),
    case("use_naive-topk-0", use_naive_block_assignment, ValueError, "topk", 3, 0, E),
    case("use_naive-block_fp8-not-bool", use_naive_block_assignment, TypeError, "block_fp8", 3, 2, E, block_fp8=1),
    case("use_naive-num_experts-0", use_naive_block_assignment, ValueError, "num_experts", 3, 2, 0),
    case("naive_padded_rows-block-0", naive_padded_rows, ValueError, "block_size", 3, 2, 0),
    case("check_alignment-ids>=E", check_alignment, ValueError, "topk_ids", ids_of(E), 16, E,
         BLOCKS.sorted_token_ids, BLOCKS.expert_ids, BLOCKS.num_tokens_post_padded),
    # ---- tile configurations -----------------------------------------------------------------------
    case("get_config-layout-bogus", get_config, ValueError, "layout", 8, E, 16, 32, torch.float32, "cpu",
         layout="contiguous"),
    case("get_config-M-negative", get_config, ValueError, "M", -1, E, 16, 32, torch.float32, "cpu"),
    case("get_config-E-0", get_config, ValueError, "E", 8, 0, 16, 32, torch.float32, "cpu"),
    case("get_config-dtype-str", get_config, TypeError, "dtype", 8, E, 16, 32, "bf16", "cpu"),
    case("get_config-device-bogus", get_config, ValueError, "device", 8, E, 16, 32, torch.float32, "gpu0"),
    *([case("get_config-cuda-without-a-gpu", get_config, ValueError, "device", 8, E, 16, 32, torch.float32, "cuda")]
      if not torch.cuda.is_available() else []),
    case("get_config-permute-align-24", get_config, ValueError, "align", 8, E, 16, 32, torch.float32, "cpu",
         layout="permute", align=24),
    # ---- fused_experts -----------------------------------------------------------------------------
    case("fused_experts-hidden-list", fused_experts, TypeError, "hidden_states", **{**GOOD, "hidden_states": X.tolist()}),
    case("fused_experts-hidden-3d", fused_experts, ValueError, "hidden_states", **{**GOOD, "hidden_states": X[None]}),
    case("fused_experts-hidden-int", fused_experts, TypeError, "hidden_states", **{**GOOD, "hidden_states": X.int()}),
    case("fused_experts-hidden-column-major", fused_experts, ValueError, "hidden_states",
         **{**GOOD, "hidden_states": col_major(X)}),
    case("fused_experts-hidden-0-wide", fused_experts, ValueError, "hidden_states",
         **{**GOOD, "hidden_states": X[:, :0], "w1": W1[:, :, :0], "w2": W2[:, :0]}),
    case("fused_experts-w1-fp16", fused_experts, TypeError, "w1", **{**GOOD, "w1": W1.half()}),
    case("fused_experts-w1-2d", fused_experts, ValueError, "w1", **{**GOOD, "w1": W1[0]}),
    case("fused_experts-w1-other-device", fused_experts, ValueError, "w1", **{**GOOD, "w1": meta(W1)}),
    case("fused_experts-w1-wrong-d", fused_experts, ValueError, "w1", **{**GOOD, "w1": W1[:, :, :16]}),
    case("fused_experts-w1-odd-rows", fused_experts, ValueError, "w1", **{**GOOD, "w1": W1[:, :31]}),
    case("fused_experts-w1-column-major", fused_experts, ValueError, "w1", **{**GOOD, "w1": col_major(W1)}),
    case("fused_experts-w2-wrong-F", fused_experts, ValueError, "w2", **{**GOOD, "w2": W2[:, :, :8]}),
    case("fused_experts-w2-wrong-E", fused_experts, ValueError, "w2", **{**GOOD, "w2": W2[:3]}),
    case("fused_experts-weights-shape", fused_experts, ValueError, "topk_weights", **{**GOOD, "topk_weights": TW[:, :1]}),
    case("fused_experts-weights-int", fused_experts, TypeError, "topk_weights", **{**GOOD, "topk_weights": TW.long()}),
    case("fused_experts-ids-rows", fused_experts, ValueError, "topk_ids",
         **{**GOOD, "topk_ids": TI[:2], "topk_weights": TW[:2]}),
    case("fused_experts-k>E", fused_experts, ValueError, "topk_ids",
         **{**GOOD, "topk_ids": torch.arange(5, device=DEVICE).repeat(3, 1) % E, "topk_weights": torch.ones(3, 5, device=DEVICE)}),
    case("fused_experts-ids-float", fused_experts, TypeError, "topk_ids", **{**GOOD, "topk_ids": TI.float()}),
    case("fused_experts-ids-other-device", fused_experts, ValueError, "topk_ids", **{**GOOD, "topk_ids": meta(TI)}),
    case("fused_experts-ids-negative", fused_experts, ValueError, "topk_ids", **{**GOOD, "topk_ids": ids_of(-1)}),
    case("fused_experts-ids>=E", fused_experts, ValueError, "topk_ids", **{**GOOD, "topk_ids": ids_of(E)}),
    case("fused_experts-block_size_m-24", fused_experts, ValueError, "block_size_m", **GOOD, block_size_m=24),
    case("fused_experts-block_size_m-8", fused_experts, ValueError, "block_size_m", **GOOD, block_size_m=8),
    case("fused_experts-block_size_m-str", fused_experts, TypeError, "block_size_m", **GOOD, block_size_m="16"),
    case("fused_experts-config-str", fused_experts, TypeError, "config", **GOOD, config="fast"),
    case("fused_experts-config-dict", fused_experts, TypeError, "config", **GOOD, config=SMALL_TILES.to_dict()),
    case("fused_experts-config-block_m-48", fused_experts, ValueError, "config.block_m", **GOOD,
         config=SMALL_TILES.with_block_m(48)),
    case("fused_experts-config-block_n-24", fused_experts, ValueError, "config.gate_up.block_n", **GOOD,
         config=MoEConfig(16, GemmTiles(block_n=24, block_k=16), TILES)),
    case("fused_experts-config-block_k-8", fused_experts, ValueError, "config.down.block_k", **GOOD,
         config=MoEConfig(16, TILES, GemmTiles(16, 8))),
    case("fused_experts-config-num_warps-3", fused_experts, ValueError, "config.gate_up.num_warps", **GOOD,
         config=MoEConfig(16, GemmTiles(16, 16, num_warps=3), TILES)),
    case("fused_experts-config-group_m-0", fused_experts, ValueError, "config.down.group_m", **GOOD,
         config=MoEConfig(16, TILES, GemmTiles(16, 16, group_m=0))),
    case("fused_experts-blocks-str", fused_experts, TypeError, "blocks", **GOOD, blocks="naive"),
    case("fused_experts-blocks-naive-other-batch", fused_experts, ValueError, "blocks", **GOOD,
         blocks=assign_blocks(TI[:2], 16, E, naive=True)),
    case("fused_experts-blocks-aligned-other-batch", fused_experts, ValueError, "blocks", **GOOD,
         blocks=assign_blocks(TI[:2], 16, E, naive=False)),
    # ---- fused_moe ---------------------------------------------------------------------------------
    case("fused_moe-logits-more-columns-than-experts", fused_moe, ValueError, "gating_output", X, W1, W2,
         LOGITS8, 2, True),
    case("fused_moe-logits-1d", fused_moe, ValueError, "gating_output", X, W1, W2, LOGITS[0], 2, True),
    case("fused_moe-logits-rows", fused_moe, ValueError, "gating_output", X, W1, W2, LOGITS[:2], 2, True),
    case("fused_moe-topk>E", fused_moe, ValueError, "topk", X, W1, W2, LOGITS, E + 1, True),
    case("fused_moe-renormalize-str", fused_moe, TypeError, "renormalize", X, W1, W2, LOGITS, 2, "no"),
    case("fused_moe-w1-not-a-tensor", fused_moe, TypeError, "w1", X, None, W2, LOGITS, 2, True),
    case("fused_moe-block_size_m-24", fused_moe, ValueError, "block_size_m", X, W1, W2, LOGITS, 2, True,
         block_size_m=24),
    # ---- the index-gather stages -----------------------------------------------------------------
    case("expert_gate_up-hidden-column-major", expert_gate_up, ValueError, "hidden_states", col_major(X), W1,
         BLOCKS, 2, tiles=TILES),
    case("expert_gate_up-top_k-0", expert_gate_up, ValueError, "top_k", X, W1, BLOCKS, 0, tiles=TILES),
    case("expert_gate_up-tiles-str", expert_gate_up, TypeError, "tiles", X, W1, BLOCKS, 2, tiles="16x16"),
    case("expert_gate_up-tiles-block_n-24", expert_gate_up, ValueError, "tiles.block_n", X, W1, BLOCKS, 2,
         tiles=GemmTiles(block_n=24, block_k=16)),
    case("expert_gate_up-blocks-naive-other-batch", expert_gate_up, ValueError, "blocks", X, W1,
         assign_blocks(TI[:1], 16, E, naive=True), 2, tiles=TILES),
    case("expert_gate_up-w1-odd-rows", expert_gate_up, ValueError, "w1", X, W1[:, :31], BLOCKS, 2, tiles=TILES),
    case("expert_gate_up-w1-no-rows", expert_gate_up, ValueError, "w1", X, W1[:, :0], BLOCKS, 2, tiles=TILES),
    case("expert_gate_up-out-shape", expert_gate_up, ValueError, "out", X, W1, BLOCKS, 2, tiles=TILES,
         out=torch.empty(6, 32, device=DEVICE)),
    case("expert_gate_up-out-dtype", expert_gate_up, TypeError, "out", X, W1, BLOCKS, 2, tiles=TILES,
         out=torch.empty(6, 16, device=DEVICE, dtype=torch.float16)),
    case("expert_gate_up-out-strided", expert_gate_up, ValueError, "out", X, W1, BLOCKS, 2, tiles=TILES,
         out=torch.empty(6, 32, device=DEVICE)[:, ::2]),
    case("expert_down-intermediate-column-major", expert_down, ValueError, "intermediate", col_major(INTER), W2,
         TW, BLOCKS, tiles=TILES),
    case("expert_down-intermediate-int", expert_down, TypeError, "intermediate", INTER.int(), W2, TW, BLOCKS,
         tiles=TILES),
    case("expert_down-intermediate-rows", expert_down, ValueError, "intermediate", INTER[:5], W2, TW, BLOCKS,
         tiles=TILES),
    case("expert_down-w2-wrong-F", expert_down, ValueError, "w2", INTER, W2[:, :, :8], TW, BLOCKS, tiles=TILES),
    case("expert_down-w2-no-rows", expert_down, ValueError, "w2", INTER, W2[:, :0], TW, BLOCKS, tiles=TILES),
    case("expert_down-weights-other-device", expert_down, ValueError, "topk_weights", INTER, W2, meta(TW), BLOCKS,
         tiles=TILES),
    case("expert_down-out-shape", expert_down, ValueError, "out", INTER, W2, TW, BLOCKS, tiles=TILES,
         out=torch.empty(3, 32, device=DEVICE)),
    # ---- permute -----------------------------------------------------------------------------------
    case("permute-num_experts-0", permute, ValueError, "num_experts", X, TI, 0, align=16),
    case("permute-ids-rows", permute, ValueError, "topk_ids", X, TI[:2], E, align=16),
    case("permute-ids-no-columns", permute, ValueError, "topk_ids", X, TI[:, :0], E, align=16),
    case("permute-align-0", permute, ValueError, "align", X, TI, E, align=0),
    case("permute-ids>=E", permute, ValueError, "topk_ids", X, ids_of(E), E, align=16),
    case("permute-out-shape", permute, ValueError, "out", X, TI, E, align=16, out=torch.empty(5, 32, device=DEVICE)),
    case("permute-out-dtype", permute, TypeError, "out", X, TI, E, align=16,
         out=torch.empty(64, 32, device=DEVICE, dtype=torch.float16)),
    case("grouped_gemm_contiguous-x-3d", grouped_gemm_contiguous, ValueError, "x", ROWS[None], W1, M_IDX, align=16),
    case("grouped_gemm_contiguous-w-dtype", grouped_gemm_contiguous, TypeError, "w", ROWS, W1.half(), M_IDX,
         align=16),
    case("grouped_gemm_contiguous-w-wrong-K", grouped_gemm_contiguous, ValueError, "w", ROWS, W1[:, :, :16], M_IDX,
         align=16),
    case("grouped_gemm_contiguous-m_indices-int64", grouped_gemm_contiguous, TypeError, "m_indices", ROWS, W1,
         M_IDX.long(), align=16),
    case("grouped_gemm_contiguous-m_indices-length", grouped_gemm_contiguous, ValueError, "m_indices", ROWS, W1,
         M_IDX[:16], align=16),
    case("grouped_gemm_contiguous-m_indices-strided", grouped_gemm_contiguous, ValueError, "m_indices", ROWS, W1,
         M_IDX.repeat_interleave(2)[::2], align=16),
    case("grouped_gemm_contiguous-rows-not-multiple-of-align", grouped_gemm_contiguous, ValueError, "m_indices",
         ROWS, W1, M_IDX, align=24),
    case("grouped_gemm_contiguous-align-24", grouped_gemm_contiguous, ValueError, "align",
         torch.randn(48, 32, device=DEVICE), W1, torch.zeros(48, dtype=torch.int32, device=DEVICE), align=24),
    case("grouped_gemm_contiguous-silu-odd-w", grouped_gemm_contiguous, ValueError, "w", ROWS, W1[:, :31], M_IDX,
         align=16, silu_mul=True),
    case("grouped_gemm_contiguous-config-str", grouped_gemm_contiguous, TypeError, "config", ROWS, W1, M_IDX,
         align=16, config="fast"),
    case("grouped_gemm_contiguous-config-block_m-32-align-16", grouped_gemm_contiguous, ValueError,
         "config.block_m", ROWS, W1, M_IDX, align=16, config=SMALL_TILES.with_block_m(32)),
    case("grouped_gemm_contiguous-out-shape", grouped_gemm_contiguous, ValueError, "out", ROWS, W1, M_IDX, align=16,
         silu_mul=True, config=SMALL_TILES, out=torch.empty(32, 32, device=DEVICE)),
    case("grouped_gemm_contiguous-which-bogus", grouped_gemm_contiguous, ValueError, "which", ROWS, W1, M_IDX,
         align=16, config=SMALL_TILES, which="up"),
    case("permute_experts-align-24", permute_experts, ValueError, "align", **GOOD, align=24),
    case("permute_experts-align-0", permute_experts, ValueError, "align", **GOOD, align=0),
    case("permute_experts-config-str", permute_experts, TypeError, "config", **GOOD, align=16, config="fast"),
    case("permute_experts-config-block_m-256", permute_experts, ValueError, "config.block_m", **GOOD, align=128,
         config=SMALL_TILES.with_block_m(256)),
    case("permute_experts-config-block_m-48", permute_experts, ValueError, "config.block_m", **GOOD, align=16,
         config=SMALL_TILES.with_block_m(48)),
    case("permute_experts-ids>=E", permute_experts, ValueError, "topk_ids", **{**GOOD, "topk_ids": ids_of(E)},
         align=16),
    case("permute_experts-k>E", permute_experts, ValueError, "topk_ids",
         **{**GOOD, "topk_ids": torch.arange(5, device=DEVICE).repeat(3, 1) % E, "topk_weights": torch.ones(3, 5, device=DEVICE)}, align=16),
    case("torch_grouped_mm-align-0", torch_grouped_mm_experts, ValueError, "align", **GOOD, align=0),
    case("torch_grouped_mm-ids-float", torch_grouped_mm_experts, TypeError, "topk_ids",
         **{**GOOD, "topk_ids": TI.float()}),
    case("weight_reader-none", weight_reader, ValueError, "tensors"),
    case("weight_reader-not-a-tensor", weight_reader, TypeError, "tensors[0]", [1.0] * 64),
    case("weight_reader-strided", weight_reader, ValueError, "tensors[1]", torch.ones(64), torch.ones(64, 2)[:, 0],
         block=16),
    case("weight_reader-bytes", weight_reader, ValueError, "tensors[0]", torch.ones(24), block=16),
    case("weight_reader-block-0", weight_reader, ValueError, "block", torch.ones(64), block=0),
    case("weight_reader-block-24", weight_reader, ValueError, "block", torch.ones(96), block=24),
    case("weight_reader-unaligned", weight_reader, ValueError, "tensors[0]",
         torch.ones(65, dtype=torch.float16)[1:], block=8),
    # ---- masked ------------------------------------------------------------------------------------
    case("masked_dispatch-m_max-0", masked_dispatch, ValueError, "m_max", X, TI, E, m_max=0),
    case("masked_dispatch-m_max-too-small", masked_dispatch, ValueError, "m_max", X, ids_of(1), E, m_max=2),
    case("masked_dispatch-num_experts-0", masked_dispatch, ValueError, "num_experts", X, TI, 0, m_max=4),
    case("masked_dispatch-ids-negative", masked_dispatch, ValueError, "topk_ids", X, ids_of(-1), E, m_max=4),
    case("masked_dispatch-hidden-int", masked_dispatch, TypeError, "hidden_states", X.int(), TI, E, m_max=4),
    case("masked_dispatch-out-shape", masked_dispatch, ValueError, "out", X, TI, E, m_max=4,
         out=torch.empty(E, 3, 32, device=DEVICE)),
    case("grouped_gemm_masked-x-2d", grouped_gemm_masked, ValueError, "x", SLABS[0], W1, MASKED_M),
    case("grouped_gemm_masked-w-experts", grouped_gemm_masked, ValueError, "w", SLABS, W1[:3], MASKED_M),
    case("grouped_gemm_masked-masked_m-length", grouped_gemm_masked, ValueError, "masked_m", SLABS, W1,
         MASKED_M[:3]),
    case("grouped_gemm_masked-masked_m-int64", grouped_gemm_masked, TypeError, "masked_m", SLABS, W1,
         MASKED_M.long()),
    case("grouped_gemm_masked-config-str", grouped_gemm_masked, TypeError, "config", SLABS, W1, MASKED_M,
         config="fast"),
    case("grouped_gemm_masked-out-dtype", grouped_gemm_masked, TypeError, "out", SLABS, W1, MASKED_M,
         config=SMALL_TILES, out=torch.empty(E, 8, 32, device=DEVICE, dtype=torch.bfloat16)),
    case("grouped_gemm_masked-which-bogus", grouped_gemm_masked, ValueError, "which", SLABS, W1, MASKED_M,
         config=SMALL_TILES, which="block_m"),
    case("masked_experts-m_max-0", masked_experts, ValueError, "m_max", **GOOD, m_max=0),
    case("masked_experts-m_max-str", masked_experts, TypeError, "m_max", **GOOD, m_max="256"),
    case("masked_experts-config-str", masked_experts, TypeError, "config", **GOOD, config="fast"),
    case("masked_experts-config-block_m-48", masked_experts, ValueError, "config.block_m", **GOOD,
         config=SMALL_TILES.with_block_m(48)),
    case("masked_experts-ids>=E", masked_experts, ValueError, "topk_ids", **{**GOOD, "topk_ids": ids_of(E)}),
    case("masked_experts-duplicates-overflow-m_max", masked_experts, ValueError, "m_max",
         **{**GOOD, "topk_ids": ids_of(0)}, m_max=4, validate_ids=False),
    # ---- the top-k sum -----------------------------------------------------------------------------
    case("moe_sum-x-2d", moe_sum, ValueError, "x", X),
    case("moe_sum-x-int", moe_sum, TypeError, "x", torch.zeros(3, 2, 4, dtype=torch.int32)),
    case("moe_sum-x-column-major", moe_sum, ValueError, "x", col_major(torch.randn(3, 4, 8, device=DEVICE))),
    case("moe_sum-out-shape", moe_sum, ValueError, "out", torch.randn(3, 2, 8, device=DEVICE),
         out=torch.empty(3, 2, device=DEVICE)),
    case("moe_sum-out-dtype", moe_sum, TypeError, "out", torch.randn(3, 2, 8, device=DEVICE),
         out=torch.empty(3, 8, device=DEVICE, dtype=torch.bfloat16)),
    case("unpermute-y-3d", unpermute, ValueError, "y_rows", ROWS[None], TI.int(), TW),
    case("unpermute-src2dst-int64", unpermute, TypeError, "src2dst", ROWS, TI, TW),
    case("unpermute-src2dst-strided", unpermute, ValueError, "src2dst", ROWS, col_major(TI.int()), TW),
    case("unpermute-src2dst-other-device", unpermute, ValueError, "src2dst", ROWS, meta(TI.int()), TW),
    case("unpermute-weights-shape", unpermute, ValueError, "topk_weights", ROWS, TI.int(), TW[:, :1]),
    case("unpermute-out-shape", unpermute, ValueError, "out", ROWS, TI.int(), TW, out=torch.empty(3, 16, device=DEVICE)),
    # ---- shared experts ----------------------------------------------------------------------------
    case("shared_expert_separate-w1-odd", shared_expert_separate, ValueError, "w1_shared", X, W1S[:31], W2S),
    case("shared_expert_separate-w2-shape", shared_expert_separate, ValueError, "w2_shared", X, W1S, W2S[:, :8]),
    case("shared_expert_separate-w1-dtype", shared_expert_separate, TypeError, "w1_shared", X, W1S.half(), W2S),
    case("moe_with_shared_separate-w1_shared-wrong-d", moe_with_shared_separate, ValueError, "w1_shared", X, W1, W2,
         TW, TI, W1S[:, :16], W2S),
    case("moe_with_shared_separate-config-str", moe_with_shared_separate, TypeError, "config", X, W1, W2, TW, TI,
         W1S, W2S, config="fast"),
    case("stack_shared_expert-w1_shared-shape", stack_shared_expert, ValueError, "w1_shared", W1, W2, W1S[:16], W2S),
    case("stack_shared_expert-w2_shared-shape", stack_shared_expert, ValueError, "w2_shared", W1, W2, W1S,
         W2S[:, :8]),
    case("stack_shared_expert-w2-dtype", stack_shared_expert, TypeError, "w2", W1, W2.half(), W1S, W2S),
    case("moe_with_shared_fused-weights-k+1", moe_with_shared_fused, ValueError, "topk_weights", X, W1ALL, W2ALL,
         torch.ones(3, 3, device=DEVICE), TI),
    case("moe_with_shared_fused-no-routed-expert", moe_with_shared_fused, ValueError, "w1_with_shared", X,
         W1ALL[:1], W2ALL[:1], TW[:, :1], TI[:, :1] * 0),
    case("moe_with_shared_fused-ids==E", moe_with_shared_fused, ValueError, "topk_ids", X, W1ALL, W2ALL, TW,
         ids_of(E)),
    case("moe_with_shared_fused-hidden-list", moe_with_shared_fused, TypeError, "hidden_states", X.tolist(), W1ALL,
         W2ALL, TW, TI),
    case("moe_with_shared_fused-w2-wrong-shape", moe_with_shared_fused, ValueError, "w2_with_shared", X, W1ALL,
         W2ALL[:, :, :8], TW, TI),
    case("moe_with_shared_fused-shared_weight-str", moe_with_shared_fused, TypeError, "shared_weight", X, W1ALL,
         W2ALL, TW, TI, shared_weight="1"),
    case("moe_with_shared_fused-config-str", moe_with_shared_fused, TypeError, "config", X, W1ALL, W2ALL, TW, TI,
         config="fast"),
    # ---- capacity-factor dropping ------------------------------------------------------------------
    case("moe_with_capacity-factor-0", moe_with_capacity, ValueError, "capacity_factor", **GOOD, capacity_factor=0),
    case("moe_with_capacity-factor-nan", moe_with_capacity, ValueError, "capacity_factor", **GOOD,
         capacity_factor=NAN),
    case("moe_with_capacity-factor-inf", moe_with_capacity, ValueError, "capacity_factor", **GOOD,
         capacity_factor=INF),
    case("moe_with_capacity-factor-negative", moe_with_capacity, ValueError, "capacity_factor", **GOOD,
         capacity_factor=-1.25),
    case("moe_with_capacity-factor-str", moe_with_capacity, TypeError, "capacity_factor", **GOOD,
         capacity_factor="1.25"),
    case("moe_with_capacity-factor-bool", moe_with_capacity, TypeError, "capacity_factor", **GOOD,
         capacity_factor=True),
    case("moe_with_capacity-ids>=E", moe_with_capacity, ValueError, "topk_ids", **{**GOOD, "topk_ids": ids_of(E)},
         capacity_factor=1.25),
    # ---- the layer ---------------------------------------------------------------------------------
    case("moe_layer-hidden-list", moe_layer, TypeError, "hidden_states", X.tolist(), layer_weights(),
         routing=Routing(2)),
    case("moe_layer-hidden-3d", moe_layer, ValueError, "hidden_states", X[None], layer_weights(), routing=Routing(2)),
    case("moe_layer-weights-tuple", moe_layer, TypeError, "weights", X, (GATE_W, W1, W2), routing=Routing(2)),
    case("moe_layer-routing-str", moe_layer, TypeError, "routing", X, layer_weights(), routing="softmax"),
    case("moe_layer-layout-bogus", moe_layer, ValueError, "layout", X, layer_weights(), routing=Routing(2),
         layout="contiguous"),
    case("moe_layer-config-str", moe_layer, TypeError, "config", X, layer_weights(), routing=Routing(2),
         config="fast"),
    case("moe_layer-config-block_m-48", moe_layer, ValueError, "config.block_m", X, layer_weights(),
         routing=Routing(2), layout="masked", config=SMALL_TILES.with_block_m(48)),
    case("LayerWeights-gate-wrong-d", layer_weights, ValueError, "gate", gate=GATE_W[:, :16]),
    case("moe_layer-gate-other-device", moe_layer, ValueError, "hidden_states", X,
         LayerWeights(meta(GATE_W), meta(W1), meta(W2)), routing=Routing(2)),
    case("LayerWeights-gate-other-device", layer_weights, ValueError, "w13", gate=meta(GATE_W)),
    case("LayerWeights-w13-wrong-E", layer_weights, ValueError, "w13", w13=W1[:3]),
    case("LayerWeights-w13-wrong-d", layer_weights, ValueError, "w13", w13=W1[:, :, :16]),
    case("moe_layer-w13-dtype", moe_layer, TypeError, "hidden_states", X, LayerWeights(GATE_W, W1.half(), W2.half()),
         routing=Routing(2)),
    case("LayerWeights-w2-dtype", layer_weights, TypeError, "w2", w13=W1.half()),
    case("LayerWeights-w2-wrong-shape", layer_weights, ValueError, "w2", w2=W2[:, :, :8]),
    case("LayerWeights-bias-length", layer_weights, ValueError, "bias", bias=torch.zeros(3, device=DEVICE)),
    case("LayerWeights-shared-w13-alone", layer_weights, ValueError, "shared_w2", shared_w13=W1S),
    case("LayerWeights-shared_w13-wrong-d", layer_weights, ValueError, "shared_w13", shared_w13=W1S[:, :16],
         shared_w2=W2S),
    case("moe_layer-routing-top_k>E", moe_layer, ValueError, "routing", X, layer_weights(), routing=Routing(E + 1)),
    case("Routing-top_k-0", Routing, ValueError, "top_k", 0),
    case("Routing-top_k-str", Routing, TypeError, "top_k", "8"),
    case("Routing-scoring-relu", Routing, ValueError, "scoring_func", 2, "relu"),
    case("Routing-renormalize-str", Routing, TypeError, "renormalize", 2, renormalize="yes"),
    case("Routing-groups-0", Routing, ValueError, "num_expert_group", 2, num_expert_group=0, topk_group=1),
    case("Routing-scale-nan", Routing, ValueError, "routed_scaling_factor", 2, routed_scaling_factor=NAN),
    case("Routing-scale-negative", Routing, ValueError, "routed_scaling_factor", 2, routed_scaling_factor=-1.0),
    case("MoELayer-layout-bogus", MoELayer, ValueError, "layout", layer_weights(), Routing(2), layout="gather"),
    case("MoELayer-shared_expert-bogus", MoELayer, ValueError, "shared_expert", layer_weights(), Routing(2),
         shared_expert="both"),
    case("MoELayer-weights-dict", MoELayer, TypeError, "weights", dict(gate=GATE_W, w13=W1, w2=W2), Routing(2)),
    case("MoELayer-routing-int", MoELayer, TypeError, "routing", layer_weights(), 2),
    case("LayerWeights-w2-wrong-E", layer_weights, ValueError, "w2", w2=W2[:3]),
    case("MoELayer.random-device-gpu0", MoELayer.random, ValueError, "device", "qwen3-30b-a3b", dtype=torch.float32,
         device="gpu0", seed=0, hidden_size=32, intermediate_size=16),
    case("MoELayer-masked-fp8", MoELayer, ValueError, "layout", FP8_WEIGHTS, Routing(2), layout="masked"),
    case("moe_layer-masked-fp8", moe_layer, ValueError, "layout", X, FP8_WEIGHTS, routing=Routing(2), layout="masked"),
    case("LayerWeights-w13_scale-rank", layer_weights, ValueError, "w13_scale", w13=FP8_WEIGHTS.w13,
         w2=FP8_WEIGHTS.w2, w13_scale=FP8_WEIGHTS.w13_scale[..., None], w2_scale=FP8_WEIGHTS.w2_scale),
    case("LayerWeights-w2_scale-other-format", layer_weights, ValueError, "w2_scale", w13=FP8_WEIGHTS.w13,
         w2=FP8_WEIGHTS.w2, w13_scale=FP8_WEIGHTS.w13_scale, w2_scale=FP8_WEIGHTS.w2_scale[:, 0]),
    case("LayerWeights-quantized-bogus", lambda: layer_weights().quantized("mxfp4"), ValueError, "granularity"),
    case("MoEConfig.from_dict-missing-down", MoEConfig.from_dict, ValueError, "d",
         {"block_m": 16, "gate_up": {"block_n": 32, "block_k": 64}}),
    case("MoEConfig.from_dict-tiles-unknown-key", MoEConfig.from_dict, ValueError, "d['down']",
         {"block_m": 16, "gate_up": {"block_n": 32, "block_k": 64}, "down": {"block_n": 32, "block_k": 64, "warps": 4}}),
    case("MoEConfig.from_dict-list", MoEConfig.from_dict, TypeError, "d", [16]),
    case("fused_experts-blocks-given-ids>=E", fused_experts, ValueError, "topk_ids", **{**GOOD, "topk_ids": ids_of(E)},
         blocks=BLOCKS),
    case("choose_config-device_name-int", choose_config, TypeError, "device_name", 8, E, 16, 32, torch.float32,
         "cpu", device_name=200),
    case("MoELayer.random-model-bogus", MoELayer.random, ValueError, "model", "gpt-5", dtype=torch.float32,
         device="cpu", seed=0),
    case("MoELayer.random-hidden_size-negative", MoELayer.random, ValueError, "hidden_size", "qwen3-30b-a3b",
         dtype=torch.float32, device="cpu", seed=0, hidden_size=-32, intermediate_size=16),
    case("MoELayer.random-dtype-str", MoELayer.random, TypeError, "dtype", "qwen3-30b-a3b", dtype="float32",
         device="cpu", seed=0, hidden_size=32, intermediate_size=16),
    case("MoELayer.random-fused-two-shared", MoELayer.random, ValueError, "shared_w13", "deepseek-v2-lite",
         dtype=torch.float32, device="cpu", seed=0, hidden_size=16, intermediate_size=16, shared_expert="fused"),
    # ---- the checkpoint loader ---------------------------------------------------------------------
    case("load_layer-config-norm_topk_prob-str", load_layer, TypeError, "config['norm_topk_prob']", STATE, layer=0,
         config={**CONFIG, "norm_topk_prob": "false"}),
    case("load_layer-config-n_shared_experts-float", load_layer, TypeError, "config['n_shared_experts']", STATE,
         layer=0, config={**CONFIG, "n_shared_experts": 1.0}),
    case("load_layer-config-scoring-int", load_layer, TypeError, "config['scoring_func']", STATE, layer=0,
         config={**CONFIG, "scoring_func": 1}),
    case("load_layer-config-two-shared-sizes", load_layer, ValueError, "config['shared_expert_intermediate_size']",
         STATE, layer=0, config={**CONFIG, "n_shared_experts": 1, "shared_expert_intermediate_size": 12}),
    case("load_layer-source-mixed-dtypes", load_layer, TypeError, "source",
         {**STATE, "model.layers.0.mlp.experts.2.up_proj.weight": STATE["model.layers.0.mlp.experts.2.up_proj.weight"].half()},
         layer=0, config=CONFIG),
    case("load_layer-source-fp8-among-bf16", load_layer, TypeError, "source",
         {**STATE, "model.layers.0.mlp.experts.1.down_proj.weight":
          STATE["model.layers.0.mlp.experts.1.down_proj.weight"].to(torch.float8_e4m3fn)},
         layer=0, config=CONFIG, dtype=torch.bfloat16),
    case("load_layer-source-undeclared-shared-expert", load_layer, ValueError, "source",
         {**STATE, **{f"model.layers.0.mlp.shared_expert.{n}.weight": torch.zeros(s) for n, s in
                      (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6)))},
          "model.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, 8)}, layer=0, config=CONFIG),
    case("load_layer-layer-negative", load_layer, ValueError, "layer", STATE, layer=-1, config=CONFIG),
    case("load_layer-layer-str", load_layer, TypeError, "layer", STATE, layer="0", config=CONFIG),
    case("load_layer-layer-bool", load_layer, TypeError, "layer", STATE, layer=False, config=CONFIG),
    case("load_layer-layer-not-moe", load_layer, ValueError, "source", STATE, layer=5, config=CONFIG),
    case("load_layer-config-int", load_layer, TypeError, "config", STATE, layer=0, config=42),
    case("load_layer-config-missing-file", load_layer, ValueError, "config", STATE, layer=0,
         config="/nonexistent/config.json"),
    case("load_layer-config-missing-key", load_layer, ValueError, "config['hidden_size']", STATE, layer=0,
         config={k: v for k, v in CONFIG.items() if k != "hidden_size"}),
    case("load_layer-config-topk>E", load_layer, ValueError, "config['num_experts_per_tok']", STATE, layer=0,
         config={**CONFIG, "num_experts_per_tok": 5}),
    case("load_layer-config-scoring-bogus", load_layer, ValueError, "config['scoring_func']", STATE, layer=0,
         config={**CONFIG, "scoring_func": "relu"}),
    case("load_layer-config-scale-nan", load_layer, ValueError, "config['routed_scaling_factor']", STATE, layer=0,
         config={**CONFIG, "routed_scaling_factor": NAN}),
    case("load_layer-config-scale-str", load_layer, TypeError, "config['routed_scaling_factor']", STATE, layer=0,
         config={**CONFIG, "routed_scaling_factor": "2.5"}),
    case("load_layer-config-groups-not-dividing", load_layer, ValueError, "config['n_group']", STATE, layer=0,
         config={**CONFIG, "n_group": 3, "topk_group": 1}),
    case("load_layer-source-int", load_layer, TypeError, "source", 42, layer=0, config=CONFIG),
    case("load_layer-source-int-no-config", load_layer, TypeError, "source", 42, layer=0),
    case("load_layer-source-missing-path", load_layer, ValueError, "source", "/nonexistent/checkpoint", layer=0),
    case("load_layer-source-missing-tensor", load_layer, ValueError, "source",
         {k: v for k, v in STATE.items() if "experts.1.up_proj" not in k}, layer=0, config=CONFIG),
    case("load_layer-source-wrong-shape", load_layer, ValueError, "source", STATE, layer=0,
         config={**CONFIG, "moe_intermediate_size": 5}),
    case("load_layer-source-not-tensors", load_layer, TypeError, "source",
         {k: v.tolist() for k, v in STATE.items()}, layer=0, config=CONFIG),
    case("load_layer-dtype-str", load_layer, TypeError, "dtype", STATE, layer=0, config=CONFIG, dtype="bf16"),
    case("load_layer-dtype-int", load_layer, TypeError, "dtype", STATE, layer=0, config=CONFIG, dtype=torch.int8),
    case("load_layer-device-bogus", load_layer, ValueError, "device", STATE, layer=0, config=CONFIG, device="gpu0"),
    # ---- model: shapes -----------------------------------------------------------------------------
    case("bytes_per_weight-name", shapes.bytes_per_weight, ValueError, "dtype", "fp7"),
    case("bytes_per_weight-negative", shapes.bytes_per_weight, ValueError, "dtype", -1.0),
    case("bytes_per_weight-nan", shapes.bytes_per_weight, ValueError, "dtype", NAN),
    case("bytes_per_weight-list", shapes.bytes_per_weight, TypeError, "dtype", ["fp8"]),
    case("GPU.ridge-dtype", H200.ridge, ValueError, "dtype", "fp7"),
    case("Attention-kind-bogus", shapes.Attention, ValueError, "kind", "mha", 32),
    # ---- model: costs ------------------------------------------------------------------------------
    case("experts_touched-batch-negative", costs.experts_touched, ValueError, "batch", -1, 256, 8),
    case("experts_touched-batch-nan", costs.experts_touched, ValueError, "batch", NAN, 256, 8),
    case("experts_touched-batch-str", costs.experts_touched, TypeError, "batch", "64", 256, 8),
    case("experts_touched-num_experts-0", costs.experts_touched, ValueError, "num_experts", 4, 0, 1),
    case("experts_touched-num_experts-float", costs.experts_touched, TypeError, "num_experts", 4, 256.0, 8),
    case("experts_touched-top_k>E", costs.experts_touched, ValueError, "top_k", 4, 8, 9),
    case("batch_for_fraction-1.5", costs.batch_for_fraction, ValueError, "fraction", 1.5, 256, 8),
    case("batch_for_fraction-nan", costs.batch_for_fraction, ValueError, "fraction", NAN, 256, 8),
    case("moe_layer_flops-batch-negative", costs.moe_layer_flops, ValueError, "batch", -1, DSV3),
    case("moe_layer_flops-model-name", costs.moe_layer_flops, TypeError, "model", 1, "gpt-5"),
    case("moe_layer_weight_bytes-dtype", costs.moe_layer_weight_bytes, ValueError, "dtype", 1, DSV3, "fp7"),
    case("moe_intensity-batch-0", costs.moe_intensity, ValueError, "batch", 0, 256, 8, 1.0),
    case("moe_intensity-bytes-0", costs.moe_intensity, ValueError, "bytes_per_w", 1, 256, 8, 0.0),
    case("dense_intensity-bytes-0", costs.dense_intensity, ValueError, "bytes_per_w", 1, 0),
    case("ridge_batch_dense-ridge-negative", costs.ridge_batch_dense, ValueError, "ridge", -1.0, 1.0),
    case("ridge_batch_moe-ridge-nan", costs.ridge_batch_moe, ValueError, "ridge", 256, 8, NAN, 1.0),
    case("ridge_batch_moe-ridge-inf", costs.ridge_batch_moe, ValueError, "ridge", 256, 8, INF, 1.0),
    case("ridge_batch_moe-ridge-0", costs.ridge_batch_moe, ValueError, "ridge", 256, 8, 0.0, 1.0),
    case("step_time-bandwidth-0", costs.step_time_weight_streaming, ValueError, "bandwidth", 1, DSV3, "fp8", 0.0),
    case("expected_padded_rows-batch-negative", costs.expected_padded_rows, ValueError, "batch", -1, 256, 8, 16),
    case("expected_padded_rows-batch-float", costs.expected_padded_rows, TypeError, "batch", 2.5, 256, 8, 16),
    case("expected_padded_rows-block-0", costs.expected_padded_rows, ValueError, "block", 4, 256, 8, 0),
    case("padding_factor-batch-0", costs.padding_factor, ValueError, "batch", 0, 256, 8, 16),
    case("padding_factor_small_batch-batch-0", costs.padding_factor_small_batch_limit, ValueError, "batch", 0, 256,
         8, 16),
    case("shared_overhead-batch-nan", costs.shared_expert_byte_overhead, ValueError, "batch", NAN, 256, 8),
    case("shared_share-batch-0", costs.shared_expert_byte_share, ValueError, "batch", 0, 256, 8),
    case("shared_overhead-num_shared-0", costs.shared_expert_byte_overhead, ValueError, "num_shared_experts", 1, 256,
         8, 0),
    case("parameter_count-model-name", costs.parameter_count, TypeError, "model", "gpt-5"),
    case("decode_flops_per_token-model-int", costs.decode_flops_per_token, TypeError, "model", 7),
    case("weight_bytes-params-negative", costs.weight_bytes, ValueError, "params", -1, "bf16"),
    case("usable_memory-utilization-1.5", costs.usable_memory_bytes, ValueError, "gpu_memory_utilization", H200, 1.5),
    case("roofline_time-gpu_flops-0", costs.roofline_time, ValueError, "gpu_flops", 1.0, 1.0, 0.0, 1.0),
    case("count_work-ids-list", costs.count_work, TypeError, "topk_ids", DSV3, [[0, 1]], 2),
    case("count_work-bytes-0", costs.count_work, ValueError, "bytes_per_element", DSV3, TI, 0),
    case("dense_work-num_tokens-negative", costs.dense_work, ValueError, "num_tokens", DSV3, -1, 2),
    # ---- model: memory -----------------------------------------------------------------------------
    case("memory_budget-gpu-str", memory.memory_budget, TypeError, "gpu", "H200"),
    case("memory_budget-utilization-0", memory.memory_budget, ValueError, "gpu_memory_utilization", H200, 0.0),
    case("memory_budget-reserve-nan", memory.memory_budget, ValueError, "reserve_gib", H200, 0.92, NAN),
    case("memory_budget-reserve-too-big", memory.memory_budget, ValueError, "reserve_gib", H200, 0.92, 1000.0),
    case("gpus_needed-bytes-nan", memory.gpus_needed, ValueError, "weight_bytes", NAN, BUDGET),
    case("gpus_needed-budget-str", memory.gpus_needed, TypeError, "budget", 1e9, "H200"),
    case("gpus_needed-kv-1", memory.gpus_needed, ValueError, "kv_cache_fraction", 1e9, BUDGET, 1.0),
    case("decode_step-batch-0", memory.decode_step, ValueError, "batch", DSV3, 0, H200, "fp8"),
    case("decode_step-gpu-str", memory.decode_step, TypeError, "gpu", DSV3, 1, "H200", "fp8"),
    case("decode_step-routed_dtype", memory.decode_step, ValueError, "routed_dtype", DSV3, 1, H200, "fp7"),
    case("model_weight_bytes-rest_dtype", memory.model_weight_bytes, ValueError, "rest_dtype", DSV3, "bf16", "fp7"),
    case("routed_parameter_share-model-name", memory.routed_parameter_share, TypeError, "model", "gpt-5"),
    # ---- model: buffers ----------------------------------------------------------------------------
    case("max_padded_rows-align-0", buffers.max_padded_rows, ValueError, "align", 8, 256, 0),
    case("max_padded_rows-assignments-negative", buffers.max_padded_rows, ValueError, "num_assignments", -1, 256, 128),
    case("permute_copy_bytes-dtype-str", buffers.permute_copy_bytes, TypeError, "dtype", 1, 8, 2048, "bf16"),
    case("masked_buffer_bytes-dtype-str", buffers.masked_buffer_bytes, TypeError, "dtype", 128, 256, 2048, 768,
         "bf16"),
    case("m_max_token_budget-negative", buffers.m_max_token_budget, ValueError, "num_tokens", -1),
    case("m_max_token_budget-block-0", buffers.m_max_token_budget, ValueError, "block", 1, 0),
    case("m_max_measured_cap-ids>=E", buffers.m_max_measured_cap, ValueError, "topk_ids", ids_of(E), E),
    case("choose_layout-budget-negative", buffers.choose_layout, ValueError, "budget_bytes", 64, 8, 128, 2048, 768,
         torch.bfloat16, -1),
    case("expert_counts-ids-str", buffers.expert_counts, TypeError, "topk_ids", "0 1", E),
    case("expert_counts-num_experts-0", buffers.expert_counts, ValueError, "num_experts", TI, 0),
    # ---- model: capacity ---------------------------------------------------------------------------
    case("expert_capacity-factor-nan", capacity.expert_capacity, ValueError, "capacity_factor", 4, 2, 4, NAN),
    case("expert_capacity-factor-inf", capacity.expert_capacity, ValueError, "capacity_factor", 4, 2, 4, INF),
    case("expert_capacity-factor-0", capacity.expert_capacity, ValueError, "capacity_factor", 4, 2, 4, 0.0),
    case("expert_capacity-factor-str", capacity.expert_capacity, TypeError, "capacity_factor", 4, 2, 4, "1.0"),
    case("expert_capacity-num_tokens-negative", capacity.expert_capacity, ValueError, "num_tokens", -1, 2, 4, 1.0),
    case("expert_capacity-top_k>E", capacity.expert_capacity, ValueError, "top_k", 4, 5, 4, 1.0),
    case("capacity_assign-capacity-negative", capacity.capacity_assign, ValueError, "capacity", TI, E, -1),
    case("dropped_fraction-ids>=E", capacity.dropped_fraction, ValueError, "topk_ids", ids_of(E), E, 2),
    case("expert_queue_positions-ids-float", capacity.expert_queue_positions, TypeError, "topk_ids", TI.float(), E),
    case("expected_dropped-popularity-length", capacity.expected_dropped_fraction, ValueError, "popularity", 4, 2, 4,
         1.0, torch.full((3,), 1 / 3, dtype=torch.float64)),
    case("monte_carlo-trials-0", capacity.monte_carlo_dropped_fraction, ValueError, "trials", 4, 2, 4, 1.0,
         trials=0),
    case("ensure_capacity-policy-drop", capacity.ensure_capacity, ValueError, "on_overflow", TI, E, 4,
         on_overflow="drop"),
    case("ensure_capacity-m_max-0", capacity.ensure_capacity, ValueError, "m_max", TI, E, 0),
    case("dropless_buffers-no-assignment", capacity.dropless_buffers, ValueError, "topk_ids", TI[:0], E, 2048, 768,
         torch.bfloat16),
    case("dropless_buffers-dtype-str", capacity.dropless_buffers, TypeError, "dtype", TI, E, 2048, 768, "bf16"),
    # ---- model: skew -------------------------------------------------------------------------------
    case("zipf-s-negative", skew.zipf_popularity, ValueError, "s", 4, -1.0),
    case("zipf-s-nan", skew.zipf_popularity, ValueError, "s", 4, NAN),
    case("zipf-s-str", skew.zipf_popularity, TypeError, "s", 4, "1"),
    case("zipf-num_experts-0", skew.zipf_popularity, ValueError, "num_experts", 0, 1.0),
    case("inclusion-top_k>E", skew.inclusion_probabilities, ValueError, "top_k", skew.zipf_popularity(4, 1.0), 5),
    case("inclusion-popularity-sum", skew.inclusion_probabilities, ValueError, "popularity", [0.5, 0.6], 1),
    case("inclusion-popularity-negative", skew.inclusion_probabilities, ValueError, "popularity", [-0.5, 1.5], 1),
    case("sample_topk_ids-num_tokens-negative", skew.sample_topk_ids, ValueError, "num_tokens", -1, PI4, 2),
    case("sample_topk_ids-inclusion-sum", skew.sample_topk_ids, ValueError, "inclusion", 4, PI4, 3),
    case("expected_contiguous_rows-block-0", skew.expected_contiguous_rows, ValueError, "block", 8, PI4, 0),
    case("expected_hottest_rows-round_to-0", skew.expected_hottest_rows, ValueError, "round_to", 8, PI4, 0),
    case("expected_rows_per_expert-num_tokens-0", skew.expected_rows_per_expert, ValueError, "num_tokens", 0, PI4),
    case("layout_rows-ids>=E", skew.layout_rows, ValueError, "topk_ids", ids_of(E), E, 16, 16),
    case("layout_rows-block-0", skew.layout_rows, ValueError, "block", TI, E, 0, 16),
    # ---- the float64 reference ---------------------------------------------------------------------
    case("moe_reference-ids>=E", moe_reference, ValueError, "topk_ids", X, W1, W2, TW, ids_of(E)),
    case("moe_reference-weights-shape", moe_reference, ValueError, "topk_weights", X, W1, W2, TW[:, :1], TI),
]


def test_the_catalogue_is_long_enough():
    assert len(BAD_INPUTS) >= 130
    ids = [p.id for p in BAD_INPUTS]
    assert len(set(ids)) == len(ids), "duplicate case ids"


@pytest.mark.parametrize("fn,args,kwargs,exc,name", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument(fn, args, kwargs, exc, name):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert re.search(r"^[\w.]+: argument '", message), f"not the package's message form: {message!r}"
    assert re.search(re.escape(f"argument '{name}'"), message), f"does not blame {name!r}: {message!r}"


# ---- edges that must give the right answer -----------------------------------------------------------


def reference_ignoring(hidden, w1, w2, weights, ids):
    """moe_reference over the valid slots only: an id outside [0, E) contributes nothing."""
    valid = (ids >= 0) & (ids < w1.shape[0])
    return moe_reference(hidden, w1, w2, torch.where(valid, weights, 0.0), torch.where(valid, ids, 0))


def empty(layout_fn, k=2, **kwargs):
    def run():
        got = layout_fn(X[:0], W1, W2, TW[:0, :k], TI[:0, :k], **kwargs)
        return got, torch.zeros(0, X.shape[1], dtype=torch.float64)
    return run


def duplicates(layout_fn, **kwargs):
    ids = torch.tensor([[2, 2], [0, 0], [2, 1]], device=DEVICE)

    def run():
        return layout_fn(X, W1, W2, TW, ids, validate_ids=False, **kwargs), moe_reference(X, W1, W2, TW, ids)
    return run


def out_of_range_unchecked(layout_fn, **kwargs):
    ids = torch.tensor([[2, E], [0, -1], [E + 7, 1]], device=DEVICE)

    def run():
        return (layout_fn(X, W1, W2, TW, ids, validate_ids=False, **kwargs),
                reference_ignoring(X, W1, W2, TW, ids))
    return run


def layer_empty(layout):
    def run():
        return (moe_layer(X[:0], layer_weights(), routing=Routing(2), layout=layout),
                torch.zeros(0, X.shape[1], dtype=torch.float64))
    return run


def unpermute_rows_outside():
    y = torch.randn(5, 8, device=DEVICE)
    src2dst = torch.tensor([[0, 5], [-1, 4], [2**31 - 1, -(2**31)]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(3, 2, device=DEVICE) + 0.5
    want = torch.zeros(3, 8, dtype=torch.float64)
    want[0] = weights[0, 0].double() * y[0].double()
    want[1] = weights[1, 1].double() * y[4].double()
    return unpermute(y, src2dst, weights), want


def contiguous_gemm_ids_past_e():
    # Segment 0 names expert 1, segment 1 names expert E (out of range): its rows must be left as
    # they were (no read past the weights, nothing written), segment 0 computed as usual.
    m_indices = torch.tensor([1] * 16 + [E] * 16, dtype=torch.int32, device=DEVICE)
    out = torch.full((32, 32), 7.0, device=DEVICE)
    got = grouped_gemm_contiguous(ROWS, W1, m_indices, align=16, out=out, config=SMALL_TILES)
    want = torch.full((32, 32), 7.0, dtype=torch.float64)
    want[:16] = ROWS[:16].double() @ W1[1].double().T
    return got, want


def contiguous_gemm_negative_ids():
    m_indices = torch.tensor([-1] * 16 + [-5] * 16, dtype=torch.int32, device=DEVICE)
    out = torch.full((32, 32), 7.0, device=DEVICE)
    return (grouped_gemm_contiguous(ROWS, W1, m_indices, align=16, out=out, config=SMALL_TILES),
            torch.full((32, 32), 7.0, dtype=torch.float64))


def masked_gemm_masked_m_outside():
    # masked_m past m_max is capped at m_max, a negative one means "no rows"
    masked_m = torch.tensor([-3, 0, 99, 1], dtype=torch.int32, device=DEVICE)
    out = torch.full((E, 8, 32), 7.0, device=DEVICE)
    got = grouped_gemm_masked(SLABS, W1, masked_m, out=out, config=SMALL_TILES)
    want = torch.full((E, 8, 32), 7.0, dtype=torch.float64)
    want[2] = SLABS[2].double() @ W1[2].double().T
    want[3, :1] = SLABS[3, :1].double() @ W1[3].double().T
    return got, want


def routing_empty(fn, *args):
    def run():
        weights, ids = fn(X[:0], *args)
        assert ids.shape == weights.shape == (0, 2) and ids.dtype == torch.int32
        return weights, torch.zeros(0, 2, dtype=torch.float64)
    return run


def fused_moe_empty():
    return fused_moe(X[:0], W1, W2, LOGITS[:0], 2, True), torch.zeros(0, 32, dtype=torch.float64)


def shared_fused_empty():
    return moe_with_shared_fused(X[:0], W1ALL, W2ALL, TW[:0], TI[:0]), torch.zeros(0, 32, dtype=torch.float64)


def shared_separate_empty():
    return (moe_with_shared_separate(X[:0], W1, W2, TW[:0], TI[:0], W1S, W2S),
            torch.zeros(0, 32, dtype=torch.float64))


def capacity_empty():
    return (moe_with_capacity(X[:0], W1, W2, TW[:0], TI[:0], capacity_factor=1.25),
            torch.zeros(0, 32, dtype=torch.float64))


def k_equals_e(layout_fn, **kwargs):
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t)) for t in range(3)]).to(DEVICE)
    weights = torch.rand(3, E, generator=torch.Generator().manual_seed(9)).to(DEVICE)

    def run():
        return layout_fn(X, W1, W2, weights, ids, **kwargs), moe_reference(X, W1, W2, weights, ids)
    return run


GOOD_EDGES = [
    pytest.param(empty(fused_experts), id="fused_experts-T=0"),
    pytest.param(empty(fused_experts, naive_block_assignment=False), id="fused_experts-aligned-T=0"),
    pytest.param(empty(permute_experts, align=16), id="permute_experts-T=0"),
    pytest.param(empty(masked_experts), id="masked_experts-T=0"),
    pytest.param(empty(fused_experts, k=1), id="fused_experts-[0,1]-weights"),
    pytest.param(empty(permute_experts, k=1, align=16), id="permute_experts-[0,1]-weights"),
    pytest.param(empty(masked_experts, k=1), id="masked_experts-[0,1]-weights"),
    pytest.param(layer_empty("index_gather"), id="moe_layer-index_gather-T=0"),
    pytest.param(layer_empty("permute"), id="moe_layer-permute-T=0"),
    pytest.param(layer_empty("masked"), id="moe_layer-masked-T=0"),
    pytest.param(fused_moe_empty, id="fused_moe-T=0"),
    pytest.param(shared_fused_empty, id="moe_with_shared_fused-T=0"),
    pytest.param(shared_separate_empty, id="moe_with_shared_separate-T=0"),
    pytest.param(capacity_empty, id="moe_with_capacity-T=0"),
    pytest.param(routing_empty(fused_topk, LOGITS[:0], 2, True), id="fused_topk-T=0"),
    pytest.param(routing_empty(grouped_topk, LOGITS8[:0], 2, True, 4, 2), id="grouped_topk-T=0"),
    pytest.param(duplicates(masked_experts), id="masked_experts-duplicate-ids-unvalidated"),
    pytest.param(duplicates(masked_experts, m_max=3), id="masked_experts-duplicate-ids-tight-m_max"),
    pytest.param(duplicates(fused_experts), id="fused_experts-duplicate-ids-unvalidated"),
    pytest.param(duplicates(fused_experts, naive_block_assignment=True), id="fused_experts-naive-duplicate-ids"),
    pytest.param(duplicates(permute_experts, align=16), id="permute_experts-duplicate-ids-unvalidated"),
    pytest.param(out_of_range_unchecked(fused_experts), id="fused_experts-ids-outside-unvalidated-add-nothing"),
    pytest.param(out_of_range_unchecked(fused_experts, naive_block_assignment=True),
                 id="fused_experts-naive-ids-outside-unvalidated-add-nothing"),
    pytest.param(out_of_range_unchecked(permute_experts, align=16),
                 id="permute_experts-ids-outside-unvalidated-add-nothing"),
    pytest.param(out_of_range_unchecked(masked_experts), id="masked_experts-ids-outside-unvalidated-add-nothing"),
    pytest.param(k_equals_e(fused_experts), id="fused_experts-k=E"),
    pytest.param(k_equals_e(masked_experts), id="masked_experts-k=E"),
    pytest.param(unpermute_rows_outside, id="unpermute-src2dst-rows-outside-add-nothing"),
    pytest.param(contiguous_gemm_ids_past_e, id="grouped_gemm_contiguous-m_indices>=E-untouched"),
    pytest.param(contiguous_gemm_negative_ids, id="grouped_gemm_contiguous-m_indices-negative-untouched"),
    pytest.param(masked_gemm_masked_m_outside, id="grouped_gemm_masked-masked_m-outside-[0,m_max]"),
]


@pytest.mark.parametrize("run", GOOD_EDGES)
def test_edge_input_gives_the_right_answer(run):
    got, want = run()
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    if want.numel():
        assert rel_err(got, want) < TOLERANCE[torch.float32]


# ---- files: tuned tables, checkpoints, their JSON -------------------------------------------------------


def test_bad_tuned_tables_are_refused_naming_the_file(tmp_path, monkeypatch):
    import json

    from moe_kernels.kernels import config as tile_config

    monkeypatch.setattr(tile_config, "CONFIG_DIR", tmp_path)
    name = tile_config.table_name("GPU X", E, 16, 32, torch.float32, "index_gather")
    good = MoEConfig(16, GemmTiles(16, 32), GemmTiles(16, 32)).to_dict()
    bad_tables = [({"configs": {"64": {**good, "block_m": 24}}}, "entry '64'", "config.block_m"),
                  ({"configs": {"64": {**good, "down": {**good["down"], "num_warps": 3}}}}, "entry '64'", "num_warps"),
                  ({"configs": {"sixty-four": good}}, "entry 'sixty-four'", "sixty-four"),
                  ({"measured": {}}, ".json'", "KeyError"),
                  ("{not json", ".json'", "JSONDecodeError")]
    try:
        for body, where, detail in bad_tables:
            (tmp_path / f"{name}.json").write_text(body if isinstance(body, str) else json.dumps(body))
            tile_config.load_table.cache_clear()
            tile_config._cached_choice.cache_clear()
            with pytest.raises(ValueError, match=re.escape(f"load_table: argument 'configs/{name}")) as info:
                choose_config(64, E, 16, 32, torch.float32, "cpu", device_name="GPU X")
            assert where in str(info.value) and detail in str(info.value), str(info.value)
    finally:
        tile_config.load_table.cache_clear()
        tile_config._cached_choice.cache_clear()


def test_corrupt_checkpoint_files_are_named(tmp_path):
    import json

    from safetensors.torch import save_file

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    (tmp_path / "bad" / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match=re.escape("load_layer: argument 'source' must hold readable safetensors "
                                                   "files; model.safetensors is not one")):
        load_layer(tmp_path / "bad", layer=0)
    (tmp_path / "good").mkdir()
    save_file(STATE, str(tmp_path / "good" / "model.safetensors"))
    (tmp_path / "good" / "config.json").write_text('{"hidden_size": 8,')
    with pytest.raises(ValueError, match=r"load_layer: argument 'config' must be a readable JSON file \(.*config.json"):
        load_layer(tmp_path / "good", layer=0)
    (tmp_path / "good" / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "good" / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"load_layer: argument 'source' must be a readable JSON file \(.*index.json"):
        load_layer(tmp_path / "good", layer=0)
    (tmp_path / "good" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=re.escape("must have a 'weight_map' of tensor name -> shard file")):
        load_layer(tmp_path / "good", layer=0)
