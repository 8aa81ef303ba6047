"""moe_kernels.bench.timing: the A/B tools' timer checks each candidate before it times it."""
import torch

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
