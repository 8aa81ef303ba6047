"""Which machine are we on, and which implementation runs there.

One code path, three machines:

* a CUDA GPU: the Triton kernels are compiled for it;
* no GPU but Triton installed: the *same* kernels run under Triton's interpreter on the CPU
  (``TRITON_INTERPRET=1``), which is slow but executes every line of kernel code;
* no Triton at all (macOS, say): every public function falls back to its torch reference, and
  the package says so once.

``TRITON_INTERPRET`` is read when a kernel is *decorated*, so it must be set before any module
that defines kernels is imported. Every kernel module imports this one first, which sets it when
there is no GPU and the user has not chosen.

Set ``MOE_KERNELS_BACKEND=torch`` to force the torch references everywhere (useful to compare).
"""

from __future__ import annotations

import os
import warnings

import torch

HAS_CUDA: bool = torch.cuda.is_available()

if not HAS_CUDA and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

FORCE_TORCH: bool = os.environ.get("MOE_KERNELS_BACKEND", "").lower() == "torch"

try:  # Triton is Linux-only on PyPI; everything must still import without it.
    if FORCE_TORCH:
        raise ImportError("MOE_KERNELS_BACKEND=torch")
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by tests that hide triton
    triton = None
    tl = None
    HAS_TRITON = False

INTERPRET: bool = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if not HAS_TRITON:
    BACKEND = "torch"
elif HAS_CUDA and not INTERPRET:
    BACKEND = "cuda"
else:
    BACKEND = "interpreter"

_NOTICE = (
    "moe_kernels: Triton is not installed, so every kernel runs as its torch reference "
    "(same results, no Triton code executed). Install triton on Linux to run the kernels."
)
if BACKEND == "torch" and not FORCE_TORCH:
    warnings.warn(_NOTICE, stacklevel=2)


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel should run for these tensors.

    On a GPU build, the kernels run for CUDA tensors; under the interpreter they run for CPU
    tensors. Without Triton the answer is always False and callers use the torch reference.
    """
    if not HAS_TRITON:
        return False
    if INTERPRET:
        return all(t.device.type == "cpu" for t in tensors)
    return all(t.is_cuda for t in tensors)


def default_device() -> torch.device:
    """The device a demo should put its tensors on: the GPU when there is one."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def describe() -> str:
    """One line saying where kernels will run, for the top of a notebook."""
    if BACKEND == "cuda":
        name = torch.cuda.get_device_name()
        return f"Triton kernels on {name} (torch {torch.__version__}, triton {triton.__version__})"
    if BACKEND == "interpreter":
        return (
            f"Triton kernels under the CPU interpreter (torch {torch.__version__}, "
            f"triton {triton.__version__}); timings are not meaningful here"
        )
    return f"torch reference implementations only (torch {torch.__version__}, no Triton)"
