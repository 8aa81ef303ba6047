"""What the kernel tests share: the device, tolerances, skip markers and random MoE problems.

Plain functions and constants; fixtures live in ``conftest.py``. Test files import them with
``from moe_testing import ...`` (pytest puts ``tests/`` on ``sys.path``: it has no ``__init__.py``).

>>> hidden, w1, w2, topk_weights, topk_ids = make_problem(3, 4, 2, seed=0)
>>> [tuple(t.shape) for t in (hidden, w1, w2, topk_weights, topk_ids)]
[(3, 32), (4, 32, 32), (4, 32, 16), (3, 2), (3, 2)]
>>> bool((topk_ids.sort(dim=1).values.diff(dim=1) > 0).all())  # distinct experts per token
True
>>> rel_err(hidden, hidden.double())
0.0
"""

import math
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_kernels._runtime import default_device
from moe_kernels.kernels.config import GemmTiles, MoEConfig

DEVICE = default_device()
ON_GPU = DEVICE.type == "cuda"
# Relative error allowed against the float64 reference, by the dtype the kernel computes in.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def needs_gpu(test):
    """A GPU-only test: marked ``gpu`` (``pytest -m gpu`` selects the GPU suite) and skipped
    without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


# Tiles small enough that the interpreter-sized problems still span several of them.
SMALL_TILES = MoEConfig(16, GemmTiles(16, 16, 1, 4, 2), GemmTiles(16, 16, 1, 4, 2))

# The layouts' edge cases, as make_problem arguments.
EDGE_SHAPES = {
    "one token": dict(num_tokens=1, num_experts=4, topk=2),
    "one expert": dict(num_tokens=5, num_experts=1, topk=1),
    "k=1": dict(num_tokens=9, num_experts=5, topk=1),
    "k=E": dict(num_tokens=6, num_experts=4, topk=4),
    "several tiles per expert": dict(num_tokens=40, num_experts=2, topk=1),
}


def random_topk_ids(generator, num_tokens, num_experts, topk):
    """``[T, k]`` int64 ids on the CPU, ``k`` distinct experts per token, as a router would give."""
    return torch.rand(num_tokens, num_experts, generator=generator).argsort(dim=1)[:, :topk]


def exact_fp8_inputs(num_tokens, d, group, generator):
    """``[T, d]`` float32 values that quantise to fp8 exactly per 1 x ``group`` (small integers times a power of
    two, each group's largest 448 times it): the interpreter's fp8 rounding, wrong where it carries into the
    exponent, never comes in, so a quantising kernel's indexing can be checked on the CPU."""
    n = torch.randint(-16, 17, (num_tokens, d // group, group), generator=generator).float()
    n[:, :, 0] = 448 * torch.where(torch.rand(num_tokens, d // group, generator=generator) < 0.5, -1.0, 1.0)
    power = 2.0 ** torch.randint(-6, 4, (num_tokens, d // group, 1), generator=generator).float()
    return (n * power).view(num_tokens, d)


def segment_indices(counts, align):
    """The permute layout's ``m_indices`` for experts with ``counts`` rows each: segments rounded up to ``align``
    rows (-1 on the padding), then one more ``align``-row tile of padding."""
    def segment(e, c):
        return torch.cat([torch.full((c,), e, dtype=torch.int32), torch.full((-c % align,), -1, dtype=torch.int32)])
    return torch.cat([segment(e, c) for e, c in enumerate(counts)] + [torch.full((align,), -1, dtype=torch.int32)])


def random_shape(seed, dtypes):
    """Interpreter-sized make_problem arguments drawn from ``seed``, and the rng that drew them
    (tests draw their other choices from it)."""
    rng = random.Random(seed)
    num_experts = rng.randint(1, 8)
    return dict(
        num_tokens=rng.randint(1, 12), num_experts=num_experts, topk=rng.randint(1, num_experts),
        hidden=rng.choice([16, 24, 40]), inter=rng.choice([16, 24, 32]), dtype=rng.choice(dtypes),
    ), rng


def make_problem(num_tokens, num_experts, topk, hidden=32, inter=16, dtype=torch.float32, *,
                 seed, topk_ids=None, fused_topk_like=False, routed_scaling_factor=1.0,
                 shared_expert=False):
    """A random MoE layer on DEVICE: ``(hidden_states, w1, w2, topk_weights, topk_ids)``.

    ``w1`` is ``[E, 2F, d]`` (gate rows, then up rows), ``w2`` ``[E, d, F]``, both scaled by one
    over the square root of their fan-in so that outputs stay of order one. Every tensor is drawn
    on the CPU from one generator seeded with ``seed``, in a fixed order, so a seed names the same
    problem on every machine. ``topk_ids``, when given, replaces the drawn routing.

    Two routing conventions, each kept so that the seeded cases of the files using it stay as they
    were. By default the ids are the first ``topk`` of a random permutation of the experts (int64,
    or the dtype of the ``topk_ids`` given) and the weights are positive but do not sum to one,
    which no kernel may assume. With ``fused_topk_like=True`` they are what vLLM's
    ``fused_topk(..., renormalize=True)`` hands the experts: the ids of the ``topk`` highest random
    scores, as int32, and weights that sum to one. Either way the weights are then multiplied by
    ``routed_scaling_factor`` (DeepSeek-V3 uses 2.5).

    ``shared_expert=True`` also draws one shared expert, ``w1_shared [2F, d]`` and ``w2_shared
    [d, F]`` (after ``w2``, before the routing), and appends the two to the returned tuple.
    """
    gen = torch.Generator().manual_seed(seed)
    drawn = [
        torch.randn(num_tokens, hidden, generator=gen),
        torch.randn(num_experts, 2 * inter, hidden, generator=gen) / math.sqrt(hidden),
        torch.randn(num_experts, hidden, inter, generator=gen) / math.sqrt(inter),
    ]
    if shared_expert:
        drawn += [torch.randn(2 * inter, hidden, generator=gen) / math.sqrt(hidden),
                  torch.randn(hidden, inter, generator=gen) / math.sqrt(inter)]
    if topk_ids is None:
        if fused_topk_like:
            topk_ids = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=1).indices
        else:
            topk_ids = random_topk_ids(gen, num_tokens, num_experts, topk)
    if fused_topk_like:
        topk_ids = topk_ids.to(torch.int32)
    raw = torch.rand(num_tokens, topk_ids.shape[1], generator=gen) + 0.1
    topk_weights = routed_scaling_factor * raw
    if fused_topk_like:
        topk_weights = topk_weights / raw.sum(dim=1, keepdim=True)
    hidden_states, w1, w2, *shared = (t.to(DEVICE, dtype) for t in drawn)
    return (hidden_states, w1, w2, topk_weights.to(DEVICE), topk_ids.to(DEVICE), *shared)


def skewed_problems():
    """Two float32 problems of 7 tokens on 4 experts: in the first, expert 3 gets no token (each
    token picks 2 of experts 0..2); in the second, every token goes to expert 2."""
    gen = torch.Generator().manual_seed(3)
    unused_last = random_topk_ids(gen, 7, 3, 2)
    all_on_one = torch.full((7, 1), 2)
    return [make_problem(7, 4, ids.shape[1], 24, 16, seed=3, topk_ids=ids)
            for ids in (unused_last, all_on_one)]


def gpu_sized_bf16_problem(seed):
    """A bf16 problem for the layouts on the GPU: 16 experts, top-4, d and F in the hundreds."""
    rng = random.Random(seed)
    return make_problem(rng.choice([1, 7, 64, 300]), 16, 4, rng.choice([256, 384]),
                        rng.choice([128, 192]), torch.bfloat16, seed=seed)


def assert_each_raises(experts, problem, cases):
    """Each case ``(changes, exception, message)``: ``experts`` called on ``problem``'s tensors, with
    the keyword arguments in ``changes`` replaced or added, raises ``exception`` saying
    ``message``."""
    hidden_states, w1, w2, topk_weights, topk_ids = problem
    good = dict(hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights,
                topk_ids=topk_ids)
    for changes, exception, message in cases:
        with pytest.raises(exception, match=re.escape(message)):
            experts(**{**good, **changes})


def check_one_launch(problem, dtype, tiles, **kwargs):
    """``one_launch_experts`` (either kernel, by ``tiles.phases``) on ``problem`` against the float64
    reference, within ``TOLERANCE[dtype]``; returns its output."""
    from moe_kernels.kernels.one_launch import one_launch_experts
    from moe_kernels.reference import moe_reference

    hidden, w1, w2, weights, ids = problem
    out = one_launch_experts(hidden, w1, w2, weights, ids, tiles=tiles, **kwargs)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    err = rel_err(out, moe_reference(hidden, w1, w2, weights, ids))
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"
    return out


def rel_err(out, ref):
    """``|out - ref| / |ref|`` (Frobenius norms) in float64; fails if ``out`` holds NaN or inf,
    as a row the kernel never wrote would."""
    out = out.double()
    assert torch.isfinite(out).all(), "output holds NaN/inf (unwritten rows?)"
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref).clamp_min(1e-30))


ROOT = Path(__file__).resolve().parent.parent

def assert_same_floats(got, want):
    """Float outputs (routing weights, logits) of two compiled kernels that run the same code: equal bit for
    bit under the interpreter (numpy runs each operation as written); on a GPU each kernel's compiler contracts
    multiply-adds and orders short sums on its own (the first GPU run of these tests saw it), so within a few
    float32 ulps there. Ids are compared exactly elsewhere."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if ON_GPU:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    else:
        assert torch.equal(got, want)


def assert_device_assert(code, message):
    """On a GPU a bad id is a device-side assert (no host sync), after which the process's CUDA
    context is unusable: run ``code`` (``torch`` imported) in a fresh interpreter and check that
    it dies of the assert with ``message``."""
    script = "import torch\n" + textwrap.dedent(code) + "\ntorch.cuda.synchronize()\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"no error from:\n{script}"
    assert "device-side assert" in output and message in output, output[-3000:]


def compiled_for_hopper(script: str) -> list[str]:
    """Run ``script`` (a kernel compiled for sm_90 with :mod:`moe_kernels.sm90_compile`, printing what
    its PTX shows) in a fresh interpreter that does not interpret kernels, and return its output lines.
    Skips where Triton has no NVIDIA backend; a failed build fails the test with its error."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_KERNELS_BACKEND")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("\n")


# ---- the browser tests (tests/test_site.py, tests/test_lab.py) -------------------------------------

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
#: CI sets REQUIRE_BROWSER=1: a missing browser then fails the browser tests instead of skipping them.
BROWSER_REQUIRED = os.environ.get("REQUIRE_BROWSER") == "1"


def skip_or_fail_browser(reason: str):
    if BROWSER_REQUIRED:
        pytest.fail(reason + " (REQUIRE_BROWSER=1)")
    pytest.skip(reason)


def headless_chromium():
    """Debian's Chromium driven by Playwright, with no background traffic (a generator for a fixture)."""
    import shutil

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_or_fail_browser("playwright is not installed")
    if not shutil.which(CHROMIUM):
        skip_or_fail_browser(f"no Chromium at {CHROMIUM}")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield b
        b.close()
