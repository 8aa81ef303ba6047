"""Timing one decode step of a whole model (``bench model``): steps back to back from Python, the
step replayed from a CUDA graph, and the memory such a capture needs.

    ms = eager_step_ms(step, "cuda", steps=2, rounds=1)   # host time included
    ms, why_not = graph_step_ms(step, "cuda", replays=2, step_bytes=peak_bytes("cuda") - held)
"""

from __future__ import annotations

import statistics
import time

import torch


def synchronize(device) -> None:
    """Wait for ``device``'s work (nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


#: Free memory a capture asks for, as a multiple of what one eager step allocates: the warm-up's
#: blocks are handed back before the capture, but the capture's own pool fragments (a failed capture
#: was seen asking for a third 28 GiB block where the eager step's peak held two).
CAPTURE_MARGIN = 1.5


def fits_free_memory(step_bytes: int, free_bytes: int) -> bool:
    """Whether a step that allocates ``step_bytes`` can be warmed up and captured with ``free_bytes``
    free (:data:`CAPTURE_MARGIN`). A capture is not tried where it does not fit: in session 18 a
    capture that ran out of memory (``batched_mm`` at 64 sequences of DeepSeek-V3) was followed by
    57-69 GiB held outside any tensor for the rest of the run, and every capture at 512 sequences
    failed, while a run of 512 alone captured every implementation but that one.

        >>> fits_free_memory(56 * 2**30, 69 * 2**30), fits_free_memory(8 * 2**30, 60 * 2**30)
        (False, True)
    """
    return CAPTURE_MARGIN * step_bytes <= free_bytes


def allocated_bytes(device, reset_peak: bool = False) -> int:
    """Bytes in live tensors on ``device`` (0 without a GPU); ``reset_peak`` starts a new peak."""
    if torch.device(device).type != "cuda":
        return 0
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_bytes(device) -> int:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else 0


def free_cached_memory(device) -> None:
    """Hand the caching allocator's idle blocks back (DeepSeek-V3's layers fill the H200 at 512 tokens)."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def eager_step_ms(step, device, steps: int, rounds: int = 3) -> float:
    """Milliseconds per step, ``steps`` steps back to back from Python (median of ``rounds`` rounds)."""
    times = []
    for _ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def graph_step_ms(step, device, replays: int, step_bytes: int = 0) -> tuple[float | None, str | None]:
    """Milliseconds per step replayed from a CUDA graph (:func:`~moe_kernels.bench.timing.graph_us`,
    one step per graph), and why not (None, the reason) where the step cannot be captured; (None,
    None) without a GPU. ``step_bytes``: what an eager step allocated beyond the memory that stays
    held; a capture is not tried where that is more than the GPU has free (see :func:`fits_free_memory`)."""
    if torch.device(device).type != "cuda":
        return None, None
    from .timing import graph_us

    errors = []
    free_cached_memory(device)   # the warm-up runs on a side stream: it cannot use blocks cached for this one
    free = torch.cuda.mem_get_info(device)[0]
    if not fits_free_memory(step_bytes, free):
        return None, (f"not captured: an eager step allocates {step_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB "
                      f"are free, and a capture asks for {CAPTURE_MARGIN}x the step's bytes")
    us = graph_us(step, calls=1, replays=replays, errors=errors, free_cached=True)
    return (None if us is None else us / 1e3), (errors[0] if errors else None)
