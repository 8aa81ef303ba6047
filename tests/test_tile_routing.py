"""The router at prefill in one launch of whole-E tiles (moe_kernels.kernels.tile_routing).

The checks of tests/test_gate_routing.py's routers: the logits against float64; the ids and weights against
the routing kernels run on the kernel's own logits (the same routing body, so the same ids); on integer-valued
inputs (exact float32 sums) the whole rule against its float64 reference. CPU tests use float32 and float16
(the interpreter's bf16 dot is wrong); bf16 runs at the models' shapes on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from moe_kernels._runtime import HAS_TRITON, record_launches
from moe_kernels.kernels import routing
from moe_kernels.kernels.gate_routing import gate_and_route_reference
from moe_kernels.kernels.tile_routing import (MAX_EXPERTS, TILE_CHOICES, gate_and_route_tiles, tile_gate,
                                              tile_router_tiles)
from moe_testing import DEVICE, assert_same_floats, compiled_for_hopper, needs_gpu
from test_gate_routing import check_real_shapes, inputs, routing_of


def check_case(num_tokens, num_experts, hidden, topk, *, seed=0, dtype=torch.float32, renormalize=True,
               scoring="softmax", block_t=None, sorted_topk=None, x=None, w=None, **grouped):
    if x is None:
        x, w = inputs(num_tokens, num_experts, hidden, seed, dtype)
    with record_launches() as launches:
        weights, ids, logits = gate_and_route_tiles(x, w, topk, renormalize, scoring, block_t=block_t,
                                                    sorted_topk=sorted_topk, **grouped)
    assert weights.shape == ids.shape == (num_tokens, topk) and logits.shape == (num_tokens, num_experts)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and logits.dtype == torch.float32
    if HAS_TRITON and num_tokens > 0:   # the path: one launch, the tile asked for
        assert [name for name, _ in launches] == ["tile_routing.gate_and_route_tiles"], launches
        settings = launches[0][1]
        want_block = block_t or tile_router_tiles(num_tokens, num_experts, hidden)["block_t"]
        assert settings["block_t"] == want_block and settings["programs"] == -(-num_tokens // want_block)
        assert settings["sorted_topk"] == (routing.TOPK_BY_SORT if sorted_topk is None else sorted_topk)
    torch.testing.assert_close(logits.double(), x.double() @ w.double().T, atol=1e-4 * hidden ** 0.5, rtol=1e-3)
    want_weights, want_ids = routing_of(x, logits, topk, renormalize, scoring, **grouped)
    assert torch.equal(ids, want_ids)
    assert_same_floats(weights, want_weights)
    return ids


def check_integer_case(num_tokens, num_experts, hidden, topk, *, seed=0, block_t=None, **rule):
    """Small integers: every product and sum exact, so the ids equal the float64 reference's."""
    x, w = inputs(num_tokens, num_experts, hidden, seed, integer=True)
    got = gate_and_route_tiles(x, w, topk, True, block_t=block_t, **rule)
    want = gate_and_route_reference(x.double(), w.double(), topk, True, **rule)
    assert torch.equal(got[2].double(), want[2]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].double(), want[0].double(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 17, 70])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plain_rule_against_references(num_tokens, scoring, dtype):
    check_case(num_tokens, 40, 96, 4, seed=num_tokens, dtype=dtype, scoring=scoring,
               renormalize=num_tokens % 2 == 1)


@pytest.mark.parametrize("block_t", TILE_CHOICES)
@pytest.mark.parametrize("sorted_topk", [False, True, "keyed"])
def test_every_token_block_and_every_topk_body(block_t, sorted_topk):
    """Each tile height, with a partial last block (tokens not a multiple of it) and several routing steps
    a program (20 experts: 2048 / 32 = 64 tokens a routing step, so 128-token blocks take two)."""
    check_case(block_t + 3, 20, 48, 3, seed=block_t, block_t=block_t, sorted_topk=sorted_topk)


@pytest.mark.parametrize("num_tokens", [1, 19])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_rule_against_references(num_tokens, bias):
    generator = torch.Generator().manual_seed(3)
    correction = (0.1 * torch.randn(48, generator=generator)).to(DEVICE) if bias else None
    rule = dict(scoring="sigmoid", num_expert_group=6, topk_group=2, routed_scaling_factor=2.5,
                e_score_correction_bias=correction)
    check_case(num_tokens, 48, 64, 4, seed=7, block_t=16, **rule)
    rule["scoring_func"] = rule.pop("scoring")
    check_integer_case(num_tokens, 48, 64, 4, seed=8, **rule)


@pytest.mark.parametrize("shape", [
    (1, 1, 16, 1),     # one token, one expert (the tile's 16 columns, 15 of them padding)
    (9, 7, 40, 7),     # k = E, d not a multiple of the K step
    (33, 24, 200, 1),  # k = 1, several K steps with a ragged last one
    (5, 130, 24, 6),   # E past a power of two (256 columns)
], ids=["E=1", "k=E", "k=1", "E=130"])
def test_edge_shapes(shape):
    num_tokens, num_experts, hidden, topk = shape
    check_case(num_tokens, num_experts, hidden, topk, seed=hidden)
    check_integer_case(num_tokens, num_experts, hidden, topk, seed=hidden + 1)


def test_every_token_on_one_expert_and_an_empty_one():
    """Expert 0's row dominates every token; expert 3's never makes a token's top-2."""
    x, w = inputs(20, 4, 32, 3)
    x = x.abs() + 0.1
    w = w.clone()
    w[0], w[3] = 1.0, -1.0
    ids = check_case(20, 4, 32, 2, x=x, w=w)
    assert bool((ids[:, 0] == 0).all()) and not bool((ids == 3).any())


@pytest.mark.parametrize("block_t", [None, 16, 64])
def test_the_gate_alone(block_t):
    """tile_gate: the kernel's logits without its routing, against float64; one launch, no routing."""
    x, w = inputs(70, 24, 200, 4)
    with record_launches() as launches:
        logits = tile_gate(x, w, block_t=block_t)
    torch.testing.assert_close(logits.double(), x.double() @ w.double().T, atol=1e-4 * 200 ** 0.5, rtol=1e-3)
    if HAS_TRITON:
        assert [name for name, _ in launches] == ["tile_routing.tile_gate"]
    assert tile_gate(x[:0], w).shape == (0, 24)
    with pytest.raises(ValueError, match="block_t"):
        tile_gate(x, w, block_t=8)


def test_tiles_that_would_not_fit_are_refused():
    """More than MAX_EXPERTS experts (the gate's pipeline would pass an SM's shared memory), or a block of tokens
    whose tile passes 128 x 256 logits, named by argument, in both calls; 512 experts on the default tile run."""
    x = inputs(20, 4, 16, 0)[0]
    for call in (lambda w, **kw: gate_and_route_tiles(x, w, 2, True, **kw), lambda w, **kw: tile_gate(x, w, **kw)):
        with pytest.raises(ValueError, match="gate_weight"):
            call(torch.randn(MAX_EXPERTS + 1, 16).to(DEVICE))
        with pytest.raises(ValueError, match="block_t"):
            call(torch.randn(MAX_EXPERTS, 16).to(DEVICE), block_t=128)
    assert tile_router_tiles(20, MAX_EXPERTS, 16)["block_t"] * MAX_EXPERTS <= 128 * 256
    check_case(3, MAX_EXPERTS, 16, 2, seed=9)


def test_no_tokens():
    x, w = inputs(0, 8, 32, 0)
    weights, ids, logits = gate_and_route_tiles(x, w, 2, True)
    assert weights.shape == ids.shape == (0, 2) and logits.shape == (0, 8)


def test_nan_in_a_token_gives_valid_ids_and_spoils_no_other_token():
    x, w = inputs(20, 16, 32, 2)
    x[1, 3] = float("nan")
    weights, ids, _ = gate_and_route_tiles(x, w, 3, True, block_t=16)
    assert bool(((ids >= 0) & (ids < 16)).all())
    keep = [t for t in range(20) if t != 1]
    clean = gate_and_route_tiles(x[keep], w, 3, True, block_t=16)
    assert torch.equal(ids[keep], clean[1]) and torch.equal(weights[keep], clean[0])


def test_the_default_tile_fills_the_machine():
    """From 2,048 tokens the default gives at least 128 programs; the tile never holds more than 128 x 128
    logits; DeepSeek-V3's 256 experts take 64-token blocks; Qwen3-30B-A3B's 128 at 16,384 tokens."""
    for num_tokens in (2048, 4096, 8192, 16384):
        for num_experts, hidden in ((128, 2048), (256, 7168)):
            tiles = tile_router_tiles(num_tokens, num_experts, hidden)
            assert tiles["programs"] >= 128 and tiles["block_t"] * tiles["e_cols"] <= 128 * 128
    assert tile_router_tiles(16384, 128, 2048)["block_t"] == 128
    assert tile_router_tiles(16384, 256, 7168)["block_t"] == 64
    assert tile_router_tiles(3, 4, 8)["e_cols"] == 16 and tile_router_tiles(3, 4, 8)["block_k"] == 16


@pytest.mark.parametrize("change, name", [
    (dict(block_t=48), "block_t"),
    (dict(block_t=16.0), "block_t"),
    (dict(block_t=128, width=512), "block_t"),
    (dict(sorted_topk=1), "sorted_topk"),
    (dict(sorted_topk="sorted"), "sorted_topk"),
    (dict(topk=9), "topk"),
    (dict(dtype=torch.float16), "gate_weight"),
    (dict(scoring_func="relu"), "scoring_func"),
])
def test_bad_input_names_the_argument(change, name):
    x, w = inputs(2, change.pop("width", 8), 16, 0)
    if "dtype" in change:
        w = w.to(change.pop("dtype"))
    kwargs = {"topk": 2, "renormalize": True, **change}
    with pytest.raises((ValueError, TypeError)) as error:
        gate_and_route_tiles(x, w, **kwargs)
    assert name in str(error.value)


@needs_gpu
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("num_tokens", [600, 2048, 16384])
@pytest.mark.parametrize("sorted_topk", [False, True, "keyed"])
def test_real_shapes_on_gpu(model, num_tokens, sorted_topk):
    """bf16 at the models' shapes, each top-k body (test_gate_routing.check_real_shapes)."""
    check_real_shapes(gate_and_route_tiles, model, num_tokens, sorted_topk=sorted_topk)


_COMPILE_FOR_HOPPER = """
import re
import triton
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import tile_routing
from moe_kernels.sm90_compile import assemble_for_sm90, compile_for_sm90

fn = tile_routing._tile_router_kernel
pointers = dict(x_ptr="*bf16", gate_ptr="*bf16", bias_ptr="*fp32", logits_ptr="*fp32", weights_ptr="*fp32",
                ids_ptr="*i32", scale="fp32")
for num_tokens, experts, hidden, grouped in ((16384, 128, 2048, False), (16384, 256, 7168, True),
                                             (2048, 128, 2048, False)):
    tiles = tile_routing.tile_router_tiles(num_tokens, experts, hidden)
    for sorted_topk in (False, True, "keyed"):
        const = dict(GROUPED=grouped, HAS_BIAS=grouped, USE_SIGMOID=grouped, PRECISE=True, SORTED=sorted_topk,
                     IEEE=False, BLOCK_T=tiles["block_t"], E_COLS=tiles["e_cols"], BLOCK_K=tiles["block_k"],
                     STAGES=tiles["stages"], ROUTE_T=2048 // tiles["e_cols"], ROUTE_COLS=tiles["e_cols"],
                     G_PAD=8 if grouped else 1, S_PAD=32 if grouped else 128, K_PAD=8)
        aligned = ("stride_x", "stride_gate", "hidden_size", "num_experts")
        ptx = compile_for_sm90(fn, const, pointers, aligned=aligned, num_warps=tiles["warps"],
                               num_stages=tiles["stages"]).asm["ptx"]
        # the first memory or sync instruction after the logits' stores is a barrier (without the kernel's
        # debug_barrier it is the routing's first parameter load)
        lines = [text.strip() for text in ptx.splitlines()]
        first_store = next(i for i, text in enumerate(lines) if "st.global" in text)
        after = next(text for text in lines[first_store:] if "st.global" not in text and
                     any(op in text for op in ("bar.sync", "ld.", "st.", "cp.async", "atom", "red.")))
        line = [tiles["block_t"] < 64 or "wgmma.mma_async" in ptx, "cp.async" in ptx, after.startswith("bar.sync")]
        if triton.__version__.startswith("3.6."):   # (a newer Triton's ptxas may not read its PTX)
            built = assemble_for_sm90(ptx)
            line.append(built["spill_stores"] + built["spill_loads"])
        print(*line)
const["ROUTE"] = False   # the gate alone (tile_gate)
ptx = compile_for_sm90(fn, const, pointers, aligned=aligned, num_warps=tiles["warps"],
                       num_stages=tiles["stages"]).asm["ptx"]
print("wgmma.mma_async" in ptx or tiles["block_t"] < 64, "bar.sync" not in ptx[ptx.find("st.global"):])
"""


def test_compiles_for_hopper():
    """Compiled for an H100/H200 (sm_90) on this machine, at the tiles the default gives Qwen3-30B-A3B and
    DeepSeek-V3 at 16,384 tokens and Qwen3 at 2,048, each top-k body: 64-row tiles and more on Hopper's wgmma,
    the gate's loads pipelined by cp.async, a barrier between the logits' last store and the routing's first read
    of them (it reads them back through other threads); under Triton 3.6 (the H200's) no spills."""
    import triton

    lines = [line for line in compiled_for_hopper(_COMPILE_FOR_HOPPER) if line]
    want = "True True True" + (" 0" if triton.__version__.startswith("3.6.") else "")
    assert lines == [want] * 9 + ["True True"], lines
