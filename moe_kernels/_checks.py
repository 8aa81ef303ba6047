"""Argument checks shared by every public function.

Bad input must fail loudly, naming the argument and what was expected, before a kernel can
silently read out of bounds or drop a token. Every message has the form
``"<function>: argument '<name>' <expected>, got <actual>"``.
"""

from __future__ import annotations

import math
from numbers import Real
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
    # A stride does not matter along a dimension of size 0 or 1 (torch gives such tensors odd ones).
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.numel() > 0 and t.stride(-1) != 1:
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


def check_bool(func: str, name: str, value: object) -> bool:
    """Check a flag is a bool (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        fail(func, name, "must be a bool", type(value).__name__, TypeError)
    return value


def check_number(func: str, name: str, value: object, *, gt: float | None = None, ge: float | None = None,
                 lt: float | None = None, le: float | None = None) -> float:
    """Check a real scalar (an int or a float, not a bool) is finite and inside the given bounds;
    return it as a float. NaN and infinities never pass: a NaN compares False with every bound,
    so a plain ``value <= 0`` test would let it through to poison the result."""
    if isinstance(value, bool) or not isinstance(value, Real):
        fail(func, name, "must be a real number", type(value).__name__, TypeError)
    number = float(value)
    lower = (">", gt) if gt is not None else (">=", ge) if ge is not None else None
    upper = ("<", lt) if lt is not None else ("<=", le) if le is not None else None
    if lower and upper:  # an interval: "in (0, 1]"
        expected = f"must be in {'(' if gt is not None else '['}{lower[1]:g}, {upper[1]:g}{')' if lt is not None else ']'}"
    elif lower or upper:
        op, bound = lower or upper
        expected = f"must be {op} {bound:g} and finite"
    else:
        expected = "must be a finite number"
    if (not math.isfinite(number) or (gt is not None and not number > gt) or (ge is not None and not number >= ge)
            or (lt is not None and not number < lt) or (le is not None and not number <= le)):
        fail(func, name, expected, value)
    return number


def check_dtype(func: str, name: str, dtype: object, allowed: Iterable[torch.dtype] | None = None) -> torch.dtype:
    """Check ``dtype`` is a ``torch.dtype`` (one of ``allowed`` when given) and return it."""
    if not isinstance(dtype, torch.dtype):
        fail(func, name, "must be a torch.dtype (e.g. torch.bfloat16)", f"{type(dtype).__name__} {dtype!r}", TypeError)
    if allowed is not None:
        allowed = tuple(allowed)
        if dtype not in allowed:
            want = " or ".join(str(d).replace("torch.", "") for d in allowed)
            fail(func, name, f"must be {want}", str(dtype).replace("torch.", ""), TypeError)
    return dtype


def check_device(func: str, name: str, device: object, *, must_exist: bool = True) -> torch.device:
    """``device`` as a ``torch.device``: a device string or object; with ``must_exist``, a CUDA
    device only where torch sees a GPU."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        fail(func, name, "must be a torch.device or a device string such as 'cuda' or 'cpu'", repr(device))
    if must_exist and parsed.type == "cuda" and not torch.cuda.is_available():
        fail(func, name, "must be a device this machine has (torch sees no CUDA GPU here)", repr(str(device)))
    return parsed


def check_ids_in_range(func: str, name: str, ids: torch.Tensor, num_experts: int, *,
                       on_device: bool = True) -> None:
    """Every expert id must lie in ``[0, num_experts)``.

    On the CPU this raises ValueError at once. On a GPU (with ``on_device``, the default for the
    kernels) it is a device-side assert: no host sync, so it can sit inside a CUDA graph, and a bad
    id still fails loudly (the next synchronising call raises "device-side assert triggered" with
    this message in the log) instead of becoming a wrong answer. ``on_device=False`` (references,
    checkers, the byte model, which read their results on the host anyway) raises ValueError on
    every device.
    """
    if ids.numel() == 0:
        return
    if ids.is_cuda and on_device:
        ok = ((ids >= 0) & (ids < num_experts)).all()
        torch._assert_async(ok, f"{func}: argument '{name}' must hold expert ids in [0, {num_experts})")
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_experts:
        fail(func, name, f"must hold expert ids in [0, {num_experts})", f"ids in [{lo}, {hi}]")


def device_id_check(func: str, name: str, ids: torch.Tensor, num_experts: int) -> str:
    """Where the id check of a kernel that reads every id goes: on a GPU running the Triton
    kernels, into that kernel as a device-side assert (returns its message; no launch and no
    host sync of its own); anywhere else it runs now (:func:`check_ids_in_range`) and "" is
    returned."""
    from . import _runtime

    if _runtime.BACKEND == "cuda" and ids.is_cuda:
        return f"{func}: argument '{name}' must hold expert ids in [0, {num_experts})"
    check_ids_in_range(func, name, ids, num_experts)
    return ""


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)


def check_moe_inputs(func: str, hidden_states, w1, w2, topk_weights, topk_ids, *, validate_ids: bool = False):
    """Check the ``(hidden, w1, w2, topk_weights, topk_ids)`` of every experts function.

    ``w1`` ``[E, 2F, d]`` (gate rows then up rows), ``w2`` ``[E, d, F]``, ``hidden_states``
    ``[T, d]`` of the weights' dtype, ``topk_weights``/``topk_ids`` ``[T, k]`` with
    ``1 <= k <= E``, all on one device and contiguous in the last dimension. ``validate_ids``
    also checks every id lies in ``[0, E)`` (:func:`check_ids_in_range`).
    Returns ``(num_tokens, topk, num_experts, hidden_size, intermediate_size)``.
    """
    hidden = check_tensor(func, "hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES,
                          last_dim_contiguous=True)
    device = hidden.device
    # fp8 weights (with their scales, checked by the layout) multiply activations quantised on the fly.
    weight_dtypes = (hidden.dtype, torch.float8_e4m3fn)
    check_tensor(func, "w1", w1, ndim=3, dtypes=weight_dtypes, device=device, last_dim_contiguous=True)
    check_tensor(func, "w2", w2, ndim=3, dtypes=(w1.dtype,), device=device, last_dim_contiguous=True)
    check_tensor(func, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=device,
                 last_dim_contiguous=True)
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, device=device)
    num_tokens, hidden_size = hidden.shape
    if hidden_size == 0:
        fail(func, "hidden_states", "must have a hidden size d >= 1 (shape [T, d])", f"shape {tuple(hidden.shape)}")
    num_experts, two_f, _ = w1.shape
    if w1.shape[2] != hidden_size or two_f % 2 or two_f == 0:
        fail(func, "w1", f"must have shape [E, 2F, d={hidden_size}] with 2F even and > 0 (gate rows then up rows)",
             f"shape {tuple(w1.shape)}")
    f = two_f // 2
    if tuple(w2.shape) != (num_experts, hidden_size, f):
        fail(func, "w2", f"must have shape [E={num_experts}, d={hidden_size}, F={f}] to match w1",
             f"shape {tuple(w2.shape)}")
    if topk_ids.shape[0] != num_tokens or not 1 <= topk_ids.shape[1] <= num_experts:
        fail(func, "topk_ids", f"must have shape [T={num_tokens}, k] with 1 <= k <= E={num_experts}",
             f"shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        fail(func, "topk_weights", f"must have the shape of topk_ids {tuple(topk_ids.shape)}",
             f"shape {tuple(topk_weights.shape)}")
    if validate_ids:
        check_ids_in_range(func, "topk_ids", topk_ids, num_experts)
    return num_tokens, topk_ids.shape[1], num_experts, hidden_size, f


def check_dispatch_inputs(func: str, hidden_states, topk_ids, num_experts: int) -> torch.Tensor:
    """The inputs of a row dispatch (permute, masked): ``hidden [T, d]`` (T may be 0), ``topk_ids
    [T, k]`` with k >= 1 on the same device, ``num_experts >= 1``. Returns ``hidden_states``."""
    hidden = check_tensor(func, "hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES + (torch.float8_e4m3fn,),
                          last_dim_contiguous=True)
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, device=hidden.device)
    check_int(func, "num_experts", num_experts, lo=1)
    if topk_ids.shape[0] != hidden.shape[0] or topk_ids.shape[1] == 0:
        fail(func, "topk_ids", f"must have shape [{hidden.shape[0]}, k] with k >= 1",
             f"shape {tuple(topk_ids.shape)}")
    return hidden


def env_int(name: str, default: int) -> int:
    """An integer setting from the environment variable ``name`` (``default`` when unset or empty),
    or a ValueError that names the variable."""
    import os

    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {text!r}") from None
