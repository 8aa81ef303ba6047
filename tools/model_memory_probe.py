"""Where the GPU's memory goes around a decode step's CUDA-graph capture, on a GPU: DeepSeek-V3's real
layer shapes (one dense and three MoE layers, as ``bench model`` builds them) at one batch. At 512
sequences ``bench model`` could capture no implementation's step: out of memory, with about 70 GiB in
tensors of the 139.8 the process held. This prints, after each stage (the model built, the prefill,
an eager step and a capture per implementation, each followed by ``empty_cache``), the memory the
process holds on the device (``mem_get_info``), what the caching allocator has reserved, what live
tensors take, and what CUDA-graph pools hold; and records it (``model-memory-<batch>.json``).
``PYTHONPATH=. python tools/model_memory_probe.py [batch]`` (default 512)."""
import inspect
import sys

import torch
from transformers import StaticCache

from moe_kernels.bench.cli import write_record
from moe_kernels.bench.model_step import build_model, cached_lengths
from moe_kernels.bench.timing import captured
from moe_kernels.integrations.transformers import register

GIB = 2**30
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 512
context = 128
stages = []


def report(stage: str, error: str | None = None) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    row = {"stage": stage, "process_gib": (total - free) / GIB, "reserved_gib": torch.cuda.memory_reserved() / GIB,
           "allocated_gib": torch.cuda.memory_allocated() / GIB,
           "inactive_split_gib": stats.get("inactive_split_bytes.all.current", 0) / GIB,
           "segments": stats.get("segment.all.current", 0)}
    if error:
        row["error"] = error[:300]
    stages.append(row)
    print(f"{stage:<40} process {row['process_gib']:6.1f}  reserved {row['reserved_gib']:6.1f}  "
          f"tensors {row['allocated_gib']:6.1f} GiB  segments {row['segments']}" + (f"  ({error[:80]})" if error else ""))


register()
model = build_model("deepseek-v3", device="cuda", dtype=torch.bfloat16)
report("built")
name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
gen = torch.Generator(device="cuda").manual_seed(batch)
prompt = torch.randint(3, model.config.vocab_size, (batch, context), device="cuda", generator=gen)
token = torch.randint(3, model.config.vocab_size, (batch, 1), device="cuda", generator=gen)
cache = StaticCache(config=model.config, max_cache_len=context + 1)
model.set_experts_implementation("moe_kernels")
with torch.no_grad():
    model(input_ids=prompt, logits_to_keep=1, **{name: cache})
report("prefill")
torch.cuda.empty_cache()
report("prefill, emptied")
lengths = cached_lengths(cache)


def step():
    torch._foreach_mul_(lengths, 0)
    torch._foreach_add_(lengths, context)
    with torch.no_grad():
        return model(input_ids=token, **{name: cache}).logits


for impl in ("moe_kernels", "grouped_mm"):
    model.set_experts_implementation(impl)
    step()
    report(f"{impl}: eager step")
    torch.cuda.empty_cache()
    report(f"{impl}: eager step, emptied")
    errors = []
    graph = captured(step, calls=1, errors=errors, free_cached=True)
    report(f"{impl}: graph captured" if graph is not None else f"{impl}: capture failed",
           errors[0] if errors else None)
    del graph
    torch.cuda.empty_cache()
    report(f"{impl}: graph dropped, emptied")
write_record(f"model-memory-{batch}", {"model": "deepseek-v3", "moe_layers": 3, "batch": batch, "context": context,
                                       "stages": stages}, None)
