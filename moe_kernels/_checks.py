"""Argument checks shared by every public function.

Bad input must fail loudly, naming the argument and what was expected, before a kernel can
silently read out of bounds or drop a token. Every message has the form
``"<function>: argument '<name>' <expected>, got <actual>"``.
"""

from __future__ import annotations

from typing import Iterable

import torch


def fail(func: str, name: str, expected: str, got: object, exc: type[Exception] = ValueError):
    raise exc(f"{func}: argument '{name}' {expected}, got {got}")


def check_tensor(
    func: str,
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check a tensor argument and return it. Raises TypeError/ValueError with a clear message."""
    if not isinstance(t, torch.Tensor):
        fail(func, name, "must be a torch.Tensor", type(t).__name__, TypeError)
    if ndim is not None and t.dim() != ndim:
        fail(func, name, f"must have {ndim} dimensions", f"shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            fail(func, name, f"must have dtype {want}", str(t.dtype).replace("torch.", ""), TypeError)
    if device is not None and t.device != device:
        fail(func, name, f"must be on device {device} (where the other inputs are)", t.device)
    if contiguous and not t.is_contiguous():
        fail(func, name, "must be contiguous (call .contiguous())", f"strides {t.stride()}")
    if last_dim_contiguous and t.dim() > 0 and t.stride(-1) != 1:
        fail(func, name, "must be contiguous in its last dimension", f"strides {t.stride()}")
    return t


def check_int(func: str, name: str, value: object, *, lo: int | None = None, hi: int | None = None,
              what_hi: str | None = None) -> int:
    """Check an integer argument lies in [lo, hi]; ``what_hi`` names where hi comes from."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(func, name, "must be an int", type(value).__name__, TypeError)
    if lo is not None and value < lo:
        fail(func, name, f"must be >= {lo}", value)
    if hi is not None and value > hi:
        bound = f"{hi} ({what_hi})" if what_hi else str(hi)
        fail(func, name, f"must be <= {bound}", value)
    return value


def check_ids_in_range(func: str, name: str, ids: torch.Tensor, num_experts: int) -> None:
    """Every expert id must lie in [0, num_experts). Costs one device-to-host read."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_experts:
        fail(func, name, f"must hold expert ids in [0, {num_experts})", f"ids in [{lo}, {hi}]")
