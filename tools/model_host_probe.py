"""Host time of the experts call inside a transformers model, on a GPU: Qwen3-30B-A3B's real layer
shapes with two layers, one eager decode step at a time; for moe_kernels and no_experts, the host
microseconds per experts call (a clock around each call) and whether fused_experts' plans run
as CUDA graphs. ``PYTHONPATH=. python tools/model_host_probe.py [batch ...]``"""
import inspect
import sys
import time

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
        ALL_EXPERTS_FUNCTIONS.register(impl, experts)
        tail = sorted(clock[-40:])
        print(f"batch {batch} {impl}: experts call host {1e6 * tail[len(tail) // 2]:.1f} us (least "
              f"{1e6 * tail[0]:.1f}), step host {1e3 * sorted(steps[-10:])[5]:.2f} ms", flush=True)
    print("  fused_experts plans (launches, graph refusal, graphs):",
          [(p.num_launches, p.graphs and p.graphs.refusal,
            p.graphs and sum(len(s.graphs) for s in p.graphs.by_stream.values())) for p in _PLANS.plans.values()],
          "last refusal:", _PLANS.last_refusal, flush=True)
