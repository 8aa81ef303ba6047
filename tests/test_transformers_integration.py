"""moe_kernels as a transformers experts implementation (moe_kernels.integrations.transformers).

Tiny random models of three MoE families whose experts go through transformers' experts registry
(Qwen3-MoE, DeepSeek-V3, Mixtral), built from their config classes (nothing is downloaded), in
float32: Triton's interpreter computes bf16 dots wrongly, so on the CPU the kernels are compared in
float32. Each model runs with experts_implementation="eager" (transformers' own loop) and with
"moe_kernels"; the logits agree to float32 accuracy and greedy generation picks the same tokens.
Every layout of the contract the kernels cannot run is refused, naming the attribute.
"""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
mt = pytest.importorskip("moe_kernels.integrations.transformers")
if not mt.available():
    pytest.skip(f"transformers {transformers.__version__} has no experts registry (transformers >= 5 has)",
                allow_module_level=True)

from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

from moe_kernels._runtime import record_launches  # noqa: E402
from moe_kernels.kernels.formats import FORMATS  # noqa: E402
from moe_kernels.reference import moe_reference_fp8  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                         q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
}
PROMPT = torch.tensor([[1, 17, 42, 5, 88, 23]])


def tiny_model(family: str, seed: int = 0, **overrides):
    """A tiny random ``family`` model in float32, eval mode, weights drawn so that every expert
    matters: matrices ~ N(0, 1/fan_in) (transformers' init, std 0.02, would leave the experts'
    share of the logits near float32 noise)."""
    config_name, model_name, sizes = FAMILIES[family]
    config = getattr(transformers, config_name)(**TINY, **{**sizes, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))


@pytest.fixture(scope="module")
def runs():
    """Per family: the model, and its logits and greedy tokens under "eager" and "moe_kernels"
    (computed once; the tests below read them)."""
    mt.register()
    out = {}
    for family in FAMILIES:
        model = tiny_model(family)
        result = {"model": model}
        for impl in ("eager", "moe_kernels"):
            model.set_experts_implementation(impl)
            with torch.no_grad(), record_launches() as launches:
                result[impl, "logits"] = model(PROMPT).logits
            result[impl, "launches"] = [name for name, _ in launches]
            generated = model.generate(PROMPT, max_new_tokens=8, do_sample=False, min_new_tokens=8,
                                       pad_token_id=0)
            result[impl, "tokens"] = generated[0, PROMPT.shape[1]:].tolist()
        out[family] = result
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(runs, family):
    run = runs[family]
    assert run["model"].config._experts_implementation == "moe_kernels"
    # The kernels ran: two grouped GEMMs per MoE layer (DeepSeek-V3's first layer is dense).
    moe_layers = 2 - FAMILIES[family][2].get("first_k_dense_replace", 0)
    assert run["moe_kernels", "launches"].count("index_gather.gemm") == 2 * moe_layers
    assert run["eager", "launches"] == []
    assert rel_err(run["moe_kernels", "logits"], run["eager", "logits"]) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_eager(runs, family):
    assert len(runs[family]["eager", "tokens"]) == 8
    assert runs[family]["moe_kernels", "tokens"] == runs[family]["eager", "tokens"]


def test_register_is_idempotent():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    mt.register()
    mt.register()
    for registry in (ALL_EXPERTS_FUNCTIONS, ALL_FP8_EXPERTS_FUNCTIONS):
        assert registry["moe_kernels"] is mt.moe_kernels_experts
        assert list(registry).count("moe_kernels") == 1
        assert registry.get_interface("moe_kernels", None) is mt.moe_kernels_experts


def test_from_pretrained_with_experts_implementation(runs, tmp_path):
    mt.register()
    runs["qwen3_moe"]["model"].save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="moe_kernels",
                                                              dtype=torch.float32)
    assert model.config._experts_implementation == "moe_kernels"
    with torch.no_grad():
        logits = model(PROMPT).logits
    assert rel_err(logits, runs["qwen3_moe"]["eager", "logits"]) < 1e-5


# ---- one experts module at a time ------------------------------------------------------------------


def qwen3_experts(seed: int = 0, implementation: str = "moe_kernels", **sizes):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    sizes = {"hidden_size": 32, "moe_intermediate_size": 16, "num_experts": 4, **sizes}
    experts = Qwen3MoeExperts(transformers.Qwen3MoeConfig(**sizes, experts_implementation=implementation))
    randomize(experts, seed)
    return experts


def randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(module, name)
            fan_in = p.shape[1] if getattr(module, "is_transposed", False) else p.shape[2]
            p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


def routed_tokens(num_tokens=7, d=32, num_experts=4, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, d, generator=g)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(1)[:, :k]
    return x, ids, torch.rand(num_tokens, k, generator=g)


def run(module, implementation, *inputs):
    module.config._experts_implementation = implementation
    with torch.no_grad():
        return module(*inputs)


def test_transposed_weights_run_from_a_cached_copy():
    """Aria's experts hold [E, d, 2F] / [E, F, d] (is_transposed=True): transposed once, kept,
    and rebuilt when a weight changes."""
    from transformers.models.aria.modeling_aria import AriaExperts

    mt.register()
    config = transformers.AriaTextConfig(hidden_size=32, intermediate_size=16, moe_num_experts=4, moe_topk=2,
                                         experts_implementation="moe_kernels")
    experts = AriaExperts(config)
    randomize(experts, 0)
    plan = mt.check_experts(experts)
    assert plan.copied and tuple(plan.w1.shape) == (4, 32, 32) and tuple(plan.w2.shape) == (4, 32, 16)
    assert mt.check_experts(experts) is plan   # kept
    inputs = routed_tokens()
    assert rel_err(run(experts, "moe_kernels", *inputs), run(experts, "eager", *inputs)) < 1e-5
    with torch.no_grad():
        experts.down_proj.mul_(-2)   # in place: a new version of the weight
    assert mt.check_experts(experts) is not plan
    assert rel_err(run(experts, "moe_kernels", *inputs), run(experts, "eager", *inputs)) < 1e-5


def test_untransposed_weights_are_read_in_place():
    experts = qwen3_experts()
    plan = mt.check_experts(experts)
    assert not plan.copied
    assert plan.w1.data_ptr() == experts.gate_up_proj.data_ptr()
    assert plan.w2.data_ptr() == experts.down_proj.data_ptr()


def _custom_gate(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate.clamp(max=7.0)) * up


# (what to change on a tiny Qwen3-MoE experts module, the attribute the error must name)
UNSUPPORTED = {
    "bias": (lambda m: setattr(m, "has_bias", True), "has_bias"),
    "interleaved gate/up": (lambda m: setattr(m, "is_concatenated", False), "is_concatenated"),
    "no gate": (lambda m: setattr(m, "has_gate", False), "has_gate"),
    "post-expert norm": (lambda m: setattr(m, "has_post_expert_norm", True), "has_post_expert_norm"),
    "expert parallel": (lambda m: setattr(m, "_is_expert_parallel", True), "_is_expert_parallel"),
    "gelu": (lambda m: setattr(m, "act_fn", ACT2FN["gelu"]), "act_fn"),
    "own gate function": (lambda m: setattr(m, "_apply_gate", _custom_gate), "_apply_gate"),
    "fp8 without scales": (lambda m: setattr(m, "gate_up_proj", torch.nn.Parameter(
        m.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False)), "gate_up_proj_scale_inv"),
    "int8 weights": (lambda m: setattr(m, "gate_up_proj", torch.nn.Parameter(
        m.gate_up_proj.detach().to(torch.int8), requires_grad=False)), "gate_up_proj"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_layouts_are_refused_by_name(case):
    change, attribute = UNSUPPORTED[case]
    mt.register()
    experts = qwen3_experts()
    inputs = routed_tokens()
    reference = run(experts, "moe_kernels", *inputs)   # first sight: checked and kept
    assert reference.shape == (7, 32)
    change(experts)
    for func, call in (("check_experts", lambda: mt.check_experts(experts)),
                       ("moe_kernels_experts", lambda: run(experts, "moe_kernels", *inputs))):
        with pytest.raises(NotImplementedError, match=rf"^{func}: argument 'Qwen3MoeExperts\.{re.escape(attribute)}' "):
            call()


def test_real_modules_and_configs_that_cannot_run_are_refused():
    """GPT-OSS's experts (biases, interleaved gate/up, a clamped gate) and a model whose config
    asks for another activation: refused when enable() checks them, before any forward."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gpt_oss = GptOssExperts(transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4))
    with pytest.raises(NotImplementedError, match=r"^check_experts: argument 'GptOssExperts\.has_bias' must be False"):
        mt.check_experts(gpt_oss)
    model = tiny_model("mixtral", hidden_act="gelu")
    with pytest.raises(NotImplementedError, match=r"^enable: argument 'MixtralExperts\.act_fn' must be SiLU"):
        mt.enable(model)
    assert model.config._experts_implementation != "moe_kernels"   # not switched
    with pytest.raises(ValueError, match=r"^enable: argument 'model' must hold experts modules"):
        mt.enable(torch.nn.Linear(2, 2))


def test_a_call_that_needs_gradients_is_refused():
    experts = qwen3_experts()
    experts.config._experts_implementation = "moe_kernels"
    with pytest.raises(NotImplementedError, match=r"^moe_kernels_experts: argument 'Qwen3MoeExperts\.gate_up_proj' "
                                                  r"must not need gradients"):
        experts(*routed_tokens())


def test_enable_switches_a_model():
    model = tiny_model("qwen3_moe", seed=3)
    model.set_experts_implementation("eager")
    assert mt.enable(model) is model
    assert model.config._experts_implementation == "moe_kernels"


def test_experts_modules_found_without_the_expert_parallel_flag():
    """transformers 5.17 (the H200's) sets no ``_is_expert_parallel`` on experts modules: they are
    still found (``enable`` and ``bench model``'s layer count rely on it) and still run."""
    model = tiny_model("qwen3_moe", seed=3)
    modules = mt._experts_modules(model)
    assert len(modules) == model.config.num_hidden_layers
    for module in modules:
        del module._is_expert_parallel   # (set in __init__ by later releases' decorator)
    assert mt._experts_modules(model) == modules and mt.enable(model) is model
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        model.set_experts_implementation("eager")
        assert rel_err(ours, model(input_ids=ids).logits) < 1e-5


def test_the_plan_key_reads_attributes_as_getattr_does():
    """check_experts' key looks attributes up without nn.Module's slow path for missing names; it
    must see what ``getattr(module, name, None)`` sees: instance values, parameters, submodules,
    class attributes, methods bound to the module, properties, and None for a missing name."""
    model = tiny_model("qwen3_moe", seed=1)
    module = mt._experts_modules(model)[0]
    cls = type("Probed", (type(module),), {"from_class": 7, "computed": property(lambda self: self.from_class + 1),
                                           "method": lambda self: None})
    probed = cls.__new__(cls)
    probed.__dict__.update(module.__dict__)
    probed.has_bias = False
    for name in ("gate_up_proj", "down_proj", "act_fn", "_apply_gate", "has_bias", "from_class", "computed",
                 "method", "no_such_attribute", "training", "forward"):
        ours, expected = mt._attribute(probed, name), getattr(probed, name, None)
        assert ours is expected or ours == expected, name   # (a bound method is a new object each time)
    probed.from_class = 9   # an instance value over the class's
    assert mt._attribute(probed, "from_class") == 9 and mt._attribute(probed, "computed") == 10
    assert mt._plan_key(module) == mt._plan_key(module) and mt.check_experts(module) is mt.check_experts(module)


# ---- fp8: transformers' FP8Experts with 128x128 block scales ----------------------------------------


def fp8_experts():
    """A tiny transformers ``FP8Experts`` (what a fine-grained fp8 checkpoint loads into), its
    weights quantised with this package's block quantiser (the same format: fp8 x scale per
    128x128 block). A subclass, so that decorating it leaves transformers' class alone."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    cls = use_experts_implementation(type("TinyFP8Experts", (FP8Experts,), {}),
                                     experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    config = transformers.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=128, num_experts=4,
                                         experts_implementation="moe_kernels")
    experts = cls(config, block_size=(128, 128))
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(4, 256, 128, generator=g) / 128**0.5, torch.randn(4, 128, 128, generator=g) / 128**0.5
    with torch.no_grad():
        for name, w in (("gate_up_proj", w1), ("down_proj", w2)):
            q, scale = FORMATS["block"].quantize_weight(w)
            getattr(experts, name).copy_(q)
            getattr(experts, name + "_scale_inv").copy_(scale)
    return experts


def test_fp8_block_experts_pass_their_scales():
    mt.register()
    experts = fp8_experts()
    plan = mt.check_experts(experts)
    assert plan.format == "fp8-block" and plan.w1_scale is experts.gate_up_proj_scale_inv
    x, ids, weights = routed_tokens(num_tokens=5, d=128)
    with torch.no_grad():
        out = experts(x, ids, weights)
        ref = moe_reference_fp8(x, experts.gate_up_proj, experts.down_proj, weights, ids,
                                w1_scale=experts.gate_up_proj_scale_inv, w2_scale=experts.down_proj_scale_inv,
                                granularity="block", intermediate_dtype=torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5


def test_the_model_bench_checks_an_fp8_layer_against_its_fp8_reference():
    """bench model's first-layer check (model_accuracy) reads fp8 experts through their plan too."""
    from moe_kernels.bench.model_accuracy import recording_experts_calls

    mt.register()
    experts = fp8_experts()
    x, ids, weights = routed_tokens(num_tokens=5, d=128)
    with torch.no_grad(), recording_experts_calls(experts) as calls:
        experts(x, ids, weights)
    assert len(calls.ids) == 1 and calls.first_layer_rel_err() < 1e-5


def _ue8m0(scale):
    return torch.nn.Parameter(scale.detach().to(torch.float8_e8m0fnu), requires_grad=False)


# (attribute, the value that makes it a format the kernels do not read, the error)
FP8_UNSUPPORTED = {
    "per-tensor scales": ("block_size", lambda m: None, NotImplementedError),
    "1x128 weight blocks": ("block_size", lambda m: (1, 128), NotImplementedError),
    "static activation scales": ("activation_scheme", lambda m: "static", NotImplementedError),
    "ue8m0 scales": ("gate_up_proj_scale_inv", lambda m: _ue8m0(m.gate_up_proj_scale_inv), TypeError),
}


@pytest.mark.parametrize("case", FP8_UNSUPPORTED)
def test_fp8_formats_the_kernels_do_not_read_are_refused(case):
    attribute, value, error = FP8_UNSUPPORTED[case]
    experts = fp8_experts()
    setattr(experts, attribute, value(experts))
    with pytest.raises(error, match=rf"^check_experts: argument 'TinyFP8Experts\.{attribute}' "):
        mt.check_experts(experts)
