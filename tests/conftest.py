"""Fixtures shared by the test files; plain helpers and constants live in moe_testing.py."""

import pytest
import torch


@pytest.fixture
def true_fp32():
    """Keep torch's own float32 matmuls (its reference and fallback paths) out of TF32: the tests
    compare against float64. A module asks for it with ``pytestmark = pytest.mark.usefixtures``."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
