"""A whole model's decode step, per experts implementation: ``python -m moe_kernels.bench model``.

The chapter argues for one layer that a decode step stops growing once the batch touches every
expert. This measures it on a model: transformers builds Qwen3-30B-A3B at its real sizes from its
config (:data:`HF_CONFIGS`; random bf16 weights, about 61 GB, nothing downloaded), fills a static
KV cache of ``context`` tokens per sequence with one prefill, then times one decode step (one new
token per sequence) for each experts implementation the installed transformers offers
(``eager``, ``grouped_mm``, ``batched_mm``) and ``moe_kernels``:

* eager: ``steps`` steps back to back from Python, host time included (what ``generate`` pays),
  in rounds interleaved over the implementations (a slow drift of the host or of the GPU's
  clocks then reaches each alike; the orders balanced, :func:`~.timing.balanced_orders`), the median
  round kept, and for
  ``moe_kernels`` the rounds in which it was faster than each other implementation;
* graph: the step captured in a CUDA graph and replayed (no host time), where the implementation
  can be captured (one that reads values back to the host cannot: None);
* ``no_experts``: the same step with every experts call returning zeros, so that the step minus
  this is the experts' share.

Each step first rewinds the cache's device-side lengths to ``context`` (two launches), so that it
repeats at the same position; the rewind alone is timed too (``rewind_ms``) and is inside every
step time.

Each implementation's logits are compared with the first implementation's (the relative error is
in each row), and one that fails on this machine gets its error in its row instead of times. Two
numbers say where a difference comes from (:mod:`~.model_accuracy`): the first MoE layer's output
against float64 (``first_moe_layer_rel_err``, each implementation's own rounding) and, per MoE
layer, the fraction of tokens routed as in the first implementation's step (``routing_agreement``:
a nearly tied router score can send a token elsewhere once the layers before differ by a rounding).
``profile_batches`` also profile one step per implementation (:mod:`~.model_profile`).

Beside each: the byte model's time for the experts' weights the batch touches in all MoE layers
(:func:`~moe_kernels.model.costs.moe_layer_weight_bytes` over the read bandwidth measured in the
same run). DeepSeek-V3 (671 B parameters) does not fit on one GPU: it runs its real layer shapes
with ``--moe-layers`` MoE layers (default 3) after one dense layer, and the record says so.

``tiny=True`` (the tests, on a CPU) runs the same code on a toy config of the model in float32.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys

import torch

from .cli import add_record_arguments, model_names, positive_ints, write_record
from .model_accuracy import recording_experts_calls
from .model_profile import profile_step
from .model_timing import allocated_bytes, eager_step_ms, free_cached_memory, graph_step_ms, peak_bytes
from .timing import balanced_orders

DEFAULT_BATCHES = (1, 8, 64, 256, 512)
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm", "moe_kernels")
NO_EXPERTS = "no_experts"
#: Eager timing rounds per implementation, interleaved (one round of each in turn).
EAGER_ROUNDS = 5
#: transformers config class, model class, and the real sizes (each model's config.json on the
#: Hugging Face hub: Qwen/Qwen3-30B-A3B, deepseek-ai/DeepSeek-V3).
HF_CONFIGS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
}
#: Toy sizes of each model's config (the CPU tests): the same code path, seconds under the
#: interpreter. Qwen3: two MoE layers; DeepSeek-V3: one dense layer, then MoE layers with a shared
#: expert, grouped routing and MLA attention, as on the GPU.
TINY = {
    "qwen3-30b-a3b": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, max_position_embeddings=256, intermediate_size=64,
                          moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "deepseek-v3": dict(vocab_size=96, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                        max_position_embeddings=256, intermediate_size=64, moe_intermediate_size=16,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}


def build_model(name: str, *, device, dtype, moe_layers: int | None = None, tiny: bool = False):
    """``name``'s transformers model with random weights on ``device`` (built there directly),
    in eval mode (``tiny``: :data:`TINY`'s sizes). DeepSeek-V3 keeps one dense layer and
    ``moe_layers`` MoE layers (default 3; tiny, 1)."""
    import transformers

    config_class, model_class, sizes = HF_CONFIGS[name]
    sizes = dict(TINY[name]) if tiny else dict(sizes)
    if name == "deepseek-v3":
        sizes.update(first_k_dense_replace=1, num_hidden_layers=1 + (moe_layers or (1 if tiny else 3)))
    elif moe_layers is not None:
        sizes["num_hidden_layers"] = moe_layers
    config = getattr(transformers, config_class)(**sizes)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # built in its dtype: a float32 copy of Qwen3-30B-A3B would not fit
    try:
        with torch.device(device):
            model = getattr(transformers, model_class)(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def _register_no_experts() -> None:
    """The ``no_experts`` implementation: every experts call returns zeros (the rest of the step)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NO_EXPERTS, lambda self, hidden_states, top_k_index, top_k_weights:
                                   torch.zeros_like(hidden_states))


def available_implementations() -> list[str]:
    """The implementations of :data:`IMPLEMENTATIONS` this transformers has, plus ``no_experts``
    (moe_kernels is registered here)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from ..integrations.transformers import register

    register()
    _register_no_experts()
    names = set(ALL_EXPERTS_FUNCTIONS.keys()) | {"eager"}
    return [name for name in IMPLEMENTATIONS if name in names] + [NO_EXPERTS]


def cached_lengths(cache) -> list:
    """The device-side lengths of a filled ``StaticCache``'s layers (transformers 5: each layer's
    ``cumulative_length``, advanced in place by every update). Setting them back makes a step
    repeatable, in a CUDA graph too."""
    lengths = [layer.cumulative_length for layer in getattr(cache, "layers", ())
               if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
    if not lengths:
        raise RuntimeError("this transformers' StaticCache keeps no device-side length per layer (transformers 5 "
                           "does): a decode step cannot be repeated at the same position")
    return lengths


def run(models, batches, *, context: int = 128, steps: int = 10, moe_layers: int | None = None, tiny: bool = False,
        device="cuda", eager_loop_max_batch: int | None = None, log=print, after_batch=None,
        profile_batches=(), eager_rounds: int = EAGER_ROUNDS) -> dict:
    """Rows of (model, implementation, batch): eager and graph step times, per-token cost, the
    experts' share, and the byte model's experts time. transformers' ``eager`` experts (a Python
    loop over the experts a batch touches) runs only up to ``eager_loop_max_batch`` tokens when
    that is given (on the H200 it takes over a second a step at 64); above it, logits are compared
    with the first implementation that ran. ``after_batch(data)``, if given, is called with the rows
    so far after each batch (a run cut short still leaves its record)."""
    from transformers import StaticCache

    from ..integrations.transformers import _experts_modules
    from ..model import costs, shapes

    dtype = torch.float32 if tiny else torch.bfloat16
    read_bw = None
    if torch.device(device).type == "cuda":
        from .ceilings import measure_read_bandwidth
        read_bw = measure_read_bandwidth()
        log(f"read bandwidth {read_bw / 1e12:.2f} TB/s")
    impls = available_implementations()
    rows = []
    for name in models:
        model = build_model(name, device=device, dtype=dtype, moe_layers=moe_layers, tiny=tiny)
        shape = shapes.MODELS[name]
        num_moe = len(list(_experts_modules(model)))
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns until 5.40)
        cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        for batch in batches:
            gen = torch.Generator(device=device).manual_seed(batch)
            vocab = model.config.vocab_size
            prompt = torch.randint(3, vocab, (batch, context), device=device, generator=gen)
            cache = StaticCache(config=model.config, max_cache_len=context + 1)
            token = torch.randint(3, vocab, (batch, 1), device=device, generator=gen)
            model.set_experts_implementation("moe_kernels" if "moe_kernels" in impls else impls[0])
            with torch.no_grad():
                # (only the last position's logits: all of them would be [batch, context, vocab])
                model(input_ids=prompt, logits_to_keep=1, **{cache_argument: cache})

            lengths = cached_lengths(cache)

            def rewind():   # every layer's length back to ``context``: two fused launches, not one per layer
                torch._foreach_mul_(lengths, 0)
                torch._foreach_add_(lengths, context)

            def step():   # always the token at position ``context``
                rewind()
                with torch.no_grad():
                    return model(input_ids=token, **{cache_argument: cache}).logits

            rewind_ms = {"eager": eager_step_ms(rewind, device, steps),
                         "graph": graph_step_ms(rewind, device, steps)[0]}
            predicted = None
            if read_bw is not None and not tiny:
                predicted = num_moe * costs.moe_layer_weight_bytes(batch, shape, "bf16") / read_bw * 1e3
            reference = None
            runnable = []   # (implementation, its row), timed eagerly below
            for impl in impls:
                row = {"model": name, "moe_layers": num_moe, "implementation": impl, "batch": batch,
                       "context": context, "predicted_experts_ms": predicted, "rewind_ms": rewind_ms}
                rows.append(row)
                if impl == "eager" and eager_loop_max_batch is not None and batch > eager_loop_max_batch:
                    row.update(skipped=f"the Python loop over experts is run up to {eager_loop_max_batch} tokens only",
                               eager_ms=None, graph_ms=None)
                    continue
                model.set_experts_implementation(impl)
                held = allocated_bytes(device, reset_peak=True)
                try:
                    with recording_experts_calls(model) as calls:   # (model_accuracy: why logits differ)
                        logits = step().float()   # also compiles and warms up
                except Exception as error:   # e.g. an implementation this torch lacks on this device
                    row.update(error=repr(error)[:600], eager_ms=None, graph_ms=None)
                    log(f"{name:<14} {impl:<12} batch {batch:>4}: failed: {row['error']}")
                    free_cached_memory(device)
                    continue
                step_bytes = peak_bytes(device) - held   # what one step allocates beyond what stays
                row["step_gib"] = step_bytes / 2**30
                if impl != NO_EXPERTS:
                    try:
                        row["first_moe_layer_rel_err"] = calls.first_layer_rel_err()
                    except Exception as error:   # a module the check refuses, or no memory for float64
                        row["first_moe_layer_error"] = repr(error)[:600]
                if reference is None and impl != NO_EXPERTS:
                    reference, reference_impl, reference_calls = logits, impl, calls
                elif impl != NO_EXPERTS:
                    row["logits_rel_err"] = float(torch.linalg.norm(logits - reference) / torch.linalg.norm(reference))
                    row["logits_compared_with"] = reference_impl
                    row["routing_agreement"] = calls.agreement(reference_calls)
                graph, graph_error = graph_step_ms(step, device, steps, step_bytes=step_bytes)
                if graph_error:
                    row["graph_error"] = graph_error
                row.update(graph_ms=graph, graph_us_per_token=None if graph is None else graph * 1e3 / batch)
                runnable.append((impl, row))
            # Eager rounds interleaved over the implementations (each round ``steps`` steps of one), so
            # that a drift of the host or of the GPU's clocks reaches every one alike; median. The orders
            # are balanced (no implementation always after the same one: the Python loop's rounds take
            # 10-100x the others' and leave the host in another state) and recorded.
            rounds = {impl: [] for impl, _ in runnable}
            names = [impl for impl, _ in runnable]
            design = balanced_orders(len(names))
            orders = []   # (below: a multiple of len(design) rounds completes the balance)
            if names and eager_rounds % len(design):
                log(f"{name:<14} batch {batch:>4}: {eager_rounds} rounds, {len(design)} balanced orders: incomplete")
            for turn in range(eager_rounds):
                order = [names[i] for i in design[turn % len(design)]] if names else []
                orders.append(order)
                for impl in order:
                    model.set_experts_implementation(impl)
                    rounds[impl].append(eager_step_ms(step, device, steps, rounds=1))
            for impl, row in runnable:
                eager = statistics.median(rounds[impl])
                row.update(eager_ms=eager, eager_rounds_ms=rounds[impl], eager_round_orders=orders,
                           eager_us_per_token=eager * 1e3 / batch)
                graph = row["graph_ms"]
                log(f"{name:<14} {impl:<12} batch {batch:>4}: eager {eager:8.2f} ms (rounds "
                    f"{min(rounds[impl]):.1f}-{max(rounds[impl]):.1f})  graph "
                    f"{'-' if graph is None else f'{graph:8.2f}'} ms  ({row['eager_us_per_token']:.1f} us/token eager)")
            ours = next((row for impl, row in runnable if impl == "moe_kernels"), None)
            if ours is not None:   # round by round against each other implementation (the host's
                # speed moves 10-50% between rounds; within a round the two ran seconds apart)
                ours["eager_rounds_faster_than"] = {
                    impl: sum(a < b for a, b in zip(rounds["moe_kernels"], rounds[impl]))
                    for impl, _ in runnable if impl not in ("moe_kernels", NO_EXPERTS)}
                faster = ours["eager_rounds_faster_than"]
                log(f"{name:<14} moe_kernels  batch {batch:>4}: faster in "
                    + ", ".join(f"{n} of {eager_rounds} rounds than {impl}" for impl, n in faster.items()))
            if batch in profile_batches:
                for impl, row in runnable:
                    if impl != "eager":   # (the Python loop: profiled long enough by its own time)
                        model.set_experts_implementation(impl)
                        row["profile"] = profile = profile_step(step, impl, device)
                        log(f"{name:<14} {impl:<12} batch {batch:>4}: profiled, GPU "
                            f"{profile['gpu_us_per_step'] / 1e3:.1f} ms/step, experts' host "
                            f"{(profile['experts_host_us_per_step'] or 0) / 1e3:.1f} ms/step; top GPU: "
                            + "; ".join(f"{e['name'][:40]} {e['us_per_step'] / 1e3:.1f}"
                                        for e in profile["by_gpu_time"][:4]))
            base = {key: next(r for r in rows if r["model"] == name and r["batch"] == batch
                              and r["implementation"] == NO_EXPERTS).get(key) for key in ("eager_ms", "graph_ms")}
            for row in rows:
                if row["model"] == name and row["batch"] == batch and row["implementation"] != NO_EXPERTS:
                    for key in ("eager_ms", "graph_ms"):
                        if row.get(key) is not None and base[key] is not None:
                            row[key.replace("_ms", "_experts_ms")] = row[key] - base[key]
            del cache
            if after_batch is not None:
                after_batch(_data(rows, read_bw, context, steps, eager_rounds, tiny))
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return _data(rows, read_bw, context, steps, eager_rounds, tiny)


def _data(rows, read_bw, context, steps, eager_rounds, tiny=False) -> dict:
    moe_layers = next((r["moe_layers"] for r in rows if r["model"] == "deepseek-v3"), None)
    note = None if moe_layers is None else (
        f"DeepSeek-V3 at {'toy sizes' if tiny else 'its real layer shapes'} with 1 dense and {moe_layers} MoE "
        f"layer{'s' * (moe_layers != 1)}" + ("" if tiny else " (the whole model does not fit on one GPU)"))
    return {"rows": rows, "read_bandwidth": read_bw, "context": context, "steps": steps,
            "eager_rounds": eager_rounds, "note": note}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=model_names, default=["qwen3-30b-a3b"])
    parser.add_argument("--batches", type=positive_ints, default=list(DEFAULT_BATCHES))
    parser.add_argument("--context", type=positive_ints, default=[128], help="tokens in each sequence's KV cache")
    parser.add_argument("--steps", type=positive_ints, default=[10], help="decode steps per timing round")
    parser.add_argument("--rounds", type=positive_ints, default=[EAGER_ROUNDS],
                        help="eager timing rounds per implementation, interleaved (the median is kept)")
    parser.add_argument("--eager-loop-max-batch", type=positive_ints, default=[8],
                        help="run transformers' eager experts (a Python loop) up to this batch only")
    parser.add_argument("--moe-layers", type=positive_ints, default=None,
                        help="MoE layers to build (default: the model's own; DeepSeek-V3: 3)")
    parser.add_argument("--profile-batches", type=positive_ints, default=[64, 512],
                        help="batches at which one eager step per implementation is also profiled")
    add_record_arguments(parser, "model-step")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in HF_CONFIGS]
    if unknown:
        parser.error(f"--models: no transformers config for {unknown}; choose from {sorted(HF_CONFIGS)}")
    if not torch.cuda.is_available():
        print("python -m moe_kernels.bench model: needs a CUDA GPU", file=sys.stderr)
        return 2
    def save(data):
        write_record(args.name or "model-step", data, args.results_dir)

    data = run(args.models, args.batches, context=args.context[0], steps=args.steps[0],
               moe_layers=None if args.moe_layers is None else args.moe_layers[0],
               eager_loop_max_batch=args.eager_loop_max_batch[0], after_batch=save if args.record else None,
               profile_batches=tuple(args.profile_batches), eager_rounds=args.rounds[0])
    if args.record:
        save(data)
    return 0
