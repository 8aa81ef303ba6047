"""moe_kernels: Triton kernels and a byte model for Mixture-of-Experts inference on one GPU."""

from . import _runtime
from ._runtime import BACKEND, describe

__all__ = ["BACKEND", "describe"]
