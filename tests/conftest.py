"""Fixtures and collection rules shared by the test files; plain helpers live in moe_testing.py."""

import importlib.util
import os

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


# CI's notebook kernels run on other CPU code paths than the machine that executed the committed
# outputs (tools/execute_notebooks.py): OpenBLAS's SSE3 kernels (numpy, hence tl.dot under Triton's
# interpreter), torch's unvectorised kernels and two threads, so that an output which depends on
# float rounding fails in CI rather than on a reader's machine. Only the notebooks' kernels take
# them (the unit tests would only run slower); .ci/run asks for it with MOE_NOTEBOOK_CPU=other.
OTHER_CPU_PATHS = {"OPENBLAS_CORETYPE": "Prescott", "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "2",
                   "MKL_NUM_THREADS": "2"}


class _NotebookKernelsOnOtherCpuPaths:
    """Sets :data:`OTHER_CPU_PATHS` while nbval starts a notebook's kernel (the first cell's setup
    starts it and the kernel copies the environment), and restores the environment after."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        if type(item).__name__ != "IPyNbCell":
            return (yield)
        saved = {name: os.environ.get(name) for name in OTHER_CPU_PATHS}
        os.environ.update(OTHER_CPU_PATHS)
        try:
            return (yield)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def pytest_configure(config):
    choice = os.environ.get("MOE_NOTEBOOK_CPU", "")
    if choice == "other":   # a plugin, so that it also sees the notebooks (outside tests/)
        config.pluginmanager.register(_NotebookKernelsOnOtherCpuPaths(), "moe-notebook-cpu")
    elif choice:
        raise pytest.UsageError(f"MOE_NOTEBOOK_CPU must be 'other' or unset, got {choice!r}")


@pytest.fixture
def true_fp32():
    """Keep torch's own float32 matmuls (its reference and fallback paths) out of TF32: the tests
    compare against float64. A module asks for it with ``pytestmark = pytest.mark.usefixtures``."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
