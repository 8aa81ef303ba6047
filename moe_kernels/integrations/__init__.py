"""Other libraries running this package's kernels.

* :mod:`moe_kernels.integrations.transformers` - ``experts_implementation="moe_kernels"`` for
  every Hugging Face transformers (>= 5) MoE model whose experts go through its experts registry.

Nothing here is imported by ``import moe_kernels``, and no integration imports the library it
serves until one of its functions is called.
"""
