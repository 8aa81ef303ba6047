"""Where kernels run, whatever was imported first.

Triton's interpreter used to be chosen by ``TRITON_INTERPRET``, read when a function is decorated;
``torch._dynamo`` (torch.compile, transformers, lightning) imports Triton first, after which every
CPU kernel failed with "Cannot call @triton.jit'd outside of the scope of a kernel". The package
now picks the interpreter per kernel. Each case runs in a fresh interpreter, importing the other
library first, then runs a router, the alignment and a whole layer on the CPU.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
from unittest import mock
import torch

from moe_testing import ROOT

RUN_KERNELS = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("error", message="moe_kernels")   # no notice may appear: the interpreter works
    import torch
    import moe_kernels
    from moe_kernels import MoELayer, moe_align_block_size
    from moe_kernels.kernels.routing import fused_topk
    assert moe_kernels.BACKEND == "interpreter", moe_kernels.BACKEND
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    weights, ids = fused_topk(x, torch.randn(5, 16), 4, True)
    moe_align_block_size(ids, 16, 16)
    import dataclasses
    style = dataclasses.replace(moe_kernels.MODELS["deepseek-v3"], num_experts=32)   # its routing, fewer experts
    layer = MoELayer.random(style, hidden_size=32, intermediate_size=16, dtype=torch.float32, device="cpu", seed=0)
    err = float((layer(x).double() - layer.reference(x)).norm() / layer.reference(x).norm())
    assert err < 1e-5, err
    print("kernels ran")
    """
)

# (torch.compile imports torch._dynamo itself, so a separate torch._dynamo case adds nothing.)
FIRST_IMPORTS = {
    "triton": "import triton, triton.language",
    "torch.compile": "import torch\ntorch.compile(lambda t: t + 1)",
    "transformers": "import transformers\nimport transformers.models.qwen3_moe.modeling_qwen3_moe",
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile; the interpreter is the CPU path")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the interpreter is Triton's)")
@pytest.mark.parametrize("first", sorted(FIRST_IMPORTS))
def test_kernels_run_whatever_was_imported_first(first):
    if first == "transformers" and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    env_free = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    code = FIRST_IMPORTS[first] + "\n" + RUN_KERNELS
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env_free,
                          timeout=600)
    assert proc.returncode == 0 and "kernels ran" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_a_broken_interpreter_falls_back_with_one_notice():
    """If the interpreter cannot run here, every function runs its torch reference, and the
    package says so once: never a crash."""
    code = textwrap.dedent(
        """
        import warnings, torch
        from triton.runtime import interpreter
        def broken(self, *args, **kwargs):
            raise RuntimeError("interpreter unavailable (simulated)")
        interpreter.GridExecutor.__call__ = broken
        import moe_kernels
        from moe_kernels import MoELayer
        warnings.simplefilter("always")
        layer = MoELayer.random("qwen3-30b-a3b", hidden_size=32, intermediate_size=16, dtype=torch.float32,
                                device="cpu", seed=0)
        x = torch.randn(3, 32)
        for _ in range(2):
            err = float((layer(x).double() - layer.reference(x)).norm() / layer.reference(x).norm())
            assert err < 1e-5, err
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    notices = [line for line in proc.stderr.splitlines() if "failed its self-test" in line]
    assert len(notices) == 1, proc.stderr



# ---- the launch shortcut (moe_kernels._launch) -----------------------------------------------------


def test_launch_key_errs_on_the_side_of_more():
    """Whatever can change Triton's specialisation changes the key; unknown types are refused."""
    from moe_kernels._launch import _Uncacheable, argument_key

    base = torch.zeros(64)
    assert argument_key(base, False) != argument_key(base[1:], False)            # 16-byte alignment
    assert argument_key(base, False) != argument_key(base.half(), False)         # dtype
    assert len({argument_key(v, False) for v in (1, 2, 16, 2**31, 2**63)}) == 5   # by value (finer than Triton)
    assert argument_key(True, False) != argument_key(1, False)
    assert argument_key("a", False) != argument_key("b", False)
    assert argument_key(0.5, False) == argument_key(2.0, False)                  # floats are not specialised
    with pytest.raises(_Uncacheable):
        argument_key(object(), False)


def test_launch_key_takes_a_constexpr_by_value():
    """A tile size is part of the binary: BLOCK_M 64 and 128 are two kernels, although both are
    multiples of 16 (the bug that once ran a 64-row kernel on a 128-row block map)."""
    pytest.importorskip("triton")
    import triton.language as tl

    from moe_kernels._launch import argument_key, cached_launch_kernel_class

    assert argument_key(64, True) != argument_key(128, True)
    assert argument_key(1, True) != argument_key(True, True)
    assert argument_key(0.0, True) != argument_key(-0.0, True)          # equal in Python, two kernels
    assert argument_key((1,), True) != argument_key((True,), True)

    def probe(x_ptr, n, BLOCK_M: tl.constexpr, FLAG: tl.constexpr = False):
        pass

    compiled_kernel = cached_launch_kernel_class()(probe)
    assert compiled_kernel._constexpr == [False, False, True, True]
    assert compiled_kernel._defaults == {"FLAG": False}
    # How a call site's arguments map onto the parameters (worked out once per site):
    # (keyword parameters in order, defaults needed, launch options, constexpr and runtime positions).
    assert compiled_kernel._call_shape(2, ("BLOCK_M",)) == (("BLOCK_M", "FLAG"), True, (), [2, 3], [0, 1])
    assert compiled_kernel._call_shape(2, ("FLAG", "num_warps", "BLOCK_M")) == (
        ("BLOCK_M", "FLAG"), False, ("num_warps",), [2, 3], [0, 1])
    assert compiled_kernel._call_shape(1, ("x_ptr", "BLOCK_M")) is None   # a positional one named again
    assert compiled_kernel._call_shape(2, ("FLAG",)) is None              # BLOCK_M missing: Triton says so


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_launch_shortcut_keeps_one_kernel_per_tile_and_alignment():
    """Two configs that differ only in constexpr tile sizes, launched alternately (each launch
    after the first takes the shortcut), both give the reference's answer; a misaligned input gets
    a kernel of its own."""
    from moe_kernels.kernels.combine import _moe_sum_kernel, sum_slots
    from moe_kernels.kernels.config import GemmTiles, MoEConfig
    from moe_kernels.kernels.index_gather import _index_gather_gemm_kernel, fused_experts
    from moe_kernels.reference import moe_reference

    torch.manual_seed(0)
    t, e, k, d, f = 40, 8, 2, 256, 128
    x = torch.randn(t, d, device="cuda", dtype=torch.float16)
    w1 = torch.randn(e, 2 * f, d, device="cuda", dtype=torch.float16) / d**0.5
    w2 = torch.randn(e, d, f, device="cuda", dtype=torch.float16) / f**0.5
    ids = torch.randint(0, e, (t, k), device="cuda", dtype=torch.int32)
    weights = torch.rand(t, k, device="cuda")
    want = moe_reference(x, w1, w2, weights, ids)
    configs = [MoEConfig(block_m, GemmTiles(block_n, 64, 1, 4, 3), GemmTiles(block_n, 64, 1, 4, 3))
               for block_m, block_n in ((16, 64), (64, 128))]
    _index_gather_gemm_kernel._compiled.clear()
    for _ in range(3):
        for config in configs:
            got = fused_experts(x, w1, w2, weights, ids, config=config, naive_block_assignment=False)
            err = float((got.double() - want).norm() / want.norm())
            assert err < 2e-3, (config, err)
    assert len(_index_gather_gemm_kernel._compiled) >= 2 * 2   # two GEMMs x two tile sets, at least

    if not type(_moe_sum_kernel).shortcut:
        pytest.skip("the launch shortcut is off (MOE_KERNELS_LAUNCH_SHORTCUT=0 or another Triton)")
    _moe_sum_kernel._compiled.clear()
    with mock.patch.object(_moe_sum_kernel, "run", wraps=_moe_sum_kernel.run) as triton_path:
        z = torch.randn(5, 3, 64, device="cuda")
        assert torch.allclose(sum_slots(z), z.sum(1), atol=1e-5)
        for _ in range(3):
            z = torch.randn_like(z)
            assert torch.allclose(sum_slots(z), z.sum(1), atol=1e-5)
        assert triton_path.call_count == 1 and len(_moe_sum_kernel._compiled) == 1   # then the shortcut
        y = torch.randn(5 * 3 * 64 + 1, device="cuda")[1:].view(5, 3, 64)   # 4 bytes off a 16-byte boundary
        assert torch.allclose(sum_slots(y), y.sum(1), atol=1e-6)
        assert triton_path.call_count == 2 and len(_moe_sum_kernel._compiled) == 2
