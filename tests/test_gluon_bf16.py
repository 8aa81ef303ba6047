"""The bf16 persistent Gluon grouped GEMM (moe_kernels.kernels.gluon_bf16): where it refuses to run, its argument
checks, its shared memory rule against the compiler's (its sm_90 builds, under Triton 3.6), and on an sm_90 GPU
the kernel against its reference on every edge case and the permute layout on it (permute_gluon.BF16_GEMM)."""

from __future__ import annotations

import re

import pytest
import torch

from moe_kernels._runtime import record_launches
from moe_kernels.kernels import permute_gluon
from moe_kernels.kernels.gluon_bf16 import (SHARED_LIMIT, bf16_grouped, bf16_grouped_reference, gathered_rows_reference,
                                            shared_bytes)
from moe_kernels.kernels.gluon_block_fp8 import available
from moe_kernels.kernels.permute import permute_experts
from moe_testing import DEVICE, make_problem, rel_err, segment_indices

# (rows per expert in 128-row segments: 0 is an empty expert; a trailing tile of padding in each)
SEGMENTS = {
    "one row": [1],
    "an empty expert": [5, 0, 130],
    "all rows on one expert": [0, 0, 256],
    "several tiles per expert": [300, 129],
    # (last tiles of 100, 65, 64, 64, 72, 1 and 1 real rows: halves at 64 or fewer, whole tiles above)
    "last tiles either side of 64 rows": [100, 65, 64, 192, 200, 1, 129],
}


def segmented(counts, seed, k, n, device="cpu"):
    """bf16 operands for experts with ``counts`` rows each in 128-row segments and a trailing tile of padding,
    ``rows_used`` (the segments, not the trailing tile). The second half of N is 8 times the first: a gated
    tile that paired a gate column with the wrong up column would be far off."""
    g = torch.Generator().manual_seed(seed)
    m_indices = segment_indices(counts, 128)
    w = torch.randn(len(counts), n, k, generator=g) / k ** 0.5
    w[:, n // 2:] *= 8
    x = torch.randn(m_indices.numel(), k, generator=g)
    rows_used = torch.tensor([m_indices.numel() - 128], dtype=torch.int32)
    return [t.to(device) for t in (x.to(torch.bfloat16), w.to(torch.bfloat16), m_indices, rows_used)]


def test_the_reference_against_float64():
    """The reference (the transposed kernel's, any segment size): each real row its expert's product, padding
    rows zero, gated silu(gate) * up."""
    x, w, m_indices, _ = segmented([5, 0, 130], seed=1, k=64, n=256)
    for gated in (False, True):
        got = bf16_grouped_reference(x, w, m_indices, gated=gated).double()
        h = torch.stack([x[r].double() @ w[int(e)].double().T if e >= 0 else torch.zeros(256, dtype=torch.float64)
                         for r, e in enumerate(m_indices.tolist())])
        want = torch.nn.functional.silu(h[:, :128]) * h[:, 128:] if gated else h
        assert rel_err(got, want) < 5e-3


def test_the_gathered_rows_reference_against_float64():
    """A gathered call's reference: its rows are the tokens ``row_assignments // top_k`` names (top-3: rows share
    tokens), padding rows zero, and the product of those rows is each real row's own float64 product."""
    x, w, m_indices, _ = segmented([5, 0, 130], seed=9, k=64, n=256)
    tokens, row_assignments, packed = gathered_rows(m_indices, 64, top_k=3, seed=9)
    assert torch.equal(gathered_rows_reference(tokens, row_assignments, 3), packed)
    got = bf16_grouped_reference(gathered_rows_reference(tokens, row_assignments, 3), w, m_indices).double()
    want = torch.stack([tokens[int(a) // 3].double() @ w[int(e)].double().T if e >= 0
                        else torch.zeros(256, dtype=torch.float64)
                        for a, e in zip(row_assignments.tolist(), m_indices.tolist())])
    assert rel_err(got, want) < 5e-3


def test_it_refuses_where_it_cannot_run():
    """Off an sm_90 GPU with Triton 3.6's Gluon, the call refuses and says why."""
    if available(DEVICE) is None:
        pytest.skip("this device runs the kernel")
    x, w, m_indices, rows_used = segmented([5], seed=2, k=64, n=256)
    with pytest.raises(ValueError, match="bf16_grouped: argument 'w' must be on a device this kernel runs on"):
        bf16_grouped(x, w, m_indices, rows_used)


@pytest.mark.parametrize("settings, says", [
    (dict(block_n=64), "'block_n' must be 128 or 256"), (dict(stages=1), "'stages' must be >= 2"),
    (dict(block_n=256, stages=4, tma_store=True), "'stages' must be at most 3 with block_n=256, gated=False"),
    (dict(gated=1), "'gated' must be a bool"), (dict(tma_store="yes"), "'tma_store' must be a bool"),
    (dict(block_n=128.0), "'block_n' must be 128 or 256"), (dict(group_m=0), "'group_m' must be >= 1")])
def test_bad_settings_are_named(settings, says):
    x, w, m_indices, rows_used = segmented([5], seed=3, k=64, n=256)
    with pytest.raises((ValueError, TypeError), match=re.escape("bf16_grouped: argument " + says)):
        bf16_grouped(x, w, m_indices, rows_used, **settings)


def test_an_output_over_the_input_is_refused():
    """In bf16 an output can have the input's shape (K = N): the grid would overwrite rows other tiles still read,
    so an ``out`` sharing memory with ``x`` is refused, by the checks this kernel shares with the fp8 and the
    transposed ones (which come after the device's)."""
    x, w, m_indices, rows_used = segmented([5], seed=5, k=256, n=256)
    from moe_kernels.kernels.gluon_block_fp8 import _overlap

    assert _overlap(x, x) and _overlap(x[1:], x[:2]) and not _overlap(x[:128], x[128:])
    if available(DEVICE) is None:
        from moe_kernels.kernels.gluon_transposed import grouped_transposed

        x, w, m_indices, rows_used = (t.to(DEVICE) for t in (x, w, m_indices, rows_used))
        with pytest.raises(ValueError, match="bf16_grouped: argument 'out' must not share memory with x"):
            bf16_grouped(x, w, m_indices, rows_used, out=x)
        with pytest.raises(ValueError, match="grouped_transposed: argument 'out' must not share memory with x"):
            grouped_transposed(x, w, m_indices, rows_used, out=x)


def test_gemm1_takes_four_stages_where_the_experts_average_two_tiles(monkeypatch):
    """permute_gluon.gate_up_stages: 4 stages storing by TMA from BF16_GEMM1_DEEP_FROM_ROWS rows an expert (from the
    shapes), the table's stages and store below it; with half tiles 4 stages fit beside the pointer stores only, and
    with BF16_TMA_STORE_GEMM1_DEEP off they keep the plain store; None turns the rule off."""
    rows, table = permute_gluon.BF16_GEMM1_DEEP_FROM_ROWS, (3, permute_gluon.BF16_TMA_STORE_GEMM1)
    assert permute_gluon.gate_up_stages(3, rows * 256, 256) == (4, True)
    assert permute_gluon.gate_up_stages(3, rows * 256 - 1, 256) == table
    monkeypatch.setattr(permute_gluon, "BF16_HALF_TILES", True)
    assert permute_gluon.gate_up_stages(3, rows * 256, 256) == (4, False)
    monkeypatch.setattr(permute_gluon, "BF16_TMA_STORE_GEMM1", True)
    assert permute_gluon.gate_up_stages(3, rows * 256, 256) == (3, True)   # (4 fit beside neither epilogue's store)
    monkeypatch.setattr(permute_gluon, "BF16_HALF_TILES", False)
    monkeypatch.setattr(permute_gluon, "BF16_TMA_STORE_GEMM1", False)
    monkeypatch.setattr(permute_gluon, "BF16_TMA_STORE_GEMM1_DEEP", False)
    assert permute_gluon.gate_up_stages(3, rows * 256, 256) == (4, False)
    monkeypatch.setattr(permute_gluon, "BF16_GEMM1_DEEP_FROM_ROWS", None)
    assert permute_gluon.gate_up_stages(3, 10 ** 9, 256) == (3, False)


def test_gemm1_gathers_its_rows_where_the_experts_average_few(monkeypatch):
    """permute_gluon.gathers_gemm1: bf16 on 128-row segments up to BF16_GATHER_GEMM1_UP_TO_ROWS rows an expert (from the
    shapes), never in fp8, on other segments, on rows that do not start on 16 bytes, or with the switch None."""
    from moe_kernels.kernels.formats import FORMATS

    most = permute_gluon.BF16_GATHER_GEMM1_UP_TO_ROWS
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    assert permute_gluon.gathers_gemm1(FORMATS["none"], 128, x, most * 256, 256)
    assert not permute_gluon.gathers_gemm1(FORMATS["none"], 128, x, most * 256 + 1, 256)
    assert not permute_gluon.gathers_gemm1(FORMATS["block"], 128, x, 8, 256)
    assert not permute_gluon.gathers_gemm1(FORMATS["none"], 64, x, 8, 256)
    assert not permute_gluon.gathers_gemm1(FORMATS["none"], 128, x[:, 1:], 8, 256)   # (rows off 16 bytes)
    monkeypatch.setattr(permute_gluon, "BF16_GATHER_GEMM1_UP_TO_ROWS", None)
    assert not permute_gluon.gathers_gemm1(FORMATS["none"], 128, x, 8, 256)


def test_every_tile_fits_with_the_stages_the_layout_takes():
    """The permute layout's default tiles fit an SM's shared memory, and the rule is the compiler's on the builds
    it was read from (``test_the_kernel_compiles_for_hopper`` holds it to every build it makes)."""
    (n1, stages1), (n2, stages2) = permute_gluon.BF16_TILES["gate_up"], permute_gluon.BF16_TILES["down"]
    assert shared_bytes(n1, stages1, gated=True, half_tiles=permute_gluon.BF16_HALF_TILES,
                        tma_store=permute_gluon.BF16_TMA_STORE_GEMM1) <= SHARED_LIMIT
    assert shared_bytes(n2, stages2, gated=False, half_tiles=permute_gluon.BF16_HALF_TILES,
                        tma_store=permute_gluon.BF16_TMA_STORE) <= SHARED_LIMIT
    assert shared_bytes(128, min(stages2 + 1, 4), gated=False, half_tiles=True, tma_store=True) <= SHARED_LIMIT


# (gated, block_n, stages, half tiles, TMA store, gathered rows): GEMM 1's and GEMM 2's tiles, half tiles, both
# epilogues, and GEMM 1 gathering its rows from the tokens
BUILDS = [(True, 256, 4, False, False, False), (True, 256, 3, True, False, False), (True, 256, 4, True, False, False),
          (True, 256, 3, False, False, False), (True, 256, 3, False, True, False), (True, 256, 3, True, True, False),
          (False, 256, 3, False, True, False),
          (False, 256, 4, False, False, False), (False, 256, 3, True, True, False), (False, 128, 4, True, True, False),
          (True, 128, 4, False, False, False), (True, 256, 4, False, True, True), (True, 256, 3, True, False, True)]

# (compiled, not interpreted, in a process of its own: the tests run under the interpreter; nothing is launched)
_COMPILE_FOR_HOPPER = """
import json, re, sys
import torch
torch.cuda.is_available = lambda: True
from moe_kernels.kernels import _gluon_bf16_persistent as kernel
from moe_kernels.sm90_compile import assemble_for_sm90

for gated, block_n, stages, half, tma_store, gather in json.loads(sys.argv[1]):
    build = kernel.compile_for_sm90(block_n, stages, 8, gated, half, tma_store, gather)
    ptx = build.asm["ptx"]
    built = assemble_for_sm90(ptx)
    print(json.dumps(dict(
        tma_loads=ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global"),
        copies=len(re.findall(r"cp\\.async\\.cg\\.shared\\.global \\[[^]]*\\], \\[[^]]*\\], 0x10", ptx)),
        copy_waits=sorted({int(v) for v in re.findall(r"cp\\.async\\.wait_group\\s+(\\d+)", ptx)}),
        shapes=sorted({int(n) for n in re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n(\\d+)k16", ptx)}),
        waits=sorted({int(v) for v in re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx)}),
        spills=[built["spill_stores"], built["spill_loads"]],
        warnings=[line for line in built["log"].splitlines() if "wgmma" in line.lower()],
        shared=build.metadata.shared, converts=build.asm["ttgir"].count("ttg.convert_layout"))))
"""


def test_the_kernel_compiles_for_hopper():
    """Each build for sm_90a (Triton 3.6's Gluon): one wgmma a K step, m64 n``block_n`` (gated too: gate and up
    quarters in one product; half tiles also the two warpgroups' n``/2`` side by side), one step left in flight
    (``wait_group 1``) and 0 before the epilogue, no spill, no wgmma ptxas serialised, and the shared memory
    :func:`shared_bytes` says. (CI's ``.ci-triton36`` phase; another Triton skips.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"written for Triton 3.6's Gluon API (this is Triton {triton.__version__})")
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_KERNELS_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(root)) if p)
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER, json.dumps(BUILDS)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(reports) == len(BUILDS), done.stdout
    for (gated, block_n, stages, half, tma_store, gather), report in zip(BUILDS, reports):
        assert report["shapes"] == sorted({block_n, block_n // 2} if half else {block_n}), report
        # gathered: 16-byte (0x10) cp.async copies, four a thread a step at each site that loads a step (the ring's
        # first fill, one a stage; in and after the K loop, once a tile variant, whole and half), each step waited
        # for with the younger steps left in flight, and 0 at the end; none otherwise
        sites = stages + 2 * (2 if half else 1)
        # TMA loads at each site: the W tile's boxes (gated: two halves, or four quarters with half tiles), and A's
        # unless gathered; pins the halves (each copy costs the K loop a CTA barrier)
        boxes = (4 if half else 2) if gated else 1
        assert report["tma_loads"] == sites * (boxes + (0 if gather else 1)), report
        assert (report["copies"], report["copy_waits"]) == ((4 * sites, [0, stages - 2]) if gather else (0, [])), report
        assert report["waits"] == [0, 1], report
        assert report["spills"] == [0, 0] and report["warnings"] == [], report
        assert report["shared"] == shared_bytes(block_n, stages, gated, half, tma_store) <= SHARED_LIMIT, report
        if gated and tma_store and not half and not gather:   # the gate/up pairing and the TMA store: no layout change
            assert report["converts"] == 0, report


# ---- on an sm_90 GPU with Triton 3.6 ------------------------------------------------------------------------

needs_gluon = pytest.mark.skipif(available(DEVICE) is not None, reason=f"the Gluon kernel: {available(DEVICE)}")


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(SEGMENTS))
@pytest.mark.parametrize("programs, block_n, stages, half_tiles, tma_store", [
    (1, 256, 4, False, False), (3, 256, 2, False, True), (7, 128, 3, True, False), (None, 256, 3, True, True),
    (None, 128, 4, False, True)])
@pytest.mark.parametrize("k", [64, 192, 576])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_the_kernel_against_its_reference_gpu(monkeypatch, case, programs, block_n, stages, half_tiles, tma_store, k,
                                              gated):
    """A few programs each walking many tiles (the ring's steps and barrier phases running on across tiles, K loops
    of 1, 3 and 9 steps, fewer steps than stages included) or one per SM; 128- and 256-row weight tiles (N = 512:
    gated, the up rows in the other half, 8 times the gate rows); half tiles interleaved with whole ones. Real rows
    within bf16 rounding of the reference; rows past rows_used keep what ``out`` held, and so do padding rows, but
    with the TMA store those of whole tiles, which it writes (the path, not only the values: a half tile's keep 7)."""
    from moe_kernels.kernels import _gluon_block_fp8_kernel as per_tile, _gluon_block_fp8_persistent as persistent

    monkeypatch.setattr(persistent, "PROGRAMS", programs)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(per_tile, "HALF_TILE_COUNTER", counter)
    x, w, m_indices, rows_used = segmented(SEGMENTS[case], seed=len(case) + k, k=k, n=512, device="cuda")
    width = 256 if gated else 512
    out = torch.full((x.shape[0], width), 7.0, device="cuda", dtype=torch.bfloat16)
    with record_launches() as launches:
        bf16_grouped(x, w, m_indices, rows_used, out=out, gated=gated, block_n=block_n, stages=stages,
                     half_tiles=half_tiles, tma_store=tma_store)
    assert [(s["block_n"], s["half_tiles"], s["tma_store"]) for name, s in launches if name == "gluon_bf16.gemm"] == [
        (block_n, half_tiles, tma_store)], launches
    want = bf16_grouped_reference(x, w, m_indices, gated=gated)
    real = m_indices >= 0
    assert rel_err(out[real].float(), want[real].float()) < 5e-3
    used = int(rows_used)
    assert bool((out[used:] == 7.0).all())
    tiles = m_indices[:used].view(-1, 128)
    half = tiles[:, 64] < 0 if half_tiles else torch.zeros(tiles.shape[0], dtype=torch.bool, device="cuda")
    # the path, not only the values: each half tile counted once per column tile
    assert int(counter) == int(half.sum()) * (width // (block_n // 2 if gated else block_n))
    kept = (out[:used].view(-1, 128, width) == 7.0).all(dim=-1)
    padding = tiles < 0
    if tma_store:   # whole tiles' padding rows written; half tiles' kept
        assert bool(kept[padding & half[:, None]].all()) and not bool(kept[padding & ~half[:, None]].any())
    else:
        assert bool(kept[padding].all())


def gathered_rows(m_indices, k, top_k, seed):
    """Tokens and the rows that read them: ``T`` random bf16 tokens, each real row of ``m_indices`` a distinct
    random assignment (several rows to a token: ``assignment // top_k``), padding rows ``T * top_k``; returns the
    tokens, ``row_assignments`` and the packed rows they stand for (padding rows zero)."""
    g = torch.Generator().manual_seed(seed)
    real = (m_indices >= 0).cpu().nonzero().flatten()
    num_tokens = -(-real.numel() // top_k) + 1   # (one token no row reads)
    tokens = torch.randn(num_tokens, k, generator=g).to(torch.bfloat16)
    assignments = torch.randperm(num_tokens * top_k, generator=g)[:real.numel()]
    row_assignments = torch.full((m_indices.numel(),), num_tokens * top_k, dtype=torch.int32)
    row_assignments[real] = assignments.to(torch.int32)
    packed = torch.zeros(m_indices.numel(), k, dtype=torch.bfloat16)
    packed[real] = tokens[assignments // top_k]
    return [t.to(m_indices.device) for t in (tokens, row_assignments, packed)]


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(SEGMENTS))
@pytest.mark.parametrize("programs, stages, half_tiles, tma_store", [
    (1, 3, False, True), (3, 2, False, False), (7, 3, True, False), (None, 4, False, True), (None, 4, False, False)])
@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_gathered_rows_give_the_packed_rows_product_gpu(monkeypatch, case, programs, stages, half_tiles, tma_store, k,
                                                        gated):
    """Each row read from its token (``row_assignments // top_k``, top-3: rows share tokens) by the kernel's
    ``cp.async`` copies gives bit for bit the product of the same rows packed, on every walk (a few programs each
    crossing many tiles, whose next tile's token rows are read a tile ahead; one a tile; K loops of one step, where
    the ring runs past the next tile, and of nine) and epilogue, and within bf16 rounding of the reference; the
    launch record says gathered."""
    from moe_kernels.kernels import _gluon_block_fp8_persistent as persistent

    if shared_bytes(256, stages, gated, half_tiles, tma_store) > SHARED_LIMIT:
        pytest.skip("this build does not fit in shared memory")
    monkeypatch.setattr(persistent, "PROGRAMS", programs)
    _, w, m_indices, rows_used = segmented(SEGMENTS[case], seed=len(case) + k, k=k, n=512, device="cuda")
    tokens, row_assignments, packed = gathered_rows(m_indices, k, top_k=3, seed=k)
    settings = dict(gated=gated, block_n=256, stages=stages, half_tiles=half_tiles, tma_store=tma_store)
    want = bf16_grouped(packed, w, m_indices, rows_used, **settings)
    with record_launches() as launches:
        got = bf16_grouped(tokens, w, m_indices, rows_used, row_assignments=row_assignments, top_k=3, **settings)
    assert [s["gathered"] for name, s in launches if name == "gluon_bf16.gemm"] == [True], launches
    real = m_indices >= 0
    assert torch.equal(got[real], want[real])
    if tma_store and not half_tiles:   # (whole tiles' padding rows written: gathered, they are zero rows' products)
        used = int(rows_used)
        assert bool((got[:used][~real[:used]] == 0).all())
    reference = bf16_grouped_reference(gathered_rows_reference(tokens, row_assignments, 3), w, m_indices, gated=gated)
    assert rel_err(got[real].float(), reference[real].float()) < 5e-3


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("change, says", [
    (dict(top_k=None), "'row_assignments' must come with top_k"), (dict(top_k=0), "'top_k' must be >= 1"),
    (dict(row_assignments="int64"), "'row_assignments' must have dtype"),
    (dict(row_assignments="short"), "'row_assignments' must have one entry per row of m_indices"),
    (dict(row_assignments="negative"), "'row_assignments' must hold no negative assignment"),
    (dict(tokens="odd stride"), "'x' must start on 16 bytes and have a row stride of a multiple of 8"),
    (dict(out="over the tokens"), "'out' must not share memory with x (the tokens the rows gather)")])
def test_bad_gathered_arguments_are_named_gpu(change, says):
    """A gathered call's own arguments, checked before the launch: ``top_k`` with ``row_assignments``, an int32 a
    row, none negative (a negative one would read before the tokens), tokens whose rows start on 16 bytes."""
    _, w, m_indices, rows_used = segmented([5, 130], seed=6, k=64, n=256, device="cuda")
    tokens, row_assignments, _ = gathered_rows(m_indices, 64, top_k=2, seed=6)
    top_k = change.get("top_k", 2)
    edits = {"int64": row_assignments.long(), "short": row_assignments[:-128], "negative": row_assignments.clone()}
    edits["negative"][0] = -1
    row_assignments = edits.get(change.get("row_assignments"), row_assignments)
    if change.get("tokens"):
        tokens = torch.zeros(tokens.shape[0], 68, device="cuda", dtype=torch.bfloat16)[:, :64]
    out = None
    if change.get("out"):   # (an output whose rows lie over the tokens past the first, which GEMM 1 still gathers)
        big = torch.zeros(m_indices.shape[0] + tokens.shape[0], 256, device="cuda", dtype=torch.bfloat16)
        tokens, out = big[m_indices.shape[0] - 1:, :64], big[:m_indices.shape[0], :128]
    with pytest.raises((ValueError, TypeError), match=re.escape("bf16_grouped: argument " + says)):
        bf16_grouped(tokens, w, m_indices, rows_used, row_assignments=row_assignments, top_k=top_k, out=out)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("group_m", [1, 3, 16])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_every_walk_order_gives_the_same_product_gpu(monkeypatch, group_m, gated):
    """The walk's group of M tiles (1, an odd 3 that leaves a short last group, 16: more than there are), on few
    programs: the same rows, whatever order the tiles come in; the launch record names the group, and the kernel is
    launched with it (the product alone would not show an order that never changed)."""
    from moe_kernels.kernels import _gluon_block_fp8_persistent as persistent, _gluon_bf16_persistent as kernel

    monkeypatch.setattr(persistent, "PROGRAMS", 5)
    real, groups = kernel._bf16_grouped_persistent_kernel, []

    class Spy:   # (the launch's GROUP, then the kernel itself)
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                groups.append(kwargs["GROUP"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernel, "_bf16_grouped_persistent_kernel", Spy())
    x, w, m_indices, rows_used = segmented(SEGMENTS["last tiles either side of 64 rows"], seed=group_m, k=192, n=512,
                                           device="cuda")
    with record_launches() as launches:
        out = bf16_grouped(x, w, m_indices, rows_used, gated=gated, tma_store=True, group_m=group_m)
    assert [s["group_m"] for name, s in launches if name == "gluon_bf16.gemm"] == [group_m], launches
    assert groups == [group_m]
    real = m_indices >= 0
    want = bf16_grouped_reference(x, w, m_indices, gated=gated)
    assert rel_err(out[real].float(), want[real].float()) < 5e-3


@pytest.mark.gpu
@needs_gluon
def test_no_rows_used_writes_nothing_gpu():
    """rows_used 0 (no tokens routed here): no tile is visited and ``out`` keeps what it held."""
    x, w, m_indices, rows_used = segmented([0, 0], seed=4, k=128, n=512, device="cuda")
    out = torch.full((x.shape[0], 512), 7.0, device="cuda", dtype=torch.bfloat16)
    bf16_grouped(x, w, m_indices, rows_used * 0, out=out, tma_store=True)
    assert bool((out == 7.0).all())


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("num_tokens", [1, 64, 600])
@pytest.mark.parametrize("half_tiles, d, tma1, one_pass, gather", [
    (False, 512, False, False, False), (True, 512, False, False, False), (False, 384, False, False, False),
    (False, 512, True, False, False), (True, 512, True, False, False), (False, 512, False, True, False),
    (True, 384, True, True, False), (False, 512, False, True, True), (True, 384, True, False, True)])
def test_the_permute_layout_on_the_bf16_kernel_gpu(monkeypatch, num_tokens, half_tiles, d, tma1, one_pass, gather):
    """permute_experts in bf16 with BF16_GEMM = "gluon" and 128-row segments: both GEMMs on the persistent kernel
    with the layout's tiles (d = 384: GEMM 2 on 128-row tiles; GEMM 1 storing by TMA too; the input in one pass,
    its padding rows never written; GEMM 1 gathering its rows from the tokens, with no scatter: every batch with
    BF16_GATHER_GEMM1_UP_TO_ROWS unbounded, none with it None),
    the result the Triton kernel's within bf16 rounding, and a CUDA graph captures the call."""
    from moe_kernels.kernels import permute as permute_module

    monkeypatch.setattr(permute_gluon, "BF16_GEMM", "gluon")
    monkeypatch.setattr(permute_gluon, "BF16_HALF_TILES", half_tiles)
    monkeypatch.setattr(permute_gluon, "BF16_TMA_STORE_GEMM1", tma1)
    monkeypatch.setattr(permute_gluon, "BF16_GATHER_GEMM1_UP_TO_ROWS", 10 ** 9 if gather else None)
    x, w1, w2, weights, ids = make_problem(num_tokens, 4, 2, d, 256, torch.bfloat16, seed=num_tokens)
    triton_out = permute_experts(x, w1, w2, weights, ids, align=128, gemm="triton")
    monkeypatch.setattr(permute_module, "ONE_PASS_BF16_INPUT", one_pass)
    torch.full((4096, d), float("nan"), device="cuda", dtype=torch.bfloat16)   # (freed: unwritten rows read NaN)
    with record_launches() as launches:
        got = permute_experts(x, w1, w2, weights, ids, align=128)
    assert [s["kernel"] for name, s in launches if name == "permute.bf16_gemm"] == ["gluon"], launches
    assert [s["quantize"] for name, s in launches if name == "quant_scatter"] == ([False] if one_pass and not gather
                                                                                  else [])
    assert [s["gathered"] for name, s in launches if name == "gluon_bf16.gemm"] == [gather, False]
    n2 = permute_gluon.BF16_TILES["down"][0] if d % 256 == 0 else 128
    n1, _ = permute_gluon.BF16_TILES["gate_up"]
    # GEMM 1's stages and store: 4 and TMA at 600 tokens (300 rows an expert), where they fit (gate_up_stages)
    stages1, store1 = permute_gluon.gate_up_stages(permute_gluon.BF16_TILES["gate_up"][1], num_tokens * 2, 4, n1)
    assert (stages1, store1) == ((4, not half_tiles) if num_tokens == 600 and not (half_tiles and tma1)
                                 else (permute_gluon.BF16_TILES["gate_up"][1], tma1))
    assert [(s["gated"], s["block_n"], s["stages"], s["half_tiles"], s["tma_store"]) for name, s in launches
            if name == "gluon_bf16.gemm"] == [(True, n1, stages1, half_tiles, store1),
                                              (False, n2, permute_gluon.BF16_TILES["down"][1] if d % 256 == 0
                                               else min(permute_gluon.BF16_TILES["down"][1] + 1, 4), half_tiles,
                                               permute_gluon.BF16_TMA_STORE)], launches
    assert rel_err(got.float(), triton_out.float()) < 1e-2
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    permute_experts(static, w1, w2, weights, ids, align=128)
    with torch.cuda.graph(graph):
        captured = permute_experts(static, w1, w2, weights, ids, align=128, validate_ids=False)
    graph.replay()
    assert torch.equal(captured, got)
