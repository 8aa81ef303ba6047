"""The router in launches chained by PDL (moe_kernels.kernels.chained_routing) and the top-k by one
partial sort (moe_kernels.kernels.sorted_topk).

The chained router adds the same partials in the same order as the one-launch router
(moe_kernels.kernels.gate_routing) and routes and aligns them with the same bodies, so its outputs
equal that router's bit for bit under the interpreter (on a GPU the weights to float32's last
bits); on integer-valued inputs (exact sums) its ids also equal the float64 reference's. The sorted top-k is checked against the k rounds of argmax it replaces, in
the routing kernels on their own, and both against the float32 references. CPU tests use float32
and float16 (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import functools

import pytest
import torch

from moe_kernels._runtime import HAS_TRITON, record_launches
from moe_kernels.kernels import chained_routing, routing
from moe_kernels.kernels._pdl import pdl_available
from moe_kernels.kernels.align import moe_align_block_size_reference
from moe_kernels.kernels.blocks import check_alignment, same_segments
from moe_kernels.kernels.chained_routing import MAX_TOKENS, gate_route_chained
from moe_kernels.kernels.gate_routing import gate_and_route, gate_and_route_reference, gate_route_and_align
from moe_kernels.kernels.grouped_routing import grouped_topk, grouped_topk_reference
from moe_kernels.kernels.routing import fused_topk, fused_topk_reference
from moe_testing import DEVICE, ON_GPU, assert_same_floats, compiled_for_hopper, needs_gpu
from test_gate_routing import inputs


def assert_same_alignment(got, want, block_size, numel):
    """Two alignments ``(sorted_ids, expert_ids, used)`` of ``numel`` assignments: equal under the interpreter
    (its programs run one after another, so the ranked body counts in assignment order); on a GPU the ranked
    body's atomics may order a segment's rows otherwise, so the same segments, blocks, padding and tail."""
    if ON_GPU:
        assert same_segments(got, want, block_size, numel)
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def check_chained(x, w, topk, *, block_size=None, sorted_topk=True, aligner="chained_routing.align",
                  gate_block_t=16, want=None, **rule):
    """gate_route_chained against the one-launch router on the same inputs (the same 16-token gate blocks:
    ids equal, floats bit for bit under the interpreter and within a few ulps on a GPU) and, with ``block_size``, its alignment against
    the reference's of its ids (integers: exact; on a GPU, above one program, the same segments). ``want``: the
    one-launch router's result, where a test already has it."""
    with record_launches() as launches:
        got = gate_route_chained(x, w, topk, True, block_size=block_size, sorted_topk=sorted_topk,
                                 gate_block_t=gate_block_t, **rule)
    if want is not None:
        pass
    elif block_size is None:
        want = gate_and_route(x, w, topk, True, **rule)
    else:
        want = gate_route_and_align(x, w, topk, True, block_size=block_size, **rule)
    assert len(got) == len(want)
    assert_same_floats(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert_same_floats(got[2], want[2])
    if block_size is not None:
        ids = got[1]
        assert_same_alignment(got[3:], want[3:], block_size, ids.numel())
        assert_same_alignment(got[3:], moe_align_block_size_reference(ids, block_size, w.shape[0]), block_size,
                              ids.numel())
        check_alignment(ids, block_size, w.shape[0], *got[3:])
    if HAS_TRITON and x.shape[0] > 0:   # the path, not only the value
        names = [name for name, _ in launches]
        assert names[:2] == ["chained_routing.gate", "chained_routing.route"], launches
        assert names[2:] == ([] if block_size is None else [aligner]), launches
        settings = launches[1][1]
        assert settings["sorted_topk"] == sorted_topk and settings["pdl"] is pdl_available(x.device)
        assert launches[0][1]["block_t"] == (gate_block_t or chained_routing.gate_block_tokens(x.shape[0]))
        if block_size is not None and aligner == "chained_routing.align":   # one program, one read, a few tokens
            one_tile = x.shape[0] * topk <= chained_routing.ONE_TILE_MAX_ASSIGNMENTS
            assert launches[2][1]["one_tile"] == one_tile and (launches[2][1]["programs"] == 1 or not one_tile)
            assert launches[2][1]["body"] == ("full" if one_tile else "ranked"), launches   # (the default)
    return got


CASES = [
    dict(shape=(1, 8, 32, 2), block=4),                       # one token: every expert hit once at most
    dict(shape=(5, 6, 33, 6), block=4),                       # k = E, odd d
    dict(shape=(9, 5, 40, 1), block=1),                       # k = 1, blocks of one row
    dict(shape=(40, 48, 600, 4), block=16),                   # three token blocks, d split, 2 expert blocks
    dict(shape=(17, 40, 96, 3), block=64),                    # k not a power of two; a block past every row
    dict(shape=(3, 1, 16, 1), block=16),                      # one expert
    dict(shape=(33, 36, 700, 5), block=16, scoring_func="sigmoid", num_expert_group=3, topk_group=2, bias=True),
    dict(shape=(12, 32, 64, 6), block=8, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
         routed_scaling_factor=2.5),
]
CASE_IDS = ["one token", "k=E", "k=1", "three token blocks", "k=3, block 64", "E=1", "grouped, bias",
            "grouped, scaled"]


def case_arguments(case):
    case = dict(case)
    num_tokens, num_experts, hidden, topk = case.pop("shape")
    block = case.pop("block")
    if case.pop("bias", False):
        generator = torch.Generator().manual_seed(num_experts)
        case["e_score_correction_bias"] = (0.1 * torch.randn(num_experts, generator=generator)).to(DEVICE)
    x, w = inputs(num_tokens, num_experts, hidden, seed=hidden)
    return x, w, topk, block, case


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("sorted_topk", [True, False, "keyed"], ids=["sorted", "rounds", "keyed"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "routed"])
def test_equals_the_one_launch_router(case, sorted_topk, aligned):
    x, w, topk, block, rule = case_arguments(case)
    check_chained(x, w, topk, block_size=block if aligned else None, sorted_topk=sorted_topk, **rule)


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
def test_integer_inputs_match_the_float64_reference(grouped):
    """Exact logits, so the whole rule matches the float64 reference id for id (many ties: small
    integers repeat), with weights to float32's last bits."""
    rule = dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2) if grouped else {}
    x, w = inputs(21, 16, 48, 5, integer=True)
    got = gate_route_chained(x, w, 4, True, **rule)
    want = gate_and_route_reference(x.double(), w.double(), 4, True, **rule)
    assert torch.equal(got[2].double(), want[2])
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].double(), want[0].double(), atol=1e-6, rtol=1e-5)


def test_every_token_on_one_expert_and_an_empty_one():
    x, w = inputs(20, 4, 32, 3)
    x = x.abs() + 0.1
    w = w.clone()
    w[0], w[3] = 1.0, -1.0
    ids = check_chained(x, w, 2, block_size=4)[1]
    assert bool((ids[:, 0] == 0).all()) and not bool((ids == 3).any())


def test_equal_scores_go_to_the_lower_ids():
    """A zero gate: every logit 0, every score equal, so the ids are 0..k-1 in order."""
    x, w = inputs(3, 16, 32, 0)
    weights, ids, _ = gate_route_chained(x, torch.zeros_like(w), 5, True)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    torch.testing.assert_close(weights, torch.full_like(weights, 0.2))


def test_many_tokens_and_past_the_alignment_launchs_reach(monkeypatch):
    """130 tokens (nine token blocks in the gate, one routing program each); and above
    ALIGN_MAX_ASSIGNMENTS the alignment kernel of its own (moe_align_block_size), with the same result."""
    x, w = inputs(130, 8, 16, 6)
    check_chained(x, w, 2, block_size=4)
    monkeypatch.setattr(chained_routing, "ALIGN_MAX_ASSIGNMENTS", 8)
    x, w = inputs(5, 16, 32, 4)
    got = check_chained(x, w, 2, block_size=4, aligner="align.moe_align_block_size")
    assert got[1].shape == (5, 2)


@pytest.mark.parametrize("grouped, gate_block_t", [(False, 16), (False, 32), (False, None), (True, 16), (True, None)],
                         ids=["plain-16", "plain-32", "plain-default", "grouped-16", "grouped-default"])
def test_wider_gate_blocks_sum_the_same_products(gate_block_t, grouped, monkeypatch):
    """The gate's token block (64 from WIDE_GATE_FROM_TOKENS, with 64-expert blocks and up to 32 spans
    of d): on integer inputs, where every sum is exact in any order, the same logits, ids, weights and
    alignment as the one-launch router's 16-token blocks. 70 tokens: two 64-token blocks, the last one
    short (the wide blocks taken from 64 tokens here, so that "default" is the wide grid of 64-token blocks,
    and no case names 64: the interpreter runs one routing program a token, and these cases are among CI's
    slowest); 80 experts: two 64-expert blocks, the last one short."""
    monkeypatch.setattr(chained_routing, "WIDE_GATE_FROM_TOKENS", 64)
    x, w, rule, one_launch = wide_gate_problem(grouped)
    got = check_chained(x, w, 6, block_size=16, gate_block_t=gate_block_t, want=one_launch, **rule)
    want = gate_and_route_reference(x.double(), w.double(), 6, True, **rule)   # and the float64 rule's
    assert torch.equal(got[2].double(), want[2]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].double(), want[0].double(), atol=1e-6, rtol=1e-5)


@functools.lru_cache(maxsize=2)
def wide_gate_problem(grouped):
    """The inputs of the test above, and the one-launch router's result on them (the same for every gate block:
    computed once per rule, since the interpreter takes seconds)."""
    rule = dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2) if grouped else {}
    x, w = inputs(70, 80, 300, 7, integer=True)
    return x, w, rule, gate_route_and_align(x, w, 6, True, block_size=16, **rule)


def test_the_gate_block_by_batch():
    """16-token blocks (the one-launch router's tiles) below WIDE_GATE_FROM_TOKENS, 64 from it; the
    wide grid of DeepSeek-V3 at 512 tokens reads each gate row 8 times, not 32."""
    wide = chained_routing.WIDE_GATE_FROM_TOKENS
    assert chained_routing.gate_block_tokens(wide - 1) == 16 and chained_routing.gate_block_tokens(wide) == 64
    tiles = chained_routing.chained_gate_tiles(512, 256, 7168, 64)
    assert (tiles["t_blocks"], tiles["e_blocks"], tiles["split_k"]) == (8, 4, 8)
    # 16-token blocks: exactly the one-launch router's grid
    assert chained_routing.chained_gate_tiles(64, 256, 7168, 16) == chained_routing.gate_tiles(64, 256, 7168)
    # at most 32 spans of d for a routing program to add, however wide the gate
    assert chained_routing.chained_gate_tiles(64, 256, 7168, 64)["split_k"] <= 32


@pytest.mark.skipif(not HAS_TRITON, reason="the launches' settings")
@pytest.mark.parametrize("rule, num_experts, warps", [("softmax", 128, 1), ("softmax", 256, 2), ("grouped", 256, 4)])
def test_the_routing_program_runs_on_the_measured_warps_and_the_gate_on_its_grid(rule, num_experts, warps):
    """The path, at one token of DeepSeek-V3's width: Qwen3-30B-A3B's softmax over 128 experts on one
    warp, softmax over 256 on two, DeepSeek-V3's grouped rule over 256 on four (route_warps, as
    measured); the gate split as gate_grid.gate_tiles says (14 spans of 512 for a 256 x 7168 gate)."""
    from moe_kernels.kernels.gate_grid import gate_tiles

    x, w = inputs(1, num_experts, 7168, 3)
    grouped = dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4,
                   e_score_correction_bias=torch.zeros(num_experts, device=DEVICE)) if rule == "grouped" else {}
    with record_launches() as launches:
        gate_route_chained(x, w, 8, True, **grouped)
    settings = dict(launches)
    assert settings["chained_routing.route"]["warps"] == warps
    assert settings["chained_routing.gate"]["split_k"] == gate_tiles(1, num_experts, 7168)["split_k"]
    assert gate_tiles(1, 256, 7168)["split_k"] == 14


@pytest.mark.parametrize("num_tokens, topk", [(6, 3), (20, 4)], ids=["one program", "chunked"])
def test_the_alignment_without_its_tail_places_the_same_rows(monkeypatch, num_tokens, topk):
    """ALIGN_BODY "no tail" (only for timing the launch's parts), in both bodies: the used rows and
    blocks as the full body's; what it leaves out is the tail past them."""
    x, w = inputs(num_tokens, 16, 32, 2)
    monkeypatch.setattr(chained_routing, "ALIGN_BODY", "full")
    full = gate_route_chained(x, w, topk, True, block_size=4)
    monkeypatch.setattr(chained_routing, "ALIGN_BODY", "no tail")
    with record_launches() as launches:
        partial = gate_route_chained(x, w, topk, True, block_size=4)
    assert launches[-1][1]["body"] == "no tail"
    assert launches[-1][1]["one_tile"] == (num_tokens * topk <= chained_routing.ONE_TILE_MAX_ASSIGNMENTS)
    used = int(full[5])
    assert int(partial[5]) == used and torch.equal(partial[3][:used], full[3][:used])
    assert torch.equal(partial[4][: used // 4], full[4][: used // 4])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_ranked_alignment_places_every_row(monkeypatch, case):
    """ALIGN_BODY "ranked": above one program's reach the routing programs count each expert's rows with
    atomics (their ranks) and the alignment only scans the counts and scatters. Same routing as the full
    body; the same segments, blocks, padding and tail as the reference, each segment the same assignments
    (in the order the programs counted them: on a GPU any order, under the interpreter the reference's);
    the launches say which body ran, and only that body's launches clear and count."""
    x, w, topk, block, rule = case_arguments(case)
    monkeypatch.setattr(chained_routing, "ALIGN_BODY", "full")
    full = gate_route_chained(x, w, topk, True, block_size=block, **rule)
    monkeypatch.setattr(chained_routing, "ALIGN_BODY", "ranked")
    gate_route_chained(x, w, topk, True, block_size=block, **rule)   # (its counters' memory, freed with counts in it)
    with record_launches() as launches:
        got = gate_route_chained(x, w, topk, True, block_size=block, **rule)
    for a, b in zip(got[:3], full[:3]):
        assert torch.equal(a, b)
    want = moe_align_block_size_reference(got[1], block, w.shape[0])
    assert same_segments(got[3:], want, block, got[1].numel())
    if not ON_GPU:   # (programs one after another: counted in assignment order)
        assert all(torch.equal(a, b) for a, b in zip(got[3:], want))
    check_alignment(got[1], block, w.shape[0], *got[3:])
    if HAS_TRITON:
        ranked = x.shape[0] * topk > chained_routing.ONE_TILE_MAX_ASSIGNMENTS
        settings = dict(launches)
        assert settings["chained_routing.align"]["body"] == ("ranked" if ranked else "full"), launches
        assert settings["chained_routing.route"]["ranks"] == settings["chained_routing.gate"]["clears_counts"] == ranked


@pytest.mark.parametrize("numel, num_experts, block", [(65, 5, 1), (130, 36, 16), (100, 1, 16), (200, 7, 64),
                                                       (129, 17, 5), (100, 300, 64)])
def test_the_ranked_alignment_takes_any_order_inside_a_segment(numel, num_experts, block):
    """The ranked body alone, on counts and ranks made here in a random order inside each expert (as a GPU's
    atomics may count them), some experts empty: the same segments as the reference, and every invariant of
    an alignment (real rows first in each segment, the sentinel after, the blocks' labels, the tail)."""
    from moe_kernels._runtime import cdiv
    from moe_kernels.kernels import align

    g = torch.Generator().manual_seed(numel * num_experts + block)
    live = torch.randperm(num_experts, generator=g)[: max(1, num_experts * 2 // 3)]
    ids = live[torch.randint(0, live.numel(), (numel,), generator=g)].to(torch.int32)
    counts = torch.bincount(ids.long(), minlength=num_experts).to(torch.int32)
    ranks = torch.empty(numel, dtype=torch.int32)
    for e in range(num_experts):
        rows = (ids == e).nonzero().flatten()
        ranks[rows] = torch.randperm(rows.numel(), generator=g).to(torch.int32)
    ids, counts, ranks = ids.to(DEVICE), counts.to(DEVICE), ranks.to(DEVICE)
    sorted_ids, expert_ids, used = align.empty_alignment(numel, block, num_experts, ids.device)
    for buffer in (sorted_ids, expert_ids, used):
        buffer.fill_(-7)
    bins, pad_tile = align.align_bins_and_pad_tile(num_experts, block)
    programs = max(cdiv(numel, align._SINGLE_TILE), cdiv(sorted_ids.numel(), align._FILL_ROWS_PER_PROGRAM), 1)
    chained_routing._chained_align_kernel[(programs,)](
        ids, sorted_ids, expert_ids, used, numel, num_experts, block, NUM_BINS=bins, TILE=align._SINGLE_TILE,
        PAD_TILE=pad_tile, COUNT_TILE=align._COUNT_TILE, FILL_TILE=align._FILL_TILE, PDL=False, BODY="ranked",
        ONE_TILE=False, ranks_ptr=ranks, counts_ptr=counts, num_warps=8)
    got = (sorted_ids, expert_ids, used)
    assert same_segments(got, moe_align_block_size_reference(ids.view(-1, 1), block, num_experts), block, numel)
    check_alignment(ids.view(-1, 1), block, num_experts, *got)


@pytest.mark.parametrize("num_tokens, topk", [(8, 8), (13, 5)], ids=["64: one program", "65: chunked"])
def test_the_alignment_at_the_one_program_edge(num_tokens, topk):
    """ONE_TILE_MAX_ASSIGNMENTS = 64 assignments exactly (one program, a full tile of ids) and one more
    (the chunked body): both equal the one-launch router and the reference (check_chained pins the path)."""
    assert chained_routing.ONE_TILE_MAX_ASSIGNMENTS == 64
    x, w = inputs(num_tokens, 16, 48, 9)
    check_chained(x, w, topk, block_size=4)


def test_no_tokens():
    x, w = inputs(0, 8, 32, 0)
    weights, ids, logits = gate_route_chained(x, w, 2, True)
    assert weights.shape == ids.shape == (0, 2) and logits.shape == (0, 8)
    weights, ids, logits, sorted_ids, expert_ids, used = gate_route_chained(x, w, 2, True, block_size=4)
    assert weights.shape == ids.shape == (0, 2) and logits.shape == (0, 8)
    assert int(used) == 0 and sorted_ids.numel() == 8 * 3 and bool((expert_ids == -1).all())


@pytest.mark.parametrize("change, name", [
    (dict(tokens=MAX_TOKENS + 1), "hidden_states"),
    (dict(sorted_topk=1), "sorted_topk"),
    (dict(pdl="yes"), "pdl"),
    (dict(gate_block_t=48), "gate_block_t"),
    (dict(gate_block_t=True), "gate_block_t"),
    (dict(gate_block_t=16.0), "gate_block_t"),
    (dict(block_size=0), "block_size"),
    (dict(topk=9), "topk"),
    (dict(scoring_func="relu"), "scoring_func"),
])
def test_bad_input_names_the_argument(change, name):
    x, w = inputs(change.pop("tokens", 2), 8, 16, 0)
    kwargs = dict(topk=2, renormalize=True)
    kwargs.update(change)
    with pytest.raises((ValueError, TypeError)) as error:
        gate_route_chained(x, w, **kwargs)
    assert name in str(error.value)


@pytest.mark.parametrize("num_tokens, num_experts, topk", [(1, 8, 2), (7, 128, 8), (33, 12, 3), (5, 6, 6),
                                                          (4, 1, 1)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("body", [True, "keyed"], ids=["sort", "keyed rounds"])
def test_sorted_topk_in_the_routing_kernel(monkeypatch, body, num_tokens, num_experts, topk, scoring):
    """fused_topk with the sorted top-k: the same ids and weights as the k rounds, and the
    reference's ids (ties included: integer logits repeat)."""
    generator = torch.Generator().manual_seed(num_experts)
    logits = torch.randint(-4, 5, (num_tokens, num_experts), generator=generator).float().to(DEVICE)
    x = torch.zeros(num_tokens, 8, device=DEVICE)
    monkeypatch.setattr(routing, "TOPK_BY_SORT", False)   # (the rounds; "keyed" is the default)
    rounds = fused_topk(x, logits, topk, True, scoring)
    monkeypatch.setattr(routing, "TOPK_BY_SORT", body)
    with record_launches() as launches:
        by_sort = fused_topk(x, logits, topk, True, scoring)
    if HAS_TRITON:   # (the body the launch took, not only its values)
        assert [settings["topk_body"] for _, settings in launches] == [body]
    assert torch.equal(by_sort[1], rounds[1])
    assert_same_floats(by_sort[0], rounds[0])   # (on a GPU the renormalising sum may run in another order)
    want = fused_topk_reference(x, logits, topk, True, scoring)
    assert torch.equal(by_sort[1], want[1])
    torch.testing.assert_close(by_sort[0], want[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("body", [True, "keyed"], ids=["sort", "keyed rounds"])
def test_sorted_topk_in_the_grouped_routing_kernel(monkeypatch, body, bias):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-4, 5, (9, 24), generator=generator).float().to(DEVICE)
    correction = (0.25 * torch.randint(-2, 3, (24,), generator=generator).float()).to(DEVICE) if bias else None
    x = torch.zeros(9, 8, device=DEVICE)
    args = (x, logits, 5, True, 4, 2, "sigmoid", 2.5, correction)
    monkeypatch.setattr(routing, "TOPK_BY_SORT", False)
    rounds = grouped_topk(*args)
    monkeypatch.setattr(routing, "TOPK_BY_SORT", body)
    with record_launches() as launches:
        by_sort = grouped_topk(*args)
    if HAS_TRITON:
        assert [settings["topk_body"] for _, settings in launches] == [body]
    assert torch.equal(by_sort[1], rounds[1])
    assert_same_floats(by_sort[0], rounds[0])
    want = grouped_topk_reference(*args)
    assert torch.equal(by_sort[1], want[1])


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("body", [True, "keyed"], ids=["sort", "keyed rounds"])
def test_sorted_topk_with_infinities_and_nan(monkeypatch, body, scoring):
    """-inf logits, +inf and a NaN (which ranks as -inf): with k = E every expert is still picked
    exactly once, in the reference's order, as by the k rounds."""
    logits = torch.tensor([[float("-inf"), 1.0, float("nan"), float("-inf")],
                           [float("inf"), 1.0, float("-inf"), 0.5],
                           [-0.0, 0.0, -1e-45, 1e-45],           # signed zeros tie; subnormals order
                           [-3.0e38, -1.5, -2.5, -1.5]], device=DEVICE)   # negatives, a tie among them
    x = torch.zeros(4, 8, device=DEVICE)
    monkeypatch.setattr(routing, "TOPK_BY_SORT", False)
    rounds = fused_topk(x, logits, 4, False, scoring)
    monkeypatch.setattr(routing, "TOPK_BY_SORT", body)
    weights, ids = fused_topk(x, logits, 4, False, scoring)
    assert torch.equal(ids, rounds[1]) and torch.equal(ids, fused_topk_reference(x, logits, 4, False, scoring)[1])
    assert all(sorted(row) == [0, 1, 2, 3] for row in ids.tolist())
    torch.testing.assert_close(weights, rounds[0], equal_nan=True)


@pytest.mark.skipif(not HAS_TRITON, reason="no Triton: the torch references launch nothing")
def test_the_routing_kernels_take_the_keyed_top_k_by_default():
    """The default body of both routing kernels is the keyed rounds (``routing-align-*-s43.json``: faster than
    the rounds at every batch measured); the chained router keeps its sort (faster at decode)."""
    x, logits = torch.zeros(3, 8, device=DEVICE), torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    logits = logits.to(DEVICE)
    with record_launches() as launches:
        fused_topk(x, logits, 2, True)
        grouped_topk(x, logits, 2, True, 4, 2, "sigmoid")
    assert [(name, settings["topk_body"]) for name, settings in launches] == [
        ("routing.fused_topk", "keyed"), ("routing.grouped_topk", "keyed")]
    with record_launches() as launches:
        gate_route_chained(*inputs(3, 16, 32, 0), 2, True)
    assert [settings["sorted_topk"] for name, settings in launches if name == "chained_routing.route"] == [True]


@needs_gpu
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 200])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_real_shapes_on_gpu(model, num_tokens, pdl):
    """bf16 at the models' shapes, chained (with and without PDL, sorted and rounds) against the
    one-launch router: with its 16-token gate blocks the same logits, the same ids, the weights to
    float32's last bits (the renormalising sum may be reduced in another order), the same alignment;
    with the default blocks (wider from WIDE_GATE_FROM_TOKENS) the logits to float32's rounding."""
    from moe_kernels.layer import MoELayer

    layer = MoELayer.random(model, dtype=torch.bfloat16, device="cuda", seed=num_tokens)
    rule, w = layer.routing, layer.weights
    x = torch.randn(num_tokens, w.gate.shape[1], device="cuda", dtype=torch.bfloat16)
    grouped = dict(num_expert_group=rule.num_expert_group, topk_group=rule.topk_group,
                   routed_scaling_factor=rule.routed_scaling_factor, e_score_correction_bias=w.bias)
    args = (x, w.gate, rule.top_k, rule.renormalize, rule.scoring_func)
    want = gate_route_and_align(*args, block_size=16, **grouped)
    for sorted_topk in (True, False):
        with record_launches() as launches:   # the one-launch router's 16-token gate blocks
            got = gate_route_chained(*args, block_size=16, sorted_topk=sorted_topk, pdl=pdl, gate_block_t=16,
                                     **grouped)
        assert [name for name, _ in launches] == ["chained_routing.gate", "chained_routing.route",
                                                  "chained_routing.align"]
        assert all(settings["pdl"] == pdl for _, settings in launches)
        assert launches[1][1]["sorted_topk"] == sorted_topk
        # the alignment's path: one program up to ONE_TILE_MAX_ASSIGNMENTS (1 and 8 tokens), chunked above
        one_tile = num_tokens * rule.top_k <= chained_routing.ONE_TILE_MAX_ASSIGNMENTS
        assert launches[2][1]["one_tile"] == one_tile and (launches[2][1]["programs"] == 1) == one_tile
        assert torch.equal(got[2], want[2]) and torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
        assert_same_alignment(got[3:], want[3:], 16, got[1].numel())
    # The default gate blocks (64 tokens from WIDE_GATE_FROM_TOKENS): the same products in another
    # grouping, so the logits to float32's rounding of the sums, and the same ids away from near-ties.
    got = gate_route_chained(*args, block_size=16, pdl=pdl, **grouped)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-4)
    assert int((got[1] != want[1]).any(dim=1).sum()) <= num_tokens // 100
    assert_same_alignment(got[3:], moe_align_block_size_reference(got[1], 16, w.gate.shape[0]), 16, got[1].numel())


@needs_gpu
def test_repeated_calls_and_graph_replays_agree_on_gpu():
    """The routing programs read the partials after ``gdc_wait``: a launch that did not wait would
    read partials of the call before. Two inputs alternate, so such stale partials would be another
    input's: 200 calls at DeepSeek-V3's shape and 100 tokens, and 50 replays of one CUDA graph whose
    input is refilled with either in turn, each against its own first eager result."""
    xs = [torch.randn(100, 7168, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    w = torch.randn(256, 7168, device="cuda", dtype=torch.bfloat16) / 85
    bias = 0.01 * torch.randn(256, device="cuda")
    args = dict(topk=8, renormalize=True, scoring_func="sigmoid", num_expert_group=8, topk_group=4,
                routed_scaling_factor=2.5, e_score_correction_bias=bias, block_size=16)
    firsts = [gate_route_chained(x, w, **args) for x in xs]
    assert not torch.equal(firsts[0][1], firsts[1][1])   # the two inputs route differently
    calls = [gate_route_chained(xs[i % 2], w, **args) for i in range(200)]

    def agree(got, want):   # (the alignment up to the order in a segment: the ranked body counts with atomics)
        return all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])) and same_segments(got[3:], want[3:], 16, 800)

    assert all(agree(call, firsts[i % 2]) for i, call in enumerate(calls))
    static = xs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gate_route_chained(static, w, **args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = gate_route_chained(static, w, **args)
    for i in range(50):
        static.copy_(xs[i % 2])
        graph.replay()
        assert agree(replayed, firsts[i % 2])


_COMPILE_FOR_HOPPER = """
import re
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import chained_routing
from moe_kernels.sm90_compile import compile_for_sm90

for block_t, block_e in ((16, 32), (64, 64)):   # the narrow gate and the wide one (WIDE_GATE_FROM_TOKENS)
    gate = compile_for_sm90(chained_routing._chained_gate_kernel,
                            dict(IEEE=False, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=128, PDL=True, COUNT_BINS=0),
                            dict(x_ptr="*bf16", gate_ptr="*bf16", partial_ptr="*fp32"),
                            aligned=("stride_x", "stride_gate", "hidden_size", "k_span", "num_experts"), num_warps=4)
    ptx = gate.asm["ptx"]
    trigger = ptx.find("griddepcontrol.launch_dependents")
    print(0 <= trigger < ptx.find("mma"), end=" " if block_t == 16 else chr(10))
pointers = dict(partial_ptr="*fp32", bias_ptr="*fp32", logits_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32",
                scale="fp32")
for grouped, e_cols, (e, d) in ((False, 128, (128, 2048)), (True, 256, (256, 7168))):   # as the launch runs them
    split = chained_routing.chained_gate_tiles(1, e, d, 16)["split_k"]
    const = dict(GROUPED=grouped, HAS_BIAS=grouped, USE_SIGMOID=grouped, PRECISE=True, SORTED=True, BLOCK_T=1,
                 SPLIT_K=split, E_COLS=e_cols, G_PAD=8 if grouped else 1, S_PAD=32 if grouped else 128, K_PAD=8,
                 PDL=True, TRIGGER=True, RANKS=False)
    ptx = compile_for_sm90(chained_routing._chained_route_kernel, const, pointers, aligned=("num_experts",),
                           num_warps=chained_routing.route_warps(e_cols, grouped)).asm["ptx"]
    wait, trigger, read = (ptx.find(op) for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                                    "ld.global.cg"))
    print(0 <= wait < read and 0 <= trigger < read)
for one_tile, tile, warps in ((False, 64, 8), (True, 16, 4)):   # the chunked body, one program (GEMM 1 next)
    ptx = compile_for_sm90(chained_routing._chained_align_kernel,
                           dict(NUM_BINS=128, TILE=tile, PAD_TILE=16, COUNT_TILE=1024, FILL_TILE=1024, PDL=True,
                                BODY="full", ONE_TILE=one_tile, TRIGGER=one_tile),
                           dict(ids_ptr="*i32", sorted_ids_ptr="*i32", expert_ids_ptr="*i32", used_ptr="*i32"),
                           num_warps=warps).asm["ptx"]
    wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    print(0 <= wait < ptx.find("ld.global.cg"), (0 <= trigger < wait) if one_tile else trigger < 0,
          end=" " if not one_tile else chr(10))
"""


def test_compiles_for_hopper_with_its_dependent_launch():
    """Compiled for an H100/H200 (sm_90) on this machine: the gate lets the next launch start before
    its products (tensor cores); the routing programs wait (``griddepcontrol.wait``) and let the
    alignment start before their first read of the partials (through L2), at Qwen3's shape and
    DeepSeek-V3's; the alignment waits before it reads the ids (chunked, and in one program), and lets the launch
    after the chain start (``launch_next``) before it waits, and only where asked."""
    lines = compiled_for_hopper(_COMPILE_FOR_HOPPER)
    assert lines[:4] == ["True True", "True", "True", "True True True True"], lines


_COMPILE_KEYED_ROUTING_FOR_HOPPER = """
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import grouped_routing, routing
from moe_kernels.sm90_compile import compile_for_sm90

pointers = dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32")
for tokens in (1, 16384):   # Qwen3-30B-A3B's fused_topk and DeepSeek-V3's grouped_topk, as the launches size them
    block_t, warps = routing._launch_config(tokens, 128)
    fused = compile_for_sm90(routing._fused_topk_kernel, dict(USE_SIGMOID=False, PRECISE=True, BLOCK_T=block_t,
                                                               E_PAD=128, K_PAD=8, SORTED="keyed"),
                             pointers, num_warps=warps)
    block_t, warps = routing._launch_config(tokens, 256)
    grouped = compile_for_sm90(grouped_routing._grouped_topk_kernel, dict(
        USE_SIGMOID=True, HAS_BIAS=True, PRECISE=True, BLOCK_T=block_t, G_PAD=8, S_PAD=32, K_PAD=8, SORTED="keyed"),
        pointers, num_warps=warps)
    print(all(k.metadata.shared >= 0 and "st.global" in k.asm["ptx"] for k in (fused, grouped)))
"""


def test_the_keyed_routing_kernels_compile_for_hopper():
    """The routing kernels' default body (the keyed rounds) built for sm_90 at the models' shapes, one token and
    16,384 (each launch's own tile): under CI's Triton 3.6 too."""
    assert compiled_for_hopper(_COMPILE_KEYED_ROUTING_FOR_HOPPER)[:2] == ["True", "True"]


_COMPILE_RANKED_FOR_HOPPER = """
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import chained_routing
from moe_kernels.sm90_compile import compile_for_sm90

gate = compile_for_sm90(chained_routing._chained_gate_kernel,
                        dict(IEEE=False, BLOCK_T=16, BLOCK_E=32, BLOCK_K=128, PDL=True, COUNT_BINS=256),
                        dict(x_ptr="*bf16", gate_ptr="*bf16", partial_ptr="*fp32", counts_ptr="*i32"),
                        aligned=("stride_x", "stride_gate", "hidden_size", "k_span", "num_experts"), num_warps=4)
split = chained_routing.chained_gate_tiles(64, 256, 7168, 16)["split_k"]
route = compile_for_sm90(chained_routing._chained_route_kernel,
                         dict(GROUPED=True, HAS_BIAS=True, USE_SIGMOID=True, PRECISE=True, SORTED=True, BLOCK_T=1,
                              SPLIT_K=split, E_COLS=256, G_PAD=8, S_PAD=32, K_PAD=8, PDL=True, TRIGGER=True,
                              RANKS=True),
                         dict(partial_ptr="*fp32", bias_ptr="*fp32", logits_ptr="*fp32", weights_ptr="*fp32",
                              ids_ptr="*i32", scale="fp32", counts_ptr="*i32", ranks_ptr="*i32"),
                         aligned=("num_experts",), num_warps=4).asm["ptx"]
align = compile_for_sm90(chained_routing._chained_align_kernel,
                         dict(NUM_BINS=256, TILE=64, PAD_TILE=16, COUNT_TILE=1024, FILL_TILE=1024, PDL=True,
                              BODY="ranked", ONE_TILE=False),
                         dict(ids_ptr="*i32", sorted_ids_ptr="*i32", expert_ids_ptr="*i32", used_ptr="*i32",
                              ranks_ptr="*i32", counts_ptr="*i32"), num_warps=8).asm["ptx"]
plain = compile_for_sm90(chained_routing._chained_gate_kernel,
                        dict(IEEE=False, BLOCK_T=16, BLOCK_E=32, BLOCK_K=128, PDL=True, COUNT_BINS=0),
                        dict(x_ptr="*bf16", gate_ptr="*bf16", partial_ptr="*fp32", counts_ptr="*i32"),
                        aligned=("stride_x", "stride_gate", "hidden_size", "k_span", "num_experts"), num_warps=4)
cleared = gate.asm["ptx"].count("st.global") - plain.asm["ptx"].count("st.global")   # the counters' clearing
wait, read = align.find("griddepcontrol.wait"), align.find("ld.global.cg")
print(cleared > 0, "atom.global.gpu.relaxed.add" in route, 0 <= wait < read, align.count("bar.sync"))
"""


def test_the_ranked_alignment_compiles_for_hopper():
    """Compiled for sm_90: the gate clears the counters, the routing program counts with global atomics,
    and the ranked alignment waits for the routing's memory before it reads the counts and ranks, with far
    fewer block-wide barriers than the full body's 27."""
    line = compiled_for_hopper(_COMPILE_RANKED_FOR_HOPPER)[0].split()
    assert line[:3] == ["True", "True", "True"] and int(line[3]) < 20, line


_COMPILE_TOP_1_FOR_HOPPER = """
import torch
torch.cuda.is_available = lambda: True
from moe_kernels.kernels import chained_routing
from moe_kernels.sm90_compile import compile_for_sm90
for block_t in (1, 4):
    compile_for_sm90(chained_routing._chained_route_kernel,
                     dict(GROUPED=False, HAS_BIAS=False, USE_SIGMOID=False, PRECISE=True, SORTED=True,
                          BLOCK_T=block_t, SPLIT_K=1, E_COLS=8, G_PAD=1, S_PAD=1, K_PAD=1, PDL=False,
                          TRIGGER=False, RANKS=False),
                     dict(partial_ptr="*fp32", bias_ptr="*fp32", logits_ptr="*fp32", weights_ptr="*fp32",
                          ids_ptr="*i32", scale="fp32", counts_ptr="*i32", ranks_ptr="*i32"), num_warps=4)
    print(block_t, "built")
"""


def test_top_1_compiles_for_hopper():
    """k = 1 on the sorted top-k, one token per program: Triton 3.6's ``tl.topk`` failed to build it for
    the GPU (its last reduction left a scalar), which the interpreter never showed; take_topk_sorted
    takes the maximum there instead."""
    assert compiled_for_hopper(_COMPILE_TOP_1_FOR_HOPPER)[:2] == ["1 built", "4 built"]


def test_the_layer_chooses_its_router():
    """choose_router's edges: the chain up to CHAINED_ROUTER_MAX_TOKENS (aligned only where the map is
    alignable and within its reach), the two steps above it or with a gate in another dtype, and the
    one-launch router first when GATE_ROUTING_MAX_TOKENS reaches the batch."""
    from unittest import mock

    import moe_kernels.layer_router as layer_router
    from moe_kernels.layer_router import CHAINED_ROUTER_MAX_TOKENS, choose_router

    assert choose_router(CHAINED_ROUTER_MAX_TOKENS, True, 8, True) == (True, True, True)
    assert choose_router(CHAINED_ROUTER_MAX_TOKENS + 1, True, 8, True) == (False, False, False)
    assert choose_router(8, False, 8, True) == (False, False, False)   # a float32 gate for bf16 activations
    assert choose_router(8, True, 8, False) == (True, False, True)     # naive map or fused shared slot
    assert choose_router(0, True, 8, True) == (False, False, False)
    with mock.patch.object(chained_routing, "ALIGN_MAX_ASSIGNMENTS", 63):
        assert choose_router(8, True, 8, True) == (True, False, True)
    with mock.patch.object(layer_router, "GATE_ROUTING_MAX_TOKENS", 8):
        assert choose_router(8, True, 8, True) == (True, True, False)
        assert choose_router(9, True, 8, True) == (True, True, True)


@pytest.mark.skipif(not HAS_TRITON, reason="a setting of the launches (the torch fallback launches nothing)")
def test_an_unknown_alignment_body_is_refused(monkeypatch):
    """A misspelt ALIGN_BODY names the setting and the bodies there are (it would otherwise run the full body
    without its tail)."""
    monkeypatch.setattr(chained_routing, "ALIGN_BODY", "rankd")
    x, w = inputs(20, 16, 32, 1)
    with pytest.raises(ValueError, match="'ALIGN_BODY' must be one of .*'ranked'.*got 'rankd'"):
        gate_route_chained(x, w, 4, True, block_size=4)
