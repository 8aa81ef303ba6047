"""``python -m moe_kernels.bench model`` (moe_kernels.bench.model_step) on the CPU: the decode step
of a two-layer toy Qwen3-MoE model with every experts implementation, the rows it records, and
the real configs it builds on a GPU against the package's model shapes."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
mt = pytest.importorskip("moe_kernels.integrations.transformers")
if not mt.available():
    pytest.skip(f"transformers {transformers.__version__} has no experts registry (transformers >= 5 has)",
                allow_module_level=True)

from moe_kernels.bench import model_step, timing  # noqa: E402
from moe_kernels.model.shapes import MODELS  # noqa: E402


def test_a_toy_model_steps_with_every_implementation():
    data = model_step.run(["qwen3-30b-a3b"], [2], tiny=True, device="cpu", context=3, steps=1, log=lambda line: None)
    rows = data["rows"]
    impls = [r["implementation"] for r in rows]
    assert impls[0] == "eager" and "moe_kernels" in impls and impls[-1] == model_step.NO_EXPERTS
    for row in rows:
        assert row["moe_layers"] == 2 and row["batch"] == 2 and row["graph_ms"] is None   # no GPU: no graph
        if "error" in row:   # an implementation this torch lacks on a CPU is reported, not fatal
            continue
        assert row["eager_ms"] > 0 and row["eager_us_per_token"] == pytest.approx(row["eager_ms"] * 500)
        if row["implementation"] not in (model_step.NO_EXPERTS, "eager"):
            assert row["logits_compared_with"] == "eager" and row["logits_rel_err"] < 1e-5, row
            assert row["routing_agreement"] == [1.0, 1.0], row   # float32: every token routed alike, both layers
        if row["implementation"] != model_step.NO_EXPERTS:
            assert "eager_experts_ms" in row
            # the first MoE layer's output against float64 (its own inputs): a float32 rounding
            assert row["first_moe_layer_rel_err"] < 1e-5, row
        else:
            assert "first_moe_layer_rel_err" not in row and "routing_agreement" not in row
    assert not any("error" in r for r in rows if r["implementation"] in ("eager", "moe_kernels"))
    # eager: EAGER_ROUNDS rounds per implementation, interleaved, each kept
    assert all(len(r["eager_rounds_ms"]) == model_step.EAGER_ROUNDS for r in rows if "error" not in r)
    # the rounds' orders follow the balanced design over the implementations that ran
    timed = [r for r in rows if "error" not in r]
    names = [r["implementation"] for r in timed]
    design = timing.balanced_orders(len(names))
    assert timed[0]["eager_round_orders"] == [[names[i] for i in design[t % len(design)]]
                                             for t in range(model_step.EAGER_ROUNDS)]
    ours = next(r for r in timed if r["implementation"] == "moe_kernels")
    others = {r["implementation"] for r in timed} - {"moe_kernels", model_step.NO_EXPERTS}
    assert set(ours["eager_rounds_faster_than"]) == others
    assert all(0 <= n <= model_step.EAGER_ROUNDS for n in ours["eager_rounds_faster_than"].values())


def test_a_deepseek_v3_toy_steps_with_its_dense_layer_and_shared_expert():
    """DeepSeek-V3 runs on the GPU with one dense layer and a few MoE layers (its MLA attention, grouped
    routing and shared expert); the same path at toy sizes: our logits match the Python loop's."""
    data = model_step.run(["deepseek-v3"], [2], tiny=True, device="cpu", context=3, steps=1, log=lambda line: None)
    model = model_step.build_model("deepseek-v3", device="cpu", dtype=torch.float32, tiny=True)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["DeepseekV3MLP", "DeepseekV3MoE"]
    rows = {r["implementation"]: r for r in data["rows"]}
    ours = rows["moe_kernels"]
    assert "error" not in ours and ours["moe_layers"] == 1 and ours["logits_compared_with"] == "eager"
    assert ours["logits_rel_err"] < 1e-5 and ours["eager_ms"] > 0
    assert ours["routing_agreement"] == [1.0] and ours["first_moe_layer_rel_err"] < 1e-5
    assert data["note"] == "DeepSeek-V3 at toy sizes with 1 dense and 1 MoE layer"
    assert (data["steps"], data["eager_rounds"]) == (1, model_step.EAGER_ROUNDS)


def test_a_profiled_batch_says_where_the_step_goes():
    data = model_step.run(["qwen3-30b-a3b"], [2], tiny=True, device="cpu", context=2, steps=1, log=lambda line: None,
                          profile_batches=(2,))
    profiled = {r["implementation"]: r["profile"] for r in data["rows"] if "profile" in r}
    assert "eager" not in profiled and "moe_kernels" in profiled
    ours = profiled["moe_kernels"]
    assert ours["experts_calls_per_step"] == 2 and ours["experts_host_us_per_step"] > 0   # two MoE layers
    assert ours["by_host_time"] and all(e["us_per_step"] >= 0 for e in ours["by_host_time"])


def test_the_record_is_written_after_every_batch():
    """A run cut short keeps the batches it finished: after_batch sees the rows so far."""
    seen = []
    model_step.run(["qwen3-30b-a3b"], [1, 2], tiny=True, device="cpu", context=2, steps=1,
                   after_batch=lambda data: seen.append(sorted({r["batch"] for r in data["rows"]})),
                   log=lambda line: None)
    assert seen == [[1], [1, 2]]


def test_the_expert_loop_can_be_left_out_above_a_batch():
    """Above ``eager_loop_max_batch`` transformers' Python loop is skipped (said in its row) and
    the others compare their logits with the first implementation that ran."""
    data = model_step.run(["qwen3-30b-a3b"], [1, 3], tiny=True, device="cpu", context=2, steps=1,
                          eager_loop_max_batch=2, log=lambda line: None)
    loop = {r["batch"]: r for r in data["rows"] if r["implementation"] == "eager"}
    assert "skipped" not in loop[1] and "up to 2 tokens" in loop[3]["skipped"] and loop[3]["eager_ms"] is None
    ours = next(r for r in data["rows"] if r["implementation"] == "moe_kernels" and r["batch"] == 3)
    assert ours["logits_compared_with"] != "eager" and ours["logits_rel_err"] < 1e-5


def test_a_step_repeats_at_the_same_position():
    """The cache's device-side lengths are rewound before each step: two steps give one answer."""
    model = model_step.build_model("qwen3-30b-a3b", device="cpu", dtype=torch.float32, tiny=True)
    cache = transformers.StaticCache(config=model.config, max_cache_len=5)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
        lengths = model_step.cached_lengths(cache)
        outs = []
        for _ in range(2):
            for length in lengths:
                length.fill_(4)
            outs.append(model(input_ids=torch.tensor([[9]]), past_key_values=cache).logits)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("name", sorted(model_step.HF_CONFIGS))
def test_the_real_configs_match_the_model_shapes(name):
    _, _, sizes = model_step.HF_CONFIGS[name]
    shape = MODELS[name]
    experts = sizes.get("num_experts", sizes.get("n_routed_experts"))
    assert (sizes["hidden_size"], sizes["moe_intermediate_size"], experts, sizes["num_experts_per_tok"],
            sizes["num_hidden_layers"]) == (shape.hidden_size, shape.moe_intermediate_size, shape.num_experts,
                                            shape.top_k, shape.num_layers)


def test_the_command_checks_its_arguments_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit) as exit_:
        model_step.main(["--models", "mixtral-8x7b"])
    assert exit_.value.code == 2 and "no transformers config" in capsys.readouterr().err


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_orders_put_each_after_each_other_equally_often(n):
    import collections

    orders = timing.balanced_orders(n)
    assert len(orders) == (2 * n if n % 2 else n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = collections.Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1
    places = collections.Counter((x, i) for order in orders for i, x in enumerate(order))
    assert len(set(places.values())) == 1


def test_the_recorded_calls_tell_a_rounding_from_a_rerouted_token():
    """model_accuracy on a toy model: the first layer's error is the implementation's own (a
    wrong output shows, a right one does not), and the agreement counts the tokens whose expert
    set changed, per layer."""
    from moe_kernels.bench.model_accuracy import ExpertsCalls, recording_experts_calls

    model = model_step.build_model("qwen3-30b-a3b", device="cpu", dtype=torch.float32, tiny=True)
    mt.register()
    model.set_experts_implementation("moe_kernels")
    tokens = torch.randint(3, model.config.vocab_size, (4, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), recording_experts_calls(model) as calls:
        model(input_ids=tokens)
    assert len(calls.ids) == 2 and calls.ids[0].shape == (12, model.config.num_experts_per_tok)
    assert calls.first_layer_rel_err() < 1e-6
    module, hidden, index, weights, output = calls.first
    calls.first = (module, hidden, index, weights, output * 1.01)   # a 1% error shows as one
    assert calls.first_layer_rel_err() == pytest.approx(0.01, rel=1e-3)
    other = ExpertsCalls()
    other.ids = [calls.ids[0].clone(), calls.ids[1].clone()]
    other.ids[1][:3] = -1   # three of twelve tokens routed elsewhere in the second layer
    assert calls.agreement(other) == [1.0, 0.75]
    assert all(not m._forward_hooks for m in mt._experts_modules(model))   # the hooks are gone after the step


def test_the_recorded_calls_refuse_what_they_cannot_read():
    """An experts call without its three arguments, and steps with different numbers of MoE layers,
    get an error naming what is wrong, not a KeyError or a silently shortened comparison."""
    from moe_kernels.bench.model_accuracy import ExpertsCalls

    calls = ExpertsCalls()
    with pytest.raises(ValueError, match="must pass hidden_states, top_k_index, top_k_weights.*'top_k_weights'"):
        calls.record(None, (torch.zeros(2, 4), torch.zeros(2, 2, dtype=torch.long)), {}, torch.zeros(2, 4))
    calls.record(None, (torch.zeros(1, 2, 4),), {"top_k_index": torch.tensor([[[1, 0], [2, 3]]]),
                                                 "top_k_weights": torch.ones(1, 2, 2)}, torch.zeros(1, 2, 4))
    assert calls.ids[0].tolist() == [[0, 1], [2, 3]] and calls.first[1].shape == (2, 4)   # tokens on one axis
    other = ExpertsCalls()
    with pytest.raises(ValueError, match="argument 'other' must hold as many MoE layers' calls as this step"):
        calls.agreement(other)
