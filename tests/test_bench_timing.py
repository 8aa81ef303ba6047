"""moe_kernels.bench.timing: the A/B tools' timer checks each candidate before it times it."""
import pytest
import torch

from moe_kernels import results
from moe_kernels.bench import timing
from moe_kernels.bench.timing import time_candidates


def test_a_candidate_is_checked_before_it_is_timed():
    """A candidate within the tolerance passes; one off by more, one that returns NaN (whose error compares False
    with any tolerance) and one that raises are each named with the reason; all but the one that raised are timed
    (1.0 without a GPU), and an unchecked one is not compared."""
    reference = torch.ones(4, 4)
    candidates = {"close": lambda: reference * (1 + 1e-4), "far": lambda: reference * 2,
                  "nan": lambda: torch.full((4, 4), float("nan")), "raises": lambda: 1 / 0,
                  "unchecked": lambda: reference * 3}
    times, errors, rel = time_candidates(candidates, reference, tolerance=1e-2, warmup_ms=1, rep_ms=1,
                                         unchecked=("unchecked",))
    assert set(errors) == {"far", "nan", "raises"}, errors
    assert errors["far"].startswith("rel err") and errors["nan"] == "rel err nan"
    assert errors["raises"].startswith("ZeroDivisionError")
    assert set(times) == {"close", "far", "nan", "unchecked"} and "unchecked" not in rel


def test_the_l2_flush_is_named_and_recorded(monkeypatch):
    """``MOE_KERNELS_L2_FLUSH`` picks the flush: unset (or empty) is do_bench's ``zero`` and records say nothing;
    ``clean`` is recorded in the provenance; any other value (case counts) is an error that names the variable and
    the choices, for the timer and for a record alike."""
    monkeypatch.delenv(timing.L2_FLUSH_ENV, raising=False)
    assert timing.l2_flush() == "zero" and "l2_flush" not in results.provenance()
    monkeypatch.setenv(timing.L2_FLUSH_ENV, "clean")
    assert timing.l2_flush() == "clean" and results.provenance()["l2_flush"] == "clean"
    monkeypatch.setenv(timing.L2_FLUSH_ENV, "")
    assert timing.l2_flush() == "zero" and "l2_flush" not in results.provenance()
    for bad in ("dirty", "Clean"):
        monkeypatch.setenv(timing.L2_FLUSH_ENV, bad)
        for call in (lambda: timing.median_ms(lambda: None, 1, 1), results.provenance):
            with pytest.raises(ValueError, match=rf"MOE_KERNELS_L2_FLUSH: must be one of \('zero', 'clean'\).*'{bad}'"):
                call()


@pytest.mark.gpu
def test_the_clean_flush_times_a_call_gpu(monkeypatch):
    """With the clean flush the timer runs the call between events after zeroing and reading 256 MB: a positive
    median, and the call ran (its output written)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv(timing.L2_FLUSH_ENV, "clean")
    x, y = torch.ones(1024, device="cuda"), torch.zeros(1024, device="cuda")
    ms = timing.median_ms(lambda: torch.add(x, 1, out=y), 1, 2)
    assert ms > 0 and bool((y == 2).all())
