"""The path a layer takes, not only the value it computes (issue: an fp8 layer once ran the bf16
tile table, 4-6x slower, while every value test passed).

* On the CPU, at the models' real shapes (meta tensors: shapes without data), every layout x
  weight format x batch class (1 token, decode, prefill) is planned as on an H200, and the plan
  must take the tuned table of its own weight format (an fp8 layer asking for the bf16 table
  fails here), the table entry nearest the batch, and the block map the batch calls for.
* At teaching shapes, the launches a call records must be the plan's: its tiles, its scale branch,
  its block map.
* On a GPU, the same at the real shapes, with the real tables (nothing is timed).
"""

import dataclasses
import math
import re
from unittest import mock

import pytest
import torch

from moe_kernels import MODELS, LayerWeights, MoELayer, Routing
from moe_kernels.layer import plan_layer
from moe_kernels._runtime import BACKEND, HAS_TRITON, record_launches
from moe_kernels.kernels.config import load_table, table_name
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.layouts import LAYOUTS
from moe_kernels.kernels.one_launch import runs_in_one_launch
from moe_testing import DEVICE, needs_gpu, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
BATCH_CLASSES = {"one token": 1, "decode": 64, "prefill": 4096}


def meta_layer(model_name: str, fmt: str, layout: str, shared_expert: str = "separate") -> MoELayer:
    """``model_name``'s layer at its real shape, on the meta device (no memory, no data)."""
    model = MODELS[model_name]
    e, d, f = model.num_experts, model.hidden_size, model.moe_intermediate_size
    s = model.num_shared_experts * f
    fmt = FORMATS[fmt]

    def weight(*shape):
        return torch.empty(*shape, device="meta", dtype=fmt.element or torch.bfloat16)

    def scale(experts, n, k):
        return torch.empty(fmt.scale_shape(experts, n, k), device="meta") if fmt.quantized else None

    shared = {}
    if s:
        shared = dict(shared_w13=weight(2 * s, d), shared_w2=weight(d, s))
        if fmt.quantized:
            shared.update(shared_w13_scale=scale(1, 2 * s, d)[0], shared_w2_scale=scale(1, d, s)[0])
    weights = LayerWeights(torch.empty(e, d, device="meta"), weight(e, 2 * f, d), weight(e, d, f),
                           torch.empty(e, device="meta") if model.scoring_func == "sigmoid" else None,
                           w13_scale=scale(e, 2 * f, d), w2_scale=scale(e, d, f), **shared)
    return MoELayer(weights, Routing.of(model), layout=layout, shared_expert=shared_expert)


def table_dtype(fmt: str) -> torch.dtype:
    return FORMATS[fmt].element or torch.bfloat16


@pytest.mark.parametrize("batch", BATCH_CLASSES.values(), ids=BATCH_CLASSES.keys())
@pytest.mark.parametrize("fmt", ["none", "block", "channel", "tensor"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model_name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_plan_takes_the_table_of_its_format(model_name, layout, fmt, batch):
    if not LAYOUTS[layout].supports(FORMATS[fmt]):
        with pytest.raises(ValueError, match=f"argument 'layout' must be a layout that runs {FORMATS[fmt].name}"):
            meta_layer(model_name, fmt, layout)
        return
    model = MODELS[model_name]
    plan = meta_layer(model_name, fmt, layout).plan(batch, device_name=H200)
    assert plan.format is FORMATS[fmt] and plan.layout == layout
    # The tables this package ships are index-gather tables; the other layouts borrow from them.
    wanted = table_name(H200, model.num_experts, model.moe_intermediate_size, model.hidden_size, table_dtype(fmt),
                        "index_gather")
    assert plan.choice.table == wanted, plan.choice
    assert plan.choice.source == ("table" if layout == "index_gather" else "borrowed")
    table = load_table(wanted)
    lookup = batch if layout != "masked" else max(batch, 256)   # the masked layout looks up its slab height
    assert plan.choice.entry == min(table, key=lambda m: (abs(math.log(m / lookup)), m))
    if layout == "index_gather":
        assert plan.config == table[plan.choice.entry]
        assert plan.naive_blocks == (batch * model.top_k * 4 <= model.num_experts)
    else:   # borrowed: the same tiles with the machinery the layout lacks switched off
        for gemm in ("gate_up", "down"):
            tiles, source = getattr(plan.config, gemm), getattr(table[plan.choice.entry], gemm)
            assert (tiles.block_n, tiles.block_k, tiles.num_warps, tiles.num_stages) == \
                (source.block_n, source.block_k, source.num_warps, source.num_stages)
            supports = LAYOUTS[layout]
            assert tiles.tma == (source.tma and supports.tma) and tiles.swap_ab == (source.swap_ab and supports.swap_ab)
            assert not tiles.persistent
            split_ok = supports.sum_in_gemm if gemm == "down" else supports.split_gate_up
            assert tiles.split_k == (source.split_k if split_ok else 1)
        # GEMM 2's sum into the tokens is kept where the layout has it (the permute layout does)
        entry = table[plan.choice.entry]
        assert plan.config.sum_in_gemm == (entry.sum_in_gemm and LAYOUTS[layout].sum_in_gemm)


def test_the_fp8_and_bf16_tables_differ_where_the_old_bug_hid():
    """The regression itself: at 4096 tokens the fp8 plan must not be the bf16 one."""
    bf16 = meta_layer("qwen3-30b-a3b", "none", "index_gather").plan(4096, device_name=H200)
    fp8 = meta_layer("qwen3-30b-a3b", "block", "index_gather").plan(4096, device_name=H200)
    assert "dtype=float8_e4m3fn" in fp8.choice.table and "dtype=bfloat16" in bf16.choice.table
    assert fp8.config != bf16.config


def test_a_cpu_plan_names_the_table_it_would_ask_for():
    plan = meta_layer("deepseek-v3", "block", "index_gather").plan(64, device="cpu")
    assert plan.choice.source == "default" and "dtype=float8_e4m3fn" in plan.choice.asked


@pytest.mark.parametrize("device_name, up_to", [("NVIDIA H200", 16), ("NVIDIA H100 80GB HBM3", 64), (None, 16)])
def test_a_16bit_shared_expert_runs_dense_at_decode_and_on_cublas_above(device_name, up_to):
    """Up to a per-GPU batch (the H100's measured on its own E=1 table; 16 elsewhere) a 16-bit shared expert runs on
    the dense block map with its E=1 table's tiles, above it on cuBLAS; fp8 always dense."""
    from moe_kernels.layer_shared import dense_shared_max_tokens

    assert dense_shared_max_tokens(device_name) == up_to
    layer = meta_layer("deepseek-v3", "none", "index_gather")
    for tokens in (1, up_to):   # the routed GEMMs on a dense block map: two launches
        plan = layer.plan(tokens, device_name=device_name)
        assert plan.shared_choice is not None and "E=1," in plan.shared_choice.asked
        assert plan.shared_choice.source == ("table" if device_name else "default")
    assert layer.plan(up_to + 1, device_name=device_name).shared_choice is None   # cuBLAS
    fp8 = meta_layer("deepseek-v3", "block", "index_gather", "separate")
    assert fp8.plan(4096, device_name=device_name).shared_choice is not None
    # above 16 tokens only on a tuned entry: a shape or dtype with no E=1 table there stays on cuBLAS
    lite = meta_layer("deepseek-v2-lite", "none", "index_gather")
    assert lite.plan(16, device_name=device_name).shared_choice is not None
    assert all(lite.plan(t, device_name=device_name).shared_choice is None for t in (17, 32, 64))
    assert layer.plan(64, dtype=torch.float16, device_name=device_name).shared_choice is None


def test_the_h100s_fp8_shared_expert_takes_its_forked_tiles_at_128_tokens():
    """The H100's fp8 E=1 entry at 128 tokens holds the tiles measured faster forked in the layer (session 48's
    tile search, its ``revised_s48``): 32-row token tiles, both GEMMs transposed through TMA, GEMM 1 on persistent
    grid 1; the entries beside it keep plain tiles. Pinned, since any of these tiles computes the same values."""
    layer = meta_layer("deepseek-v3", "block", "index_gather", "separate")
    plan = layer.plan(128, device_name="NVIDIA H100 80GB HBM3", captured=True)
    choice = plan.shared_choice
    assert (choice.source, choice.entry) == ("table", 128) and ",E=1," in choice.table, choice
    cfg = choice.config
    assert cfg.block_m == 32 and cfg.gate_up.swap_ab and cfg.gate_up.tma and cfg.gate_up.persistent == 1
    assert cfg.down.swap_ab and cfg.down.tma and cfg.down.persistent == 0
    neighbour = layer.plan(256, device_name="NVIDIA H100 80GB HBM3").shared_choice
    assert neighbour.entry == 256 and not neighbour.config.gate_up.swap_ab and not neighbour.config.gate_up.persistent


def test_the_dense_shared_limit_follows_the_gpu_a_cuda_device_is(monkeypatch):
    """Asked with no ``device_name``, the plan reads the GPU's name from the device: an H100 runs a bf16 shared
    expert dense at 32 and 64 tokens on its E=1 table's entries (a CUDA device stood in for on a CPU machine)."""
    from moe_kernels.kernels import config
    from moe_kernels.layer_shared import dense_shared_choice

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    weights = meta_layer("deepseek-v3", "none", "index_gather").weights
    try:
        config._cached_choice.cache_clear()
        for tokens in (32, 64):
            choice = dense_shared_choice("test", weights, tokens, torch.bfloat16, "cuda:0", None)
            assert choice is not None and choice.source == "table" and choice.entry == tokens, choice
        assert dense_shared_choice("test", weights, 65, torch.bfloat16, "cuda:0", None) is None
    finally:
        config._cached_choice.cache_clear()


def test_the_shared_experts_tables_stand_only_for_the_batches_they_were_tuned_near():
    """The shared expert's E=1 tables hold the batches they were tuned at (the H200's bf16 1-16 tokens, where the
    layer runs it dense there; fp8 1-16,384): a batch more than TABLE_REACH past a table's largest entry takes
    the defaults, not the tiles of a much smaller batch. The routed experts' tables keep their nearest
    entry at any batch."""
    from moe_kernels.kernels.config import TABLE_REACH

    layer = meta_layer("deepseek-v3", "block", "index_gather")   # fp8: its shared expert always runs dense
    top = int(16384 * TABLE_REACH)
    for tokens, source, entry in ((0, "table", 1), (1, "table", 1), (128, "table", 128), (256, "table", 256),
                                  (16384, "table", 16384), (top, "table", 16384), (top + 1, "default", None)):
        choice = layer.plan(tokens, device_name="NVIDIA H200").shared_choice
        assert (choice.source, choice.entry) == (source, entry), tokens
        assert "E=1," in choice.asked and "dtype=float8_e4m3fn" in choice.asked
    for tokens in (3, 100, 5000, 32769, 200_000):
        assert layer.plan(tokens, device_name="NVIDIA H200").choice.source == "table", tokens
    bf16 = meta_layer("deepseek-v3", "none", "index_gather")   # dense up to 16 tokens: always within reach
    assert bf16.plan(16, device_name="NVIDIA H200").shared_choice.entry == 16


@pytest.mark.parametrize("model_name, fmt", [("qwen3-30b-a3b", "none"), ("qwen3-30b-a3b", "block"),
                                             ("deepseek-v3", "none"), ("deepseek-v3", "block")])
def test_the_h100_runs_its_own_tables_the_h200s_tiles(model_name, fmt):
    """Since session 36 the H100 has index-gather tables, copies of the H200's (fp8-sweep-h200-tables-s36.json:
    at least as fast at every batch as the default tiles it ran before): a call there takes its own table's entry
    (source "table", the H100's file, the nearest entry), with the tiles the H200 takes at that batch."""
    for batch in (1, 8, 100, 512, 3000, 16384):
        h100 = meta_layer(model_name, fmt, "index_gather").plan(batch, device_name="NVIDIA H100 80GB HBM3").choice
        h200 = meta_layer(model_name, fmt, "index_gather").plan(batch, device_name="NVIDIA H200").choice
        assert h100.source == "table" and h100.table.startswith("device=NVIDIA_H100_80GB_HBM3,"), (batch, h100)
        # (the H100's own changes since: a two-phase one launch at a few tokens, the test below; DeepSeek-V3 at 512
        # tokens, GEMM 1 one expert's N tiles at a time and in fp8 GEMM 2 in two-chunk steps, the tests after it)
        own = dataclasses.replace(h100.config, one_launch=None)
        if model_name == "deepseek-v3" and h100.entry == 512:
            own = dataclasses.replace(own, gate_up=dataclasses.replace(own.gate_up, group_m=8),
                                      down=dataclasses.replace(own.down, k_chunks=1))
        assert h100.entry == h200.entry and own == h200.config, batch


def entry_ab_record(plan, key: str, record: str, variant: str) -> dict:
    """The H100 table's ``measured[key]`` names ``record`` (an A/B of the 512-token entry against ``variant``) and
    quotes its times; returns the record's row."""
    import json
    from pathlib import Path

    from moe_kernels.kernels.config import CONFIG_DIR

    table = json.loads((CONFIG_DIR / f"{plan.choice.table}.json").read_text())
    ab = table["measured"][key]
    assert ab["tokens"] == [512] and ab["record"] == f"results/nvidia-h100-80gb-hbm3/{record}"
    row = json.loads((Path(__file__).resolve().parents[1] / ab["record"]).read_text())["data"]["rows"][0]
    timed = row["lowest_us"]
    assert (round(timed["table"], 1), round(timed[variant], 1)) == (ab["us"]["512"]["table_us"],
                                                                    ab["us"]["512"]["new_us"])
    return row


def test_the_h100s_deepseek_v3_bf16_gemm_1_walks_one_expert_at_512_tokens():
    """Session 50 (variants-ds-bf16-512-s50-h100.json): on the H100, the whole experts call at 512 tokens took 0.9%
    less with GEMM 1's group_m 1 than with the H200's 8 (the four rounds of each within 0.05%); the H100's entry holds
    it, and its table names that record, whose times it quotes."""
    plan = meta_layer("deepseek-v3", "none", "index_gather").plan(512, device_name="NVIDIA H100 80GB HBM3")
    assert plan.choice.entry == 512 and plan.choice.config.gate_up.group_m == 1
    assert plan.choice.config.down.group_m == 8
    entry_ab_record(plan, "whole_call_ab_s50", "variants-ds-bf16-512-s50-h100.json", "gate_up.group_m=1")


def test_the_h100s_deepseek_v3_fp8_entry_at_512_tokens_walks_one_expert_and_chunks_gemm_2():
    """Session 51 (variants-ds-fp8-512-s51-h100.json): on the H100, the whole fp8 experts call at 512 tokens took
    0.8% less with GEMM 1's group_m 1 and GEMM 2's K steps in two 128-value chunks than on the H200's tiles (each
    change alone about half of that; the entry's and the pair's four rounds each within 0.06%); the H100's entry
    holds both, and its table names that record, whose times it quotes. The layer's plan runs that entry, chunks and
    all."""
    plan = meta_layer("deepseek-v3", "block", "index_gather").plan(512, device_name="NVIDIA H100 80GB HBM3")
    config = plan.choice.config
    assert plan.choice.entry == 512 and (config.gate_up.group_m, config.gate_up.k_chunks) == (1, 1)
    assert (config.down.group_m, config.down.k_chunks, config.down.swap_ab, config.down.tma) == (8, 2, True, True)
    assert config.stream_lag is None and config.one_launch is None   # (chunks: the two launches' kernel only)
    rows = entry_ab_record(plan, "whole_call_ab_s51", "variants-ds-fp8-512-s51-h100.json",
                           "gate_up.group_m=1,down.k_chunks=2")
    assert rows["tiles"]["gate_up.group_m=1,down.k_chunks=2"].endswith("n256 k128x2 w8 s3 tma swap")


@pytest.mark.parametrize("model_name, fmt, batches, chunked", [("qwen3-30b-a3b", "block", (1, 2, 3, 4, 5), (2, 3, 4, 5)),
                                                               ("qwen3-30b-a3b", "none", (1, 2, 3, 4, 5), ()),
                                                               ("deepseek-v3", "block", (), ()),
                                                               ("deepseek-v3", "none", (1,), ())])
def test_the_h100_runs_both_gemms_in_one_two_phase_launch_at_a_few_tokens(model_name, fmt, batches, chunked):
    """Sessions 37-39 (two-phase-swap-s38.json, two-phase-variants-s38.json, two-phase-chunks-*-s39.json): on the
    H100 the two-phase one launch, its weights as the MMA's A operand (swap_ab), beat the two GEMMs by more than 3% in
    two runs at 1-2 Qwen3 tokens in fp8 (31.7 us against 36.2 at one) and bf16, and at one DeepSeek-V3 token in bf16;
    with fp8 steps of two 128-value chunks of a row (k_chunks=2) also at Qwen3's 2 tokens (4.5% over one chunk) and at
    its '4' entry, which serves 3-5 tokens (1.07-1.14 over the two GEMMs), and in bf16 at Qwen3's '4' (1.05-1.11, one
    chunk); never in DeepSeek-V3's fp8. Where its table entry says so, the layer's plan has the router align nothing,
    and the experts make no block map (the one launch reads the routing's ids; at 5 tokens vLLM's rule would have
    aligned them); that the layer then aligns and quantises nothing first is tests/test_two_phase.py's test."""
    for batch in (1, 2, 3, 4, 5, 8):
        plan = meta_layer(model_name, fmt, "index_gather").plan(batch, device_name="NVIDIA H100 80GB HBM3")
        tiles = plan.choice.config.one_launch
        assert (tiles is not None and tiles.phases == 2 and tiles.swap_ab) == (batch in batches), (batch, tiles)
        assert (tiles is not None and tiles.k_chunks == 2) == (batch in chunked), (batch, tiles)
        if batch in batches:   # (the one launch reads the ids: no block map, aligned or naive, is made)
            assert not plan.gate_alignment and runs_in_one_launch(plan.config, plan.format), (batch, plan)
    for batch in (1, 2, 4):   # (the H200 has not measured it: its tables keep the two GEMMs)
        assert meta_layer(model_name, fmt, "index_gather").plan(batch, device_name="NVIDIA H200").choice.config \
            .one_launch is None


def test_a_reach_must_be_a_number_of_at_least_one():
    from moe_kernels.kernels.config import choose_config

    for reach, error in ((0.5, ValueError), (float("nan"), ValueError), ("2", TypeError)):
        with pytest.raises(error, match="argument 'reach'"):
            choose_config(8, 1, 2048, 7168, torch.bfloat16, "cpu", reach=reach)


# ---- what the launches say ---------------------------------------------------------------------------


def small_layer(fmt: str, layout: str, shared_expert="separate", model="deepseek-v3"):
    """The model's routing style with 32 experts at d = 256 (fp8 blocks need 128-multiples)."""
    style = dataclasses.replace(MODELS[model], num_experts=32)
    base = MoELayer.random(style, hidden_size=256, intermediate_size=128, dtype=torch.float32, device=DEVICE,
                           seed=0, layout=layout, shared_expert=shared_expert)
    return base if fmt == "none" else base.quantized(fmt)


@pytest.mark.parametrize("fmt", ["none", "block", "tensor"])
def test_block_fp8_layers_take_the_naive_map_up_to_two_tokens(fmt):
    """DeepSeek-V3 (E = 256, top-8) is inside vLLM's naive rule up to 8 tokens; its block-fp8 layer measured faster
    on the aligned map from 3 (``blocks.NAIVE_MAX_TOKENS_BLOCK_FP8``), so only block fp8 aligns there."""
    layer = meta_layer("deepseek-v3", fmt, "index_gather")
    naive = [batch for batch in range(1, 11) if layer.plan(batch, device_name=H200).naive_blocks]
    assert naive == ([1, 2] if fmt == "block" else list(range(1, 9)))


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
def test_the_layers_naive_map_groups_an_experts_tokens():
    """From two tokens on, the layer's naive block map runs both GEMMs with each expert's assignments in
    one block (``naive_group``); one token keeps one block per assignment. 64 experts, top-8: the naive
    map holds up to 2 tokens."""
    from moe_kernels.kernels.blocks import NAIVE_GROUP_MAX

    style = dataclasses.replace(MODELS["deepseek-v3"], num_experts=64)
    layer = MoELayer.random(style, hidden_size=256, intermediate_size=128, dtype=torch.float32, device=DEVICE,
                            seed=0, layout="index_gather", shared_expert="separate")
    for batch, group in ((1, 0), (2, 16 if NAIVE_GROUP_MAX >= 16 else 0)):
        x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(batch)).to(DEVICE)
        assert layer.plan(batch, dtype=x.dtype).naive_blocks
        with record_launches() as launches:
            out = layer(x)
        assert rel_err(out, layer.reference(x)) < 1e-3
        routed = [s for name, s in launches if name == "index_gather.gemm" and not s["dense"]]
        assert [(g["gemm"], g["naive"], g["naive_group"]) for g in routed] == [("gate_up", True, group),
                                                                               ("down", True, group)]


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
@pytest.mark.parametrize("fmt, batch", [("none", 9), ("block", 1), ("tensor", 9)])   # both block maps, 3 formats
def test_launches_follow_the_plan(fmt, batch):
    layer = small_layer(fmt, "index_gather")
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    plan = layer.plan(batch, dtype=x.dtype)
    with record_launches() as launches:
        out = layer(x)
    assert rel_err(out, layer.reference(x)) < 1e-3
    assert layer.plan(batch, dtype=x.dtype) is plan, "the plan is made once per batch size"
    gemms = [settings for name, settings in launches if name == "index_gather.gemm"]
    routed = [g for g in gemms if not g["dense"]]
    shared = [g for g in gemms if g["dense"]]   # an fp8 shared expert: one expert, no block map
    assert [g["gemm"] for g in routed] == ["gate_up", "down"]
    for g, tiles in zip(routed, (plan.config.gate_up, plan.config.down)):
        assert g["tiles"] == plan.format.gemm_tiles(tiles)
        assert g["scales"] == plan.format.scale_code and g["block_m"] == plan.config.block_m
        assert g["naive"] == plan.naive_blocks and not g["id_check"]   # the layer's own ids need none
    if plan.shared_choice is None:
        assert not shared
    else:
        assert [g["gemm"] for g in shared] == ["gate_up", "down"]
        for g, tiles in zip(shared, (plan.shared_choice.config.gate_up, plan.shared_choice.config.down)):
            assert g["tiles"] == plan.format.gemm_tiles(tiles) and g["scales"] == plan.format.scale_code
    names = [name for name, _ in launches]
    # One alignment at most (the routed map's, by the alignment kernel or in the router's chain; none
    # on the naive path), one top-k sum, into which the shared expert's output is added.
    aligners = names.count("align.moe_align_block_size") + names.count("chained_routing.align")
    assert aligners == (0 if plan.naive_blocks else 1), names
    assert ("chained_routing.align" in names) == plan.gate_alignment == (plan.chained and not plan.naive_blocks)
    sums = [settings for name, settings in launches if name == "combine.moe_sum"]
    assert len(sums) == 1 and sums[0]["add"] == (layer.weights.shared_w13 is not None), names


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
def test_a_shared_expert_apart_is_added_after_a_two_phase_routed_launch(monkeypatch):
    """Where the routed GEMMs are one two-phase launch (the H100's DeepSeek-V3 bf16 table at one token), the shared
    expert apart is not read by that launch's kernel (its note's ``add`` False) but added after it, in line as when
    forked (``SharedApart.for_sum`` hands a callable either way; the GPU replay test compares the two bit for bit).
    The layer's value is the float64 reference's. (16-bit weights: on the CPU the two-phase kernel runs fp8 ones by its torch reference,
    which launches nothing; tests/test_replay.py replays both formats on a GPU.)"""
    from moe_kernels import layer as layer_module
    from moe_kernels.kernels.config import OneLaunchTiles

    tiles = OneLaunchTiles(16, 16, phases=2, block_k=16, num_stages=2)
    choose = layer_module.choose_config

    def with_two_phases(m, e, *args, **kwargs):   # the routed experts' tiles (the shared expert's are e = 1)
        choice = choose(m, e, *args, **kwargs)
        return choice if e == 1 else dataclasses.replace(choice, config=dataclasses.replace(choice.config,
                                                                                            one_launch=tiles))

    monkeypatch.setattr(layer_module, "choose_config", with_two_phases)
    layer = small_layer("none", "index_gather")
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with record_launches() as launches:
        out = layer(x)
    assert rel_err(out, layer.reference(x)) < 1e-3
    two_phase = [s for name, s in launches if name == "two_phase.experts"]
    assert len(two_phase) == 1 and not two_phase[0]["add"], launches
    assert [name for name, _ in launches][-1] == "two_phase.experts", launches   # (the addition: a torch op after it)


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
def test_the_default_path_fills_no_per_slot_buffer():
    """The [T, k, d] buffer is written whole by GEMM 2 when the ids are known good: no zero-fill."""
    layer = small_layer("none", "index_gather", model="qwen3-30b-a3b")
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    real_zeros, shapes = torch.zeros, []

    def zeros(*args, **kwargs):
        shapes.append(tuple(args[0]) if args and isinstance(args[0], (tuple, list, torch.Size)) else args)
        return real_zeros(*args, **kwargs)

    with mock.patch("torch.zeros", zeros):
        layer(x)
    assert (9, MODELS["qwen3-30b-a3b"].top_k, 256) not in shapes, shapes


# ---- on a GPU, at the real shapes ----------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("fmt", ["none", "block"])
@pytest.mark.parametrize("model_name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_real_layer_runs_its_plan_gpu(model_name, fmt):
    layer = MoELayer.random(model_name, dtype=torch.bfloat16, device="cuda", seed=0)
    layer = layer if fmt == "none" else layer.quantized(fmt)
    model = MODELS[model_name]
    on_this_gpu = table_name(torch.cuda.get_device_name(), model.num_experts, model.moe_intermediate_size,
                             model.hidden_size, table_dtype(fmt), "index_gather")
    for batch in BATCH_CLASSES.values():
        plan = layer.plan(batch, dtype=torch.bfloat16)
        if load_table(on_this_gpu) is not None:
            assert plan.choice.table == on_this_gpu and plan.choice.source == "table"
        x = torch.randn(batch, model.hidden_size, device="cuda", dtype=torch.bfloat16)
        with record_launches() as launches:
            layer(x)
        torch.cuda.synchronize()
        expected = [plan.format.gemm_tiles(plan.config.gate_up), plan.format.gemm_tiles(plan.config.down)]
        if runs_in_one_launch(plan.config, plan.format):   # both GEMMs in one launch (the table's choice)
            tiles = plan.config.one_launch
            name = "two_phase.experts" if tiles.phases == 2 else "one_launch.experts"
            # (add: False, a shared expert apart is added after the launch, SharedApart.for_sum)
            assert [s for n, s in launches if n == name] == [{"format": plan.format.name, **tiles.as_dict(),
                                                              "add": False}], launches
            assert not [s for n, s in launches if n == "index_gather.gemm" and not s["dense"]], launches
        elif plan.config.stream_lag is not None:   # both GEMMs as one stream of tiles (the table's choice)
            streams = [settings for name, settings in launches if name == "streamed_pair"]
            assert [[s["gate_up"], s["down"]] for s in streams] == [expected], launches
            assert streams[0]["lag"] == plan.config.stream_lag and streams[0]["quant"] == plan.format.quantized
        else:
            gemms = [settings for name, settings in launches if name == "index_gather.gemm" and not settings["dense"]]
            assert [g["tiles"] for g in gemms] == expected
            assert all(g["scales"] == plan.format.scale_code for g in gemms)
        del x
    del layer
    torch.cuda.empty_cache()


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
@pytest.mark.parametrize("model", ["deepseek-v3", "qwen3-30b-a3b"])
def test_router_chained_up_to_its_batch(model):
    """By default a layer up to CHAINED_ROUTER_MAX_TOKENS tokens routes with the chained router (the
    split gate, one program per token and, on an aligned block map, the alignment: no routing or
    alignment kernel of the two steps), and gives the two-step layer's answer; above it, the two steps."""
    import moe_kernels.layer_router as layer_router

    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with mock.patch.object(layer_router, "CHAINED_ROUTER_MAX_TOKENS", 0):
        two_steps = small_layer("none", "index_gather", model=model)
        assert not two_steps.plan(8, dtype=x.dtype).gate_routing
        want = two_steps(x[:8])
    with mock.patch.object(layer_router, "CHAINED_ROUTER_MAX_TOKENS", 8):
        layer = small_layer("none", "index_gather", model=model)
        for batch, chained, aligned in ((1, True, False), (8, True, True), (9, False, False)):
            plan = layer.plan(batch, dtype=x.dtype)
            assert (plan.gate_routing, plan.chained, plan.gate_alignment) == (chained, chained, aligned)
            assert plan.naive_blocks == (batch == 1)
            with record_launches() as launches:
                out = layer(x[:batch])
            names = [name for name, _ in launches]
            routing = "routing.grouped_topk" if model == "deepseek-v3" else "routing.fused_topk"
            assert ("chained_routing.route" in names) == chained and (routing in names) == (not chained), names
            assert ("chained_routing.align" in names) == aligned, names
            assert ("align.moe_align_block_size" in names) == (batch > 1 and not aligned), names
            assert "gate_routing.gate_and_route" not in names
            assert rel_err(out, layer.reference(x[:batch])) < 1e-3
        torch.testing.assert_close(layer(x[:8]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
@pytest.mark.parametrize("model, layout", [("deepseek-v3", "index_gather"), ("qwen3-30b-a3b", "permute")])
def test_tile_router_from_its_batch(model, layout):
    """With ``TILE_ROUTER_MIN_TOKENS`` at 9 (the chain's reach at 8), a layer from 9 tokens routes with the tile
    router (one launch: no gate GEMM, no routing kernel) and gives the two-step layer's answer; below it, the
    chain; with a float32 gate for 16-bit activations, the two steps. (Off by default: measured slower.)"""
    import moe_kernels.layer_router as layer_router

    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with mock.patch.object(layer_router, "CHAINED_ROUTER_MAX_TOKENS", 8):
        two_steps = small_layer("none", layout, model=model)
        want = two_steps(x)
        assert not two_steps.plan(9, dtype=x.dtype).tile_router
        with mock.patch.object(layer_router, "TILE_ROUTER_MIN_TOKENS", 9):
            layer = small_layer("none", layout, model=model)   # (plans are cached per layer)
            assert layer.plan(24, dtype=x.dtype).tile_router
            for batch, tiled in ((8, False), (9, True)):
                plan = layer.plan(batch, dtype=x.dtype)
                assert plan.tile_router == tiled and plan.chained == (not tiled)
                # (no gate GEMM either: the two steps' router_logits would raise)
                with record_launches() as launches, mock.patch.object(layer_router, "router_logits",
                                                                      side_effect=AssertionError("gate GEMM")):
                    out = layer(x[:batch])
                names = [name for name, _ in launches]
                routing = "routing.grouped_topk" if model == "deepseek-v3" else "routing.fused_topk"
                assert ("tile_routing.gate_and_route_tiles" in names) == tiled and routing not in names, names
                assert rel_err(out, layer.reference(x[:batch])) < 1e-3
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)   # (9 tokens, as the two steps ran)
            assert not layer.plan(24, dtype=torch.float16).tile_router   # (the gate is float32)


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
@pytest.mark.parametrize("model", ["deepseek-v3", "qwen3-30b-a3b"])
def test_router_in_one_launch_up_to_its_batch(model):
    """With ``GATE_ROUTING_MAX_TOKENS`` at 8 (and the chained router off), a layer up to 8 tokens routes
    with one launch (gate_and_route, no routing kernel after a GEMM) and gives the two-step layer's
    answer; at 9 tokens it takes the two steps again. Where the block map is aligned (8 tokens: not
    naive), the router's launch aligns too: no alignment kernel. (Off by default: slower on the H200.)"""
    import moe_kernels.layer_router as layer_router

    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with mock.patch.object(layer_router, "CHAINED_ROUTER_MAX_TOKENS", 0):
        two_steps = small_layer("none", "index_gather", model=model)
        want = two_steps(x[:8])
        with mock.patch.object(layer_router, "GATE_ROUTING_MAX_TOKENS", 8):
            layer = small_layer("none", "index_gather", model=model)
            for batch, fused, aligned in ((1, True, False), (8, True, True), (9, False, False)):
                plan = layer.plan(batch, dtype=x.dtype)
                assert plan.gate_routing == fused and plan.gate_alignment == aligned and not plan.chained
                assert plan.naive_blocks == (batch == 1)
                with record_launches() as launches:
                    out = layer(x[:batch])
                names = [name for name, _ in launches]
                routing = "routing.grouped_topk" if model == "deepseek-v3" else "routing.fused_topk"
                assert ("gate_routing.gate_and_route" in names) == fused and (routing in names) == (not fused), names
                assert ("align.moe_align_block_size" in names) == (batch > 1 and not aligned), names
                assert [s["aligned"] for n, s in launches if n == "gate_routing.gate_and_route"] == [aligned] * fused
                assert rel_err(out, layer.reference(x[:batch])) < 1e-3
            torch.testing.assert_close(layer(x[:8]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
@pytest.mark.parametrize("router", ["one launch", "chained"])
def test_router_aligns_only_where_its_ids_are_the_gemms_ids(router):
    """The router aligns only where the ids it writes are the ones the GEMMs read, and within its
    reach: not with the shared expert fused as slot E (its column is added after the routing), not
    above the router's ALIGN_MAX_ASSIGNMENTS (then the alignment kernel runs)."""
    import moe_kernels.layer_router as layer_router
    from moe_kernels.kernels import chained_routing, gate_routing

    one_launch = router == "one launch"
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with mock.patch.object(layer_router, "GATE_ROUTING_MAX_TOKENS", 8 if one_launch else 0):
        fused_slot = small_layer("none", "index_gather", shared_expert="fused")
        plan = fused_slot.plan(8, dtype=x.dtype)
        assert plan.gate_routing and plan.naive_blocks is False and not plan.gate_alignment
        assert plan.chained == (not one_launch)
        reach = gate_routing if one_launch else chained_routing
        with mock.patch.object(reach, "ALIGN_MAX_ASSIGNMENTS", 63):   # 8 tokens x top-8 = 64
            layer = small_layer("none", "index_gather")
            plan = layer.plan(8, dtype=x.dtype)
            assert plan.gate_routing and plan.naive_blocks is False and not plan.gate_alignment
            with record_launches() as launches:
                out = layer(x)
            names = [name for name, _ in launches]
            router_launch = "gate_routing.gate_and_route" if one_launch else "chained_routing.route"
            assert router_launch in names and "align.moe_align_block_size" in names, names
            assert rel_err(out, layer.reference(x)) < 1e-3


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
def test_a_stacked_shared_expert_run_apart_lets_the_router_align(monkeypatch):
    """``shared_expert="auto"``: a batch that runs the stacked shared expert apart routes, and aligns, the routed
    ids alone in the chained router (the GEMMs read those ids: the stacked expert E is never among them); a slot
    batch does not align in the router (its column is added after the routing). Both match the reference."""
    import moe_kernels.layer as layer_module
    import moe_kernels.layer_router as layer_router

    monkeypatch.setattr(layer_module, "choose_shared_slot", lambda M, *args, **kwargs: M <= 4)
    monkeypatch.setattr(layer_router, "GATE_ROUTING_MAX_TOKENS", 0)
    layer = small_layer("none", "index_gather", "auto")
    for batch, slot in ((3, True), (8, False)):
        x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(30 + batch)).to(DEVICE)
        plan = layer.plan(batch, dtype=x.dtype)
        assert plan.shared_slot == slot and plan.chained
        assert plan.gate_alignment == (not slot and plan.naive_blocks is False)
        with record_launches() as launches:
            out = layer(x)
        names = [name for name, _ in launches]
        assert ("align.moe_align_block_size" in names) == (plan.naive_blocks is False and not plan.gate_alignment)
        assert rel_err(out, layer.reference(x)) < 1e-3


def test_gemm_1_follows_the_chained_router_only_where_nothing_runs_between(monkeypatch):
    """GEMM 1 launches as a programmatic dependent of the chained router (``ROUTER_LAUNCHES_GEMM1``) only where it is
    the next launch: the chained router, index-gather, no activation quantiser, no shared expert in line or as a
    slot, GEMM 1 a launch of its own (the H100's one-launch kernel at one token is not)."""
    import moe_kernels.layer_router as layer_router
    from moe_kernels.layer_router import gemm1_follows_router

    layer = meta_layer("qwen3-30b-a3b", "none", "index_gather")   # (a float32 gate: float32 activations chain)
    plans = {batch: layer.plan(batch, dtype=torch.float32, device_name=H200) for batch in (1, 8, 512, 4096)}
    assert [plans[batch].chained for batch in plans] == [True, True, True, False]
    monkeypatch.setattr(layer_router, "ROUTER_LAUNCHES_GEMM1", False)
    assert not gemm1_follows_router(plans[8], quantize=False, launches_between=False)   # (off: the default)
    monkeypatch.setattr(layer_router, "ROUTER_LAUNCHES_GEMM1", True)
    assert [gemm1_follows_router(plans[batch], quantize=False, launches_between=False) for batch in plans] == [
        True, True, True, False]
    assert not gemm1_follows_router(plans[8], quantize=True, launches_between=False)
    assert not gemm1_follows_router(plans[8], quantize=False, launches_between=True)
    permute = meta_layer("qwen3-30b-a3b", "none", "permute").plan(8, dtype=torch.float32, device_name=H200)
    assert permute.chained and not gemm1_follows_router(permute, quantize=False, launches_between=False)
    # (the H100's bf16 table at one token; chained as a bf16 gate would make it)
    one_launch = dataclasses.replace(layer.plan(1, device_name=H100), chained=True)
    assert one_launch.naive_blocks and runs_in_one_launch(one_launch.config, one_launch.format)
    assert not gemm1_follows_router(one_launch, quantize=False, launches_between=False)
    choice = plans[8].choice
    streamed = dataclasses.replace(plans[8], choice=dataclasses.replace(
        choice, config=dataclasses.replace(choice.config, stream_lag=4)))
    assert not gemm1_follows_router(streamed, quantize=False, launches_between=False)


@pytest.mark.skipif(BACKEND == "torch", reason="no Triton: the torch references launch nothing")
@pytest.mark.parametrize("fmt, shared, takes", [("none", False, True), ("block", False, False),
                                                ("none", True, False)])
def test_the_layer_hands_the_router_and_gemm_1_their_parts(monkeypatch, fmt, shared, takes):
    """What ``run_layer`` passes on, with ``ROUTER_LAUNCHES_GEMM1`` on: the router's ``launch_next`` and GEMM 1's
    ``after_router`` together, only for a bf16 (here float32) layer with no shared expert in line."""
    import moe_kernels.layer as layer_module
    import moe_kernels.layer_router as layer_router

    monkeypatch.setattr(layer_router, "ROUTER_LAUNCHES_GEMM1", True)
    seen = {}
    route, run_experts = layer_module.route, layer_module.run_experts

    def spy_route(*args, launch_next=False):
        seen["launch_next"] = launch_next
        return route(*args, launch_next=launch_next)

    def spy_run_experts(*args, after_router=False, **kwargs):
        seen["after_router"] = after_router
        return run_experts(*args, after_router=after_router, **kwargs)

    monkeypatch.setattr(layer_module, "route", spy_route)
    monkeypatch.setattr(layer_module, "run_experts", spy_run_experts)
    layer = small_layer(fmt, "index_gather", model="deepseek-v3" if shared else "qwen3-30b-a3b")
    assert (layer.weights.shared_w13 is not None) == shared
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = layer(x)
    assert layer.plan(8, dtype=x.dtype).chained and seen == {"launch_next": takes, "after_router": takes}
    assert rel_err(out, layer.reference(x)) < (3e-2 if fmt == "block" else 1e-3)


def test_a_gemms_part_in_a_dependent_launch_is_checked():
    from moe_kernels.kernels import index_gather

    both = index_gather._pdl_options("wait+trigger", 2, 1, 0)
    assert both["PDL_TRIGGER"] == 1 and both["PDL_WAIT"] and both["PREFETCH_K"] == 0 and both["launch_pdl"]
    assert "PDL_WAIT" not in index_gather._pdl_options("trigger", 2)
    with pytest.raises(ValueError, match="pdl.*must be one of"):
        index_gather._pdl_options("trigger+wait", 2)


@needs_gpu
@pytest.mark.parametrize("model_name, batches", [("qwen3-30b-a3b", (1, 8, 64, 512)), ("deepseek-v3", (1, 64))])
def test_gemm_1_launches_behind_the_chained_router_gpu(model_name, batches, monkeypatch):
    """With ``ROUTER_LAUNCHES_GEMM1`` a bf16 layer's chained router lets GEMM 1 launch early (Hopper) where the layer
    says GEMM 1 follows it: the router's last launch triggers exactly then, GEMM 1 is the next launch and waits,
    prefetching nothing, and the output is the same bits as a layer without the setting, eager and replayed from a
    CUDA graph on new inputs. (Two layers over the same weights: each records its own calls.)"""
    import moe_kernels.layer_router as layer_router
    from moe_kernels.kernels._pdl import pdl_available

    def setting(on, call):
        monkeypatch.setattr(layer_router, "ROUTER_LAUNCHES_GEMM1", on)
        return call()

    can = pdl_available(torch.device("cuda"))
    base = MoELayer.random(model_name, dtype=torch.bfloat16, device="cuda", seed=3)
    # (DeepSeek-V3's shared expert left out: eager, it runs in line between the router and GEMM 1)
    weights = dataclasses.replace(base.weights, shared_w13=None, shared_w2=None)
    plain, behind = MoELayer(weights, base.routing), MoELayer(weights, base.routing)
    del base
    d = MODELS[model_name].hidden_size
    for batch in batches:
        x = torch.randn(batch, d, device="cuda", dtype=torch.bfloat16)
        want = setting(False, lambda: plain(x)).clone()
        plan = behind.plan(batch, dtype=torch.bfloat16)
        follows = setting(True, lambda: layer_router.gemm1_follows_router(plan, quantize=False,
                                                                          launches_between=False))
        with record_launches() as launches:
            got = setting(True, lambda: behind(x))
        exact = not plan.config.sum_in_gemm and plan.config.gate_up.split_k == 1 and plan.config.down.split_k == 1
        assert torch.equal(got, want) if exact else rel_err(got, want) < 1e-2, (model_name, batch)
        names = [n for n, _ in launches]
        last = max(i for i, n in enumerate(names) if n in ("chained_routing.route", "chained_routing.align"))
        assert launches[last][1]["triggers"] == (follows and can), launches
        if follows:
            assert names[last + 1] == "index_gather.gemm" and launches[last + 1][1]["gemm"] == "gate_up", launches
            assert launches[last + 1][1]["pdl"].startswith("wait") == can, launches
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            setting(True, lambda: behind(x))
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            replayed = setting(True, lambda: behind(x))
        for seed in (5, 6):
            x.copy_(torch.randn(batch, d, generator=torch.Generator().manual_seed(seed)).to(x))
            graph.replay()
            want = setting(False, lambda: plain(x))
            assert torch.equal(replayed, want) if exact else rel_err(replayed, want) < 1e-2, (model_name, batch, seed)
        del graph
    del plain, behind, weights
    torch.cuda.empty_cache()


@needs_gpu
@pytest.mark.parametrize("model_name, batch", [("qwen3-30b-a3b", 8), ("deepseek-v3", 64)])
@pytest.mark.parametrize("one_launch", [True, False], ids=["one launch", "chained"])
def test_router_replays_and_graphs_on_two_streams_gpu(model_name, batch, one_launch):
    """The router (one launch, or chained by PDL; with the alignment) through the replay path: the
    layer's calls are recorded, replayed, then captured as a CUDA graph (the fourth call on), on the
    default stream and on a second stream in turn; every output matches the first, eager, call."""
    import moe_kernels.layer_router as layer_router

    with mock.patch.object(layer_router, "GATE_ROUTING_MAX_TOKENS", 128 if one_launch else 0):
        layer = MoELayer.random(model_name, dtype=torch.bfloat16, device="cuda", seed=1)
        plan = layer.plan(batch, dtype=torch.bfloat16)
        assert plan.gate_routing and plan.gate_alignment and plan.chained == (not one_launch)
        x = torch.randn(batch, MODELS[model_name].hidden_size, device="cuda", dtype=torch.bfloat16)
        first = layer(x).clone()
        side = torch.cuda.Stream()
        outputs = []
        for call in range(12):
            stream = side if call % 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outputs.append(layer(x).clone())
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for out in outputs:   # (the top-k sum's fp32 atomics may add in another order)
            assert rel_err(out, first) < 1e-2


# ---- layout="auto": the layer picks the layout by batch from measured crossovers -------------------


@pytest.mark.parametrize("model_name, fmt, device_name, batch, layout", [
    ("deepseek-v3", "none", H200, 1, "index_gather"), ("deepseek-v3", "none", H200, 64, "index_gather"),
    ("deepseek-v3", "none", H200, 1024, "index_gather"), ("deepseek-v3", "none", H200, 4095, "index_gather"),
    ("deepseek-v3", "none", H200, 4096, "permute 128 from 4096"),
    ("deepseek-v3", "none", H200, 16384, "permute 128 from 4096"), ("deepseek-v3", "block", H200, 1024, "index_gather"),
    ("deepseek-v3", "block", H200, 2047, "index_gather"), ("deepseek-v3", "block", H200, 2048, "permute 128 from 2048"),
    ("deepseek-v3", "block", H200, 16384, "permute 128 from 2048"),
    ("qwen3-30b-a3b", "block", H200, 1023, "index_gather"), ("qwen3-30b-a3b", "block", H200, 1024, "permute 128 from 1024"),
    ("qwen3-30b-a3b", "block", H200, 16384, "permute 128 from 1024"),
    ("qwen3-30b-a3b", "none", H200, 16384, "index_gather"),
    # the H100's bf16 entries: the 128-row bf16 Gluon GEMMs (layer-layout-ab-bf16*-s33.json, -s35.json, -s36.json)
    ("qwen3-30b-a3b", "none", H100, 1023, "index_gather"), ("qwen3-30b-a3b", "none", H100, 1024, "permute 128 from 1024"),
    ("deepseek-v3", "none", H100, 1024, "index_gather"), ("deepseek-v3", "none", H100, 2047, "index_gather"),
    ("deepseek-v3", "none", H100, 2048, "permute 128 from 2048"),
    ("deepseek-v3", "none", H100, 16384, "permute 128 from 2048"),
    ("deepseek-v3", "none", "NVIDIA A100", 16384, "index_gather"),
    # the H100's fp8 entries: the 128-row Gluon GEMMs at prefill; index-gather at decode since the H100 has tables
    # (session 36: the transposed Gluon kernel's decode entries went)
    ("qwen3-30b-a3b", "block", H100, 64, "index_gather"), ("qwen3-30b-a3b", "block", H100, 128, "index_gather"),
    ("qwen3-30b-a3b", "block", H100, 1023, "index_gather"),
    ("qwen3-30b-a3b", "block", H100, 1024, "permute 128 from 1024"),
    ("qwen3-30b-a3b", "block", H100, 4096, "permute 128 from 1024"),
    ("deepseek-v3", "block", H100, 1, "index_gather"), ("deepseek-v3", "block", H100, 2, "index_gather"),
    ("deepseek-v3", "block", H100, 512, "index_gather"), ("deepseek-v3", "block", H100, 1024, "index_gather"),
    ("deepseek-v3", "block", H100, 2047, "index_gather"), ("deepseek-v3", "block", H100, 2048, "permute 128 from 2048"),
    ("deepseek-v3", "block", H100, 16384, "permute 128 from 2048"),
])
def test_auto_layout_follows_the_measured_crossover(model_name, fmt, device_name, batch, layout):
    """DeepSeek-V3's experts ran faster on the permute layout (TMA, persistent grid) from 4,096
    tokens on the H200 in bf16 (prefill-ab.json), and the routed fp8 layer of both models with its
    GEMMs on the Gluon kernel from 1,024 (Qwen3-30B-A3B) or 2,048 (DeepSeek-V3) tokens on the H200
    (fp8-sweep-s33.json, layer-layout-ab*.json); on the H100 the fp8 experts ran faster on the 128-row Gluon GEMMs
    from 1,024 or 2,048 tokens (fp8-sweep.json, fp8-sweep-h200-tables-s36.json), and the bf16
    layer on the 128-row bf16 Gluon GEMMs from 1,024 (Qwen3-30B-A3B) or 2,048 tokens (DeepSeek-V3; GEMM 1 gathering its
    rows where the experts average few): there, and only there, "auto" takes the permute layout, with the tiles, segments and GEMM kernel it was measured with;
    everywhere else index-gather with its own table."""
    from moe_kernels.kernels.layout_choice import load_choices, shape_key

    model = MODELS[model_name]
    plan = meta_layer(model_name, fmt, "auto").plan(batch, device_name=device_name)
    assert plan.layout == layout.split()[0]
    if plan.layout == "permute":
        align, start = int(layout.split()[1]), int(layout.split()[-1])
        key = shape_key(device_name, model.num_experts, model.moe_intermediate_size, model.hidden_size,
                        FORMATS[fmt].name)
        entry = next(choice for choice in load_choices()[key] if choice.from_tokens == start)
        assert plan.choice.source == "layout-choice" and plan.config == entry.config
        # the H200's bf16 entry: 128-row segments and the switch's kernel (the Triton tiles it names); the others:
        # the Gluon GEMMs on the entry's segments
        assert (plan.align, plan.gemm) == (entry.align, entry.gemm)
        assert (plan.align, plan.gemm) == ((None, None) if entry.gemm is None else (align, "gluon"))
        assert plan.choice.table == "layout-choices" and plan.choice.entry == start
        if entry.gemm is None:
            assert plan.config.block_m == align and plan.config.down.tma and plan.config.down.persistent
    else:
        forced = meta_layer(model_name, fmt, "index_gather").plan(batch, device_name=device_name)
        assert plan.choice == forced.choice
    # layout= still forces one: the permute layout at 4096 borrows the index-gather table as before (the
    # H100's since session 36, copies of the H200's); a config given, or the shared expert fused as a slot (not
    # measured; Qwen3 has none), keep index-gather.
    if plan.layout == "permute":
        forced = meta_layer(model_name, fmt, "permute").plan(batch, device_name=device_name).choice.source
        assert forced == ("borrowed" if device_name in (H200, H100) else "default")
        if model.num_shared_experts:
            assert meta_layer(model_name, fmt, "auto", "fused").plan(batch, device_name=device_name).layout == \
                "index_gather"
        weights, routing = meta_layer(model_name, fmt, "auto").weights, Routing.of(model)
        given = plan_layer("test", weights, routing, "auto", batch, torch.bfloat16, torch.device("meta"),
                           config=plan.config.with_block_m(64), device_name=device_name)
        assert given.layout == "index_gather" and given.choice.source == "argument"


@pytest.mark.parametrize("device_name", [H100, H200])
def test_auto_shared_expert_follows_the_measured_choice(device_name):
    """``shared_expert="auto"``: DeepSeek-V3's fp8 shared expert runs as slot E up to the measured
    crossover of ``shared-choices.json`` (the H100's: 32 tokens since its shared expert's own E=1 table; the H200's:
    16) on the table tuned for the fused
    problem (E + 1 experts) where it covers the batch, else the routed one, and apart above it, on the routed table
    and its own dense tiles; a GPU, shape or format with no entry runs it apart at every batch, as ``"separate"``
    does."""
    from moe_kernels.kernels.shared_choice import load_shared_choices
    from moe_kernels.kernels.layout_choice import shape_key

    model = MODELS["deepseek-v3"]
    key = shape_key(device_name, model.num_experts, model.moe_intermediate_size, model.hidden_size,
                    FORMATS["block"].name)
    up_to = load_shared_choices().get(key)
    assert up_to == {H100: 32, H200: 16}[device_name]
    auto = meta_layer("deepseek-v3", "block", "index_gather", "auto")
    separate = meta_layer("deepseek-v3", "block", "index_gather", "separate")
    fused = meta_layer("deepseek-v3", "block", "index_gather", "fused")
    for batch in (1, 8, 16, 17, 32, 33, 64, 65, 512):
        plan = auto.plan(batch, device_name=device_name)
        slot = up_to is not None and batch <= up_to
        assert plan.shared_slot == slot and (plan.shared_choice is None) == slot
        like = (fused if slot else separate).plan(batch, device_name=device_name)
        assert plan.choice == like.choice and plan.naive_blocks == like.naive_blocks
        assert plan.shared_choice == like.shared_choice
        if slot:   # the fused problem's own table where it covers the batch (TABLE_REACH), else the routed one:
            # the H100's keeps its one-token entry (the routed tiles measured faster in the layer from 4 tokens)
            assert (",E=257," in plan.choice.table) == (batch <= {H100: 2, H200: 64}[device_name])
            assert ",E=256," in plan.choice.table or ",E=257," in plan.choice.table
    for fmt in ("none",):   # bf16 weights: the H100's slot at one token only, the H200 has no entry (apart)
        bf16 = meta_layer("deepseek-v3", fmt, "index_gather", "auto")
        assert bf16.plan(1, device_name=device_name).shared_slot == (device_name == H100)
        assert not bf16.plan(8, device_name=device_name).shared_slot
        # inside a capture the H100's forked shared expert beat the slot from one token (session 48): its beside
        # crossover is 0, the slot at no batch
        for batch in (0, 1, 2, 8):
            assert not bf16.plan(batch, device_name=device_name, captured=True).shared_slot, batch
    # With layout="auto" the slot is taken only where index-gather runs (where it was measured): at decode on both
    # GPUs (until session 36 the H100 ran DeepSeek-V3's fp8 layer on the transposed permute path from 2 tokens, and
    # the shared expert apart there); at prefill the permute layout runs it apart.
    both_auto = meta_layer("deepseek-v3", "block", "auto", "auto")
    one, eight = both_auto.plan(1, device_name=device_name), both_auto.plan(8, device_name=device_name)
    assert one.layout == "index_gather" and one.shared_slot == (up_to is not None)
    assert eight.shared_slot == (eight.layout == "index_gather" and up_to is not None)
    assert eight.layout == "index_gather"
    prefill = both_auto.plan(4096, device_name=device_name)
    assert prefill.layout == "permute" and not prefill.shared_slot
    assert (eight.shared_choice is not None) == (not eight.shared_slot)


@pytest.mark.parametrize("device_name", [H100, H200])
def test_a_plan_made_inside_a_capture_takes_the_crossover_against_the_forked_shared_expert(device_name):
    """Inside a CUDA-graph capture a shared expert run apart forks onto a side stream (``layer_shared``), which
    moved the measured crossover for DeepSeek-V3's fp8 layer to one token: on the H100 from 32 tokens (64 before its
    own E=1 table), on the H200 from 16 (session 49: the fork costs 0.25-0.64x the slot at 2-16 tokens, ties at one).
    ``choose_shared_slot(..., beside=True)`` is what ``plan_layer`` asks there (``layer_shared.forks_here``)."""
    from moe_kernels.kernels.shared_choice import choose_shared_slot, load_beside_choices
    from moe_kernels.kernels.layout_choice import shape_key

    model = MODELS["deepseek-v3"]
    shape = (model.num_experts, model.moe_intermediate_size, model.hidden_size)
    key = shape_key(device_name, *shape, FORMATS["block"].name)
    assert load_beside_choices().get(key) == 1
    for batch, in_line, beside in ((1, True, True), (2, True, False), (8, True, False), (16, True, False),
                                   (32, device_name == H100, False), (64, False, False)):
        assert choose_shared_slot(batch, *shape, "fp8-block", "cpu", device_name=device_name) == in_line, batch
        assert choose_shared_slot(batch, *shape, "fp8-block", "cpu", device_name=device_name,
                                  beside=True) == beside, batch
    with pytest.raises(TypeError, match=re.escape("choose_shared_slot: argument 'beside' must be a bool")):
        choose_shared_slot(1, *shape, "fp8-block", "cpu", device_name=device_name, beside="yes")
    # The layer's plan as inside a capture: the slot where the forked crossover says, else apart on its dense tiles
    auto = meta_layer("deepseek-v3", "block", "index_gather", "auto")
    for batch in (1, 2, 8, 16, 64):
        plan = auto.plan(batch, device_name=device_name, captured=True)
        slot = choose_shared_slot(batch, *shape, "fp8-block", "cpu", device_name=device_name, beside=True)
        assert plan.shared_slot == slot and (plan.shared_choice is None) == slot, batch
        assert auto.plan(batch, device_name=device_name).shared_slot == choose_shared_slot(
            batch, *shape, "fp8-block", "cpu", device_name=device_name), batch
    with pytest.raises(TypeError, match=re.escape("MoELayer.plan: argument 'captured' must be a bool")):
        auto.plan(1, device_name=device_name, captured=1)


@pytest.mark.parametrize("args, says", [
    ((8, 256, 2048, 7168, "block"), "'fmt_name' must be a weight format's name"),
    ((8, 0, 2048, 7168, "fp8-block"), "'E' must be >= 1"), ((-1, 256, 2048, 7168, "fp8-block"), "'M' must be >= 0"),
    ((8, 256, 2048, 7168, "fp8-block", "cpu", 7), "'device_name' must be a GPU name")])
def test_the_shared_slot_choice_names_a_bad_argument(args, says):
    from moe_kernels.kernels.shared_choice import choose_shared_slot

    *positional, = args
    device_name = positional.pop() if len(positional) == 7 else "NVIDIA H100 80GB HBM3"
    device = positional.pop() if len(positional) == 6 else "cpu"
    with pytest.raises((ValueError, TypeError), match=re.escape("choose_shared_slot: argument " + says)):
        choose_shared_slot(*positional, device, device_name=device_name)


@pytest.mark.parametrize("fmt, gated", [("none", False), ("block", False), ("none", True)])
def test_auto_shared_expert_runs_both_ways(monkeypatch, fmt, gated):
    """Through the layer's call, with a stand-in choice (a slot up to 4 tokens): a slot batch runs the stacked
    shared expert among the routed experts (no dense launch), a larger one apart on views of the same stacked
    tensors (the dense launches, no second copy), and both give the reference's answer, with no tokens, one,
    and with a Qwen2-MoE-style sigmoid gate on a shared expert of the routed width."""
    import moe_kernels.layer as layer_module
    from moe_kernels.layer_shared import shared_tensors

    monkeypatch.setattr(layer_module, "choose_shared_slot", lambda M, *args, **kwargs: M <= 4)
    layer = small_layer(fmt, "index_gather", "auto")
    if gated:
        plain = small_layer(fmt, "index_gather")
        gate = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE) / 16
        layer = MoELayer(dataclasses.replace(plain.weights, shared_gate=gate), plain.routing, shared_expert="auto")
    weights = layer.weights
    assert weights.shared_fused and weights.shared_w13 is None
    w13, w2, w13_scale, _ = shared_tensors(weights)
    assert w13.data_ptr() == weights.w13[weights.num_experts].data_ptr()
    assert (w13_scale is None) == (fmt == "none")
    for batch, slot in ((0, True), (1, True), (3, True), (9, False)):
        x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(batch)).to(DEVICE)
        plan = layer.plan(batch, dtype=x.dtype)
        assert plan.shared_slot == slot
        with record_launches() as launches:
            out = layer(x)
        dense = [s for name, s in launches if name == "index_gather.gemm" and s["dense"]]
        if HAS_TRITON and BACKEND != "torch" and batch:
            assert (len(dense) == 0) == slot, launches
        assert out.shape == x.shape
        if batch:
            assert rel_err(out, layer.reference(x)) < (1e-3 if fmt == "none" else 3e-2)


def test_auto_layout_runs_the_layout_it_picks(monkeypatch):
    """Through the layer's call: where the choice says permute (here a stand-in choice with plain
    tiles, on the CPU), the permute layout runs with those tiles, and the answer is the reference's."""
    import moe_kernels.layer as layer_module
    from moe_kernels.kernels.config import GemmTiles, MoEConfig
    from moe_kernels.kernels.layout_choice import LayoutChoice

    tiles = GemmTiles(32, 32, 1, 4, 2)
    picked = LayoutChoice("permute", MoEConfig(16, GemmTiles(16, 32, 1, 4, 2), tiles), 4)
    monkeypatch.setattr(layer_module, "choose_layout", lambda *args, **kwargs: picked)
    layer = small_layer("none", "auto")
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    plan = layer.plan(6, dtype=x.dtype)
    assert plan.layout == "permute" and plan.config == picked.config and plan.choice.source == "layout-choice"
    assert rel_err(layer(x), layer.reference(x)) < 1e-3


def test_auto_layout_runs_and_names_itself_in_errors():
    """On the CPU (no measurement for it) "auto" runs index-gather, with the same answer; a bad
    layout name is an error that lists "auto" among the choices."""
    layer = small_layer("none", "auto")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert layer.plan(5, dtype=x.dtype).layout == "index_gather"
    assert rel_err(layer(x), layer.reference(x)) < 1e-3
    with pytest.raises(ValueError, match="'masked' or 'auto'"):
        small_layer("none", "fastest")


CHOICE_TILES = {"block_m": 16, "gate_up": {"block_n": 32, "block_k": 64}, "down": {"block_n": 64, "block_k": 64}}


def test_a_key_of_ranges_picks_each_batchs_entry_with_its_align_and_gemm(tmp_path, monkeypatch):
    """A key holding a list of entries: each batch takes the last entry that starts at or below it; a permute
    entry's align and gemm reach the plan and the call (here on the CPU, where "gluon" falls back to the Triton
    kernel and says why), and an index_gather entry with no config runs its table's tiles."""
    import json

    from moe_kernels.kernels import layout_choice

    model = MODELS["qwen3-30b-a3b"]
    key = layout_choice.shape_key("NVIDIA H200", model.num_experts, model.moe_intermediate_size,
                                  model.hidden_size, "unquantized")
    path = tmp_path / "layout-choices.json"
    path.write_text(json.dumps({"choices": {key: [
        {"layout": "index_gather", "from_tokens": 300, "config": None},
        {"layout": "permute", "from_tokens": 1, "config": CHOICE_TILES, "align": 16, "gemm": "gluon"}]}}))
    monkeypatch.setattr(layout_choice, "CHOICES_FILE", path)
    layout_choice.forget_choices()
    try:
        decode = meta_layer("qwen3-30b-a3b", "none", "auto").plan(8, device_name="NVIDIA H200")
        assert (decode.layout, decode.align, decode.gemm, decode.config.block_m) == ("permute", 16, "gluon", 16)
        assert decode.choice.source == "layout-choice" and decode.choice.entry == 1
        later = meta_layer("qwen3-30b-a3b", "none", "auto").plan(300, device_name="NVIDIA H200")
        forced = meta_layer("qwen3-30b-a3b", "none", "index_gather").plan(300, device_name="NVIDIA H200")
        assert (later.layout, later.align, later.gemm) == ("index_gather", None, None)
        assert later.choice == forced.choice
    finally:
        layout_choice.forget_choices()


def test_the_layer_runs_a_measured_align_and_gemm(monkeypatch):
    """Through the layer's call: a choice of 32-row segments on the Gluon kernel runs permute_experts with both
    (the alignment's blocks of 32 rows; the Gluon kernel refuses these float32 weights, here or on a GPU, and
    the Triton kernel runs: the plan's check that it can run is stood in for)."""
    import moe_kernels.layer as layer_module
    from moe_kernels.kernels.config import MoEConfig
    from moe_kernels.kernels.layout_choice import LayoutChoice

    picked = LayoutChoice("permute", MoEConfig.from_dict(CHOICE_TILES), 1, 32, "gluon")
    monkeypatch.setattr(layer_module, "choose_layout", lambda *args, **kwargs: picked)
    monkeypatch.setattr(layer_module, "gluon_refusal", lambda *args: None)
    layer = small_layer("none", "auto")
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with record_launches() as launches:
        out = layer(x)
    assert [r["block_size"] for name, r in launches if name == "align.moe_align_block_size"] == [32], launches
    chosen = [r for name, r in launches if name == "permute.bf16_gemm"]
    assert len(chosen) == (1 if HAS_TRITON else 0) and all(r["kernel"] == "triton" for r in chosen), launches
    assert rel_err(out, layer.reference(x)) < 1e-3


def test_a_gluon_choice_is_left_where_the_gluon_gemms_cannot_run(monkeypatch):
    """A choice measured with the Gluon GEMMs is not taken where they cannot run (here: no GPU, and float32
    activations): the permute layout would run the Triton GEMMs, which lost to index-gather in every record
    behind the choices. Asked for a named GPU (device_name), bf16 weights and activations take it, float16
    activations do not, nor weights the Gluon kernels cannot read (float32; a view that is not contiguous)."""
    import moe_kernels.layer as layer_module
    from moe_kernels.kernels.config import MoEConfig
    from moe_kernels.kernels.layout_choice import LayoutChoice

    picked = LayoutChoice("permute", MoEConfig.from_dict(CHOICE_TILES), 1, 128, "gluon")
    monkeypatch.setattr(layer_module, "choose_layout", lambda *args, **kwargs: picked)
    layer = small_layer("none", "auto")
    here = layer.plan(6, dtype=torch.float32)
    forced = small_layer("none", "index_gather").plan(6, dtype=torch.float32)
    assert (here.layout, here.gemm) == ("index_gather", None) and here.choice == forced.choice
    assert layer.plan(6, dtype=torch.bfloat16, device_name="NVIDIA H200").layout == "index_gather"   # float32 w
    w = layer.weights
    bf16 = dataclasses.replace(w, **{name: getattr(w, name).to(torch.bfloat16) for name in
                                     ("w13", "w2", "shared_w13", "shared_w2") if getattr(w, name) is not None})
    assert MoELayer(bf16, layer.routing, layout="auto").plan(6, device_name="NVIDIA H200").layout == "permute"
    assert MoELayer(bf16, layer.routing, layout="auto").plan(6, dtype=torch.float16,
                                                            device_name="NVIDIA H200").layout == "index_gather"
    wide = torch.zeros(w.w13.shape[0], w.w13.shape[1] + 128, w.w13.shape[2], dtype=torch.bfloat16,
                       device=w.w13.device)   # (on the layer's device: a GPU run builds the layer there)
    sliced = dataclasses.replace(bf16, w13=wide[:, :w.w13.shape[1]])   # (rows contiguous, the tensor not)
    assert MoELayer(sliced, layer.routing, layout="auto").plan(6, device_name="NVIDIA H200").layout == "index_gather"
    assert layer_module.gluon_refusal(bf16.format, 128, torch.bfloat16, bf16.w13, bf16.w2, torch.device("cpu"))


@pytest.mark.parametrize("change, where", [
    (lambda e: {**e, "align": 24}, r"\.align"), (lambda e: {**e, "gemm": "cuda"}, r"\.gemm"),
    (lambda e: {**e, "layout": "index_gather", "align": None, "gemm": "gluon"}, r"\.gemm"),
    (lambda e: {**e, "layout": "index_gather", "align": 16}, r"\.align"),
    (lambda e: [e, e], "distinct from_tokens"), (lambda e: {**e, "config": None}, "valid 'config'"),
    (lambda e: [], "at least one entry"), (lambda e: {**e, "align": 16.0}, r"\.align")])
def test_a_bad_range_is_an_error_that_names_it(tmp_path, monkeypatch, change, where):
    import json

    from moe_kernels.kernels import layout_choice

    entry = {"layout": "permute", "from_tokens": 1, "config": CHOICE_TILES, "align": 16, "gemm": "gluon"}
    path = tmp_path / "layout-choices.json"
    path.write_text(json.dumps({"choices": {"k,format=unquantized": change(entry)}}))
    monkeypatch.setattr(layout_choice, "CHOICES_FILE", path)
    layout_choice.forget_choices()
    try:
        with pytest.raises((ValueError, TypeError), match=r"layout-choices.json\['k,format=unquantized'\].*" + where):
            layout_choice.load_choices()
    finally:
        layout_choice.forget_choices()


@pytest.mark.parametrize("entry, says", [
    ({"slot_up_to_tokens": 64}, "must be an object with 'slot_up_to_tokens' and 'measured'"),
    ({"slot_up_to_tokens": 64, "measured": {"records": []}}, "naming its records"),
    ({"slot_up_to_tokens": 0, "measured": {"records": ["r.json"]}}, r"\.slot_up_to_tokens.*must be >= 1"),
    ({"slot_up_to_tokens": "64", "measured": {"records": ["r.json"]}}, r"\.slot_up_to_tokens.*must be an int"),
    ([64], "must be an object")])
def test_a_bad_shared_choice_is_an_error_that_names_it(tmp_path, monkeypatch, entry, says):
    """``shared-choices.json`` is checked like the layout choices: each entry names its records and a token
    count, and an error names the file and the entry; a key without a weight format is refused too."""
    import json

    from moe_kernels.kernels import shared_choice

    path = tmp_path / "shared-choices.json"
    monkeypatch.setattr(shared_choice, "SHARED_CHOICES_FILE", path)
    try:
        for key, want in (("k,format=fp8-block", says), ("k", "must end with format=")):
            path.write_text(json.dumps({"choices": {key: entry}}))
            shared_choice.forget_shared_choices()
            with pytest.raises((ValueError, TypeError), match=r"shared-choices.json\[" + repr(key) + r"\].*" + want):
                shared_choice.load_shared_choices()
    finally:
        shared_choice.forget_shared_choices()


@pytest.mark.parametrize("beside, says", [
    ({"slot_up_to_tokens": 1}, r"\.beside' must be an object with 'slot_up_to_tokens' and 'measured'"),
    ({"slot_up_to_tokens": -1, "measured": {"records": ["r.json"]}}, r"\.beside\.slot_up_to_tokens' must be >= 0"),
    (7, r"\.beside' must be an object")])
def test_a_bad_beside_crossover_is_an_error_that_names_it(tmp_path, monkeypatch, beside, says):
    """An entry's ``beside`` crossover (against the forked shared expert) is checked as the entry is."""
    import json

    from moe_kernels.kernels import shared_choice

    path = tmp_path / "shared-choices.json"
    monkeypatch.setattr(shared_choice, "SHARED_CHOICES_FILE", path)
    entry = {"slot_up_to_tokens": 4, "measured": {"records": ["r.json"]}, "beside": beside}
    path.write_text(json.dumps({"choices": {"k,format=fp8-block": entry}}))
    try:
        shared_choice.forget_shared_choices()
        assert shared_choice.load_shared_choices() == {"k,format=fp8-block": 4}
        with pytest.raises((ValueError, TypeError), match=r"load_beside_choices: .*shared-choices.json.*" + says):
            shared_choice.load_beside_choices()
    finally:
        shared_choice.forget_shared_choices()


def test_a_beside_crossover_of_zero_takes_the_slot_at_no_batch(tmp_path, monkeypatch):
    """A ``beside`` crossover of 0 (the forked shared expert measured faster from one token) loads as 0 and answers
    False at every batch inside a capture, zero tokens included, while the entry's in-line crossover still answers
    outside one."""
    import json

    from moe_kernels.kernels import shared_choice

    path = tmp_path / "shared-choices.json"
    monkeypatch.setattr(shared_choice, "SHARED_CHOICES_FILE", path)
    key = "device=NVIDIA_H100_80GB_HBM3,E=8,N=32,K=64,format=fp8-block"
    entry = {"slot_up_to_tokens": 4, "measured": {"records": ["r.json"]},
             "beside": {"slot_up_to_tokens": 0, "measured": {"records": ["r.json"]}}}
    path.write_text(json.dumps({"choices": {key: entry}}))
    try:
        shared_choice.forget_shared_choices()
        assert shared_choice.load_beside_choices() == {key: 0}
        for batch, in_line in ((0, True), (1, True), (4, True), (5, False)):
            ask = (batch, 8, 32, 64, "fp8-block", "cpu")
            assert shared_choice.choose_shared_slot(*ask, device_name="NVIDIA H100 80GB HBM3") == in_line, batch
            assert not shared_choice.choose_shared_slot(*ask, device_name="NVIDIA H100 80GB HBM3", beside=True), batch
    finally:
        shared_choice.forget_shared_choices()


def test_a_corrupt_choices_file_is_an_error_that_names_it(tmp_path, monkeypatch):
    from moe_kernels.kernels import layout_choice

    bad = tmp_path / "layout-choices.json"
    bad.write_text('{"choices": {"k": {"layout": "nosuch", "from_tokens": 1, "config": '
                   '{"block_m": 16, "gate_up": {"block_n": 32, "block_k": 64}, "down": {"block_n": 64, "block_k": 64}}}}}')
    monkeypatch.setattr(layout_choice, "CHOICES_FILE", bad)
    layout_choice.forget_choices()
    try:
        with pytest.raises(ValueError, match=r"layout-choices.json\['k'\]"):   # no format in the key
            layout_choice.load_choices()
        bad.write_text(bad.read_text().replace('"k"', '"k,format=fp8-block"').replace('"nosuch"', '"masked"'))
        layout_choice.forget_choices()
        with pytest.raises(ValueError, match=r"\.layout.*must be a layout that runs fp8-block"):
            layout_choice.load_choices()
        for text in ("not json", '{"choices": []}'):
            bad.write_text(text)
            layout_choice.forget_choices()
            with pytest.raises(ValueError, match="layout-choices.json"):
                layout_choice.load_choices()
    finally:
        layout_choice.forget_choices()


@needs_gpu
def test_auto_layout_at_a_prefill_batch_through_replays_and_graphs_gpu():
    """DeepSeek-V3 bf16 at 4,096 tokens with layout="auto": on the H200 the permute layout with TMA
    on both operands and a persistent grid (elsewhere index-gather); six calls (recorded, replayed,
    then a CUDA graph) agree with the index-gather layer."""
    layer = MoELayer.random("deepseek-v3", dtype=torch.bfloat16, device="cuda", seed=2, layout="auto")
    plan = layer.plan(4096, dtype=torch.bfloat16)
    if torch.cuda.get_device_name() == H200:
        assert plan.layout == "permute" and plan.choice.source == "layout-choice"
    x = torch.randn(4096, MODELS["deepseek-v3"].hidden_size, device="cuda", dtype=torch.bfloat16)
    outputs = [layer(x).clone() for _ in range(6)]
    layer.layout = "index_gather"
    want = layer(x)
    for out in outputs:
        assert rel_err(out, want) < 1e-2
