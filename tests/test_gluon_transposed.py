"""The transposed Gluon grouped GEMM for decode (moe_kernels.kernels.gluon_transposed), bf16 here (its fp8
path is block_fp8_grouped's, tested in test_gluon_block_fp8.py): its torch reference against float64, its
argument checks, where it refuses to run, the permute layout's switch (permute_gluon.BF16_GEMM); on an sm_90
GPU with Triton 3.6, the kernel against its reference and inside permute_experts."""

from __future__ import annotations

import pytest
import torch

from moe_kernels._runtime import HAS_TRITON, record_launches
from moe_kernels.kernels import permute_gluon
from moe_kernels.kernels.gluon_block_fp8 import available
from moe_kernels.kernels.gluon_transposed import grouped_transposed, grouped_transposed_reference
from moe_kernels.kernels.permute import permute_experts
from moe_testing import DEVICE, make_problem, rel_err, segment_indices

# (tokens per expert in segments of block_t rows: 0 is an empty expert; a trailing tile of padding)
CASES = {"one token": [1], "an empty expert": [3, 0, 17], "a full tile": [0, 16, 64],
         "several tiles per expert": [40, 1, 70, 9]}


def segmented(counts, seed, align, k=128, n=256, device="cpu"):
    """bf16 operands for experts with ``counts`` rows each, segments rounded up to ``align`` rows, and
    ``rows_used`` (every segment, not the trailing tile). The up half of N is 8 times the gate half."""
    g = torch.Generator().manual_seed(seed)
    m_indices = segment_indices(counts, align)
    w = torch.randn(len(counts), n, k, generator=g) / 16
    w[:, n // 2:] *= 8
    x = torch.randn(m_indices.numel(), k, generator=g)
    rows_used = torch.tensor([m_indices.numel() - align], dtype=torch.int32)
    return [t.to(device) for t in (x.to(torch.bfloat16), w.to(torch.bfloat16), m_indices, rows_used)]


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_against_float64(case, gated):
    """Each expert's rows: the product in float64 (gated: then silu(gate) * up), rounded to bf16; padding zero."""
    x, w, m_indices, _ = segmented(CASES[case], seed=len(case), align=16)
    out = grouped_transposed_reference(x, w, m_indices, gated=gated)
    assert out.shape == (x.shape[0], 128 if gated else 256)
    for r, e in enumerate(m_indices.tolist()):
        want = x[r].double() @ w[e].double().T if e >= 0 else torch.zeros(256, dtype=torch.float64)
        if gated:
            want = want[:128] * torch.sigmoid(want[:128]) * want[128:]
        assert torch.allclose(out[r].double(), want, rtol=1e-2, atol=1e-3), (case, r, e)


def test_it_refuses_where_it_cannot_run():
    x, w, m_indices, rows_used = segmented([3], seed=1, align=16)
    assert available("cpu") is not None
    with pytest.raises(ValueError, match=r"argument 'w' must be on a device this kernel runs on \(needs"):
        grouped_transposed(x, w, m_indices, rows_used)


@pytest.mark.parametrize("settings, name", [(dict(block_t=8), "block_t"), (dict(block_t=128), "block_t"),
                                            (dict(stages=1), "stages"), (dict(stages=7), "stages"),
                                            (dict(gated=1), "gated"), (dict(validate_ids="no"), "validate_ids"),
                                            (dict(quantize_output=1), "quantize_output"),
                                            (dict(quantize_output=True, gated=True), "quantize_output")])
def test_bad_settings_are_named(settings, name):
    x, w, m_indices, rows_used = segmented([3], seed=1, align=16)
    with pytest.raises((ValueError, TypeError), match=f"argument '{name}'"):
        grouped_transposed(x, w, m_indices, rows_used, **settings)


@pytest.mark.parametrize("change, name", [
    (lambda a: {**a, "rows_used": torch.zeros(2, dtype=torch.int32)}, "rows_used"),
    (lambda a: {**a, "rows_used": torch.zeros(1, dtype=torch.int64)}, "rows_used"),
])
def test_bad_rows_used_is_named(change, name):
    x, w, m_indices, rows_used = segmented([3], seed=1, align=16)
    args = change(dict(rows_used=rows_used))
    with pytest.raises((ValueError, TypeError), match=f"argument '{name}'"):
        grouped_transposed(x, w, m_indices, args["rows_used"])


@pytest.mark.parametrize("change, name", [
    (lambda a: {**a, "x": a["x"].float()}, "x"),
    (lambda a: {**a, "x": a["x"][:, :96].contiguous(), "w": a["w"][:, :, :96].contiguous()}, "x"),   # (K = 96)
    (lambda a: {**a, "x": a["x"][:8], "m_indices": a["m_indices"][:8]}, "x"),   # (not whole 16-row tiles)
    (lambda a: {**a, "x_scale": torch.ones(32, 1)}, "x_scale"),       # (bf16: no scales)
    (lambda a: {**a, "m_indices": torch.where(a["m_indices"] == 0, 1, a["m_indices"])}, "m_indices"),  # E = 1
])
def test_bad_arguments_are_named(change, name):
    """The bf16 checks (gluon_block_fp8._check with bf16 dtypes, on tiles of block_t rows) before any launch."""
    from moe_kernels.kernels import gluon_block_fp8

    x, w, m_indices, _ = segmented([3], seed=2, align=16)
    a = change(dict(x=x, w=w, m_indices=m_indices, x_scale=None))
    with pytest.raises((ValueError, TypeError), match=f"argument '{name}'"):
        gluon_block_fp8._check("grouped_transposed", a["x"], a["x_scale"], a["w"], None, a["m_indices"], None, 128,
                               tile_m=16, dtype=torch.bfloat16)


def test_k_of_a_multiple_of_64_and_n_of_128_pass_in_bf16():
    """bf16 takes K steps of 64 and, gated, 64 gate and 64 up rows a tile: K = 192 and F = 192 (N = 384) pass
    the checks that fp8 (K steps and scale blocks of 128) would refuse."""
    from moe_kernels.kernels import gluon_block_fp8

    x, w, m_indices, _ = segmented([3], seed=2, align=16, k=192, n=384)
    gluon_block_fp8._check("grouped_transposed", x, None, w, None, m_indices, None, 128, gated=True, tile_m=16,
                           dtype=torch.bfloat16)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_switch_falls_back_to_triton_and_says_why(monkeypatch):
    """permute_gluon.BF16_GEMM = "gluon" where the kernel cannot run (this machine: no Gluon) takes the Triton
    kernel, same result, reason recorded."""
    x, w1, w2, weights, ids = make_problem(9, 4, 2, 256, 128, torch.float32, seed=3)
    want = permute_experts(x, w1, w2, weights, ids, align=16)
    monkeypatch.setattr(permute_gluon, "BF16_GEMM", "gluon")
    with record_launches() as launches:
        got = permute_experts(x, w1, w2, weights, ids, align=16)
    assert torch.equal(got, want)
    if HAS_TRITON:
        chosen = [s for name, s in launches if name == "permute.bf16_gemm"]
        assert len(chosen) == 1 and chosen[0]["kernel"] == "triton", launches
        assert chosen[0]["refused"] == (available(x.device) or "weights not bf16"), launches
    monkeypatch.setattr(permute_gluon, "BF16_GEMM", "triton")   # (the argument over the switch)
    with record_launches() as launches:
        assert torch.equal(permute_experts(x, w1, w2, weights, ids, align=16, gemm="gluon"), want)
    if HAS_TRITON:
        assert [s["refused"] for name, s in launches if name == "permute.bf16_gemm"] == [chosen[0]["refused"]]
    with pytest.raises(ValueError, match="permute_experts: argument 'gemm' must be 'triton' or 'gluon', got 'cuda'"):
        permute_experts(x, w1, w2, weights, ids, align=16, gemm="cuda")
    monkeypatch.setattr(permute_gluon, "BF16_GEMM", "glucon")
    with pytest.raises(ValueError, match="'BF16_GEMM' must be 'triton' or 'gluon', got 'glucon'"):
        permute_experts(x, w1, w2, weights, ids, align=16)


# ---- on an sm_90 GPU with Triton 3.6 ------------------------------------------------------------------------

needs_gluon = pytest.mark.skipif(available(DEVICE) is not None, reason=f"the Gluon kernel: {available(DEVICE)}")


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_t", [16, 32, 64])
@pytest.mark.parametrize("programs, stages, warps", [(1, 2, None), (3, 6, None), (None, 6, None), (3, 4, 8)])
@pytest.mark.parametrize("k", [64, 192, 576])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_the_kernel_against_its_reference_gpu(monkeypatch, case, block_t, programs, stages, warps, k, gated):
    """bf16 tiles of 128 weight rows by block_t tokens: K loops of 1, 3 and 9 steps of 64, few programs walking
    many tiles or one per SM, the kernel's warps and 8; padding rows and rows past rows_used untouched (N =
    512: the gated tile's up rows 8 times its gate rows, in another half of w)."""
    from moe_kernels.kernels import _gluon_transposed as transposed

    monkeypatch.setattr(transposed, "PROGRAMS", programs)
    monkeypatch.setattr(transposed, "NUM_WARPS", warps)
    x, w, m_indices, rows_used = segmented(CASES[case], seed=len(case) + k, align=block_t, k=k, n=512,
                                           device="cuda")
    out = torch.full((x.shape[0], 256 if gated else 512), 7.0, device="cuda", dtype=torch.bfloat16)
    with record_launches() as launches:
        grouped_transposed(x, w, m_indices, rows_used, gated=gated, block_t=block_t, stages=stages, out=out)
    assert [(s["format"], s["block_t"]) for name, s in launches if name == "gluon_transposed.gemm"] == [
        ("bf16", block_t)], launches
    want = grouped_transposed_reference(x, w, m_indices, gated=gated)
    real = m_indices >= 0
    assert rel_err(out[real].float(), want[real].float()) < 5e-3
    assert bool((out[~real] == 7.0).all())


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("num_tokens, align", [(1, 16), (8, 16), (64, 16), (64, 32), (200, 64)])
@pytest.mark.parametrize("via", ["switch", "argument"])
def test_the_permute_layout_at_decode_on_the_transposed_kernel_gpu(monkeypatch, num_tokens, align, via):
    """permute_experts in bf16 with BF16_GEMM = "gluon" (or gemm="gluon") and segments of 16-64 rows: both GEMMs
    on the transposed kernel (the launch record says so), the result the Triton kernel's within bf16 rounding,
    and a CUDA graph captures the call."""
    x, w1, w2, weights, ids = make_problem(num_tokens, 4, 2, 256, 128, torch.bfloat16, seed=num_tokens)
    triton_out = permute_experts(x, w1, w2, weights, ids, align=align)
    asked = {"gemm": "gluon"} if via == "argument" else {}
    if not asked:
        monkeypatch.setattr(permute_gluon, "BF16_GEMM", "gluon")
    with record_launches() as launches:
        got = permute_experts(x, w1, w2, weights, ids, align=align, **asked)
    assert [s["kernel"] for name, s in launches if name == "permute.bf16_gemm"] == ["gluon"], launches
    assert [(s["gated"], s["block_t"]) for name, s in launches if name == "gluon_transposed.gemm"] == [
        (True, align), (False, align)], launches
    assert rel_err(got.float(), triton_out.float()) < 1e-2
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    permute_experts(static, w1, w2, weights, ids, align=align, **asked)
    with torch.cuda.graph(graph):
        captured = permute_experts(static, w1, w2, weights, ids, align=align, validate_ids=False, **asked)
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.gpu
@needs_gluon
def test_the_switch_refuses_what_the_kernel_cannot_take_gpu(monkeypatch):
    """bf16 segments of 48 rows (no Gluon kernel for them) and fp16 weights go to the Triton kernel, the launch
    record saying why."""
    monkeypatch.setattr(permute_gluon, "BF16_GEMM", "gluon")
    for dtype, align, reason in ((torch.bfloat16, 48, "segments of 48 rows, not 16, 32, 64, 128"),
                                 (torch.float16, 16, "weights not bf16")):
        x, w1, w2, weights, ids = make_problem(20, 4, 2, 256, 128, dtype, seed=5)
        with record_launches() as launches:
            permute_experts(x, w1, w2, weights, ids, align=align)
        chosen = [s for name, s in launches if name == "permute.bf16_gemm"]
        assert chosen[0]["kernel"] == "triton" and reason in chosen[0]["refused"], launches
