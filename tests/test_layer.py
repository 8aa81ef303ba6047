"""The whole layer (moe_kernels.layer) and the checkpoint loader (moe_kernels.checkpoint).

Both model styles, every layout, the shared expert separate and fused, against the float64
direct reference; the loader on small safetensors files written here (no downloads).
"""

import dataclasses
import json
import re

import pytest
import torch

from moe_kernels import MODELS, LayerWeights, MoELayer, Routing, moe_layer
from moe_kernels.checkpoint import load_layer
from moe_testing import DEVICE, needs_gpu, rel_err

pytestmark = pytest.mark.usefixtures("true_fp32")

STYLES = [("qwen3-30b-a3b", "separate"), ("deepseek-v3", "separate"), ("deepseek-v3", "fused")]


def small_layer(model, shared_expert="separate", layout="index_gather", dtype=torch.float32, seed=0, d=32, f=16,
                experts=32):
    """``model``'s routing style at a small shape with ``experts`` routed experts (None: the model's
    own). 32 keeps DeepSeek-V3's 8 groups and top-8 and keeps the interpreter quick."""
    style = MODELS[model] if experts is None else dataclasses.replace(MODELS[model], num_experts=experts)
    return MoELayer.random(style, hidden_size=d, intermediate_size=f, dtype=dtype, device=DEVICE, seed=seed,
                           layout=layout, shared_expert=shared_expert)


def tokens(n, d, dtype=torch.float32, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# Every style in every layout at 1 token; at 7 tokens every style in the index-gather layout and
# Qwen3's in the permute layout. The other layouts at 7 tokens add nothing the 1-token cases and the
# layouts' own tests (tests/test_permute.py, tests/test_masked.py) do not cover, and under the
# interpreter they are the slowest cases of the suite (10-17 s each).
CASES = [(n, m, s, lay) for n in (1, 7) for m, s in STYLES for lay in ("index_gather", "permute", "masked")
         if n == 1 or lay == "index_gather" or (m, lay) == ("qwen3-30b-a3b", "permute")]


@pytest.mark.parametrize("num_tokens, model, shared, layout", CASES)
def test_layer_matches_float64_reference(model, shared, layout, num_tokens):
    layer = small_layer(model, shared, layout)
    x = tokens(num_tokens, 32)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, layer.reference(x)) < 1e-5


def test_routing_follows_the_model():
    qwen, ds = Routing.of(MODELS["qwen3-30b-a3b"]), Routing.of(MODELS["deepseek-v3"])
    assert (qwen.scoring_func, qwen.top_k, qwen.num_expert_group, qwen.routed_scaling_factor) == ("softmax", 8, None, 1.0)
    assert (ds.scoring_func, ds.num_expert_group, ds.topk_group, ds.routed_scaling_factor) == ("sigmoid", 8, 4, 2.5)
    layer = small_layer("deepseek-v3")
    assert layer.weights.bias is not None and layer.weights.shared_w13.shape == (32, 32)
    assert small_layer("qwen3-30b-a3b").weights.shared_w13 is None


def test_separate_and_fused_shared_expert_agree():
    x = tokens(9, 32)
    separate, fused = small_layer("deepseek-v3", "separate"), small_layer("deepseek-v3", "fused")
    assert fused.weights.w13.shape[0] == 33 and fused.weights.shared_fused
    assert rel_err(fused(x), separate(x).double()) < 1e-5


def test_empty_batch():
    layer = small_layer("qwen3-30b-a3b")
    assert layer(tokens(0, 32)).shape == (0, 32)


def test_bad_arguments():
    layer = small_layer("qwen3-30b-a3b")
    x = tokens(3, 32)
    with pytest.raises(ValueError, match=re.escape("moe_layer: argument 'layout' must be one of")):
        moe_layer(x, layer.weights, routing=layer.routing, layout="dense")
    with pytest.raises(TypeError, match=re.escape("moe_layer: argument 'routing' must be a Routing")):
        moe_layer(x, layer.weights, routing={"top_k": 8})
    with pytest.raises(ValueError, match=re.escape("moe_layer: argument 'hidden_states' must be [T, d=32]")):
        moe_layer(x[:, :16], layer.weights, routing=layer.routing)
    with pytest.raises(ValueError, match=re.escape("MoELayer: argument 'hidden_states' must be [T, d=32]")):
        layer(x[:, :16])
    with pytest.raises(ValueError, match=re.escape("MoELayer: argument 'shared_expert' must be")):
        MoELayer(layer.weights, layer.routing, shared_expert="both")
    with pytest.raises(ValueError, match=re.escape("MoELayer.random: argument 'model' must be a MoEModel")):
        MoELayer.random("gpt-5", dtype=torch.float32, device="cpu", seed=0)


@needs_gpu
@pytest.mark.parametrize("layout", ["index_gather", "permute", "masked"])
@pytest.mark.parametrize("model, shared", STYLES)
def test_layer_bf16_gpu(model, shared, layout):
    layer = small_layer(model, shared, layout, dtype=torch.bfloat16, d=512, f=256, experts=None)
    x = tokens(100, 512, torch.bfloat16)
    assert rel_err(layer(x), layer.reference(x)) < 1e-2


# ---- the checkpoint loader ------------------------------------------------------------------


QWEN_CONFIG = {"hidden_size": 16, "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2,
               "norm_topk_prob": True}
DS_CONFIG = {"hidden_size": 16, "moe_intermediate_size": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
             "norm_topk_prob": True, "scoring_func": "sigmoid", "n_group": 4, "topk_group": 2,
             "routed_scaling_factor": 2.5, "n_shared_experts": 1}


def checkpoint_tensors(config, layer, *, fused, seed=0):
    """A layer's tensors under Hugging Face names, plus the LayerWeights they must load as."""
    g = torch.Generator().manual_seed(seed)
    d, f = config["hidden_size"], config["moe_intermediate_size"]
    e = config.get("n_routed_experts", config.get("num_experts"))
    p = f"model.layers.{layer}.mlp."
    gate_w, up, down = torch.randn(e, f, d, generator=g), torch.randn(e, f, d, generator=g), torch.randn(e, d, f, generator=g)
    router = torch.randn(e, d, generator=g)
    state = {p + "gate.weight": router, "model.embed_tokens.weight": torch.randn(10, d, generator=g)}
    if fused:
        state[p + "experts.gate_up_proj"] = torch.cat([gate_w, up], dim=1)
        state[p + "experts.down_proj"] = down
    else:
        for i in range(e):
            state[p + f"experts.{i}.gate_proj.weight"] = gate_w[i]
            state[p + f"experts.{i}.up_proj.weight"] = up[i]
            state[p + f"experts.{i}.down_proj.weight"] = down[i]
    bias = shared_w13 = shared_w2 = None
    if config.get("scoring_func") == "sigmoid":
        bias = torch.randn(e, generator=g) * 0.01
        state[p + "gate.e_score_correction_bias"] = bias
    if config.get("n_shared_experts"):
        sg, su, sd = torch.randn(f, d, generator=g), torch.randn(f, d, generator=g), torch.randn(d, f, generator=g)
        state.update({p + "shared_experts.gate_proj.weight": sg, p + "shared_experts.up_proj.weight": su,
                      p + "shared_experts.down_proj.weight": sd})
        shared_w13, shared_w2 = torch.cat([sg, su]), sd
    return state, LayerWeights(router, torch.cat([gate_w, up], dim=1), down, bias, shared_w13, shared_w2)


def write_shards(folder, state, config, *, with_index):
    """Split ``state`` over two safetensors shards (with or without the index) and write config.json."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / shard))
    if with_index:
        weight_map = {k: shard for shard, keys in halves.items() for k in keys}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))


def assert_same_weights(loaded, expected):
    for name in ("gate", "w13", "w2", "bias", "shared_w13", "shared_w2"):
        a, b = getattr(loaded, name), getattr(expected, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a.float().cpu(), b.float()), name


@pytest.mark.parametrize("config", [QWEN_CONFIG, DS_CONFIG], ids=["qwen-style", "deepseek-style"])
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
@pytest.mark.parametrize("with_index", [True, False])
def test_loader_reads_safetensors_shards(tmp_path, config, fused, with_index):
    state, expected = checkpoint_tensors(config, layer=3, fused=fused)
    write_shards(tmp_path / "ckpt", state, config, with_index=with_index)
    weights, routing = load_layer(tmp_path / "ckpt", layer=3)
    assert_same_weights(weights, expected)
    assert routing.top_k == 2 and routing.renormalize
    layer = MoELayer.from_pretrained_layer(tmp_path / "ckpt", layer=3, device=DEVICE)
    x = tokens(5, 16)
    assert rel_err(layer(x), layer.reference(x)) < 1e-5


def test_loader_from_one_file_and_from_a_state_dict(tmp_path):
    from safetensors.torch import save_file

    state, expected = checkpoint_tensors(DS_CONFIG, layer=0, fused=False)
    save_file(state, str(tmp_path / "one.safetensors"))
    weights, routing = load_layer(tmp_path / "one.safetensors", layer=0, config=DS_CONFIG)
    assert_same_weights(weights, expected)
    assert (routing.scoring_func, routing.num_expert_group, routing.topk_group, routing.routed_scaling_factor) == \
        ("sigmoid", 4, 2, 2.5)
    assert_same_weights(load_layer(state, layer=0, config=DS_CONFIG)[0], expected)
    bf16, _ = load_layer(state, layer=0, config=DS_CONFIG, dtype=torch.bfloat16)
    stored = state["model.layers.0.mlp.gate.weight"].dtype
    assert bf16.w13.dtype == torch.bfloat16 and bf16.gate.dtype == stored   # the router keeps its stored dtype
    assert bf16.bias.dtype == torch.float32


def test_loader_errors_name_what_is_wrong(tmp_path):
    state, _ = checkpoint_tensors(QWEN_CONFIG, layer=1, fused=False)
    cases = [
        (dict(source=state, layer=0, config=QWEN_CONFIG), "must hold layer 0's experts"),
        (dict(source=state, layer=-1, config=QWEN_CONFIG), "argument 'layer' must be an int >= 0"),
        (dict(source=state, layer=1, config={**QWEN_CONFIG, "moe_intermediate_size": 6}),
         "must hold 'model.layers.1.mlp.experts.0.gate_proj.weight' of shape (6, 16)"),
        (dict(source=state, layer=1, config={**QWEN_CONFIG, "num_experts_per_tok": None}),
         "argument 'config['num_experts_per_tok']' must be a positive int"),
        (dict(source={k: v for k, v in state.items() if "experts.2.up_proj" not in k}, layer=1, config=QWEN_CONFIG),
         "must hold the tensor 'model.layers.1.mlp.experts.2.up_proj.weight'"),
        (dict(source=tmp_path / "nothing-here", layer=1, config=QWEN_CONFIG), "argument 'source' must be a state dict"),
        (dict(source=state, layer=1, config=tmp_path / "config.json"), "argument 'config' must be a config dict"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=re.escape(message)):
            load_layer(**kwargs)


# ---- the package's layers ---------------------------------------------------------------------


def test_model_never_imports_kernels():
    """model/ is pure arithmetic: no module there imports kernels/ (checked in the source and in a
    fresh interpreter)."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    model_dir = Path(__file__).resolve().parent.parent / "moe_kernels" / "model"
    for path in sorted(model_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = "." * node.level + (node.module or "")
                assert "kernels" not in target and "bench" not in target and "book" not in target, (path.name, target)
    code = ("import sys, importlib, pkgutil, moe_kernels.model as m\n"
            "[importlib.import_module(i.name) for i in pkgutil.iter_modules(m.__path__, 'moe_kernels.model.')]\n"
            "print(sorted(n for n in sys.modules if n.startswith('moe_kernels.kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


QWEN2_CONFIG = {"hidden_size": 16, "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2,
                "norm_topk_prob": False, "shared_expert_intermediate_size": 24}


@pytest.mark.parametrize("shared_expert", ["separate", "fused", "auto"])
def test_loader_reads_a_qwen2_moe_gated_shared_expert(tmp_path, shared_expert):
    """Qwen2-MoE: a shared expert of its own width, its output times sigmoid(x @ shared_expert_gate).
    "auto" keeps a shared expert wider than the routed ones apart (it cannot be stacked as expert E)."""
    config = QWEN2_CONFIG if shared_expert != "fused" else {**QWEN2_CONFIG, "shared_expert_intermediate_size": 8}
    state, expected = checkpoint_tensors(config, layer=0, fused=False)
    g = torch.Generator().manual_seed(7)
    s, p = config["shared_expert_intermediate_size"], "model.layers.0.mlp."
    shared = {n: torch.randn(shape, generator=g) / 4 for n, shape in
              (("gate_proj", (s, 16)), ("up_proj", (s, 16)), ("down_proj", (16, s)))}
    state.update({p + f"shared_expert.{n}.weight": t for n, t in shared.items()})
    state[p + "shared_expert_gate.weight"] = torch.randn(1, 16, generator=g)
    weights, routing = load_layer(state, layer=0, config=config)
    assert torch.equal(weights.shared_gate, state[p + "shared_expert_gate.weight"]) and not routing.renormalize
    assert torch.equal(weights.shared_w13, torch.cat([shared["gate_proj"], shared["up_proj"]]))
    layer = MoELayer(weights, routing, shared_expert=shared_expert).to(DEVICE)
    assert layer.weights.shared_fused == (shared_expert == "fused")
    x = tokens(6, 16)
    out = layer(x)
    assert rel_err(out, layer.reference(x)) < 1e-5
    # The gate is really applied: the same layer without it differs by the gated share.
    ungated = MoELayer(LayerWeights(weights.gate, weights.w13, weights.w2, None, weights.shared_w13, weights.shared_w2),
                       routing).to(DEVICE)
    xs = x.cpu().double()
    h = xs @ torch.cat([shared["gate_proj"], shared["up_proj"]]).double().T
    ffn = (torch.nn.functional.silu(h[:, :s]) * h[:, s:]) @ shared["down_proj"].double().T
    gate_value = torch.sigmoid(xs @ state[p + "shared_expert_gate.weight"].double().T)
    assert rel_err(out.cpu(), ungated(x).cpu().double() - ffn + gate_value * ffn) < 1e-5


def test_a_layer_checks_its_routing_and_layout_again_when_they_change():
    layer = small_layer("qwen3-30b-a3b")
    x = tokens(3, 32)
    layer(x)
    layer.routing = Routing(top_k=MODELS["qwen3-30b-a3b"].num_experts + 2)
    with pytest.raises(ValueError, match=re.escape("MoELayer: argument 'routing' must have top_k <= the number")):
        layer(x)
    layer.routing = Routing.of(MODELS["qwen3-30b-a3b"])
    layer.layout = "gather"
    with pytest.raises(ValueError, match=re.escape("MoELayer: argument 'layout' must be one of")):
        layer(x)
    layer.layout = "permute"
    assert rel_err(layer(x), layer.reference(x)) < 1e-5 and layer.plan(3, dtype=x.dtype).layout == "permute"
    with pytest.raises(ValueError, match=re.escape("MoELayer: argument 'shared_expert' must be chosen when")):
        layer.shared_expert = "fused"


def test_the_shared_expert_beside_setting_is_checked_and_changes_nothing_uncaptured(monkeypatch):
    """``layer_shared.SHARED_BESIDE`` forks only inside a CUDA-graph capture: an uncaptured call (replays off, so
    that every call runs the layer's Python) runs the shared expert in line and gives the same output with the
    setting on and off; a setting it does not know is refused by name, with or without a shared expert."""
    from moe_kernels import _replay, layer_shared

    monkeypatch.setattr(_replay, "ENABLED", False)
    says = re.escape("moe_kernels.layer_shared: argument 'SHARED_BESIDE' must be one of")
    for model in ("deepseek-v3", "qwen3-30b-a3b"):
        layer, x = small_layer(model), tokens(7, 32)
        monkeypatch.setattr(layer_shared, "SHARED_BESIDE", "side")
        with pytest.raises(ValueError, match=says):
            layer(x)
        monkeypatch.setattr(layer_shared, "SHARED_BESIDE", None)
        inline = layer(x)
        monkeypatch.setattr(layer_shared, "SHARED_BESIDE", "experts")
        assert torch.equal(layer(x), inline), model
