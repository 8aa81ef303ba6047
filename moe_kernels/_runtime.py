"""Which machine are we on, and which implementation runs there.

One code path, three machines:

* a CUDA GPU: the Triton kernels are compiled for it;
* no GPU but Triton installed: the *same* kernels run under Triton's interpreter on the CPU,
  which is slow but executes every line of kernel code;
* no Triton at all (macOS, say), or an interpreter that fails its self-test: every public
  function falls back to its torch reference, and the package says so once.

The interpreter is chosen here, kernel by kernel, not through the ``TRITON_INTERPRET``
environment variable. That variable is read when a function is *decorated*, so it only works if
it is set before anything imports Triton; ``torch._dynamo`` (hence ``torch.compile``,
transformers' model files, lightning) imports Triton first, after which Triton's own library
functions (``tl.sigmoid``, ``tl.max``, ...) are compiled-mode objects that an interpreted kernel
cannot call. So every kernel of this package is declared with :func:`kernel` instead of
``triton.jit``: on a machine without a GPU it becomes an interpreted kernel whatever was imported
before, and while it runs, Triton's library functions are interpreted too (:func:`_interpreting`).
Nothing global is left changed once a kernel returns.

Set ``MOE_KERNELS_BACKEND=torch`` to force the torch references everywhere (useful to compare),
or ``TRITON_INTERPRET=1`` to interpret even on a GPU machine (kernels then take CPU tensors).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import torch

from . import _replay

HAS_CUDA: bool = torch.cuda.is_available()

FORCE_TORCH: bool = os.environ.get("MOE_KERNELS_BACKEND", "").lower() == "torch"

try:  # Triton is Linux-only on PyPI; everything must still import without it.
    if FORCE_TORCH:
        raise ImportError("MOE_KERNELS_BACKEND=torch")
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by tests that hide triton
    triton = None
    tl = None
    HAS_TRITON = False

_ASKED_TO_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Kernels run under Triton's interpreter (CPU tensors) rather than compiled for a GPU.
INTERPRET: bool = HAS_TRITON and (not HAS_CUDA or _ASKED_TO_INTERPRET)

if not HAS_TRITON:
    BACKEND = "torch"
elif INTERPRET:
    BACKEND = "interpreter"
else:
    BACKEND = "cuda"

_NO_TRITON_NOTICE = (
    "moe_kernels: Triton is not installed, so every kernel runs as its torch reference "
    "(same results, no Triton code executed). Install triton on Linux to run the kernels."
)
if BACKEND == "torch" and not FORCE_TORCH:
    warnings.warn(_NO_TRITON_NOTICE, stacklevel=2)


# ----------------------------------------------------------------------------------------------
# Interpreted kernels, whatever was imported first
# ----------------------------------------------------------------------------------------------

_lock = threading.RLock()
_depth = 0


@contextlib.contextmanager
def _interpreting():
    """While an interpreted kernel runs: Triton's knob says "interpret", and a compiled-mode
    ``@triton.jit`` function that the kernel calls (Triton's standard library, when Triton was
    imported before this package) runs as interpreted Python instead of refusing to be called.
    Both are restored when the outermost kernel returns."""
    global _depth
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with _lock:
        if _depth == 0:
            knobs = getattr(triton, "knobs", None)
            saved_knob = knobs.runtime.__dict__.get("interpret", _UNSET) if knobs else _UNSET
            if knobs is not None:
                knobs.runtime.interpret = True
            saved_call = JITFunction.__call__

            def call_interpreted(self, *args, **kwargs):
                interpreted = self.__dict__.get("_moe_kernels_interpreted")
                if interpreted is None:
                    interpreted = self.__dict__["_moe_kernels_interpreted"] = InterpretedFunction(self.fn)
                return interpreted(*args, **kwargs)

            JITFunction.__call__ = call_interpreted
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                JITFunction.__call__ = saved_call
                if knobs is not None:
                    if saved_knob is _UNSET:
                        knobs.runtime.__dict__.pop("interpret", None)
                    else:
                        knobs.runtime.interpret = saved_knob


_UNSET = object()

if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction

    class _InterpretedKernel(_InterpretedFunction):
        """An interpreted kernel whose launches run inside :func:`_interpreting` (``kernel[grid](...)``
        goes through ``run`` in recent Triton and straight to a grid executor in older ones)."""

        def run(self, *args, **kwargs):
            with _interpreting():
                return super().run(*args, **kwargs)

        def __getitem__(self, grid):
            launch = super().__getitem__(grid)

            def launch_interpreted(*args, **kwargs):
                with _interpreting():
                    return launch(*args, **kwargs)

            return launch_interpreted


def kernel(fn=None, **options):
    """``triton.jit`` for this package: compiled on a GPU, interpreted on the CPU.

    Used exactly like ``@triton.jit`` (also as ``@kernel(do_not_specialize=[...])``), for kernels
    and for the device functions they call. Compiled kernels launch through
    :mod:`moe_kernels._launch`, which skips Triton's per-launch bookkeeping once a signature has
    been compiled.
    """
    if fn is None:
        return lambda f: kernel(f, **options)
    if INTERPRET:
        return _InterpretedKernel(fn, **options)
    return _compiled_kernel_class()(fn, **options)


def gluon_kernel(fn):
    """``gluon.jit`` for this package's Gluon kernels (Triton 3.6, compiled only; their device functions keep
    ``gluon.jit``): launched through :mod:`moe_kernels._launch`'s shortcut like the Triton kernels, so that a
    recorded call replays them (:mod:`moe_kernels._replay`)."""
    return _compiled_kernel_class(gluon=True)(fn)


_COMPILED_KERNEL = {}


def _compiled_kernel_class(gluon: bool = False):
    """``triton.jit``'s (or ``gluon.jit``'s) class with the launch shortcut of :mod:`moe_kernels._launch`."""
    if gluon not in _COMPILED_KERNEL:
        from ._launch import cached_launch_kernel_class

        _COMPILED_KERNEL[gluon] = cached_launch_kernel_class(gluon)
    return _COMPILED_KERNEL[gluon]


# ----------------------------------------------------------------------------------------------
# Does the interpreter work here? (checked once, on first use)
# ----------------------------------------------------------------------------------------------

_interpreter_ok: bool | None = None

_BROKEN_INTERPRETER_NOTICE = (
    "moe_kernels: Triton's interpreter failed its self-test on this machine ({error}), so every "
    "kernel runs as its torch reference instead (same results, no Triton code executed)."
)

if INTERPRET:

    @kernel
    def _self_test_kernel(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        # A library function (compiled-mode when Triton was imported first), a reduction and a
        # small matrix product: what every kernel of the package relies on.
        total = tl.sum(tl.sigmoid(x), axis=0)
        square = tl.dot(tl.reshape(x, (4, 4)), tl.reshape(x, (4, 4)))
        tl.store(out_ptr + offs, tl.reshape(square, (N,)) + total)


def _check_interpreter() -> bool:
    global _interpreter_ok
    if _interpreter_ok is None:
        try:
            x = torch.linspace(-1.0, 1.0, 16)
            out = torch.empty(16)
            _self_test_kernel[(1,)](x, out, N=16)
            m = x.view(4, 4)
            want = (m @ m).reshape(16) + torch.sigmoid(x).sum()
            if not torch.allclose(out, want, atol=1e-4):
                raise RuntimeError("self-test kernel computed a wrong result")
            _interpreter_ok = True
        except Exception as err:  # noqa: BLE001 - any failure means: use the references
            _interpreter_ok = False
            warnings.warn(_BROKEN_INTERPRETER_NOTICE.format(error=f"{type(err).__name__}: {err}"),
                          stacklevel=3)
    return _interpreter_ok


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code. ``triton.cdiv`` is a ``constexpr_function``: called from
    Python it converts its arguments through Triton's constexpr machinery and costs about as
    much as a ``torch.empty`` (3-4 us), which a decode call would pay several times over."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), for host code (see :func:`cdiv`).

        >>> [next_power_of_2(n) for n in (0, 1, 5, 8, 129)]
        [1, 1, 8, 8, 256]
    """
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel should run for these tensors.

    On a GPU build, the kernels run for CUDA tensors; under the interpreter they run for CPU
    tensors (once the interpreter has passed its self-test). Without Triton the answer is always
    False and callers use the torch reference.
    """
    if not HAS_TRITON:
        return False
    if INTERPRET:
        return all(t.device.type == "cpu" for t in tensors) and _check_interpreter()
    for t in tensors:   # a loop, not all(<generator>): this runs several times per decode call
        if not t.is_cuda:
            return False
    return True


def interpreted_bf16(*tensors: torch.Tensor) -> bool:
    """The interpreter's bf16 ``tl.dot`` multiplies raw bit patterns (triton issue 11584) and its
    fp32 -> bf16 stores truncate: such inputs are computed in float32 and rounded once."""
    return INTERPRET and any(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


# ----------------------------------------------------------------------------------------------
# Which kernels a call launched (for tests that pin the path, not only the value)
# ----------------------------------------------------------------------------------------------

_launches: list | None = None


@contextlib.contextmanager
def record_launches():
    """Collect what every kernel launch of this package says about itself while the block runs:
    a list of ``(kernel name, {setting: value})`` (tiles, the scale branch, the block map, the
    grid...). A test then checks which variant ran, not only what it computed:

        >>> import torch
        >>> from moe_kernels.kernels.combine import moe_sum
        >>> with record_launches() as launches:
        ...     _ = moe_sum(torch.ones(2, 3, 4))
        >>> [name for name, _ in launches] == (["combine.moe_sum"] if BACKEND != "torch" else [])
        True

    Outside the block recording costs one global read per launch. Inside it, calls run eagerly
    (a replayed call, :mod:`moe_kernels._replay`, would not say what it launches)."""
    global _launches
    saved, _launches = _launches, []
    _replay.eager_calls += 1
    try:
        yield _launches
    finally:
        _launches = saved
        _replay.eager_calls -= 1


def recording() -> bool:
    """True inside :func:`record_launches` (a launch site with many settings asks first, so that
    an unrecorded launch does not build their dict)."""
    return _launches is not None


def note_launch(name: str, **settings) -> None:
    """Called by each launch site just before it launches (a no-op unless recording)."""
    if _launches is not None:
        _launches.append((name, settings))


def device_assert_options(message: str) -> dict:
    """Launch options for a kernel that asserts on the device (``message`` non-empty): Triton
    compiles ``tl.device_assert`` only with ``debug``, and ``sanitize_overflow=False`` keeps
    ``debug`` from adding an overflow check to every integer operation, so the kernel is the
    same kernel plus its one assert. The interpreter ignores these options."""
    return {"debug": True, "sanitize_overflow": False} if message else {}


def default_device() -> torch.device:
    """The device a demo should put its tensors on: the GPU when there is one."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def describe() -> str:
    """One line saying where kernels will run, for the top of a notebook."""
    if BACKEND == "cuda":
        name = torch.cuda.get_device_name()
        return f"Triton kernels on {name} (torch {torch.__version__}, triton {triton.__version__})"
    if BACKEND == "interpreter" and _check_interpreter():
        return (
            f"Triton kernels under the CPU interpreter (torch {torch.__version__}, "
            f"triton {triton.__version__}); timings are not meaningful here"
        )
    return f"torch reference implementations only (torch {torch.__version__}, no Triton)"
