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

FIRST_IMPORTS = {
    "triton": "import triton, triton.language",
    "torch._dynamo": "import torch._dynamo",
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

