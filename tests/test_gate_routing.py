"""The gate and the routing in one launch (moe_kernels.kernels.gate_routing).

Three checks per case: the logits against float64; the ids and weights against the routing
kernels run on the kernel's own logits (the same routing code, so equal bit for bit); and, on
integer-valued inputs (exact float32 sums, so no near-ties can differ), the ids against the float64
reference of the whole rule. CPU tests use float32 and float16 (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import pytest
import torch

from moe_kernels._runtime import HAS_TRITON, record_launches
from moe_kernels.kernels import gate_routing
from moe_kernels.kernels.align import moe_align_block_size_reference
from moe_kernels.kernels.blocks import check_alignment
from moe_kernels.kernels.gate_grid import gate_tiles
from moe_kernels.kernels.gate_routing import gate_and_route, gate_and_route_reference, gate_route_and_align
from moe_kernels.kernels.grouped_routing import grouped_topk
from moe_kernels.kernels.routing import fused_topk
from moe_testing import DEVICE, assert_same_floats, compiled_for_hopper, needs_gpu


def inputs(num_tokens, num_experts, hidden, seed, dtype=torch.float32, integer=False):
    generator = torch.Generator().manual_seed(seed)
    if integer:   # small integers: every product and sum exact in float32
        x = torch.randint(-3, 4, (num_tokens, hidden), generator=generator).float()
        w = torch.randint(-3, 4, (num_experts, hidden), generator=generator).float()
    else:
        x = torch.randn(num_tokens, hidden, generator=generator)
        w = torch.randn(num_experts, hidden, generator=generator) / hidden ** 0.5
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def routing_of(x, logits, topk, renormalize, scoring, **grouped):
    """The routing kernels on given logits, with gate_and_route's arguments."""
    if grouped.get("num_expert_group") is None and grouped.get("e_score_correction_bias") is None:
        weights, ids = fused_topk(x, logits, topk, renormalize, scoring)
        return weights * grouped.get("routed_scaling_factor", 1.0), ids
    return grouped_topk(x, logits, topk, renormalize, grouped.get("num_expert_group") or 1,
                        grouped.get("topk_group") or 1, scoring, grouped.get("routed_scaling_factor", 1.0),
                        grouped.get("e_score_correction_bias"))


def check_case(num_tokens, num_experts, hidden, topk, *, seed=0, dtype=torch.float32, renormalize=True,
               scoring="softmax", **grouped):
    x, w = inputs(num_tokens, num_experts, hidden, seed, dtype)
    weights, ids, logits = gate_and_route(x, w, topk, renormalize, scoring, **grouped)
    assert weights.shape == ids.shape == (num_tokens, topk) and logits.shape == (num_tokens, num_experts)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and logits.dtype == torch.float32
    want_logits = x.double() @ w.double().T
    torch.testing.assert_close(logits.double(), want_logits, atol=1e-4 * hidden ** 0.5, rtol=1e-3)
    # The routing kernel on this kernel's logits: the same rule (the rounds here, the keyed rounds there: the same
    # ids by construction), so the same ids (the weights: see assert_same_floats).
    want_weights, want_ids = routing_of(x, logits, topk, renormalize, scoring, **grouped)
    assert torch.equal(ids, want_ids)
    assert_same_floats(weights, want_weights)
    # Integer inputs: exact logits, so the whole rule matches the float64 reference id for id.
    xi, wi = inputs(num_tokens, num_experts, hidden, seed + 1, dtype, integer=True)
    got = gate_and_route(xi, wi, topk, renormalize, scoring, **grouped)
    want = gate_and_route_reference(xi.double(), wi.double(), topk, renormalize, scoring, **grouped)
    assert torch.equal(got[2].double(), want[2])
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].double(), want[0].double(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plain_rule_against_references(num_tokens, scoring, dtype):
    check_case(num_tokens, 40, 96, 4, seed=num_tokens, dtype=dtype, scoring=scoring, renormalize=num_tokens % 2 == 1)


@pytest.mark.parametrize("num_tokens", [1, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_rule_against_references(num_tokens, bias):
    generator = torch.Generator().manual_seed(3)
    correction = (0.1 * torch.randn(32, generator=generator)).to(DEVICE) if bias else None
    check_case(num_tokens, 32, 64, 4, seed=7, scoring="sigmoid", num_expert_group=4, topk_group=2,
               routed_scaling_factor=2.5, e_score_correction_bias=correction)


@pytest.mark.parametrize("shape", [(1, 1, 16, 1), (3, 6, 33, 6), (2, 4, 8, 1), (20, 128, 48, 8), (1, 7, 300, 3)],
                         ids=["E=1", "k=E, odd d", "tiny d", "E=128", "E=7, long d"])
def test_edge_shapes(shape):
    num_tokens, num_experts, hidden, topk = shape
    check_case(num_tokens, num_experts, hidden, topk, seed=sum(shape))


@pytest.mark.parametrize("case", [
    dict(shape=(40, 48, 600, 4)),                                                  # split 5, 2 e-blocks, 3 t-blocks
    dict(shape=(18, 100, 1000, 8)),                                                # split 8, 4 e-blocks, 2 t-blocks
    dict(shape=(40, 48, 600, 4), scoring="sigmoid", num_expert_group=3, topk_group=2),
    dict(shape=(33, 40, 520, 6), scoring="sigmoid", num_expert_group=5, topk_group=2, routed_scaling_factor=2.5),
    dict(shape=(33, 36, 700, 5), scoring="sigmoid", num_expert_group=3, topk_group=2, bias=True),
], ids=["plain", "plain wide", "grouped", "groups of 8", "groups of 12, bias"])
def test_split_with_several_expert_and_token_blocks(case):
    """Every program of a token block must arrive before its last one routes: d split several ways
    while the experts span several blocks and the tokens several blocks, for both rules (groups
    whose size is no power of two too)."""
    num_tokens, num_experts, hidden, topk = case.pop("shape")
    tiles = gate_tiles(num_tokens, num_experts, hidden)
    assert tiles["split_k"] > 1 and tiles["e_blocks"] > 1 and tiles["t_blocks"] > 1, tiles
    if case.pop("bias", False):
        generator = torch.Generator().manual_seed(num_experts)
        case["e_score_correction_bias"] = (0.1 * torch.randn(num_experts, generator=generator)).to(DEVICE)
    check_case(num_tokens, num_experts, hidden, topk, seed=hidden, **case)


@pytest.mark.skipif(not HAS_TRITON, reason="without Triton the reference runs")
def test_bf16_on_the_interpreter_computes_in_float32():
    """The interpreter's bf16 dot is wrong; bf16 inputs there are computed in float32 (exact
    products), so the logits match the float64 gate on the same bf16 numbers."""
    x, w = inputs(4, 16, 64, 3, torch.bfloat16)
    weights, ids, logits = gate_and_route(x, w, 2, True)
    torch.testing.assert_close(logits.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-4)
    assert torch.equal(ids, fused_topk(x, logits, 2, True)[1])


def test_no_tokens():
    x, w = inputs(0, 8, 32, 0)
    weights, ids, logits = gate_and_route(x, w, 2, True)
    assert weights.shape == ids.shape == (0, 2) and logits.shape == (0, 8)


def test_scaling_factor_multiplies_the_plain_weights():
    x, w = inputs(3, 8, 32, 1)
    once = gate_and_route(x, w, 2, True)[0]
    scaled = gate_and_route(x, w, 2, True, routed_scaling_factor=2.5)[0]
    torch.testing.assert_close(scaled, 2.5 * once)


def test_split_over_d_is_taken_and_deterministic():
    """The path: d split over several programs (the last one per token block adds the partials),
    one launch; and two calls give the same bits (a fixed order of the partial sums)."""
    x, w = inputs(2, 16, 512, 5)
    tiles = gate_tiles(2, 16, 512)
    assert tiles["split_k"] == 4 and tiles["e_blocks"] == 1
    with record_launches() as launches:
        first = gate_and_route(x, w, 3, True)
    if HAS_TRITON:
        assert [name for name, _ in launches] == ["gate_routing.gate_and_route"]
        assert launches[0][1]["split_k"] == 4
    second = gate_and_route(x, w, 3, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_tiles_fill_the_machine_within_the_partial_budget():
    for num_tokens, num_experts, hidden in [(1, 128, 2048), (64, 256, 7168), (512, 256, 7168), (1, 8, 4096)]:
        tiles = gate_tiles(num_tokens, num_experts, hidden)
        assert tiles["k_span"] % tiles["block_k"] == 0
        assert (tiles["split_k"] - 1) * tiles["k_span"] < hidden <= tiles["split_k"] * tiles["k_span"]
        assert tiles["split_k"] * 16 * num_experts * 4 <= 2 * 128 * 1024


@pytest.mark.parametrize("router", ["one launch", "chained"])
def test_nan_in_a_token_gives_valid_ids_and_spoils_no_other_token(router):
    """For the one-launch router and the chained one (moe_kernels.kernels.chained_routing)."""
    from moe_kernels.kernels.chained_routing import gate_route_chained

    route = gate_and_route if router == "one launch" else gate_route_chained
    x, w = inputs(4, 16, 32, 2)
    x[1, 3] = float("nan")
    weights, ids, _ = route(x, w, 3, True)
    assert bool(((ids >= 0) & (ids < 16)).all())
    clean = route(x[[0, 2, 3]], w, 3, True)
    assert torch.equal(ids[[0, 2, 3]], clean[1]) and torch.equal(weights[[0, 2, 3]], clean[0])


@pytest.mark.parametrize("change, name", [
    (dict(gate_weight="dtype"), "gate_weight"),
    (dict(gate_weight="width"), "gate_weight"),
    (dict(topk=9), "topk"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(topk_group=2), "topk_group"),
    (dict(num_expert_group=3, topk_group=1), "num_expert_group"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (dict(renormalize=1), "renormalize"),
    (dict(gate_weight="no width"), "hidden_states.shape[1]"),
])
def test_bad_input_names_the_argument(change, name):
    x, w = inputs(2, 8, 16, 0)
    if change.get("gate_weight") == "dtype":
        w = w.half()
    elif change.get("gate_weight") == "width":
        w = w[:, :8]
    elif change.get("gate_weight") == "no width":
        x, w = x[:, :0], w[:, :0]
    kwargs = dict(topk=2, renormalize=True)
    kwargs.update({k: v for k, v in change.items() if k != "gate_weight"})
    with pytest.raises((ValueError, TypeError)) as error:
        gate_and_route(x, w, **kwargs)
    assert name in str(error.value)


def check_aligned(x, w, topk, block_size, *, launches_expected=1, **rule):
    """gate_route_and_align against gate_and_route on the same inputs (the same router, so the same
    bits) and its alignment against the float64-free reference of the ids (integers: exact)."""
    with record_launches() as launches:
        weights, ids, logits, sorted_ids, expert_ids, used = gate_route_and_align(
            x, w, topk, True, block_size=block_size, **rule)
    alone = gate_and_route(x, w, topk, True, **rule)
    assert torch.equal(weights, alone[0]) and torch.equal(ids, alone[1]) and torch.equal(logits, alone[2])
    want = moe_align_block_size_reference(ids, block_size, w.shape[0])
    for got, wanted in zip((sorted_ids, expert_ids, used), want):
        assert got.dtype == torch.int32 and torch.equal(got, wanted)
    check_alignment(ids, block_size, w.shape[0], sorted_ids, expert_ids, used)
    if HAS_TRITON and x.shape[0] > 0:
        assert len(launches) == launches_expected, launches
        assert launches[0][0] == "gate_routing.gate_and_route"
        assert launches[0][1]["aligned"] == (launches_expected == 1)
    return ids


@pytest.mark.parametrize("case", [
    dict(shape=(1, 8, 32, 2), block=4),                       # one token: every expert hit once
    dict(shape=(5, 6, 33, 6), block=4),                       # k = E, odd d
    dict(shape=(9, 5, 40, 1), block=1),                       # k = 1, blocks of one row
    dict(shape=(40, 48, 600, 4), block=16),                   # 3 token blocks, d split, 2 expert blocks
    dict(shape=(17, 40, 96, 4), block=64),                    # a block longer than all the assignments
    dict(shape=(3, 1, 16, 1), block=16),                      # one expert
    dict(shape=(33, 36, 700, 5), block=16, scoring_func="sigmoid", num_expert_group=3, topk_group=2, bias=True),
], ids=["one token", "k=E", "k=1", "three token blocks", "block 64", "E=1", "grouped, bias"])
def test_aligned_in_the_same_launch(case):
    """The router's last token block aligns every token's ids (the others' read from L2):
    one launch, the alignment equal to the reference's element for element."""
    num_tokens, num_experts, hidden, topk = case.pop("shape")
    block = case.pop("block")
    if case.pop("bias", False):
        generator = torch.Generator().manual_seed(num_experts)
        case["e_score_correction_bias"] = (0.1 * torch.randn(num_experts, generator=generator)).to(DEVICE)
    x, w = inputs(num_tokens, num_experts, hidden, seed=hidden)
    check_aligned(x, w, topk, block, **case)


def test_aligned_with_every_token_on_one_expert_and_an_empty_one():
    """Expert 0's row dominates every token (one long segment over several blocks); expert 3 gets
    nothing (no segment at all)."""
    x, w = inputs(20, 4, 32, 3)
    x = x.abs() + 0.1
    w = w.clone()
    w[0], w[3] = 1.0, -1.0
    ids = check_aligned(x, w, 2, 4)
    assert bool((ids[:, 0] == 0).all()) and not bool((ids == 3).any())


def test_aligned_past_one_programs_share_runs_the_alignment_kernel(monkeypatch):
    """Above ALIGN_MAX_ASSIGNMENTS the alignment is a launch of its own, with the same result."""
    monkeypatch.setattr(gate_routing, "ALIGN_MAX_ASSIGNMENTS", 8)
    x, w = inputs(5, 16, 32, 4)
    check_aligned(x, w, 2, 4, launches_expected=2)


def test_aligned_with_no_tokens():
    x, w = inputs(0, 8, 32, 0)
    *_, sorted_ids, expert_ids, used = gate_route_and_align(x, w, 2, True, block_size=4)
    assert int(used) == 0 and sorted_ids.numel() == 8 * 3 and bool((expert_ids == -1).all())


@pytest.mark.parametrize("block_size", [0, 2.5])
def test_aligned_bad_block_size_names_it(block_size):
    x, w = inputs(2, 8, 16, 0)
    with pytest.raises((ValueError, TypeError), match="block_size"):
        gate_route_and_align(x, w, 2, True, block_size=block_size)


def check_real_shapes(router, model, num_tokens, **options):
    """``router`` (gate_and_route's arguments and result) in bf16 at a model's shapes, on a GPU: the routing on
    its own logits (ids exactly); the logits within the tensor-core gate's error of torch.mm's; the ids of the
    two-step layer path but at near-ties."""
    from moe_kernels.kernels.routing import router_logits
    from moe_kernels.layer import MoELayer

    layer = MoELayer.random(model, dtype=torch.bfloat16, device="cuda", seed=num_tokens)
    routing, w = layer.routing, layer.weights
    x = torch.randn(num_tokens, w.gate.shape[1], device="cuda", dtype=torch.bfloat16)
    grouped = dict(num_expert_group=routing.num_expert_group, topk_group=routing.topk_group,
                   routed_scaling_factor=routing.routed_scaling_factor, e_score_correction_bias=w.bias)
    weights, ids, logits = router(x, w.gate, routing.top_k, routing.renormalize, routing.scoring_func, **grouped,
                                  **options)
    want_weights, want_ids = routing_of(x, logits, routing.top_k, routing.renormalize, routing.scoring_func,
                                        **grouped)
    # (the same ids; the weights to float32's last bits: the routing kernel on its own reduces
    # the softmax or sigmoid sums over another tile of tokens, in another order)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logits, router_logits(x, w.gate), atol=1e-2, rtol=1e-3)
    two_step = routing.route(x, router_logits(x, w.gate), w.bias)
    assert int((ids != two_step[1]).any(dim=1).sum()) <= max(1, num_tokens // 50)


@needs_gpu
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 100])
def test_real_shapes_on_gpu(model, num_tokens):
    """bf16 at the models' shapes (check_real_shapes)."""
    check_real_shapes(gate_and_route, model, num_tokens)


_COMPILE_FOR_HOPPER = """
import re
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import gate_routing
from moe_kernels.sm90_compile import compile_for_sm90

fn = gate_routing._gate_routing_kernel
for grouped, e_cols, split, align in ((False, 128, 16, False), (True, 256, 8, False), (False, 128, 16, True),
                                      (True, 256, 8, True)):
    pointers = dict(x_ptr="*bf16", gate_ptr="*bf16", bias_ptr="*fp32", partial_ptr="*fp32", logits_ptr="*fp32",
                    arrivals_ptr="*i32", weights_ptr="*fp32", ids_ptr="*i32", sorted_ids_ptr="*i32",
                    expert_ids_ptr="*i32", used_ptr="*i32", scale="fp32")
    const = dict(GROUPED=grouped, HAS_BIAS=grouped, USE_SIGMOID=grouped, PRECISE=True, IEEE=False, BLOCK_T=16,
                 BLOCK_E=32, BLOCK_K=128, SPLIT_K=split, E_COLS=e_cols, G_PAD=8 if grouped else 1,
                 S_PAD=32 if grouped else 128, K_PAD=8, ALIGN=align, NUM_BINS=e_cols, ALIGN_TILE=64, PAD_TILE=16,
                 COUNT_TILE=1024, FILL_TILE=1024)
    # (as the real launch specialises them: multiples of 16)
    aligned = ("stride_x", "stride_gate", "hidden_size", "k_span", "num_experts")
    ptx = compile_for_sm90(fn, const, pointers, aligned=aligned, num_warps=8 if grouped else 4,
                           num_stages=2).asm["ptx"]
    atoms = list(re.finditer(r"atom[.a-z]*[.]gpu[.]acq_rel[.a-z]*add|atom[.a-z]*[.]acq_rel[.]gpu[.a-z]*add", ptx))
    atom = atoms[0] if atoms else None
    read = ptx.find("ld.global.cg")
    # a barrier between the arrival and the first read of the other programs' partials
    line = [atom is not None, read > 0, atom is not None and "bar.sync" in ptx[atom.end():read],
            bool(re.search(r"mma", ptx))]
    if align:   # the routing's stores, a barrier, the second count (token blocks routed), a barrier,
        # then the ids read through L2
        found = re.compile(r"ld[.]global[.]cg([.]v[248])?[.]b32").search(ptx, atoms[-1].end()) if len(atoms) > 1 else None
        ids_read = found.start() if found else -1
        last_store = ptx.rfind("st.global", 0, atoms[-1].start())
        line += [len(atoms) == 2 and 0 < last_store and "bar.sync" in ptx[last_store:atoms[-1].start()],
                 ids_read > 0 and "bar.sync" in ptx[atoms[-1].end():ids_read]]
    print(*line)
"""


def test_compiles_for_hopper_with_its_release_and_acquire():
    """Compiled for an H100/H200 (sm_90) on this machine: the arrival is an acquire-release atomic
    at GPU scope after a CTA barrier, the partials are read through L2 (``.cg``), the gate's
    products go to the tensor cores; for the plain rule (Qwen3's shape) and the grouped one
    (DeepSeek-V3's); with the alignment, a barrier after the routing's stores, a second such
    atomic (token blocks routed), then a barrier, then the ids read through L2."""
    lines = compiled_for_hopper(_COMPILE_FOR_HOPPER)
    assert lines[:4] == ["True True True True"] * 2 + ["True True True True True True"] * 2, lines


@needs_gpu
def test_repeated_calls_agree_bit_for_bit_on_gpu():
    """The last program of each token block reads the other programs' partials after an
    acquire-release count: a missing fence would show as a call that differs now and then.
    200 calls at DeepSeek-V3's shape and 100 tokens (7 token blocks, 64 programs each), and
    the same inside one CUDA graph replayed 50 times."""
    x, w = (torch.randn(100, 7168, device="cuda", dtype=torch.bfloat16),
            torch.randn(256, 7168, device="cuda", dtype=torch.bfloat16) / 85)
    bias = 0.01 * torch.randn(256, device="cuda")
    args = dict(topk=8, renormalize=True, scoring_func="sigmoid", num_expert_group=8, topk_group=4,
                routed_scaling_factor=2.5, e_score_correction_bias=bias)
    first = gate_and_route(x, w, **args)
    calls = [gate_and_route(x, w, **args) for _ in range(200)]   # queued, compared after one sync
    graph = torch.cuda.CUDAGraph()
    gate_and_route(x, w, **args)
    with torch.cuda.graph(graph):
        captured = gate_and_route(x, w, **args)
    replays = []
    for _ in range(50):
        graph.replay()
        replays.append([t.clone() for t in captured])   # on the stream: a bad replay stays visible
    torch.cuda.synchronize()
    for outputs in calls + replays:
        assert all(torch.equal(a, b) for a, b in zip(first, outputs))


@needs_gpu
@pytest.mark.parametrize("model, num_tokens, block", [("qwen3-30b-a3b", 8, 16), ("qwen3-30b-a3b", 64, 16),
                                                      ("deepseek-v3", 16, 16), ("deepseek-v3", 100, 64)])
def test_aligned_at_real_shapes_repeated_and_replayed_on_gpu(model, num_tokens, block):
    """The alignment in the router's launch reads ids other SMs wrote: 100 calls queued back to
    back, then 30 replays of one CUDA graph (each replay's outputs cloned on the stream, so that a
    bad replay is not hidden by the next), compared after one synchronisation with the first
    call, whose alignment equals the reference's of its ids."""
    from moe_kernels.layer import MoELayer

    layer = MoELayer.random(model, dtype=torch.bfloat16, device="cuda", seed=num_tokens)
    routing, w = layer.routing, layer.weights
    x = torch.randn(num_tokens, w.gate.shape[1], device="cuda", dtype=torch.bfloat16)
    grouped = dict(num_expert_group=routing.num_expert_group, topk_group=routing.topk_group,
                   routed_scaling_factor=routing.routed_scaling_factor, e_score_correction_bias=w.bias)
    if routing.num_expert_group is None and w.bias is None:
        grouped = dict(routed_scaling_factor=routing.routed_scaling_factor)
    args = (x, w.gate, routing.top_k, routing.renormalize, routing.scoring_func)
    first = gate_route_and_align(*args, block_size=block, **grouped)
    want = moe_align_block_size_reference(first[1], block, w.gate.shape[0])
    assert all(torch.equal(a, b) for a, b in zip(first[3:], want))
    calls = [gate_route_and_align(*args, block_size=block, **grouped) for _ in range(100)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gate_route_and_align(*args, block_size=block, **grouped)
    replays = []
    for _ in range(30):
        graph.replay()
        replays.append([t.clone() for t in captured])
    torch.cuda.synchronize()
    for outputs in calls + replays:
        assert all(torch.equal(a, b) for a, b in zip(first, outputs))


@needs_gpu
def test_aligned_with_changing_batches_back_to_back_on_gpu():
    """Token counts that change from call to call, queued on one stream with no synchronisation
    (1 to 7 token blocks, at DeepSeek-V3's shape): each call's alignment is the reference's of its
    own ids."""
    from moe_kernels.layer import MoELayer

    layer = MoELayer.random("deepseek-v3", dtype=torch.bfloat16, device="cuda", seed=5)
    routing, w = layer.routing, layer.weights
    x = torch.randn(100, w.gate.shape[1], device="cuda", dtype=torch.bfloat16)
    grouped = dict(num_expert_group=routing.num_expert_group, topk_group=routing.topk_group,
                   routed_scaling_factor=routing.routed_scaling_factor, e_score_correction_bias=w.bias)
    sizes = [1, 100, 17, 3, 64, 33, 2, 100, 16] * 4
    outputs = [gate_route_and_align(x[:n], w.gate, routing.top_k, routing.renormalize, routing.scoring_func,
                                    block_size=16, **grouped) for n in sizes]
    torch.cuda.synchronize()
    for n, out in zip(sizes, outputs):
        want = moe_align_block_size_reference(out[1], 16, w.gate.shape[0])
        assert all(torch.equal(a, b) for a, b in zip(out[3:], want)), n
        alone = gate_and_route(x[:n], w.gate, routing.top_k, routing.renormalize, routing.scoring_func, **grouped)
        assert torch.equal(out[1], alone[1]), n
