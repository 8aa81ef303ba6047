"""Launching a Triton kernel for less host time: the compiled kernel kept per argument signature.

``kernel[grid](*args, **kwargs)`` pays on the host, at every launch, for Triton's general
machinery: it binds every argument to a dict, asks Triton's C++ specialiser about each one (dtype,
16-byte alignment, integer divisibility), turns the result and the options into a cache key, looks
the compiled kernel up, checks the globals it captured, and only then calls the launcher. A decode
step of one MoE layer launches four to eight kernels of up to forty arguments each, and on a slow
host Triton's path costs 11-25 microseconds per launch, longer than the GPU takes for the kernel.

:class:`CachedLaunchKernel` is Triton's ``JITFunction`` with one shortcut. The first launch of a
signature goes through Triton (which compiles, or finds the kernel in its cache) and the compiled
kernel is kept under a key that holds *more* than Triton's specialisation does:

* a ``tl.constexpr`` parameter: its type and value (a tile size is part of the binary);
* a tensor: its dtype and its address modulo 16;
* an integer: its value (finer than Triton's classes: equal to 1, a multiple of 16, 32 or 64 bits);
* a bool, a string or None: its value; a float: only that it is a float;
* the launch options (``num_warps``, ``debug``...), Triton's debug and instrumentation knobs
  and the device.

The key is built cheaply: how a call site passes its arguments (how many positionally, which by
name, which are launch options) is worked out once per site, the constexprs are keyed as one tuple
in C (``map``), and only the other arguments, tensors and integers, take a Python-level step each.
Later launches with the same key call the compiled kernel's launcher directly, with the arguments
in Triton's order, exactly as Triton's own ``run`` does (hooks and launch metadata included, so a
profiler still sees every launch). A key that over-distinguishes only costs one more lookup
through Triton; one that under-distinguished would run the wrong binary, which is why the key errs
on the side of more. A TMA tensor descriptor is keyed as Triton specialises it (element type and
box; :func:`descriptor_key`). Arguments of any other type, a callable grid,
a kernel with pre-run hooks, a stages-inspection hook, or a Triton whose ``run`` calls its launcher
differently take Triton's own path. (Triton's check that a kernel's global constants have not
changed since it was compiled is skipped: this package's kernels read none.)
``MOE_KERNELS_LAUNCH_SHORTCUT=0`` turns the shortcut off.
"""

from __future__ import annotations

import os

import torch

_Tensor = torch.Tensor


_UNSEEN = object()
#: Compiled kernels kept per kernel before its cache is emptied (each entry is a key and a
#: reference to a kernel Triton keeps anyway).
MAX_KEPT = 4096


class _Uncacheable(Exception):
    """An argument whose effect on the compiled kernel the key cannot describe."""


def _refuse(value):
    raise _Uncacheable(type(value).__name__)


def argument_key(value, constexpr: bool):
    """What of one argument can change the compiled kernel (see the module docstring); the launch
    keys its arguments the same way, all at once (:func:`constexprs_key`, :func:`runtime_key`)."""
    return constexprs_key((value,)) if constexpr else runtime_key((value,))[0]


def constexprs_key(values: tuple) -> tuple:
    """The key of a kernel's ``tl.constexpr`` values: the values with their types (``64`` and
    ``128`` are two binaries; so are ``1`` and ``True``, equal in Python). A float or a tuple is
    keyed by its ``repr``, as Triton's own key spells it: ``0.0`` and ``-0.0``, or ``(1,)`` and
    ``(True,)``, compare equal but are different kernels. Built with ``map`` (in C): a constexpr
    costs next to nothing, where a Python-level step per argument would not."""
    types = tuple(map(type, values))
    if float in types or tuple in types:
        return types, tuple(map(repr, values))
    return types, values


def runtime_key(values) -> list:
    """The key of a kernel's other arguments, in one comprehension (a function call per argument
    would cost more host time than the rest of the launch). An integer is its own key: finer than
    Triton's classes (equal to 1, a multiple of 16, 32 or 64 bits), so a new value costs one lookup
    through Triton and is then kept, and it costs no work at all, where computing the class took
    about as long as the rest of the key. Decode repeats a few batch sizes, so its keys repeat;
    a server whose every prefill has a new length pays Triton's path once per length, and the
    cache is emptied when it passes :data:`MAX_KEPT` entries. Integers are tested first:
    ``isinstance(3, torch.Tensor)`` is the slowest test of the line."""
    return [v if type(v) is int
            else (v.dtype, v.data_ptr() & 15) if isinstance(v, _Tensor)
            else (type(v), v) if type(v) in (bool, str) or v is None
            else float if type(v) is float
            else descriptor_key(v) if type(v) in _descriptor_types
            else _refuse(v)
            for v in values]


#: Triton's host-side ``TensorDescriptor`` classes (Gluon's too, for a Gluon kernel's class), set when the
#: shortcut is built (it needs Triton).
_descriptor_types = frozenset()


def descriptor_key(desc) -> tuple:
    """The key of a TMA tensor descriptor: what Triton specialises on (the element type and the
    box, ``tensordesc<bf16[128, 64]>``; a Gluon descriptor's shared-memory layout too), with the
    padding mode; its base address, shape and strides are launch-time values that the launcher
    encodes into the descriptor at every launch."""
    return type(desc), desc.base.dtype, tuple(desc.block_shape), desc.padding, getattr(desc, "layout", None)


def _launcher_call_matches() -> bool:
    """True when this Triton's ``JITFunction.run`` launches as the shortcut does (it reads the
    same attributes of the compiled kernel) and ``MOE_KERNELS_LAUNCH_SHORTCUT`` is not ``0``."""
    from triton.runtime.jit import JITFunction

    if os.environ.get("MOE_KERNELS_LAUNCH_SHORTCUT", "1") == "0":
        return False
    code = getattr(JITFunction.run, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    return {"packed_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook", "function"} <= names


def _current_device() -> int:
    """``torch.cuda.current_device()`` without its lazy-initialisation checks: a kernel already in
    the cache was launched once, so CUDA is initialised."""
    return torch._C._cuda_getDevice()


def cached_launch_kernel_class(gluon: bool = False):
    """The ``JITFunction`` subclass (built on first use: it needs Triton); ``gluon``: the subclass of
    Gluon's ``GluonJITFunction`` (Triton 3.6), for the package's Gluon kernels."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    from . import _replay
    global _descriptor_types
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        _descriptor_types = _descriptor_types | {TensorDescriptor}
    except ImportError:   # a Triton without host-side descriptors: none is ever passed
        pass
    base = JITFunction
    if gluon:
        from triton.experimental.gluon._runtime import GluonJITFunction as base
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        _descriptor_types = _descriptor_types | {TensorDescriptor}
    this_thread = _replay._local   # .recording: a call being recorded for replay (moe_kernels._replay)
    no_hooks = _replay.no_hooks

    class CachedLaunchKernel(base):
        """``triton.jit`` (or ``gluon.jit``) whose ``kernel[grid](...)`` goes straight to the launcher once
        compiled."""

        #: Off: every launch takes Triton's own path (``MOE_KERNELS_LAUNCH_SHORTCUT=0``; A/B timing).
        shortcut = _launcher_call_matches()

        def __init__(self, fn, **options):
            super().__init__(fn, **options)
            self._names = [p.name for p in self.params]
            self._constexpr = [p.is_constexpr for p in self.params]
            self._defaults = {p.name: p.default for p in self.params if p.has_default}
            self._compiled = {}
            self._call_shapes = {}

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self._launch(grid, args, kwargs)

        def _call_shape(self, num_args: int, keywords: tuple):
            """How a call that passes ``num_args`` positional arguments and ``keywords`` (in that
            order) maps onto the parameters, worked out once per call site: the keyword
            parameters in parameter order, whether defaults must fill gaps, the launch options,
            and which positions hold constexprs. None: an odd call, left to Triton."""
            names = self._names
            if num_args > len(names) or any(k in names[:num_args] for k in keywords):
                return None
            tail = tuple(names[num_args:])
            missing = [n for n in tail if n not in keywords]
            if any(n not in self._defaults for n in missing):
                return None
            options = tuple(k for k in keywords if k not in names)
            constexpr = [i for i, c in enumerate(self._constexpr) if c]
            runtime = [i for i, c in enumerate(self._constexpr) if not c]
            return tail, bool(missing), options, constexpr, runtime

        def _launch(self, grid, args, kwargs):
            if (not self.shortcut or callable(grid) or self.pre_run_hooks
                    or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None):
                return self._triton_run(grid, args, kwargs)
            site = (len(args), tuple(kwargs))
            shape = self._call_shapes.get(site, _UNSEEN)
            if shape is _UNSEEN:
                shape = self._call_shapes[site] = self._call_shape(*site)
            if shape is None:
                return self._triton_run(grid, args, kwargs)
            tail, fill, options, constexpr, runtime = shape
            named = {**self._defaults, **kwargs} if fill else kwargs
            values = args + tuple(map(named.__getitem__, tail))
            try:
                device = _current_device()
                compilation = knobs.compilation
                key = (site, device, knobs.runtime.debug, getattr(compilation, "instrumentation_mode", None),
                       getattr(compilation, "fpsan_homomorphic_casts", None),
                       constexprs_key(tuple(map(values.__getitem__, constexpr))),
                       tuple(runtime_key(map(values.__getitem__, runtime))),
                       tuple(map(kwargs.__getitem__, options)))
                compiled = self._compiled.get(key)
            except (_Uncacheable, TypeError):   # odd arguments: Triton sorts them out (or says why)
                return self._triton_run(grid, args, kwargs)
            if compiled is None:
                compiled = self._triton_run(grid, args, kwargs)
                if compiled is not None and not hasattr(compiled, "result"):   # not an async compile
                    if len(self._compiled) >= MAX_KEPT:
                        self._compiled.clear()
                    self._compiled[key] = compiled
                return compiled
            # Triton's own launch (JITFunction.run): with hooks, the same hooks and metadata.
            stream = torch._C._cuda_getCurrentRawStream(device)
            runtime_knobs = knobs.runtime
            enter, leave = runtime_knobs.launch_enter_hook, runtime_knobs.launch_exit_hook
            if no_hooks(enter) and no_hooks(leave):
                enter = leave = metadata = None
            else:
                metadata = compiled.launch_metadata(grid, stream, *values)
            compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                         compiled.function, compiled.packed_metadata, metadata, enter, leave, *values)
            recording = getattr(this_thread, "recording", None)
            if recording is not None:
                recording.note_launch(compiled, grid, device, values)
            return compiled

        def _triton_run(self, grid, args, kwargs):
            """Triton's own launch; a call being recorded for replay cannot replay it (a new binary,
            or arguments the shortcut does not describe)."""
            recording = getattr(this_thread, "recording", None)
            if recording is not None:
                recording.refuse(f"{self.__name__} took Triton's own launch path")
            return self.run(*args, grid=grid, warmup=False, **kwargs)

    return CachedLaunchKernel
