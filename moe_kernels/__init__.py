"""moe_kernels: Triton kernels and a byte model for Mixture-of-Experts inference on one GPU.

The public API. Names that mirror vLLM's keep vLLM's meaning (``fused_topk``, ``grouped_topk``,
``moe_align_block_size``, ``fused_experts``, ``moe_sum``). The layers of the package:

* :mod:`moe_kernels.kernels` - the Triton kernels, each beside its torch reference;
* :mod:`moe_kernels.model` - the closed-form byte model (never imports the kernels);
* :mod:`moe_kernels.bench` - the measurement commands (``python -m moe_kernels.bench``);
* :mod:`moe_kernels.book` - pictures, tables and explorers for the chapter;
* :mod:`moe_kernels.layer` (with :mod:`moe_kernels.layer_spec`, its data) and
  :mod:`moe_kernels.checkpoint` - one whole MoE layer, and loading it from a Hugging Face
  checkpoint; :mod:`moe_kernels.trace` runs one layer stage by stage and keeps every tensor.

Names are imported on first use, so ``import moe_kernels.model.costs`` loads no kernel (and no
Triton) at all.
"""

import importlib

_EXPORTS = {
    "BACKEND": "._runtime", "describe": "._runtime",
    "MoELayer": ".layer", "moe_layer": ".layer", "LayerWeights": ".layer_spec", "Routing": ".layer_spec",
    "load_layer": ".checkpoint",
    "gate": ".kernels.routing", "fused_topk": ".kernels.routing", "grouped_topk": ".kernels.grouped_routing",
    "append_shared_expert": ".kernels.routing",
    "moe_align_block_size": ".kernels.align",
    "fused_experts": ".kernels.index_gather", "fused_moe": ".kernels.index_gather",
    "permute_experts": ".kernels.permute", "masked_experts": ".kernels.masked",
    "moe_sum": ".kernels.combine", "unpermute": ".kernels.combine",
    "moe_with_shared_separate": ".kernels.shared", "moe_with_shared_fused": ".kernels.shared",
    "stack_shared_expert": ".kernels.shared",
    "GemmTiles": ".kernels.config", "MoEConfig": ".kernels.config", "get_config": ".kernels.config",
    "MODELS": ".model.shapes", "MoEModel": ".model.shapes", "default_device": "._runtime",
    "moe_reference": ".reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moe_kernels' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
