"""Read one MoE layer out of a Hugging Face checkpoint into the kernels' layout.

A checkpoint stores a layer's experts one of two ways, and both are read:

* per expert, as released (DeepSeek-V3, Qwen3-30B-A3B on the Hub):
  ``model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight`` of ``[F, d]``, ``[F, d]``,
  ``[d, F]``;
* fused 3-D, as transformers 5 holds them in memory (``Qwen3MoeExperts``, ``DeepseekV3Experts``):
  ``model.layers.N.mlp.experts.gate_up_proj`` ``[E, 2F, d]`` (gate rows, then up rows) and
  ``...experts.down_proj`` ``[E, d, F]``.

Either becomes ``w13 [E, 2F, d]`` and ``w2 [E, d, F]``, vLLM's layout. The router is
``mlp.gate.weight [E, d]``; DeepSeek-V3 adds ``mlp.gate.e_score_correction_bias [E]`` and a shared
expert ``mlp.shared_experts.{gate,up,down}_proj.weight`` (``n_shared_experts`` of width ``F``);
Qwen2-MoE a shared expert ``mlp.shared_expert.*`` of its own width
(``shared_expert_intermediate_size``) whose output is scaled by ``sigmoid(x @ g)``, with
``g = mlp.shared_expert_gate.weight [1, d]``. A tensor of the layer that the loader does not
read (a shared expert the config does not declare, say) is an error naming it: nothing of a
layer is dropped silently. fp8 checkpoints (DeepSeek-V3, Qwen3-FP8)
store each weight in ``float8_e4m3fn`` beside its ``weight_scale_inv``, one float32 per 128x128
block; both are read, and the gate and up scales stacked like their weights. The routing rules
come from the model's
``config.json`` (a dict, a path, or the ``config.json`` beside the shards).

``source`` is a folder of ``*.safetensors`` shards (with or without
``model.safetensors.index.json``), one ``.safetensors`` file, or a state dict. Only the tensors of
the requested layer are read (the safetensors package maps the files; nothing else is loaded).

    >>> import torch
    >>> state = {"model.layers.0.mlp.gate.weight": torch.randn(4, 8)}
    >>> for e in range(4):
    ...     for name, shape in (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6))):
    ...         state[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = torch.randn(shape)
    >>> config = {"hidden_size": 8, "moe_intermediate_size": 6, "num_experts": 4, "num_experts_per_tok": 2,
    ...           "norm_topk_prob": True}
    >>> weights, routing = load_layer(state, layer=0, config=config)
    >>> tuple(weights.w13.shape), tuple(weights.w2.shape), routing.top_k
    ((4, 12, 8), (4, 8, 6), 2)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_number, fail
from .layer_spec import LayerWeights, Routing

_FUNC = "load_layer"


def _config_value(config: Mapping, key: str, kind: type, default=None):
    """``config[key]`` of exactly ``kind`` (no coercion: JSON's ``"false"`` is not ``False``),
    ``default`` when absent or null."""
    value = config.get(key)
    if value is None:
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        fail(_FUNC, f"config['{key}']", "must be an int (the model's config.json)", repr(value), TypeError)
    if kind is not int and not isinstance(value, kind):
        fail(_FUNC, f"config['{key}']", f"must be a JSON {'boolean' if kind is bool else kind.__name__}",
             repr(value), TypeError)
    return value


def routing_from_config(config: Mapping) -> tuple[Routing, dict]:
    """The routing rules and the layer's sizes from a Hugging Face ``config.json``."""
    num_experts = config.get("n_routed_experts", config.get("num_experts", config.get("num_local_experts")))
    for key, value in (("hidden_size", config.get("hidden_size")), ("moe_intermediate_size",
                       config.get("moe_intermediate_size")), ("num_experts", num_experts),
                       ("num_experts_per_tok", config.get("num_experts_per_tok"))):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(_FUNC, f"config['{key}']", "must be a positive int (the model's config.json)", repr(value))
    if config["num_experts_per_tok"] > num_experts:
        fail(_FUNC, "config['num_experts_per_tok']", f"must be <= the number of experts ({num_experts})",
             repr(config["num_experts_per_tok"]))
    scoring_func = _config_value(config, "scoring_func", str, "softmax")
    if scoring_func not in ("softmax", "sigmoid"):
        fail(_FUNC, "config['scoring_func']", "must be 'softmax' or 'sigmoid'", repr(scoring_func))
    groups = config.get("n_group") or 1
    if not isinstance(groups, int) or isinstance(groups, bool) or num_experts % groups:
        fail(_FUNC, "config['n_group']", f"must be a positive int dividing the number of experts ({num_experts})",
             repr(groups))
    topk_group = config.get("topk_group") or 1
    if groups > 1 and (not isinstance(topk_group, int) or isinstance(topk_group, bool) or not 1 <= topk_group <= groups):
        fail(_FUNC, "config['topk_group']", f"must be an int in [1, n_group={groups}]", repr(topk_group))
    scaling = check_number(_FUNC, "config['routed_scaling_factor']", config.get("routed_scaling_factor", 1.0), gt=0)
    routing = Routing(
        top_k=config["num_experts_per_tok"],
        scoring_func=scoring_func,
        renormalize=_config_value(config, "norm_topk_prob", bool, False),
        num_expert_group=groups if groups > 1 else None,
        topk_group=topk_group if groups > 1 else None,
        routed_scaling_factor=scaling,
    )
    shared = _config_value(config, "n_shared_experts", int, 0) * config["moe_intermediate_size"]
    gated_shared = _config_value(config, "shared_expert_intermediate_size", int, 0)
    if shared < 0 or gated_shared < 0 or (shared and gated_shared):
        fail(_FUNC, "config['shared_expert_intermediate_size']", "must be absent, or the only shared expert size (a "
             "Qwen2-MoE gated shared expert; DeepSeek's is n_shared_experts * moe_intermediate_size)",
             f"{gated_shared} with n_shared_experts={config.get('n_shared_experts')}")
    sizes = {"d": config["hidden_size"], "f": config["moe_intermediate_size"], "e": num_experts,
             "shared": shared, "gated_shared": gated_shared}
    return routing, sizes


def _read_json(path: Path, name: str) -> dict:
    """A JSON object from ``path``, or an error naming the file."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        fail(_FUNC, name, f"must be a readable JSON file ({path})", f"{type(err).__name__}: {err}")
    if not isinstance(value, dict):
        fail(_FUNC, name, f"must hold a JSON object ({path})", type(value).__name__, TypeError)
    return value


class _Tensors:
    """Named tensors from a state dict, one safetensors file, or a folder of shards; remembers
    which names were read, so that the loader can refuse a layer's tensors it did not use."""

    def __init__(self, source):
        self._dict, self._files, self.read = None, {}, set()
        if isinstance(source, Mapping):
            self._dict = source
            return
        if not isinstance(source, (str, os.PathLike)):
            fail(_FUNC, "source", "must be a state dict, a .safetensors file or a folder of shards",
                 type(source).__name__, TypeError)
        path = Path(source)
        if path.is_dir():
            shards = sorted(path.glob("*.safetensors"))
        elif path.is_file() and path.suffix == ".safetensors":
            shards = [path]
        else:
            fail(_FUNC, "source", "must be a state dict, a .safetensors file or a folder of shards", repr(source))
        if not shards:
            fail(_FUNC, "source", "must hold *.safetensors shards", str(path))
        index = path / "model.safetensors.index.json" if path.is_dir() else None
        if index is not None and index.exists():
            weight_map = _read_json(index, "source").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                fail(_FUNC, "source", f"must have a 'weight_map' of tensor name -> shard file in {index.name}",
                     repr(type(weight_map).__name__))
            self._where = {name: path / shard for name, shard in weight_map.items()}
        else:
            self._where = {}
            for shard in shards:
                self._where.update({name: shard for name in self._open(shard, lambda f: list(f.keys()))})

    @staticmethod
    def _open(shard: Path, read):
        """``read(handle)`` of one safetensors file; a file safetensors cannot read is an error naming it."""
        from safetensors import safe_open

        try:
            with safe_open(str(shard), framework="pt") as f:
                return read(f)
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types (and OSError)
            fail(_FUNC, "source", f"must hold readable safetensors files; {shard.name} is not one",
                 f"{type(err).__name__}: {err}")

    def __contains__(self, name: str) -> bool:
        return name in (self._dict if self._dict is not None else self._where)

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in (self._dict if self._dict is not None else self._where) if n.startswith(prefix))

    def get(self, name: str) -> torch.Tensor:
        if name not in self:
            fail(_FUNC, "source", f"must hold the tensor '{name}'", "it is missing")
        self.read.add(name)
        if self._dict is not None:
            tensor = self._dict[name]
            if not isinstance(tensor, torch.Tensor):
                fail(_FUNC, "source", f"must map '{name}' to a torch.Tensor", type(tensor).__name__, TypeError)
            return tensor
        return self._open(self._where[name], lambda f: f.get_tensor(name))


def _expect(name: str, tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        fail(_FUNC, "source", f"must hold '{name}' of shape {shape} (from the config)", f"shape {tuple(tensor.shape)}")
    return tensor


def load_layer(source, *, layer: int, config=None, dtype: torch.dtype | None = None,
               device="cpu") -> tuple[LayerWeights, Routing]:
    """``(LayerWeights, Routing)`` of MoE layer ``layer``; tensors cast to ``dtype`` (default: as
    stored) and moved to ``device``. The router keeps the dtype it is stored in (bf16 in the real
    checkpoints: a GPU then computes its float32 logits on tensor cores, exact products, see
    :func:`moe_kernels.kernels.routing.gate`); the bias and the scales stay float32."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        fail(_FUNC, "layer", "must be an int >= 0", repr(layer), TypeError)
    if layer < 0:
        fail(_FUNC, "layer", "must be an int >= 0", repr(layer))
    if dtype is not None:
        check_dtype(_FUNC, "dtype", dtype, FLOAT_DTYPES)
    device = check_device(_FUNC, "device", device)
    tensors = _Tensors(source)  # checks source before the config beside it is looked for
    if config is None and not isinstance(source, Mapping):
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
        config = folder / "config.json"
    if isinstance(config, (str, Path)):
        if not Path(config).exists():
            fail(_FUNC, "config", "must be a config dict or the path of a config.json", str(config))
        config = _read_json(Path(config), "config")
    if not isinstance(config, Mapping):
        fail(_FUNC, "config", "must be a config dict or the path of a config.json", type(config).__name__, TypeError)
    routing, n = routing_from_config(config)
    d, f, e = n["d"], n["f"], n["e"]
    prefix = f"model.layers.{layer}.mlp."

    stored = {}   # the dtype the expert weights are stored in: every one must share it

    def take(name, shape, as_dtype=dtype, weight=True):
        t = _expect(prefix + name, tensors.get(prefix + name), shape)
        if weight:
            first = stored.setdefault("dtype", (t.dtype, prefix + name))
            fp8 = torch.float8_e4m3fn
            if (t.dtype == fp8) != (first[0] == fp8) or (as_dtype is None and t.dtype != first[0]):
                fail(_FUNC, "source", f"must store '{prefix + name}' as {str(first[0]).replace('torch.', '')}, like "
                     f"'{first[1]}' (mixed expert dtypes{'' if as_dtype is None else ' of fp8 and 16/32-bit'})",
                     str(t.dtype).replace("torch.", ""), TypeError)
        # fp8 weights stay fp8 (their scales come with them); ``dtype`` casts 16/32-bit ones.
        keep = t.dtype == torch.float8_e4m3fn or as_dtype is None
        return t.to(device=device, dtype=t.dtype if keep else as_dtype)

    def blocks(rows, cols):
        return (-(-rows // 128), -(-cols // 128))

    def scale(name, rows, cols):   # DeepSeek-V3's weight_scale_inv: one float32 per 128x128 block
        return take(name + "_scale_inv", blocks(rows, cols), torch.float32, weight=False)

    scales = {}
    if prefix + "experts.gate_up_proj" in tensors:   # fused 3-D layout
        w13 = take("experts.gate_up_proj", (e, 2 * f, d))
        w2 = take("experts.down_proj", (e, d, f))
        if w13.dtype == torch.float8_e4m3fn:
            scales = dict(w13_scale=take("experts.gate_up_proj_scale_inv", (e, *blocks(2 * f, d)), torch.float32,
                                         weight=False),
                          w2_scale=take("experts.down_proj_scale_inv", (e, *blocks(d, f)), torch.float32, weight=False))
    elif prefix + "experts.0.gate_proj.weight" in tensors:
        w13 = torch.stack([torch.cat([take(f"experts.{i}.gate_proj.weight", (f, d)),
                                      take(f"experts.{i}.up_proj.weight", (f, d))]) for i in range(e)])
        w2 = torch.stack([take(f"experts.{i}.down_proj.weight", (d, f)) for i in range(e)])
        if w13.dtype == torch.float8_e4m3fn:
            if f % 128:
                fail(_FUNC, "config['moe_intermediate_size']", "must be a multiple of 128 to stack the gate and "
                     "up block scales of an fp8 checkpoint", f)
            scales = dict(
                w13_scale=torch.stack([torch.cat([scale(f"experts.{i}.gate_proj.weight", f, d),
                                                  scale(f"experts.{i}.up_proj.weight", f, d)]) for i in range(e)]),
                w2_scale=torch.stack([scale(f"experts.{i}.down_proj.weight", d, f) for i in range(e)]))
    else:
        fail(_FUNC, "source", f"must hold layer {layer}'s experts ('{prefix}experts.0.gate_proj.weight' or "
             f"'{prefix}experts.gate_up_proj'): is it an MoE layer?", "neither is there")
    router = take("gate.weight", (e, d), None, weight=False)
    bias = take("gate.e_score_correction_bias", (e,), torch.float32, weight=False) \
        if prefix + "gate.e_score_correction_bias" in tensors else None
    shared_w13 = shared_w2 = shared_gate = None
    s = n["shared"] or n["gated_shared"]
    if s:
        # DeepSeek: mlp.shared_experts (n_shared_experts of width F); Qwen2-MoE: mlp.shared_expert, gated.
        where = "shared_experts." if n["shared"] else "shared_expert."
        shared_w13 = torch.cat([take(where + "gate_proj.weight", (s, d)), take(where + "up_proj.weight", (s, d))])
        shared_w2 = take(where + "down_proj.weight", (d, s))
        if n["gated_shared"]:
            shared_gate = take("shared_expert_gate.weight", (1, d), torch.float32, weight=False)
        if shared_w13.dtype == torch.float8_e4m3fn:
            scales.update(shared_w13_scale=torch.cat([scale(where + "gate_proj.weight", s, d),
                                                      scale(where + "up_proj.weight", s, d)]),
                          shared_w2_scale=scale(where + "down_proj.weight", d, s))
    unread = [name for name in tensors.names(prefix) if name not in tensors.read]
    if unread:
        fail(_FUNC, "source", f"must hold only tensors of layer {layer}'s MoE block that this loader reads (a shared "
             "expert needs n_shared_experts or shared_expert_intermediate_size in the config)",
             f"{len(unread)} unread: {', '.join(unread[:4])}{' ...' if len(unread) > 4 else ''}")
    return LayerWeights(router, w13, w2, bias, shared_w13, shared_w2, **scales, shared_gate=shared_gate), routing
