"""moe_kernels.kernels.quant_scatter: each token quantised once, its fp8 row and scales at each of its slots (and,
unquantised, its row at each of its slots: scatter_rows)."""
import pytest
import torch

from moe_kernels._runtime import HAS_TRITON, record_launches
from moe_kernels.kernels import quant
from moe_kernels.kernels.permute import permute
from moe_kernels.kernels.quant import per_token_group_quant_fp8
from moe_kernels.kernels.quant_scatter import (quantize_scatter, quantize_scatter_reference, scatter_rows,
                                               scatter_rows_reference)
from moe_testing import DEVICE, ON_GPU, compiled_for_hopper, exact_fp8_inputs, needs_gpu, random_topk_ids


def per_slot_expectation(x, src2dst, num_rows, group):
    """Token by token, slot by slot, in float64: the fp8 row each routed slot must hold and its scales."""
    rows = {}
    for t in range(x.shape[0]):
        g = x[t].double().view(-1, group)
        scale = (g.abs().amax(1).clamp_min(1e-10) / 448).float()
        q = (g / scale.double()[:, None]).clamp(-448, 448).float().to(torch.float8_e4m3fn).view(-1)
        for dst in src2dst[t].tolist():
            if dst >= 0:
                assert dst not in rows and dst < num_rows
                rows[dst] = (q, scale)
    return rows


CASES = {   # name: tokens, experts, k, d, group
    "no tokens": (0, 4, 2, 256, 128),
    "one token": (1, 4, 2, 256, 128),
    "k = 1": (9, 5, 1, 384, 128),
    "k = E": (7, 3, 3, 256, 128),
    "all on one expert": (12, 1, 1, 256, 128),
    "more groups than a program's": (5, 6, 2, 128 * 11, 128),
    "groups of 64": (6, 4, 2, 192, 64),
}


def _routed(case, generator, exact):
    t, e, k, d, group = CASES[case]
    x = exact_fp8_inputs(t, d, group, generator) if exact else torch.randn(t, d, generator=generator)
    ids = random_topk_ids(generator, t, e, k) if t else torch.zeros(0, k, dtype=torch.int64)
    return x, ids, e, group


def _check_against_slots(x, src2dst, rows, scales, group):
    """Every routed slot holds its token's row and scales: the float64 expectation here; on a GPU the quantiser
    kernel's own bits (it divides by 448 and by the scale with div.full.f32, within 2 ulp of float64's
    division: the same arithmetic as this kernel, not the same numbers as float64)."""
    if ON_GPU:
        q_all, s_all = per_token_group_quant_fp8(x.to(DEVICE), group)
        want = {dst: (q_all[t].cpu(), s_all[t].cpu()) for t, slots in enumerate(src2dst.tolist())
                for dst in slots if dst >= 0}
    else:
        want = per_slot_expectation(x.cpu(), src2dst.cpu(), rows.shape[0], group)
    for dst, (q, scale) in want.items():
        assert torch.equal(scales[dst].cpu(), scale)
        assert torch.equal(rows[dst].cpu().view(torch.uint8), q.view(torch.uint8))
    return want


@pytest.mark.parametrize("case", CASES)
def test_each_slot_holds_its_token_quantised(case):
    """The call as it runs here (on the CPU its torch path, on a GPU the kernel) against the per-slot expectation."""
    x, ids, e, group = _routed(case, torch.Generator().manual_seed(1), exact=False)
    p = permute(x.to(DEVICE), ids.to(DEVICE), e, align=16, copy=False)
    rows, scales = quantize_scatter(x.to(DEVICE), p.src2dst, p.m_indices.shape[0], group=group)
    assert rows.dtype == torch.float8_e4m3fn and scales.shape == (p.m_indices.shape[0], x.shape[1] // group)
    assert len(_check_against_slots(x, p.src2dst, rows, scales, group)) == int((p.src2dst >= 0).sum())


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the kernel under the interpreter)")
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_on_values_that_quantise_exactly(case, monkeypatch):
    """The kernel itself (its indexing, masks, slots), under the interpreter too, on values whose
    quantisation is exact; the reference leaves unwritten rows at zero and scale 1."""
    monkeypatch.setattr(quant, "INTERPRETER_ROUNDS_FP8_WRONGLY", False)
    x, ids, e, group = _routed(case, torch.Generator().manual_seed(2), exact=True)
    x, ids = x.to(DEVICE), ids.to(DEVICE)
    p = permute(x, ids, e, align=16, copy=False)
    with record_launches() as launches:
        rows, scales = quantize_scatter(x, p.src2dst, p.m_indices.shape[0], group=group)
    if x.shape[0]:
        assert [name for name, _ in launches] == ["quant_scatter"]
    _check_against_slots(x, p.src2dst, rows, scales, group)
    ref_rows, ref_scales = quantize_scatter_reference(x, p.src2dst, p.m_indices.shape[0], group=group)
    routed = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    routed[p.src2dst[p.src2dst >= 0].long()] = True
    if not ON_GPU:   # (the torch reference divides exactly; on a GPU the kernels' div.full may differ by an ulp)
        assert torch.equal(rows[routed].view(torch.uint8), ref_rows[routed].view(torch.uint8))
        assert torch.equal(scales[routed], ref_scales[routed])
    assert bool((ref_rows[~routed].float() == 0).all() and (ref_scales[~routed] == 1).all())


def test_a_slot_routed_nowhere_is_skipped(monkeypatch):
    """src2dst = -1 (an id out of range) writes nothing; the token's other slot is still written."""
    monkeypatch.setattr(quant, "INTERPRETER_ROUNDS_FP8_WRONGLY", False)
    x = exact_fp8_inputs(2, 128, 128, torch.Generator().manual_seed(3)).to(DEVICE)
    src2dst = torch.tensor([[2, -1], [0, 1]], dtype=torch.int32, device=DEVICE)
    rows, scales = quantize_scatter_reference(x, src2dst, 4)
    got_rows, got_scales = quantize_scatter(x, src2dst, 4)
    assert len(_check_against_slots(x, src2dst, got_rows, got_scales, 128)) == 3
    assert bool((rows[3].float() == 0).all() and (scales[3] == 1).all())   # (the reference: row 3 unwritten)


@pytest.mark.parametrize("change, name", [
    (dict(x=torch.zeros(2, 3, 4)), "x"),
    (dict(x=torch.zeros(2, 200)), "x"),
    (dict(x=torch.zeros(2, 256, dtype=torch.int32)), "x"),
    (dict(src2dst=torch.zeros(3, 2, dtype=torch.int32)), "src2dst"),
    (dict(src2dst=torch.zeros(2, 2, dtype=torch.int64)), "src2dst"),
    (dict(num_rows=-1), "num_rows"),
    (dict(group=64, x=torch.zeros(2, 288)), "x"),
    (dict(group=8), "group"),
    (dict(group=96, x=torch.zeros(2, 192)), "group"),
])
def test_bad_arguments_are_named(change, name):
    args = dict(x=torch.zeros(2, 256), src2dst=torch.zeros(2, 2, dtype=torch.int32), num_rows=4, group=128)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=name):
        quantize_scatter(args.pop("x"), args.pop("src2dst"), args.pop("num_rows"), **args)


@needs_gpu
@pytest.mark.parametrize("num_tokens, d", [(1, 7168), (37, 2048), (512, 7168)])
def test_bit_for_bit_the_three_step_path_gpu(num_tokens, d):
    """bf16 activations at the models' widths: every routed row equals the quantiser's row of its token
    (the same bits), and its scales."""
    g = torch.Generator("cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, d, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    ids = torch.randint(0, 256, (num_tokens, 8), device="cuda", generator=g)
    p = permute(x, ids, 256, align=128, copy=False)
    with record_launches() as launches:
        rows, scales = quantize_scatter(x, p.src2dst, p.m_indices.shape[0])
    assert [name for name, _ in launches] == ["quant_scatter"]
    q, s = per_token_group_quant_fp8(x, 128)
    dst = p.src2dst.flatten().long()
    tokens = torch.arange(dst.numel(), device="cuda") // 8
    assert torch.equal(rows[dst].view(torch.uint8), q[tokens].view(torch.uint8))
    assert torch.equal(scales[dst], s[tokens])


_COMPILE_FOR_HOPPER = """
import torch
torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
from moe_kernels.kernels import quant_scatter
from moe_kernels.sm90_compile import compile_for_sm90
for topk in (1, 8):
    compile_for_sm90(quant_scatter._quant_scatter_kernel, dict(TOPK=topk, GROUP=128, BLOCK_G=quant_scatter.BLOCK_G,
                                                               QUANTIZE=True),
                     dict(x_ptr="*bf16", src2dst_ptr="*i32", q_ptr="*fp8e4nv", s_ptr="*fp32"),
                     aligned=("stride_x", "stride_q"), num_warps=4)
    print(topk, "built")
ptx = compile_for_sm90(quant_scatter._quant_scatter_kernel, dict(TOPK=8, GROUP=128, BLOCK_G=quant_scatter.BLOCK_G,
                                                                 QUANTIZE=False, s_ptr=None),
                       dict(x_ptr="*bf16", src2dst_ptr="*i32", q_ptr="*bf16"), aligned=("stride_x", "stride_q"),
                       num_warps=4).asm["ptx"]
print("unquantised built", "cvt.rn.satfinite.e4m3x2" in ptx, "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx)
"""


def test_the_kernel_builds_for_hopper():
    """Triton 3.6 (CI) builds the kernel for sm_90 with one slot and with DeepSeek-V3's eight."""
    lines = compiled_for_hopper(_COMPILE_FOR_HOPPER)
    assert lines[:2] == ["1 built", "8 built"], lines
    # unquantised (scatter_rows): no fp8 conversion, 16-byte loads
    assert lines[2] == "unquantised built False True", lines


@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_the_permute_layout_gives_the_same_output_with_its_input_in_one_pass(monkeypatch, num_tokens):
    """permute_experts on block-fp8 weights with permute.ONE_PASS_FP8_INPUT: the same rows and scales reach
    the GEMMs (the real rows' bits), so the same output bit for bit; the launch record says which path ran."""
    from moe_kernels.kernels import permute as permute_module
    from moe_kernels.kernels.formats import FORMATS
    from moe_testing import make_problem

    x, w1, w2, weights, ids = make_problem(num_tokens, 4, 2, 256, 128, torch.float32, seed=num_tokens)
    w1q, w1s = FORMATS["block"].quantize_weight(w1)
    w2q, w2s = FORMATS["block"].quantize_weight(w2)
    outputs, calls = {}, []
    monkeypatch.setattr(permute_module, "quantize_scatter", lambda *a, **k: calls.append(1) or quantize_scatter(*a, **k))
    for one_pass in (False, True):
        monkeypatch.setattr(permute_module, "ONE_PASS_FP8_INPUT", one_pass)
        outputs[one_pass] = permute_module.permute_experts(x, w1q, w2q, weights, ids, align=16, w1_scale=w1s,
                                                           w2_scale=w2s)
        assert len(calls) == int(one_pass)   # the path, not only the value
    assert torch.equal(outputs[True], outputs[False])


@pytest.mark.parametrize("case", sorted(c for c, (_, _, _, d, _) in CASES.items() if d % 128 == 0))
def test_scatter_rows_puts_each_token_at_each_of_its_slots(case):
    """scatter_rows (the kernel without its quantiser; under the interpreter too): each routed slot holds its
    token's row exactly, in the input's dtype; a slot of -1 is skipped; the launch record says which kernel ran."""
    t, e, k, d, _ = CASES[case]
    g = torch.Generator().manual_seed(t + d)
    dtype = torch.bfloat16 if ON_GPU else torch.float16   # (the interpreter: no bf16)
    x = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    ids = (random_topk_ids(g, t, e, k) if t else torch.zeros(0, k, dtype=torch.int64)).to(DEVICE)
    p = permute(x, ids, e, align=16, copy=False)
    src2dst = p.src2dst.clone()
    if t:
        src2dst[0, -1] = -1   # (an id out of range: routed nowhere)
    with record_launches() as launches:
        rows = scatter_rows(x, src2dst, p.m_indices.shape[0])
    assert rows.dtype == dtype and tuple(rows.shape) == (p.m_indices.shape[0], d)
    if t and HAS_TRITON:
        assert [(name, s["quantize"]) for name, s in launches] == [("quant_scatter", False)]
    written = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    for token, slots in enumerate(src2dst.tolist()):   # token by token, slot by slot
        for dst in slots:
            if dst >= 0:
                assert torch.equal(rows[dst], x[token])
                written[dst] = True
    reference = scatter_rows_reference(x, src2dst, rows.shape[0])   # (unwritten rows: zeros)
    assert torch.equal(rows[written], reference[written]) and bool((reference[~written] == 0).all())


def test_scatter_rows_names_bad_arguments():
    with pytest.raises(ValueError, match="scatter_rows: argument 'x' must have a multiple of group=128 columns"):
        scatter_rows(torch.zeros(2, 192), torch.zeros(2, 2, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="scatter_rows: argument 'src2dst'"):
        scatter_rows(torch.zeros(2, 256), torch.zeros(3, 2, dtype=torch.int32), 4)


@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_the_permute_layout_gives_the_same_output_with_its_bf16_input_in_one_pass(monkeypatch, num_tokens):
    """permute_experts on unquantised weights with permute.ONE_PASS_BF16_INPUT: the same rows reach the GEMMs, so
    the same output bit for bit (float32 here; the GEMMs do not see how the rows were copied); the launch
    record says which path ran."""
    from moe_kernels.kernels import permute as permute_module
    from moe_testing import make_problem

    x, w1, w2, weights, ids = make_problem(num_tokens, 4, 2, 256, 128, torch.float32, seed=num_tokens)
    outputs, calls = {}, []
    monkeypatch.setattr(permute_module, "scatter_rows", lambda *a, **k: calls.append(1) or scatter_rows(*a, **k))
    for one_pass in (False, True):
        monkeypatch.setattr(permute_module, "ONE_PASS_BF16_INPUT", one_pass)
        outputs[one_pass] = permute_module.permute_experts(x, w1, w2, weights, ids, align=16)
        assert len(calls) == int(one_pass)   # the path, not only the value
    assert torch.equal(outputs[True], outputs[False])
