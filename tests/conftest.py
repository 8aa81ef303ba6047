"""Fixtures and collection rules shared by the test files; plain helpers live in moe_testing.py."""

import importlib.util

import pytest
import torch

# Doctests whose examples build IPython display objects; the GPU machine has no IPython.
_NEEDS_IPYTHON = ("moe_kernels.book.report", "moe_kernels.book.widgets")


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("IPython") is not None:
        return
    skip = pytest.mark.skip(reason="needs IPython (not installed here): its examples build IPython display objects")
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.name.startswith(_NEEDS_IPYTHON):
            item.add_marker(skip)


@pytest.fixture
def true_fp32():
    """Keep torch's own float32 matmuls (its reference and fallback paths) out of TF32: the tests
    compare against float64. A module asks for it with ``pytestmark = pytest.mark.usefixtures``."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
