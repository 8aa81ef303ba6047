"""The Gluon block-fp8 grouped GEMM (moe_kernels.kernels.gluon_block_fp8): its torch reference against
float64 on the edge cases, its argument checks, where it refuses to run, and the permute layout's switch
(permute_gluon.FP8_GEMM). The kernel itself runs only on an sm_90 GPU with Triton 3.6 (the GPU tests); its sm_90
build is tested with the A/B tool's (tests/test_gpu_tools.py)."""

from __future__ import annotations

import pytest
import torch

from moe_kernels._runtime import HAS_TRITON, record_launches
from moe_kernels.kernels import gluon_block_fp8, permute as permute_module, permute_gluon
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.gluon_block_fp8 import available, block_fp8_grouped, block_fp8_grouped_reference
from moe_kernels.kernels.permute import permute_experts
from moe_testing import DEVICE, make_problem, rel_err, segment_indices

BLOCK = FORMATS["block"]

# (rows per expert in 128-row segments: 0 is an empty expert; a trailing tile of padding in each)
SEGMENTS = {
    "one row": [1],
    "an empty expert": [5, 0, 130],
    "all rows on one expert": [0, 0, 256],
    "several tiles per expert": [300, 129],
    "one expert": [128],
    # (last tiles of 100, 65, 64, 64, 72, 1 and 1 real rows: halves at 64 or fewer, whole tiles above)
    "last tiles either side of 64 rows": [100, 65, 64, 192, 200, 1, 129],
}


def segmented(counts, seed, k=256, n=128, device="cpu", align=128):
    """fp8 block operands for experts with ``counts`` rows each, segments rounded up to ``align`` rows, and a
    trailing tile of padding. The second half of N is 8 times larger than the first (its 128 x 128 blocks'
    scales too): a tile that promoted one half with the other's weight scale would be off by 8 times."""
    g = torch.Generator().manual_seed(seed)
    m_indices = segment_indices(counts, align)
    raw = torch.randn(len(counts), n, k, generator=g) / 16
    raw[:, n // 2:] *= 8
    w, w_scale = BLOCK.quantize_weight(raw)
    x, x_scale = BLOCK.quantize_activations(torch.randn(m_indices.numel(), k, generator=g))
    return [t.to(device) for t in (x, x_scale, w, w_scale, m_indices)]


def silu_mul64(h):
    gate, up = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2:]
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("case", sorted(SEGMENTS))
def test_reference_against_float64(case, gated):
    """Each expert's rows: the dequantised operands' product (float64, per row; gated: then silu(gate) * up
    of its halves), rounded to bf16; padding rows zero."""
    x, x_scale, w, w_scale, m_indices = segmented(SEGMENTS[case], seed=len(case), n=256)
    out = block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices, gated=gated)
    a = BLOCK.dequantize_activations(x, x_scale).double()
    weights = BLOCK.dequantize_weight(w, w_scale).double()
    assert out.shape == (x.shape[0], 128 if gated else 256)
    for r, e in enumerate(m_indices.tolist()):
        want = a[r] @ weights[e].T if e >= 0 else torch.zeros(w.shape[1], dtype=torch.float64)
        want = silu_mul64(want) if gated else want
        assert torch.allclose(out[r].double(), want, rtol=1e-2, atol=1e-3), (case, r, e)


def test_it_refuses_where_it_cannot_run():
    """Without Triton 3.6's Gluon, a CUDA device or sm_90, the call fails naming why."""
    x, x_scale, w, w_scale, m_indices = segmented([3], seed=1)
    reason = available("cpu")
    assert reason is not None
    with pytest.raises(ValueError, match=r"argument 'w' must be on a device this kernel runs on \(needs"):
        block_fp8_grouped(x, x_scale, w, w_scale, m_indices)


@pytest.mark.parametrize("settings, name", [(dict(stages=1), "stages"), (dict(stages=7), "stages"),
                                            (dict(block_n=256), "block_n"), (dict(gated=1), "gated"),
                                            (dict(overlap="yes"), "overlap"), (dict(validate_ids=None), "validate_ids"),
                                            (dict(rows_used=torch.zeros(2, dtype=torch.int32)), "rows_used"),
                                            (dict(rows_used=torch.zeros(1, dtype=torch.int64)), "rows_used"),
                                            (dict(rows_used=torch.zeros(1, dtype=torch.int32), overlap=False),
                                             "overlap"),
                                            (dict(quantize_output=1), "quantize_output"),
                                            (dict(quantize_output=True, gated=True), "quantize_output"),
                                            (dict(quantize_output=True, rows_used=torch.zeros(1, dtype=torch.int32)),
                                             "quantize_output"),
                                            (dict(gated=True, stages=6, rows_used=torch.zeros(1, dtype=torch.int32)),
                                             "stages"),
                                            (dict(gated=True, stages=5, quantize_output=True,
                                                  rows_used=torch.zeros(1, dtype=torch.int32)), "stages"),
                                            (dict(half_tiles=1, rows_used=torch.zeros(1, dtype=torch.int32)),
                                             "half_tiles"),
                                            (dict(half_tiles=True, overlap=False), "half_tiles"),
                                            (dict(tma_store=1), "tma_store"), (dict(tma_store=True), "tma_store"),
                                            (dict(tma_store=True, gated=True,
                                                  rows_used=torch.zeros(1, dtype=torch.int32)), "tma_store"),
                                            (dict(half_tiles=True, block_n=64), "half_tiles"),
                                            (dict(block_n=64, rows_used=torch.zeros(1, dtype=torch.int32)), "block_n"),
                                            (dict(block_t=8, rows_used=torch.zeros(1, dtype=torch.int32)), "block_t"),
                                            (dict(block_t=16), "block_t"),
                                            (dict(block_t=16, quantize_output=True,   # (not gated)
                                                  rows_used=torch.zeros(1, dtype=torch.int32)), "quantize_output"),
                                            (dict(block_t=16, half_tiles=True,
                                                  rows_used=torch.zeros(1, dtype=torch.int32)), "block_t")])
def test_bad_launch_settings_are_named(settings, name):
    """Checked before the device: refused by name on any machine."""
    x, x_scale, w, w_scale, m_indices = segmented([3], seed=1)
    with pytest.raises((ValueError, TypeError), match=f"argument '{name}'"):
        block_fp8_grouped(x, x_scale, w, w_scale, m_indices, **settings)


@pytest.mark.parametrize("change, name", [
    (lambda a: {**a, "x": a["x"].float()}, "x"),
    (lambda a: {**a, "x": a["x"][:, :128]}, "x"),
    (lambda a: {**a, "x": a["x"][:64], "x_scale": a["x_scale"][:64], "m_indices": a["m_indices"][:64]}, "x"),
    (lambda a: {**a, "w": a["w"][:, :64].contiguous(), "w_scale": a["w_scale"][:, :1]}, "w"),
    (lambda a: {**a, "x_scale": a["x_scale"][:, :1]}, "x_scale"),
    (lambda a: {**a, "w_scale": a["w_scale"].double()}, "w_scale"),
    (lambda a: {**a, "m_indices": a["m_indices"].long()}, "m_indices"),
    (lambda a: {**a, "m_indices": a["m_indices"][:128]}, "m_indices"),
    (lambda a: {**a, "m_indices": torch.where(a["m_indices"] == 0, 2, a["m_indices"])}, "m_indices"),   # E = 2
    (lambda a: {**a, "out": torch.empty(8, 8, dtype=torch.bfloat16)}, "out"),
    (lambda a: {**a, "x": torch.cat([a["x"], a["x"][:, :8]], 1)[:, :256]}, "x"),    # a row stride of 264
    (lambda a: {**a, "w": a["w"][:0], "w_scale": a["w_scale"][:0]}, "w"),          # no expert
    (lambda a: {**a, "m_indices": torch.cat([torch.tensor([0, 0, 1], dtype=torch.int32),
                                             a["m_indices"][3:]])}, "m_indices"),    # two experts in a tile
    (lambda a: {**a, "gated": True}, "w"),                                  # 128 rows: no two 128-row halves
    (lambda a: {**a, "gated": True, "w": torch.cat([a["w"]] * 2, 1), "w_scale": torch.cat([a["w_scale"]] * 2, 1),
                "out": torch.empty(256, 256, dtype=torch.bfloat16)}, "out"),   # gated: [M, N/2]
])
def test_bad_arguments_are_named(change, name):
    """The checks run before any launch (here on the CPU, where the kernel itself cannot run)."""
    x, x_scale, w, w_scale, m_indices = segmented([3, 0], seed=2)   # (expert 1: no rows)
    args = change(dict(x=x, x_scale=x_scale, w=w, w_scale=w_scale, m_indices=m_indices, out=None, gated=False))
    with pytest.raises((ValueError, TypeError), match=f"argument '{name}'"):
        gluon_block_fp8._check("block_fp8_grouped", args["x"], args["x_scale"], args["w"], args["w_scale"],
                               args["m_indices"], args["out"], 128, args["gated"])


@pytest.mark.parametrize("tile_m", [16, 32, 64])
def test_the_transposed_grids_tiles_are_checked(tile_m):
    """With block_t (the transposed grid) x's rows and each tile's expert are checked on tiles of block_t rows."""
    x, x_scale, w, w_scale, m_indices = segmented([3, 0, 20], seed=2, align=tile_m)
    gluon_block_fp8._check("f", x, x_scale, w, w_scale, m_indices, None, 128, tile_m=tile_m)   # (fine)
    with pytest.raises(ValueError, match=f"argument 'x' must have a multiple of {tile_m} rows"):
        gluon_block_fp8._check("f", x[:-8], x_scale[:-8], w, w_scale, m_indices[:-8], None, 128, tile_m=tile_m)
    m_indices[1] = 1   # (a tile of expert 0 with a row of expert 1)
    with pytest.raises(ValueError, match=f"argument 'm_indices' must give each {tile_m}-row tile one expert"):
        gluon_block_fp8._check("f", x, x_scale, w, w_scale, m_indices, None, 128, tile_m=tile_m)


def fp8_problem(num_tokens, seed, dtype=torch.float32):
    from moe_kernels.kernels.quant import quantize_weight

    x, w1, w2, weights, ids = make_problem(num_tokens, 4, 2, 256, 128, dtype, seed=seed)
    (w1q, w1s), (w2q, w2s) = quantize_weight(w1, "block"), quantize_weight(w2, "block")
    return x, w1q, w2q, weights, ids, w1s, w2s


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_switch_falls_back_to_triton_and_says_why(monkeypatch):
    """permute_gluon.FP8_GEMM = "gluon" where the Gluon kernel cannot run (here: this machine) takes the Triton
    kernel, with the same result, and the launch record names the reason; a misspelt value is refused."""
    x, w1q, w2q, weights, ids, w1s, w2s = fp8_problem(9, seed=3)
    want = permute_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    monkeypatch.setattr(permute_gluon, "FP8_GEMM", "gluon")
    with record_launches() as launches:
        got = permute_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    assert torch.equal(got, want)
    if HAS_TRITON:
        chosen = [s for name, s in launches if name == "permute.fp8_gemm"]
        # (here no Gluon; on an H200 with Triton 3.6 these float32 activations)
        assert len(chosen) == 1 and chosen[0]["kernel"] == "triton", launches
        assert chosen[0]["refused"] == (available(x.device) or "activations not bf16"), launches
    monkeypatch.setattr(permute_gluon, "FP8_GEMM", "glucon")
    with pytest.raises(ValueError, match="'FP8_GEMM' must be 'triton' or 'gluon', got 'glucon'"):
        permute_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)


# ---- on an sm_90 GPU with Triton 3.6 ------------------------------------------------------------------------

needs_gluon = pytest.mark.skipif(available(DEVICE) is not None, reason=f"the Gluon kernel: {available(DEVICE)}")


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(SEGMENTS))
@pytest.mark.parametrize("overlap, block_n", [(True, 128), (False, 128), (True, 64), (False, 64)])
@pytest.mark.parametrize("k", [128, 256, 384, 640, 1152])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_the_kernel_against_its_reference_gpu(case, overlap, block_n, k, gated):
    """Every edge case, both orders and both N tiles, K loops of 1-9 steps (the overlapped loop runs two a
    turn, then an odd one; at 9 every stage's barrier turns its phase twice), plain and gated (N = 512: two column tiles of each half, the up half in other
    scale blocks than the gate's); rows of padding keep what ``out`` held."""
    check_against_reference(case, k, gated, overlap=overlap, block_n=block_n)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(SEGMENTS))
@pytest.mark.parametrize("stages", [2, 4, 6])
@pytest.mark.parametrize("k", [128, 256, 384, 640, 1152])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_half_tiles_one_program_a_tile_against_the_reference_gpu(monkeypatch, case, stages, k, gated):
    """Half tiles with one program a tile: a segment's last tile with at most 64 real rows multiplies 64 rows
    (the two warpgroups side by side along N) and the others 128; every edge case, K loops of 1-9 steps, 2-6
    stages; rows of padding keep what ``out`` held, and a test counter pins how many tiles took the half path."""
    from moe_kernels.kernels import _gluon_block_fp8_kernel as per_tile

    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(per_tile, "HALF_TILE_COUNTER", counter)
    launches = check_against_reference(case, k, gated, stages=stages, half_tiles=True)
    assert [(s["persistent"], s["half_tiles"]) for name, s in launches if name == "gluon_block_fp8.gemm"] == [
        (False, True)], launches
    assert int(counter) == half_tiles_in(SEGMENTS[case]) * 4   # (each half tile once per column tile: N = 512)


def check_against_reference(case, k, gated, persistent=False, **settings):
    """block_fp8_grouped on a GPU against its reference over the real rows (N = 512); rows of padding (and,
    ``persistent``, the rows past rows_used) keep what ``out`` held. Returns the launch record."""
    x, x_scale, w, w_scale, m_indices = segmented(SEGMENTS[case], seed=len(case), k=k, n=512, device="cuda")
    if persistent:   # (the last tile is padding)
        settings["rows_used"] = torch.tensor([m_indices.shape[0] - 128], dtype=torch.int32, device="cuda")
    out = torch.full((x.shape[0], w.shape[1] // 2 if gated else w.shape[1]), 7.0, device="cuda",
                     dtype=torch.bfloat16)
    with record_launches() as launches:
        block_fp8_grouped(x, x_scale, w, w_scale, m_indices, out=out, gated=gated, **settings)
    want = block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices, gated=gated)
    real = m_indices >= 0
    assert rel_err(out[real].float(), want[real].float()) < 5e-3
    assert bool((out[~real] == 7.0).all())
    return launches


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(SEGMENTS))
@pytest.mark.parametrize("programs, stages, half_tiles", [(1, 4, False), (3, 2, False), (7, 3, False), (None, 4, False),
                                                        (1, 4, True), (3, 2, True), (None, 4, True)])
@pytest.mark.parametrize("k", [128, 256, 384, 640, 1152])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_the_persistent_grid_against_the_reference_gpu(monkeypatch, case, programs, stages, k, gated, half_tiles):
    """The persistent grid (rows_used given): a few programs each walking many tiles (the ring's steps and
    barrier phases running on across tiles, K loops of 1-9 steps, fewer steps than stages included), or one
    per SM; with half tiles, whole and half tiles interleaved in one program's walk (the ring does not change
    with the kind of tile); rows of padding and the rows past rows_used keep what ``out`` held."""
    from moe_kernels.kernels import _gluon_block_fp8_kernel as per_tile, _gluon_block_fp8_persistent as persistent

    monkeypatch.setattr(persistent, "PROGRAMS", programs)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(per_tile, "HALF_TILE_COUNTER", counter)
    launches = check_against_reference(case, k, gated, persistent=True, stages=stages, half_tiles=half_tiles)
    assert [(s["persistent"], s["half_tiles"]) for name, s in launches if name == "gluon_block_fp8.gemm"] == [
        (True, half_tiles)], launches
    # the path, not only the values: each half tile (row 64 padding) counted once per column tile (N = 512)
    assert int(counter) == (half_tiles_in(SEGMENTS[case]) * 4 if half_tiles else 0)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(SEGMENTS))
@pytest.mark.parametrize("programs, stages, half_tiles", [(1, 4, False), (3, 2, False), (None, 6, False),
                                                        (3, 4, True), (None, 5, True)])
@pytest.mark.parametrize("k", [128, 384, 1152])
def test_the_tma_store_against_the_reference_gpu(monkeypatch, case, programs, stages, half_tiles, k):
    """The persistent grid storing whole tiles by TMA (plain GEMM): every real row bit for bit the pointer stores'
    (and the reference's), the padding rows of whole tiles written (the path, not only the values), the rows past
    rows_used keeping what ``out`` held; a few programs walk many tiles (each copy waited for before its tile's
    shared memory is written again); with half tiles, the halves store their rows by pointer (the counter pins
    that they were taken)."""
    from moe_kernels.kernels import _gluon_block_fp8_kernel as per_tile, _gluon_block_fp8_persistent as persistent

    monkeypatch.setattr(persistent, "PROGRAMS", programs)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(per_tile, "HALF_TILE_COUNTER", counter)
    x, x_scale, w, w_scale, m_indices = segmented(SEGMENTS[case], seed=len(case) + k, k=k, n=512, device="cuda")
    used = m_indices.shape[0] - 128   # (the last tile: padding, past rows_used)
    rows_used = torch.tensor([used], dtype=torch.int32, device="cuda")
    out = torch.full((x.shape[0], 512), 7.0, device="cuda", dtype=torch.bfloat16)
    with record_launches() as launches:
        block_fp8_grouped(x, x_scale, w, w_scale, m_indices, out=out, rows_used=rows_used, stages=stages,
                          half_tiles=half_tiles, tma_store=True)
    assert [(s["persistent"], s["tma_store"]) for name, s in launches if name == "gluon_block_fp8.gemm"] == [
        (True, True)], launches
    assert int(counter) == (half_tiles_in(SEGMENTS[case]) * 4 if half_tiles else 0)   # (N = 512: 4 column tiles)
    want = block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices)
    pointer = block_fp8_grouped(x, x_scale, w, w_scale, m_indices, rows_used=rows_used, stages=stages,
                                half_tiles=half_tiles)
    real = m_indices >= 0
    assert torch.equal(out[real], pointer[real]) and rel_err(out[real].float(), want[real].float()) < 5e-3
    assert bool((out[used:] == 7.0).all())
    # the padding rows of whole tiles below rows_used hold products now (a half tile's keep 7.0)
    tiles = m_indices[:used].view(-1, 128)
    whole = ~(tiles[:, 64] < 0) if half_tiles else torch.ones(tiles.shape[0], dtype=torch.bool, device="cuda")
    padding = (tiles < 0) & whole[:, None]
    if bool(padding.any()):
        assert not bool((out[:used].view(-1, 128, 512)[padding] == 7.0).all(dim=-1).any())


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("num_tokens", [64, 600])
def test_the_permute_layout_with_the_tma_store_gpu(monkeypatch, num_tokens):
    """permute_experts on the persistent Gluon grid with GEMM 2 storing by TMA (permute_gluon.GLUON_TMA_STORE,
    the default): the record says so, and the result is bit for bit the same grid's with pointer stores (the
    gather back reads real rows only, so GEMM 2's written padding rows change nothing)."""
    x, w1q, w2q, weights, ids, w1s, w2s = fp8_problem(num_tokens, seed=num_tokens + 1, dtype=torch.bfloat16)
    monkeypatch.setattr(permute_gluon, "FP8_GEMM", "gluon")
    assert permute_gluon.GLUON_TMA_STORE is True
    monkeypatch.setattr(permute_gluon, "GLUON_TMA_STORE", False)
    want = permute_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    monkeypatch.setattr(permute_gluon, "GLUON_TMA_STORE", True)
    with record_launches() as launches:
        got = permute_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    assert [s["tma_store"] for name, s in launches if name == "gluon_block_fp8.gemm"] == [False, True], launches
    assert torch.equal(got, want)


def assert_the_quantisers_bits(q, s, bf16, m_indices):
    """A quantising GEMM's fp8 output ``q`` and scales ``s`` (N = 512: two 128-column groups) are, on every real
    row, bit for bit the bf16 output ``bf16`` quantised by per_token_group_quant_fp8."""
    from moe_kernels.kernels.quant import per_token_group_quant_fp8

    assert q.dtype == torch.float8_e4m3fn and q.shape == (bf16.shape[0], 256) and s.shape == (bf16.shape[0], 2)
    want_q, want_s = per_token_group_quant_fp8(bf16, 128)
    real = m_indices >= 0
    assert torch.equal(q[real].view(torch.uint8), want_q[real].view(torch.uint8))
    assert torch.equal(s[real], want_s[real])


def half_tiles_in(counts):
    """Segments (of 128-row tiles) whose last tile has at most 64 real rows."""
    return sum(1 for c in counts if c and 0 < (c - 1) % 128 + 1 <= 64)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(SEGMENTS))
@pytest.mark.parametrize("programs", [1, 3, None])
@pytest.mark.parametrize("k", [128, 384, 1152])
@pytest.mark.parametrize("half_tiles", [False, True], ids=["whole tiles", "half tiles"])
def test_the_quantising_epilogue_gives_the_quantisers_bits_gpu(monkeypatch, case, programs, k, half_tiles):
    """GEMM 1 gated with quantize_output: the fp8 rows and scales of every real row are bit for bit the
    persistent kernel's bf16 output quantised by per_token_group_quant_fp8 (N = 512: two 128-column groups,
    each from two 64-column tiles taken back to back); a few programs walk many pairs; with half tiles, a
    half tile's group waits in the first 64 rows of the stash."""
    from moe_kernels.kernels import _gluon_block_fp8_kernel as per_tile, _gluon_block_fp8_persistent as persistent

    monkeypatch.setattr(persistent, "PROGRAMS", programs)
    x, x_scale, w, w_scale, m_indices = segmented(SEGMENTS[case], seed=len(case) + k, k=k, n=512, device="cuda")
    rows_used = torch.tensor([m_indices.shape[0] - 128], dtype=torch.int32, device="cuda")
    bf16 = block_fp8_grouped(x, x_scale, w, w_scale, m_indices, gated=True, rows_used=rows_used,
                             half_tiles=half_tiles)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(per_tile, "HALF_TILE_COUNTER", counter)
    with record_launches() as launches:
        q, s = block_fp8_grouped(x, x_scale, w, w_scale, m_indices, gated=True, rows_used=rows_used,
                                 quantize_output=True, half_tiles=half_tiles)
    assert int(counter) == (half_tiles_in(SEGMENTS[case]) * 4 if half_tiles else 0)   # (both tiles of each pair)
    assert [(r["quantize_output"], r["half_tiles"]) for name, r in launches if name == "gluon_block_fp8.gemm"] == [
        (True, half_tiles)], launches
    assert_the_quantisers_bits(q, s, bf16, m_indices)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("half_tiles", [False, True], ids=["whole tiles", "half tiles"])
def test_the_quantising_epilogue_matches_the_quantiser_on_inf_and_nan_gpu(half_tiles):
    """A row whose product is inf or NaN (an inf activation scale) gets the quantiser's bits too: its clamp
    (min.xorsign.abs) keeps NaN's sign where a max/min pair would not (rows 0 and 5 lie in a whole tile, rows
    300 and 305 in a half tile)."""
    from moe_kernels.kernels.quant import per_token_group_quant_fp8

    x, x_scale, w, w_scale, m_indices = segmented([300, 129], seed=3, k=384, n=512, device="cuda")
    for row in (0, 256):   # (256: the last tile of expert 0's segment, 44 real rows)
        x_scale[row, 1] = float("inf")
        x_scale[row + 5] = float("nan")
    rows_used = torch.tensor([m_indices.shape[0] - 128], dtype=torch.int32, device="cuda")
    bf16 = block_fp8_grouped(x, x_scale, w, w_scale, m_indices, gated=True, rows_used=rows_used,
                             half_tiles=half_tiles)
    q, s = block_fp8_grouped(x, x_scale, w, w_scale, m_indices, gated=True, rows_used=rows_used,
                             quantize_output=True, half_tiles=half_tiles)
    want_q, want_s = per_token_group_quant_fp8(bf16, 128)
    assert not bool(torch.isfinite(bf16[0].float()).all())
    real = m_indices >= 0
    assert torch.equal(q[real].view(torch.uint8), want_q[real].view(torch.uint8))
    assert torch.equal(s[real].view(torch.int32), want_s[real].view(torch.int32))


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("change, message", [
    (lambda used, m: (used + 64, m), "multiple of 128"),
    (lambda used, m: (used + 256, m), "multiple of 128"),
    (lambda used, m: (used - 128, m), "no real row past it"),
    (lambda used, m: (used, torch.cat([torch.full((128,), -1, dtype=torch.int32, device="cuda"), m[128:]])),
     "real row"),
])
def test_rows_used_is_checked_gpu(change, message):
    """With validate_ids the persistent grid's rows_used is read back: a multiple of 128 within the rows, every
    tile below it starting on a real row (the kernel takes a tile's expert from its first row), no real row
    past it; the error names the argument."""
    x, x_scale, w, w_scale, m_indices = segmented([300, 129], seed=4, k=128, n=256, device="cuda")
    used, m_indices = change(m_indices.shape[0] - 128, m_indices)
    rows_used = torch.tensor([used], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=message):
        block_fp8_grouped(x, x_scale, w, w_scale, m_indices, rows_used=rows_used)


# (decode: a few tokens an expert, segments of block_t rows)
DECODE_SEGMENTS = {"one token": [1], "an empty expert": [3, 0, 17], "a full tile": [0, 16, 64],
                   "several tiles per expert": [40, 1, 70, 9]}


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(DECODE_SEGMENTS))
@pytest.mark.parametrize("block_t", [16, 32, 64])
@pytest.mark.parametrize("programs, stages, warps", [(1, 2, None), (3, 6, None), (None, 6, None), (3, 4, 8)])
@pytest.mark.parametrize("k", [128, 384, 1152])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_the_transposed_grid_against_the_reference_gpu(monkeypatch, case, block_t, programs, stages, warps, k, gated):
    """The transposed product (block_t: 128 weight rows by block_t tokens a tile) on its persistent grid: a few
    programs each walking many tiles, K loops of 1, 3 and 9 steps, the kernel's warps (warps_for) and 8, rows of
    padding and past rows_used untouched; N = 512, so the gated tile's up rows are in other scale blocks than its
    gate rows (8 times larger)."""
    from moe_kernels.kernels import _gluon_transposed as transposed

    monkeypatch.setattr(transposed, "PROGRAMS", programs)
    monkeypatch.setattr(transposed, "NUM_WARPS", warps)
    x, x_scale, w, w_scale, m_indices = segmented(DECODE_SEGMENTS[case], seed=len(case) + k, k=k, n=512,
                                                  device="cuda", align=block_t)
    rows_used = torch.tensor([m_indices.shape[0] - block_t], dtype=torch.int32, device="cuda")
    out = torch.full((x.shape[0], 256 if gated else 512), 7.0, device="cuda", dtype=torch.bfloat16)
    with record_launches() as launches:
        block_fp8_grouped(x, x_scale, w, w_scale, m_indices, out=out, gated=gated, rows_used=rows_used,
                          block_t=block_t, stages=stages)
    assert [(s["block_t"], s["persistent"]) for name, s in launches if name == "gluon_block_fp8.gemm"] == [
        (block_t, True)], launches
    want = block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices, gated=gated)
    real = m_indices >= 0
    assert rel_err(out[real].float(), want[real].float()) < 5e-3
    assert bool((out[~real] == 7.0).all())


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(DECODE_SEGMENTS))
@pytest.mark.parametrize("block_t", [16, 32, 64])
@pytest.mark.parametrize("programs, stages", [(1, 2), (3, 6), (None, 6)])
@pytest.mark.parametrize("k", [128, 1152])
def test_the_transposed_quantising_epilogue_gives_the_quantisers_bits_gpu(monkeypatch, case, block_t, programs,
                                                                          stages, k):
    """GEMM 1 on the transposed grid with quantize_output: the fp8 rows and scales of every real row are bit for
    bit the transposed kernel's bf16 output quantised by per_token_group_quant_fp8 (N = 512: two 128-column
    groups, each from one program's two 64-column tiles back to back); a few programs walk many pairs."""
    from moe_kernels.kernels import _gluon_transposed as transposed

    monkeypatch.setattr(transposed, "PROGRAMS", programs)
    x, x_scale, w, w_scale, m_indices = segmented(DECODE_SEGMENTS[case], seed=len(case) + k, k=k, n=512,
                                                  device="cuda", align=block_t)
    rows_used = torch.tensor([m_indices.shape[0] - block_t], dtype=torch.int32, device="cuda")
    bf16 = block_fp8_grouped(x, x_scale, w, w_scale, m_indices, gated=True, rows_used=rows_used, block_t=block_t,
                             stages=stages)
    with record_launches() as launches:
        q, s = block_fp8_grouped(x, x_scale, w, w_scale, m_indices, gated=True, rows_used=rows_used,
                                 block_t=block_t, stages=stages, quantize_output=True)
    assert [(r["block_t"], r["quantize_output"]) for name, r in launches if name == "gluon_block_fp8.gemm"] == [
        (block_t, True)], launches
    assert_the_quantisers_bits(q, s, bf16, m_indices)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("align", [16, 128])
def test_the_gluon_path_leaves_the_triton_tiles_epilogue_choices_aside_gpu(align):
    """A config whose Triton tiles gather the rows and sum in GEMM 2 (as the tuned fp8 tables do at some batches)
    still runs on the Gluon kernels with gemm="gluon": the rows are copied into their segments and gathered back
    after GEMM 2, the launch record names the two choices left aside, and the result is the Triton path's (on
    its default tiles)."""
    import dataclasses

    from moe_kernels.kernels.config import get_config

    x, w1q, w2q, weights, ids, w1s, w2s = fp8_problem(40, seed=7, dtype=torch.bfloat16)
    config = get_config(40, w1q.shape[0], w2q.shape[2], w2q.shape[1], w1q.dtype, x.device, layout="permute",
                        align=align)
    config = dataclasses.replace(config, gather_rows=True, sum_in_gemm=True)
    triton_out = permute_experts(x, w1q, w2q, weights, ids, align=align, w1_scale=w1s, w2_scale=w2s)
    with record_launches() as launches:
        got = permute_experts(x, w1q, w2q, weights, ids, align=align, config=config, w1_scale=w1s, w2_scale=w2s,
                              gemm="gluon")
    assert [(r["kernel"], r["unused"]) for name, r in launches if name == "permute.fp8_gemm"] == [
        ("gluon", ["gather_rows", "sum_in_gemm"])], launches
    assert len([name for name, _ in launches if name == "gluon_block_fp8.gemm"]) == 2, launches
    assert rel_err(got.float(), triton_out.float()) < 2e-2


@pytest.mark.gpu
@needs_gluon
def test_half_tiles_refuse_a_real_row_after_row_64s_padding_gpu():
    """A half tile multiplies rows 0-63 only, so with half_tiles and validate_ids a tile whose row 64 is padding
    must hold no real row after it (permute never makes one; a hand-made m_indices might)."""
    x, x_scale, w, w_scale, m_indices = segmented([300, 129], seed=6, k=128, n=256, device="cuda")
    rows_used = torch.tensor([m_indices.shape[0] - 128], dtype=torch.int32, device="cuda")
    m_indices[64] = -1   # (the first tile: rows 0-63 and 65-127 of expert 0, row 64 padding)
    block_fp8_grouped(x, x_scale, w, w_scale, m_indices, rows_used=rows_used)   # (whole tiles: allowed)
    for grid in (dict(rows_used=rows_used), {}):   # (the persistent grid, one program a tile)
        with pytest.raises(ValueError, match="argument 'm_indices' must hold no real row after padding at row 64"):
            block_fp8_grouped(x, x_scale, w, w_scale, m_indices, half_tiles=True, **grid)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("num_tokens", [1, 64, 600])
@pytest.mark.parametrize("persistent, fused, one_pass, half", [
    (False, False, False, False), (False, False, True, False), (False, False, True, True), (True, False, True, False),
    (True, True, True, False), (True, False, True, True), (True, True, True, True), (True, True, True, "gemm2")],
    ids=["per tile", "per tile, one-pass input", "per tile, half tiles", "persistent", "persistent, GEMM 1 quantising",
         "persistent, half tiles", "persistent, GEMM 1 quantising, half tiles",
         "persistent, GEMM 1 quantising, half tiles in GEMM 2"])
def test_the_permute_layout_on_the_gluon_kernel_gpu(monkeypatch, num_tokens, persistent, fused, one_pass, half):
    """permute_experts with FP8_GEMM = "gluon" (per tile, on the persistent grid, and with GEMM 1 quantising
    GEMM 2's input): the launch record says which kernels ran, the result agrees with the Triton kernel's
    and the fp8 reference's (GEMM 1's bf16 output rounds once more), and a CUDA graph captures the call."""
    from moe_kernels.reference import moe_reference_fp8

    x, w1q, w2q, weights, ids, w1s, w2s = fp8_problem(num_tokens, seed=num_tokens, dtype=torch.bfloat16)
    triton_out = permute_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    monkeypatch.setattr(permute_gluon, "FP8_GEMM", "gluon")
    monkeypatch.setattr(permute_gluon, "GLUON_PERSISTENT", persistent)
    monkeypatch.setattr(permute_gluon, "GLUON_QUANTIZE_IN_GEMM1", fused)
    monkeypatch.setattr(permute_module, "ONE_PASS_FP8_INPUT", one_pass)
    monkeypatch.setattr(permute_gluon, "GLUON_HALF_TILES", half is True)
    monkeypatch.setattr(permute_gluon, "GLUON_HALF_TILES_GEMM2", half == "gemm2")
    with record_launches() as launches:
        got = permute_experts(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)
    assert [s["kernel"] for name, s in launches if name == "permute.fp8_gemm"] == ["gluon"], launches
    # GEMM 1 gated (SiLU·mul in its epilogue), GEMM 2 plain, both overlapped on 128-column tiles
    assert [(s["gated"], s["overlap"], s["block_n"], s["persistent"], s["quantize_output"], s["half_tiles"])
            for name, s in launches if name == "gluon_block_fp8.gemm"] == [
        (True, True, 128, persistent, fused, half is True), (False, True, 128, persistent, False, bool(half))], launches
    assert not any(name.startswith(("permute.gemm", "activation.")) for name, _ in launches), launches
    # the input quantised and scattered in one pass (or quantised, then scattered); GEMM 2's input by the
    # quantiser unless GEMM 1 quantises it
    assert [name for name, _ in launches if name.startswith("quant")] == (
        (["quant_scatter"] if one_pass else ["quant.groups"]) + ([] if fused else ["quant.groups"])), launches
    # (GEMM 2's quantiser stops at rows_used on the persistent grid, which reads no row past it)
    assert [r["bounded"] for name, r in launches if name == "quant.groups"][-1:] == ([] if fused else [persistent])
    want = moe_reference_fp8(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity="block",
                             intermediate_dtype=x.dtype)
    assert rel_err(got.float(), want.float()) < 2e-2 and rel_err(got.float(), triton_out.float()) < 2e-2
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    permute_experts(static, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)   # (compiled outside the capture)
    with torch.cuda.graph(graph):
        captured = permute_experts(static, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, validate_ids=False)
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("num_tokens, align", [(1, 16), (8, 16), (64, 16), (64, 32), (200, 64)])
@pytest.mark.parametrize("fused", [False, True], ids=["quantiser", "GEMM 1 quantising"])
def test_the_permute_layout_at_decode_on_the_transposed_kernel_gpu(monkeypatch, num_tokens, align, fused):
    """permute_experts with FP8_GEMM = "gluon" and segments of 16-64 rows: both GEMMs on the transposed grid
    (the launch record says so), GEMM 2's input by the quantiser or by GEMM 1 (TRANSPOSED_QUANTIZE_IN_GEMM1),
    the result within the fp8 reference's tolerance and the Triton kernel's, and a CUDA graph captures the
    call."""
    from moe_kernels.reference import moe_reference_fp8

    x, w1q, w2q, weights, ids, w1s, w2s = fp8_problem(num_tokens, seed=num_tokens, dtype=torch.bfloat16)
    triton_out = permute_experts(x, w1q, w2q, weights, ids, align=align, w1_scale=w1s, w2_scale=w2s)
    monkeypatch.setattr(permute_gluon, "FP8_GEMM", "gluon")
    monkeypatch.setattr(permute_gluon, "TRANSPOSED_QUANTIZE_IN_GEMM1", fused)
    with record_launches() as launches:
        got = permute_experts(x, w1q, w2q, weights, ids, align=align, w1_scale=w1s, w2_scale=w2s)
    assert [(s["gated"], s["block_t"], s["quantize_output"]) for name, s in launches
            if name == "gluon_block_fp8.gemm"] == [(True, align, fused), (False, align, False)], launches
    # x's quantiser (or, with the one-pass input, the default, quantize_scatter), then GEMM 2's (bounded by
    # rows_used) unless GEMM 1 quantises
    one_pass = permute_module.ONE_PASS_FP8_INPUT
    assert [r["bounded"] for name, r in launches if name == "quant.groups"] == [False] * (not one_pass) + [True] * (
        not fused), launches
    assert len([name for name, _ in launches if name == "quant_scatter"]) == one_pass, launches
    want = moe_reference_fp8(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity="block",
                             intermediate_dtype=x.dtype)
    assert rel_err(got.float(), want.float()) < 2e-2 and rel_err(got.float(), triton_out.float()) < 2e-2
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    permute_experts(static, w1q, w2q, weights, ids, align=align, w1_scale=w1s, w2_scale=w2s)
    with torch.cuda.graph(graph):
        captured = permute_experts(static, w1q, w2q, weights, ids, align=align, w1_scale=w1s, w2_scale=w2s,
                                   validate_ids=False)
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.gpu
@needs_gluon
def test_the_switch_refuses_what_the_kernel_cannot_take_gpu(monkeypatch):
    """fp16 activations and 256-row segments go to the Triton kernel, the launch record saying why."""
    x, w1q, w2q, weights, ids, w1s, w2s = fp8_problem(20, seed=5, dtype=torch.bfloat16)
    monkeypatch.setattr(permute_gluon, "FP8_GEMM", "gluon")
    for hidden, align, reason in ((x.half(), 128, "activations not bf16"), (x, 256, "segments of 256 rows")):
        with record_launches() as launches:
            permute_experts(hidden, w1q, w2q, weights, ids, align=align, w1_scale=w1s, w2_scale=w2s)
        chosen = [s for name, s in launches if name == "permute.fp8_gemm"]
        assert chosen[0]["kernel"] == "triton" and reason in chosen[0]["refused"], launches
