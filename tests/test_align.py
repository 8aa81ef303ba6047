"""moe_kernels.kernels.align: the kernel against the reference, the invariant checker, the naive path.

Runs on the default device: the compiled kernels with a GPU, the Triton interpreter without one.
Interpreter-friendly shapes keep the file fast on a CPU; GPU-only tests add the real sizes.
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_kernels.kernels import align
from moe_kernels._runtime import HAS_TRITON, use_triton
from moe_kernels.kernels.align import moe_align_block_size, moe_align_block_size_reference
from moe_kernels.kernels.blocks import (
    check_alignment,
    naive_block_assignment,
    naive_padded_rows,
    use_naive_block_assignment,
)
from moe_testing import assert_device_assert, compiled_for_hopper, DEVICE, needs_gpu

POISON = -77



def random_topk_ids(generator, num_tokens, num_experts, topk, dtype=torch.int64):
    """``[T, k]`` ids with ``k`` distinct experts per row, as a router would give."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    return scores.argsort(dim=1)[:, :topk].to(dtype).to(DEVICE)


def assert_aligned_like_reference(topk_ids, block_size, num_experts, what=""):
    """Kernel and reference both pass the checker, and agree element for element."""
    got = moe_align_block_size(topk_ids, block_size, num_experts)
    want = moe_align_block_size_reference(topk_ids, block_size, num_experts)
    case = f"{what} T={topk_ids.shape[0]} k={topk_ids.shape[1]} E={num_experts} block={block_size}"
    for label, outputs in (("kernel", got), ("reference", want)):
        try:
            check_alignment(topk_ids, block_size, num_experts, *outputs)
        except AssertionError as error:
            raise AssertionError(f"{label}, {case}: {error}") from None
    for name, g, w in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
        assert g.device == topk_ids.device, f"{name} on {g.device}, {case}"
        assert torch.equal(g, w), f"{name} differs from the reference, {case}"
    return got


def random_cases(count, seed):
    """(T, k, E, block, dtype) drawn so that the whole set stays cheap under the interpreter."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    experts = [1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 128, 160, 256, 257, 384, 512]
    for i in range(count):
        num_experts = pick(experts)
        topk = int(torch.randint(1, min(num_experts, 16) + 1, (1,), generator=g))
        # Mostly decode-sized batches; one case in eight is a few hundred assignments more.
        max_tokens = 300 if i % 8 == 0 else 24
        num_tokens = int(torch.randint(1, max_tokens + 1, (1,), generator=g))
        if i % 8 == 0:
            num_tokens = min(num_tokens, 1200 // topk)
        block_size, dtype = pick([1, 16, 64, 128]), pick([torch.int32, torch.int64])
        yield num_tokens, topk, num_experts, block_size, dtype


# ----------------------------------------------------------------------------------------------
# The kernel against the reference
# ----------------------------------------------------------------------------------------------


def test_random_cases_match_reference_and_pass_checker():
    g = torch.Generator().manual_seed(1234)
    count = 0
    for num_tokens, topk, num_experts, block_size, dtype in random_cases(120, seed=5):
        ids = random_topk_ids(g, num_tokens, num_experts, topk, dtype)
        assert_aligned_like_reference(ids, block_size, num_experts, what=f"{dtype}")
        count += 1
    assert count >= 112


def test_vllm_docstring_example_zero_based():
    # vLLM's example uses experts 1..4; shifted to 0..3 the assignment indices are unchanged.
    ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]], device=DEVICE)
    sorted_ids, expert_ids, used = assert_aligned_like_reference(ids, 4, 4)
    assert int(used) == 16
    blocks = sorted_ids[:16].view(4, 4)
    assert blocks[:, :3].tolist() == [[3, 6, 9], [0, 4, 10], [1, 7, 11], [2, 5, 8]]  # each expert's assignments
    assert blocks[:, 3].tolist() == [12] * 4  # then one padding row (the sentinel T*k = 12)
    assert sorted_ids[16:].tolist() == [12] * 8
    assert expert_ids.tolist() == [0, 1, 2, 3, -1, -1]


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_one_token(block_size):
    ids = torch.tensor([[7, 2, 5]], device=DEVICE)
    sorted_ids, expert_ids, used = assert_aligned_like_reference(ids, block_size, 8)
    assert int(used) == 3 * block_size
    assert expert_ids[:3].tolist() == [2, 5, 7]


def test_expert_with_no_tokens():
    g = torch.Generator().manual_seed(3)
    ids = random_topk_ids(g, 40, 7, 3)
    ids = torch.where(ids >= 3, ids + 1, ids)  # experts 0..7 without 3
    _, expert_ids, used = assert_aligned_like_reference(ids, 16, 8)
    assert 3 not in expert_ids[: int(used) // 16].tolist()


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_all_tokens_on_one_expert(block_size):
    ids = torch.full((77, 1), 5, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, used = assert_aligned_like_reference(ids, block_size, 16)
    blocks = -(-77 // block_size)
    assert int(used) == blocks * block_size
    assert expert_ids[:blocks].tolist() == [5] * blocks
    assert sorted_ids[:77].tolist() == list(range(77))


def test_topk_equals_num_experts():
    g = torch.Generator().manual_seed(4)
    ids = random_topk_ids(g, 21, 16, 16)
    _, _, used = assert_aligned_like_reference(ids, 16, 16)
    assert int(used) == 16 * 32  # 21 rows per expert -> two blocks each


@pytest.mark.parametrize("block_size", [16, 128])
def test_512_experts(block_size):
    g = torch.Generator().manual_seed(5)
    assert_aligned_like_reference(random_topk_ids(g, 33, 512, 8), block_size, 512)


def test_no_tokens():
    ids = torch.zeros((0, 4), dtype=torch.int64, device=DEVICE)
    sorted_ids, expert_ids, used = assert_aligned_like_reference(ids, 16, 8)
    assert int(used) == 0 and sorted_ids.unique().tolist() == [0]
    assert expert_ids.unique().tolist() == [-1]


def test_non_contiguous_ids():
    g = torch.Generator().manual_seed(6)
    ids = random_topk_ids(g, 4, 30, 9).t().contiguous().t()  # same values, column-major
    assert not ids.is_contiguous()
    assert_aligned_like_reference(ids, 16, 30)


@pytest.mark.parametrize("chunk_offsets", align.CHUNK_OFFSET_RULES)
@pytest.mark.parametrize("max_chunks", [128, 3])
def test_multi_launch_paths(monkeypatch, chunk_offsets, max_chunks):
    # Force the per-chunk-histogram paths on small inputs, each rule; 3 chunks makes each one span
    # several tiles, so a program carries its experts' next free rows from tile to tile.
    monkeypatch.setattr(align, "SINGLE_LAUNCH_MAX_NUMEL", 0)
    monkeypatch.setattr(align, "CHUNK_OFFSETS", chunk_offsets)
    monkeypatch.setattr(align, "MAX_CHUNKS", max_chunks)
    monkeypatch.setattr(align, "SCAN_MAX_CHUNKS", max_chunks)
    g = torch.Generator().manual_seed(7)
    for num_tokens, topk, num_experts, block_size in [(1, 1, 1, 1), (100, 8, 64, 16),
                                                      (150, 6, 257, 128), (333, 2, 3, 1)]:
        ids = random_topk_ids(g, num_tokens, num_experts, topk, torch.int32)
        assert_aligned_like_reference(ids, block_size, num_experts, what=f"{chunk_offsets} chunk offsets")


@pytest.mark.parametrize("tile, scan_rows, scan_bins, pad_tile, max_chunks",
                         [(16, 4, 16, 64, 4096), (32, 8, 32, 8, 4096), (128, 2, 16, 4, 4096), (16, 2, 16, 8, 5)])
def test_scanned_chunk_offsets(monkeypatch, tile, scan_rows, scan_bins, pad_tile, max_chunks):
    """The three-launch path (``CHUNK_OFFSETS = "scanned"``: count per chunk, scan the table down each expert's
    column, place) against the reference, element for element, into poisoned buffers: short chunks so that the scan
    carries its sums across many steps and several programs of columns, tokens that skip experts, all on one expert,
    one expert, more experts than bins of a scan program, and unchecked ids out of range (skipped); the padding
    written a few rows a step or many (``_SCANNED_MAX_PAD_TILE``); and few chunks of many tiles, whose program carries
    its experts' next free rows from tile to tile."""
    from moe_kernels._runtime import record_launches

    if not use_triton(torch.zeros(1, device=DEVICE)):
        pytest.skip("no Triton kernel for this device")
    for name, value in (("CHUNK_OFFSETS", "scanned"), ("SINGLE_LAUNCH_MAX_NUMEL", 0), ("SCAN_MAX_CHUNKS", max_chunks),
                        ("_SCANNED_TILE", tile), ("_SCAN_ROWS", scan_rows), ("_SCAN_BINS", scan_bins),
                        ("_SCANNED_MAX_PAD_TILE", pad_tile)):
        monkeypatch.setattr(align, name, value)
    g = torch.Generator().manual_seed(tile)
    cases = [random_topk_ids(g, t, e, k, dtype) for t, e, k, dtype in
             ((1, 1, 1, torch.int32), (100, 64, 8, torch.int32), (150, 257, 6, torch.int64), (333, 3, 2, torch.int32),
              (40, 100, 3, torch.int32))]
    cases.append(torch.full((90, 4), 5, dtype=torch.int32, device=DEVICE))            # all on expert 5 of 8
    bad = random_topk_ids(g, 70, 20, 2, torch.int32)
    bad[::7, 1] = 20                                                                   # not an expert of 20
    cases.append(bad)
    most_chunks = 0
    for ids, num_experts in zip(cases, (1, 64, 257, 3, 100, 8, 20)):
        for block_size in (1, 16, 128):
            want = moe_align_block_size_reference(ids.clamp(max=num_experts - 1) if ids is bad else ids, block_size,
                                                  num_experts)
            if ids is bad:   # (the reference refuses a bad id: compare with it on the ids that are good)
                want = _skipping(ids, block_size, num_experts)
            got = tuple(torch.full_like(w, POISON) for w in want)
            with record_launches() as seen:
                align._launch_alignment(ids.contiguous(), block_size, num_experts, *got)
            (record,) = [s for n, s in seen if n == "align.moe_align_block_size"]
            assert (record["launches"], record["chunk_offsets"]) == (3, "scanned")
            most_chunks = max(most_chunks, record["chunks"])
            case = f"T={ids.shape[0]} k={ids.shape[1]} E={num_experts} block={block_size}, {record['chunks']} chunks"
            for name, g_out, w_out in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
                assert torch.equal(g_out, w_out), f"{name} differs from the reference, {case}"
    assert most_chunks > scan_rows or max_chunks < 8   # (a table took more than one step of the scan)


def _skipping(ids, block_size, num_experts):
    """The reference alignment of ``ids`` where an id outside ``[0, num_experts)`` takes no row (as the kernel skips
    it): aligned as an extra expert, whose segment is then dropped, with the sentinel renumbered."""
    flat = ids.flatten().long()
    numel = flat.numel()
    extra = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).view(ids.shape)
    sorted_ids, expert_ids, used = moe_align_block_size_reference(extra, block_size, num_experts + 1)
    good = int(((flat >= 0) & (flat < num_experts)).sum())
    padded_good = int(used) - -(-(numel - good) // block_size) * block_size   # (the extra expert's segment is last)
    capacity = numel + num_experts * (block_size - 1)
    out = torch.full((capacity,), numel, dtype=torch.int32, device=ids.device)
    out[:padded_good] = sorted_ids[:padded_good]
    blocks = torch.full((-(-capacity // block_size),), -1, dtype=torch.int32, device=ids.device)
    blocks[: padded_good // block_size] = expert_ids[: padded_good // block_size]
    return out, blocks, torch.tensor([padded_good], dtype=torch.int32, device=ids.device)


def test_a_bad_chunk_offsets_rule_is_refused(monkeypatch):
    if not use_triton(torch.zeros(1, device=DEVICE)):
        pytest.skip("no Triton kernel for this device")
    monkeypatch.setattr(align, "CHUNK_OFFSETS", "sorted")
    monkeypatch.setattr(align, "SINGLE_LAUNCH_MAX_NUMEL", 0)
    with pytest.raises(ValueError, match=r"CHUNK_OFFSETS.*must be one of \('summed', 'scanned'\)"):
        moe_align_block_size(torch.zeros((2, 2), dtype=torch.int32, device=DEVICE), 4, 4)


@pytest.mark.parametrize("chunk_offsets", align.CHUNK_OFFSET_RULES)
def test_large_inputs_take_the_large_tiles(monkeypatch, chunk_offsets):
    """One launch up to SINGLE_LAUNCH_MAX_NUMEL assignments; beyond, the scanned path's three launches on its own tiles
    (the default), or the summed path's two on the two-launch tiles and, past LARGE_FROM_NUMEL, on 64-assignment tiles
    of 8 warps: the path each size takes, as the launch record names it (the limits scaled down for the interpreter;
    the package's: 8,192 and 65,536, 1,024 and 8,192 tokens of top-8), with the reference's output."""
    from moe_kernels._runtime import record_launches

    assert (align.SINGLE_LAUNCH_MAX_NUMEL, align.LARGE_FROM_NUMEL, align.CHUNK_OFFSETS) == (8192, 65536, "scanned")
    if not use_triton(torch.zeros(1, device=DEVICE)):
        pytest.skip("no Triton kernel for this device")
    monkeypatch.setattr(align, "SINGLE_LAUNCH_MAX_NUMEL", 64)
    monkeypatch.setattr(align, "LARGE_FROM_NUMEL", 256)
    monkeypatch.setattr(align, "CHUNK_OFFSETS", chunk_offsets)
    single = (1, None, (align._SINGLE_TILE, align._SINGLE_WARPS))
    if chunk_offsets == "scanned":
        expected = (single, (3, "scanned", (align._SCANNED_TILE, align._SCANNED_WARPS)),
                    (3, "scanned", (align._SCANNED_TILE, align._SCANNED_WARPS)))
    else:
        expected = (single, (2, "summed", (align._MULTI_TILE, align._MULTI_WARPS)),
                    (2, "summed", (align._LARGE_TILE, align._LARGE_WARPS)))
    for numel, want_path in zip((64, 256, 264), expected):
        ids = torch.arange(numel, device=DEVICE, dtype=torch.int32).view(-1, 8) % 16
        with record_launches() as seen:
            got = moe_align_block_size(ids, 16, 16, validate_ids=False)
        assert [(s["launches"], s["chunk_offsets"], (s["tile"], s["warps"])) for n, s in seen
                if n == "align.moe_align_block_size"] == [want_path], numel
        assert all(torch.equal(a, b) for a, b in zip(got, moe_align_block_size_reference(ids, 16, 16)))


@pytest.mark.skipif(not HAS_TRITON, reason="the kernel needs triton")
@pytest.mark.parametrize("single_launch_max, chunk_offsets", [(align.SINGLE_LAUNCH_MAX_NUMEL, "scanned"),
                                                             (0, "scanned"), (0, "summed")])
def test_every_slot_is_written(monkeypatch, single_launch_max, chunk_offsets):
    """Poisoned output buffers: any slot the kernel forgets shows up as a mismatch (the one-launch path and both
    multi-launch rules)."""
    monkeypatch.setattr(align, "SINGLE_LAUNCH_MAX_NUMEL", single_launch_max)
    monkeypatch.setattr(align, "CHUNK_OFFSETS", chunk_offsets)
    g = torch.Generator().manual_seed(8)
    for num_tokens, topk, num_experts, block_size in [(1, 8, 256, 128), (60, 4, 20, 16),
                                                      (9, 3, 5, 1)]:
        ids = random_topk_ids(g, num_tokens, num_experts, topk)
        want = moe_align_block_size_reference(ids, block_size, num_experts)
        got = tuple(torch.full_like(w, POISON) for w in want)
        align._launch_alignment(ids.contiguous(), block_size, num_experts, *got)
        for g_out, w_out in zip(got, want):
            assert torch.equal(g_out, w_out)


@pytest.mark.skipif(not HAS_TRITON, reason="the kernel needs triton")
def test_unchecked_out_of_range_ids_are_skipped():
    ids = torch.tensor([[0, 1], [9, 1]], device=DEVICE)  # 9 is not an expert of 4
    if not use_triton(ids):
        pytest.skip("no Triton kernel for this device")
    sorted_ids, expert_ids, used = moe_align_block_size(ids, 4, 4, validate_ids=False)
    assert int(used) == 8
    assert sorted_ids[:8].tolist() == [0, 4, 4, 4, 1, 3, 4, 4]
    assert expert_ids.tolist()[:2] == [0, 1]
    assert set(sorted_ids[8:].tolist()) == {4}


@needs_gpu
@pytest.mark.parametrize("chunk_offsets", align.CHUNK_OFFSET_RULES)
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 1024, 4096, 16384])
@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_model_sizes_on_gpu(monkeypatch, chunk_offsets, num_tokens, block_size):
    # DeepSeek-V3's routing shape: E=256, top-8; from 1024 tokens the multi-launch paths (each rule).
    monkeypatch.setattr(align, "CHUNK_OFFSETS", chunk_offsets)
    g = torch.Generator().manual_seed(num_tokens + block_size)
    ids = random_topk_ids(g, num_tokens, 256, 8, torch.int32)
    assert_aligned_like_reference(ids, block_size, 256)


@needs_gpu
def test_skewed_routing_on_gpu():
    # Most assignments on a handful of experts: long segments spanning many chunks.
    g = torch.Generator().manual_seed(9)
    ids = (torch.rand(8192, 8, generator=g) ** 6 * 256).long().to(DEVICE)
    assert_aligned_like_reference(ids, 64, 256)


# ----------------------------------------------------------------------------------------------
# The naive (small-batch) assignment
# ----------------------------------------------------------------------------------------------


def test_naive_rule():
    assert use_naive_block_assignment(8, 8, 256)  # DeepSeek-V3: up to 8 tokens
    assert not use_naive_block_assignment(9, 8, 256)
    assert not use_naive_block_assignment(1, 8, 256, has_expert_map=True)
    assert use_naive_block_assignment(4, 8, 128) and not use_naive_block_assignment(5, 8, 128)
    # block-fp8 weights: the naive map up to 2 tokens only (DeepSeek-V3's fp8 layer measured faster aligned from 3)
    assert use_naive_block_assignment(2, 8, 256, block_fp8=True)
    assert not use_naive_block_assignment(3, 8, 256, block_fp8=True)
    assert not use_naive_block_assignment(1, 8, 16, block_fp8=True)   # (the 4 of vLLM's rule still applies)


@pytest.mark.parametrize("block_size", [1, 16])
def test_naive_layout(block_size):
    g = torch.Generator().manual_seed(10)
    ids = random_topk_ids(g, 3, 64, 4, torch.int32)
    numel = ids.numel()
    sorted_ids, expert_ids, used = naive_block_assignment(ids, block_size)
    assert sorted_ids.dtype == expert_ids.dtype == used.dtype == torch.int32
    assert int(used) == naive_padded_rows(3, 4, block_size) == numel * block_size
    blocks = sorted_ids.view(numel, block_size).cpu()
    assert blocks[:, 0].tolist() == list(range(numel))
    assert (blocks[:, 1:] == numel).all()
    assert expert_ids.tolist() == ids.flatten().tolist()


def test_naive_and_aligned_rows_agree_when_every_expert_is_hit_once():
    ids = torch.tensor([[3, 9], [12, 0]], device=DEVICE)
    _, _, used = moe_align_block_size(ids, 16, 64)
    assert int(used) == naive_padded_rows(2, 2, 16)
    shared = torch.tensor([[3, 9], [3, 9]], device=DEVICE)
    _, _, used = moe_align_block_size(shared, 16, 64)
    assert int(used) == naive_padded_rows(2, 2, 16) // 2


# ----------------------------------------------------------------------------------------------
# The checker rejects broken layouts
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def good_layout():
    # Blocks of 4. Expert 0 serves assignments 1, 4, 7; expert 1 serves 0, 2, 5, 6, 8;
    # expert 2 none; expert 3 serves 3, 9. The sentinel is 10.
    ids = torch.tensor([[1, 0], [1, 3], [0, 1], [1, 0], [1, 3]], device=DEVICE)
    outputs = moe_align_block_size_reference(ids, 4, 4)
    check_alignment(ids, 4, 4, *outputs)
    return ids, [t.clone() for t in outputs]


def _rejects(layout, match):
    ids, (sorted_ids, expert_ids, used) = layout
    with pytest.raises(AssertionError, match=match):
        check_alignment(ids, 4, 4, sorted_ids, expert_ids, used)


def test_checker_layout_is_as_planned(good_layout):
    ids, (sorted_ids, expert_ids, used) = good_layout
    assert sorted_ids.tolist() == [1, 4, 7, 10, 0, 2, 5, 6, 8, 10, 10, 10, 3, 9, 10, 10] + [10] * 6
    assert expert_ids.tolist() == [0, 1, 1, 3, -1, -1]
    assert int(used) == 16


def test_checker_rejects_dropped_index(good_layout):
    good_layout[1][0][5] = 10  # assignment 2 replaced by padding
    _rejects(good_layout, "assignment index 2 is missing")


def test_checker_rejects_duplicated_index(good_layout):
    good_layout[1][0][9] = 5  # a padding row of expert 1 repeats assignment 5
    _rejects(good_layout, "assignment index 5 appears 2 times")


def test_checker_rejects_misaligned_segment(good_layout):
    sorted_ids = good_layout[1][0]
    sorted_ids[4:10] = torch.tensor([10, 0, 2, 5, 6, 8])  # expert 1 starts one row late
    _rejects(good_layout, "row 4 holds 10, but expert 1's segment starts at row 4")


def test_checker_rejects_padding_inside_a_segment(good_layout):
    sorted_ids = good_layout[1][0]
    sorted_ids[[6, 9]] = sorted_ids[[9, 6]]  # a hole before expert 1's last real row
    _rejects(good_layout, "row 6 holds 10")


def test_checker_rejects_wrong_expert_id(good_layout):
    good_layout[1][1][2] = 2
    _rejects(good_layout, r"expert_ids\[2\] = 2, expected 1")


def test_checker_rejects_assignment_in_wrong_segment(good_layout):
    sorted_ids = good_layout[1][0]
    sorted_ids[[0, 4]] = sorted_ids[[4, 0]]  # assignments 1 (expert 0) and 0 (expert 1) swap
    _rejects(good_layout,
             "row 0 holds assignment 0 of expert 1, but its block 0 belongs to expert 0")


def test_checker_rejects_wrong_used_length(good_layout):
    good_layout[1][2][0] = 12
    _rejects(good_layout, "num_tokens_post_padded is 12, expected 16")


def test_checker_rejects_garbage_past_the_used_region(good_layout):
    good_layout[1][0][20] = 0
    _rejects(good_layout, r"sorted_token_ids\[20\] = 0 lies past the used region")
    good_layout[1][0][20] = 10
    good_layout[1][1][5] = 0
    _rejects(good_layout, r"expert_ids\[5\] = 0 lies past the 4 used blocks")


def test_checker_rejects_wrong_sizes_and_dtypes(good_layout):
    ids, (sorted_ids, expert_ids, used) = good_layout
    with pytest.raises(AssertionError, match=r"sorted_token_ids must have shape \(22,\)"):
        check_alignment(ids, 4, 4, sorted_ids[:-1], expert_ids, used)
    with pytest.raises(AssertionError, match="expert_ids must be an int32 tensor"):
        check_alignment(ids, 4, 4, sorted_ids, expert_ids.long(), used)


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [moe_align_block_size, moe_align_block_size_reference])
def test_bad_inputs_name_the_argument(fn):
    ids = torch.tensor([[0, 1], [2, 3]], device=DEVICE)
    range_check = {"validate_ids": True} if fn is moe_align_block_size else {}
    with pytest.raises(TypeError, match="argument 'topk_ids' must have dtype int32 or int64"):
        fn(ids.float(), 16, 4)
    with pytest.raises(ValueError, match="argument 'topk_ids' must have 2 dimensions"):
        fn(ids.flatten(), 16, 4)
    with pytest.raises(ValueError, match="argument 'block_size' must be >= 1"):
        fn(ids, 0, 4)
    with pytest.raises(TypeError, match="argument 'block_size' must be an int"):
        fn(ids, 16.0, 4)
    with pytest.raises(ValueError, match="argument 'num_experts' must be >= 1"):
        fn(ids, 16, 0)
    for bad_ids, num_experts in ((ids, 3), (ids - 1, 4)):
        message = f"argument 'topk_ids' must hold expert ids in [0, {num_experts})"
        if DEVICE.type == "cuda" and fn is moe_align_block_size:   # (the reference checks on the host)
            assert_device_assert(f"""
                from moe_kernels.kernels.align import {fn.__name__} as fn
                fn(torch.tensor({bad_ids.tolist()}, device="cuda"), 16, {num_experts}, **{range_check})
                """, message)
        else:
            with pytest.raises(ValueError, match=re.escape(message)):
                fn(bad_ids, 16, num_experts, **range_check)


def test_id_range_check_on_request_and_by_default():
    ids = torch.tensor([[0, 5]], device=DEVICE)
    message = "moe_align_block_size: argument 'topk_ids' must hold expert ids in [0, 4)"
    for options in ({"validate_ids": True}, {}):
        if DEVICE.type == "cuda":
            assert_device_assert(f"""
                from moe_kernels.kernels.align import moe_align_block_size
                moe_align_block_size(torch.tensor([[0, 5]], device="cuda"), 16, 4, **{options})
                """, message)
        else:
            with pytest.raises(ValueError, match=re.escape(message)):
                moe_align_block_size(ids, 16, 4, **options)


def test_int32_overflow_is_refused():
    ids = torch.zeros((1, 1), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="argument 'topk_ids' must give numel"):
        moe_align_block_size(ids, 2**20, 4096)
    # (the kernels' chunk arithmetic is int32: at most 2**30 assignments; a view of one element, no memory)
    huge = torch.zeros(1, dtype=torch.int32, device=DEVICE).expand(2**30 + 8).view(-1, 8)
    with pytest.raises(ValueError, match=r"argument 'topk_ids' must hold at most 2\*\*30 assignments"):
        moe_align_block_size(huge, 16, 8)


def test_naive_helpers_check_arguments():
    with pytest.raises(ValueError, match="argument 'topk' must be >= 1"):
        use_naive_block_assignment(4, 0, 256)
    with pytest.raises(ValueError, match="argument 'block_size' must be >= 1"):
        naive_block_assignment(torch.zeros((1, 2), dtype=torch.int64), 0)
    with pytest.raises(TypeError, match="argument 'topk_ids' must have dtype"):
        naive_block_assignment(torch.zeros((1, 2)), 16)


_COMPILE_FOR_HOPPER = """
import torch
import triton
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import align
from moe_kernels.sm90_compile import assemble_for_sm90, compile_for_sm90

def int_pointers(fn):
    return {n: "*i32" for n in fn.arg_names if n.endswith("_ptr")}

fn = align._chunk_count_kernel
ptx = compile_for_sm90(fn, dict(NUM_BINS=128, COUNT_TILE=1024), int_pointers(fn), pointers_aligned=False,
                       num_warps=4).asm["ptx"]
print(len(ptx) > 0)
fn = align._scan_chunk_counts_kernel
ptx = compile_for_sm90(fn, dict(NUM_BINS=256, SCAN_BINS=align._SCAN_BINS, SCAN_ROWS=align._SCAN_ROWS),
                       int_pointers(fn), pointers_aligned=False, num_warps=4).asm["ptx"]
print(len(ptx) > 0)
fn = align._align_kernel
message = "align: argument 'topk_ids' must hold expert ids in [0, 128)"
for from_table, check, permute in ((False, "", False), (True, message, False), (False, "", True),
                                   (False, message, True), ("large", "", False), ("scanned", message, False),
                                   ("scanned", "", True)):
    tile, warps = ((align._LARGE_TILE, align._LARGE_WARPS) if from_table == "large" else
                   (align._SCANNED_TILE, align._SCANNED_WARPS) if from_table == "scanned" else
                   (align._MULTI_TILE, align._MULTI_WARPS) if from_table else (align._SINGLE_TILE, align._SINGLE_WARPS))
    const = dict(COUNTS_FROM_TABLE=bool(from_table), NUM_BINS=256, TILE=tile, COUNT_TILE=1024, ROW_TILE=16,
                 PAD_TILE=align._SCANNED_MAX_PAD_TILE if from_table == "scanned" else 64, FILL_TILE=1024,
                 ID_CHECK=check, PERMUTE=permute, SCANNED=from_table == "scanned")
    ptx = compile_for_sm90(fn, const, int_pointers(fn), pointers_aligned=False, num_warps=warps, debug=bool(check),
                           sanitize_overflow=False).asm["ptx"]
    print(len(ptx) > 0)
    if (permute or from_table == "scanned") and triton.__version__.startswith("3.6."):   # (a newer Triton's ptxas
        built = assemble_for_sm90(ptx)   # may not read its PTX) the one-launch alignment writing the permute
        print("spills", built["spill_stores"] + built["spill_loads"])   # indices, and the scanned one: no spills
"""


def test_compiles_for_hopper():
    """The alignment's kernels compiled for an H100/H200 (sm_90) on this machine: the per-chunk count of
    the multi-launch paths and the scan of the scanned one, the alignment with and without its id check (reading the
    scanned table too, and with the permute indices, which must not spill there either), on the tiles and warps each
    path runs (the
    large inputs' too), and the one-launch alignment writing the permute layout's indices, which must not spill (the
    CPU tests otherwise run it under the interpreter only, which accepts code that a compiler may refuse)."""
    import triton

    lines = compiled_for_hopper(_COMPILE_FOR_HOPPER)
    # (the spill count under the H200's Triton, 3.6, whose ptxas reads its PTX: 4.3 KB a thread in the two-launch
    # build with the indices, which permute therefore leaves to the row kernel)
    spills = ["spills 0"] if triton.__version__.startswith("3.6.") else []
    assert [line for line in lines if line] == (["True"] * 5 + spills) + ["True"] + spills + ["True"] * 2 + spills + (
        ["True"] + spills), lines
