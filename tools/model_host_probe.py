"""Host time of the experts call inside a transformers model, on a GPU: Qwen3-30B-A3B's real layer
shapes with two layers, one eager decode step at a time; for moe_kernels and no_experts, the host
microseconds per experts call (a clock around each call) and whether fused_experts' plans run
as CUDA graphs; then, for moe_kernels, cProfile over the experts calls alone (20 steps), the
functions by their own time per call, and the arguments' layouts (what the model hands the
kernels: a dtype cast or a strided view costs a copy). ``PYTHONPATH=. python tools/model_host_probe.py [batch ...]``"""
import collections
import cProfile
import inspect
import pstats
import sys
import time
import warnings

import torch
from transformers import StaticCache
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from moe_kernels.bench.model_step import available_implementations, build_model, cached_lengths
from moe_kernels.kernels.index_gather import _PLANS

device = "cuda" if torch.cuda.is_available() else "cpu"
tiny = device == "cpu"
model = build_model("qwen3-30b-a3b", device=device, dtype=torch.float32 if tiny else torch.bfloat16,
                    moe_layers=2, tiny=tiny)
impls = available_implementations()
# (transformers 5.24 renamed past_key_values to cache)
name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
for batch in [int(b) for b in sys.argv[1:]] or [1, 64]:
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (batch, 16), device=device)
    cache = StaticCache(config=model.config, max_cache_len=17)
    token = torch.randint(3, vocab, (batch, 1), device=device)
    with torch.no_grad():
        model(input_ids=prompt, logits_to_keep=1, **{name: cache})
    lengths = cached_lengths(cache)
    step_profiles = {}
    # Does a step wait for the GPU anywhere (a read-back, a nonzero)? torch's sync debug mode warns at
    # each synchronising call: if a step has one per layer, the GPU's work is not hidden behind the
    # host's and an eager step costs host time plus GPU time, not the larger of the two.
    for impl in [i for i in ("moe_kernels", "no_experts", "grouped_mm", "batched_mm") if i in impls]:
        model.set_experts_implementation(impl)
        for _ in range(4):   # warm: fused_experts records its plans at a call's second sight, graphs at the fourth
            torch._foreach_mul_(lengths, 0)
            torch._foreach_add_(lengths, 16)
            with torch.no_grad():
                model(input_ids=token, **{name: cache})
        torch._foreach_mul_(lengths, 0)
        torch._foreach_add_(lengths, 16)
        if device == "cuda":
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                model(input_ids=token, **{name: cache})
            launched = time.perf_counter() - start
            torch.cuda.synchronize()
            print(f"batch {batch} {impl}: one step's host {1e3 * launched:.2f} ms, to the GPU's end "
                  f"{1e3 * (time.perf_counter() - start):.2f} ms", flush=True)
        if device != "cuda":
            print(f"batch {batch} {impl}: synchronising calls: n/a (no GPU)", flush=True)
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                torch._foreach_mul_(lengths, 0)
                torch._foreach_add_(lengths, 16)
                with torch.no_grad():
                    model(input_ids=token, **{name: cache})
            finally:
                torch.cuda.set_sync_debug_mode(before)
        # torch's warning at a synchronising call (the mode also warns once that it is a prototype: not counted)
        syncs = collections.Counter(str(w.message).splitlines()[0][:120] + " @ " + f"{w.filename.split('/')[-1]}:{w.lineno}"
                                    for w in caught if "called a synchronizing" in str(w.message))
        # (the mode sees torch's synchronising calls, not torch.cuda.synchronize() or an event's wait)
        print(f"batch {batch} {impl}: synchronising calls torch's sync debug mode sees in one step: "
              f"{sum(syncs.values())}", flush=True)
        for where, n in syncs.most_common(6):
            print(f"   x{n}  {where}", flush=True)
    for impl in ("moe_kernels", "no_experts"):
        experts, clock = ALL_EXPERTS_FUNCTIONS[impl], []

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = experts(*args, **kwargs)
            clock.append(time.perf_counter() - start)
            return out

        ALL_EXPERTS_FUNCTIONS.register(impl, timed)
        model.set_experts_implementation(impl)
        steps = []
        for _ in range(30):
            torch._foreach_mul_(lengths, 0)
            torch._foreach_add_(lengths, 16)
            start = time.perf_counter()
            with torch.no_grad():
                model(input_ids=token, **{name: cache})
            steps.append(time.perf_counter() - start)
        if impl == "moe_kernels":   # where the experts call's host time goes, inside the model
            profiler, seen = cProfile.Profile(), []

            def profiled(module, hidden, ids, weights):
                if not seen:
                    seen.append([(n, t.dtype, tuple(t.shape), t.stride(), t.is_contiguous())
                                 for n, t in (("hidden_states", hidden), ("top_k_index", ids), ("top_k_weights", weights))])
                profiler.enable()
                out = experts(module, hidden, ids, weights)
                profiler.disable()
                return out

            ALL_EXPERTS_FUNCTIONS.register(impl, profiled)
            model.set_experts_implementation(impl)
            for _ in range(20):
                torch._foreach_mul_(lengths, 0)
                torch._foreach_add_(lengths, 16)
                with torch.no_grad():
                    model(input_ids=token, **{name: cache})
            print(f"batch {batch} moe_kernels arguments:", seen[0], flush=True)
            stats = pstats.Stats(profiler)
            calls = 20 * len(clock) // 30 if clock else 1   # experts calls in the 20 profiled steps
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
            print(f"batch {batch} moe_kernels cProfile, us per experts call (own, cumulative), {calls} calls:")
            for (file, line, func), (_, ncalls, own, cum, _) in rows:
                print(f"   {1e6 * own / calls:7.1f} {1e6 * cum / calls:7.1f}  x{ncalls / calls:4.1f}  "
                      f"{func} ({file.split('/')[-1]}:{line})", flush=True)
        ALL_EXPERTS_FUNCTIONS.register(impl, experts)
        model.set_experts_implementation(impl)
        step_profiles[impl] = profiler = cProfile.Profile()   # 10 whole steps, to compare below
        for _ in range(10):
            torch._foreach_mul_(lengths, 0)
            torch._foreach_add_(lengths, 16)
            with torch.no_grad():
                profiler.enable()
                model(input_ids=token, **{name: cache})
                profiler.disable()
        tail = sorted(clock[-40:])
        print(f"batch {batch} {impl}: experts call host {1e6 * tail[len(tail) // 2]:.1f} us (least "
              f"{1e6 * tail[0]:.1f}), step host {1e3 * sorted(steps[-10:])[5]:.2f} ms", flush=True)
    # Where a step with the kernels spends host time that a step without experts does not: the
    # functions by their own time per step, moe_kernels minus no_experts (the experts call's own
    # functions are above; this shows what moves outside it, e.g. a wait in a launch).
    own = {impl: {k: v[2] / 10 for k, v in pstats.Stats(p).stats.items()} for impl, p in step_profiles.items()}
    diff = sorted(((t - own["no_experts"].get(k, 0.0), k) for k, t in own["moe_kernels"].items()), reverse=True)
    print(f"batch {batch} step host, own us per step, moe_kernels minus no_experts (top 15):")
    for d, (file, line, func) in diff[:15]:
        print(f"   {1e6 * d:8.1f}  {func} ({file.split('/')[-1]}:{line})", flush=True)
    # The experts call's host time taken apart without a profiler (cProfile inflates calls of many
    # small functions): the same arguments as the model hands them, 200 calls, one sync at the end.
    experts_modules = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "is_concatenated")]
    from moe_kernels.integrations.transformers import check_experts, moe_kernels_experts
    from moe_kernels.kernels.index_gather import fused_experts

    hidden = torch.randn(batch, model.config.hidden_size, device=device, dtype=experts_modules[0].gate_up_proj.dtype)
    ids = torch.stack([torch.randperm(model.config.num_experts, device=device)[:model.config.num_experts_per_tok]
                       for _ in range(batch)])   # int64, as the model hands them
    weights = torch.rand(batch, ids.shape[1], device=device, dtype=hidden.dtype)

    def host_us(call, modules, calls=20):
        """Host us per call over one round of ``calls`` calls, the GPU idle at its start (a sync
        before the clock) and its queue short enough (~5 entries a call) never to block a launch."""
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(calls):
            call(modules[i % len(modules)])
        return 1e6 * (time.perf_counter() - start) / calls

    parts = {
        "check_experts": lambda m: check_experts(m),
        "fused_experts (int64 ids, as handed)": lambda m: fused_experts(hidden, m.gate_up_proj, m.down_proj, weights,
                                                                         ids),
        "fused_experts (int32 ids)": lambda m, i=ids.to(torch.int32): fused_experts(hidden, m.gate_up_proj,
                                                                                    m.down_proj, weights, i),
        "moe_kernels_experts": lambda m: moe_kernels_experts(m, hidden, ids, weights),
    }
    # The parts interleaved, round by round (an earlier run timed them one after another and each
    # line came out slower than the one before it), one module and two alternating; medians of 15.
    rounds = {(label, n): [] for label in parts for n in (1, 2)}
    with torch.no_grad():
        for call in parts.values():   # warm: plans recorded and captured
            for _ in range(4):
                for m in experts_modules[:2]:
                    call(m)
        for _ in range(15):
            for label, call in parts.items():
                for n in (1, 2):
                    rounds[label, n].append(host_us(call, experts_modules[:n]))
    for label in parts:
        one, two = (sorted(rounds[label, n])[7] for n in (1, 2))
        print(f"batch {batch} host us per call, {label}: one module {one:.1f}, two alternating {two:.1f} "
              "(medians of 15 interleaved rounds of 20 calls)", flush=True)
    print("  fused_experts plans (launches, graph refusal, graphs):",
          [(p.num_launches, p.graphs and p.graphs.refusal,
            p.graphs and sum(len(s.graphs) for s in p.graphs.by_stream.values())) for p in _PLANS.plans.values()],
          "last refusal:", _PLANS.last_refusal, flush=True)
