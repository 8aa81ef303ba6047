"""Launching a Triton kernel for less host time: the compiled kernel kept per argument signature.

``kernel[grid](*args, **kwargs)`` pays on the host, at every launch, for Triton's general
machinery: it binds every argument to a dict, asks Triton's C++ specialiser about each one (dtype,
16-byte alignment, integer divisibility), turns the result and the options into a cache key, looks
the compiled kernel up, checks the globals it captured, and only then calls the launcher. A decode
step of one MoE layer launches five to eight kernels of up to forty arguments each, so at small
batches that host time is longer than the GPU time.

:class:`CachedLaunchKernel` is Triton's ``JITFunction`` with one shortcut. The first launch of a
signature goes through Triton (which compiles, or finds the kernel in its cache) and the compiled
kernel is kept under a key that holds *more* than Triton's specialisation does: each tensor's
dtype and whether its address is a multiple of 16, each integer's class (equal to 1, a multiple
of 16, fitting in 32 bits), every other value as it is, the launch options and the device. Later
launches with the same key call the compiled kernel's launcher directly, with the arguments in
Triton's order, exactly as Triton's own ``run`` does. A key that over-distinguishes only costs a
second lookup through Triton; one that under-distinguished would run the wrong binary, which is
why the key errs on the side of more. Arguments of any other type (a TMA tensor descriptor, say),
or a Triton whose ``run`` calls its launcher differently, take Triton's own path.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

_INT32 = 2**31


def _signature_part(value):
    """What of ``value`` can change the compiled kernel (see the module docstring)."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    if kind is int:
        return kind, value == 1, value & 15 == 0, -_INT32 <= value < _INT32
    if kind in (bool, str, float) or value is None:
        return kind, value if kind is not float else None
    raise _Uncacheable


class _Uncacheable(Exception):
    pass


def _launcher_call_matches() -> bool:
    """True when this Triton's ``JITFunction.run`` launches as the shortcut does (it reads the
    same attributes of the compiled kernel), and ``MOE_KERNELS_LAUNCH_SHORTCUT`` is not ``0``."""
    from triton.runtime.jit import JITFunction

    if os.environ.get("MOE_KERNELS_LAUNCH_SHORTCUT", "1") == "0":
        return False
    names = set(getattr(JITFunction.run, "__code__", None).co_names if hasattr(JITFunction.run, "__code__") else ())
    return {"packed_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook", "function"} <= names


def cached_launch_kernel_class():
    """The ``JITFunction`` subclass (built on first use: it needs Triton and a GPU driver)."""
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    shortcut = _launcher_call_matches()

    class CachedLaunchKernel(JITFunction):
        """``triton.jit`` whose ``kernel[grid](...)`` goes straight to the launcher once compiled."""

        def __init__(self, fn, **options):
            super().__init__(fn, **options)
            params = list(inspect.signature(fn).parameters.values())
            self._names = [p.name for p in params]
            self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
            self._compiled = {}

        def __getitem__(self, grid):
            return functools.partial(self._launch, grid)

        def _launch(self, grid, *args, **kwargs):
            if not shortcut:
                return self.run(*args, grid=grid, warmup=False, **kwargs)
            values = list(args)
            try:
                for name in self._names[len(args):]:
                    values.append(kwargs.pop(name) if name in kwargs else self._defaults[name])
                device = driver.active.get_current_device()
                key = (device, tuple(map(_signature_part, values)), tuple(sorted(kwargs.items())))
                compiled = self._compiled.get(key)
            except (_Uncacheable, KeyError, TypeError):   # odd arguments: Triton sorts them out (or says why)
                return self.run(*args, grid=grid, warmup=False, **dict(zip(self._names[len(args):], values[len(args):])),
                                **kwargs)
            if compiled is None:
                compiled = self.run(*values, grid=grid, warmup=False, **kwargs)
                if compiled is not None:
                    self._compiled[key] = compiled
                return compiled
            # Exactly Triton's own launch (JITFunction.run), hooks and their metadata included.
            stream = driver.active.get_current_stream(device)
            runtime = knobs.runtime
            compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                         compiled.function, compiled.packed_metadata, compiled.launch_metadata(grid, stream, *values),
                         runtime.launch_enter_hook, runtime.launch_exit_hook, *values)
            return compiled

    return CachedLaunchKernel
