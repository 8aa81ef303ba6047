"""The shared expert run separately or fused, timed on the GPU: ``python -m moe_kernels.bench.shared``.

One DeepSeek-V3 MoE layer in bf16 (256 routed experts, top-8, one shared expert of the same
width) at batches 1, 8, 64, 512 and 4096, two ways:

* **separate**: :func:`moe_kernels.kernels.shared.moe_with_shared_separate`, the routed grouped
  GEMM followed by the shared FFN as two cuBLAS GEMMs (what vLLM runs on NVIDIA);
* **fused**: :func:`moe_kernels.kernels.shared.moe_with_shared_fused`, the shared expert spliced
  in as expert 256 and top-9 run in one grouped GEMM (what SGLang runs).

Each batch is checked first: both outputs against the float64 reference
(:func:`moe_kernels.reference.moe_reference`) and against each other, relative error below
1e-2, or the run stops. Every time is a CUDA-graph replay (:func:`moe_kernels.bench.timing.graph_us`,
ids not range-checked, so nothing syncs with the host). Besides the two totals the parts are
timed alone: the routed experts, the shared FFN, and the fused grouped GEMM with the nine-slot ids
prepared beforehand (the splice itself is a few small torch kernels; SGLang does it inside its
top-k kernel). The separate way runs the routed shape's tuned tiles; the fused one the tiles tuned for
its own problem (``E + 1`` experts, top-``(k+1)``: ``bench tune --fused-shared``) where this GPU has a table
that covers the batch, else the routed shape's too (:func:`~moe_kernels.kernels.config.choose_fused_shared_config`; the
record's ``fused_config`` says which).

The shared expert alone is timed two ways too: as two cuBLAS GEMMs (``shared_us``) and on the
routed experts' kernels over a dense block map with the layer's tiles for it
(:func:`~moe_kernels.kernels.index_gather.dense_expert`, ``shared_dense_us``: the tuned E=1 table
where ``bench tune --shared`` wrote one), each against its own floor, the 88 MB of its weights over
the measured read bandwidth (``shared_floor_us``; the larger of that and its FLOPs over the GEMM rate).
Beside them, timed by the same method, a plain read of the same two weight tensors, one launch each
(``shared_read_us``, :func:`~moe_kernels.bench.ceilings.weight_reader`): the floor leaves out what
any two launches that stream 88 MB pay (start, ramp, tail): a plain-read reference for the GEMMs.

Bytes are counted for the ids drawn: the routed experts touched plus the shared expert
(``3 d F`` bf16 weights each), activations in and out; FLOPs are ``6 d F`` per row of the
``k + 1`` per token. The floor is ``max(bytes / bandwidth, FLOPs / GEMM rate)`` with both
ceilings measured in the same run (:mod:`moe_kernels.bench.ceilings`). ``--record`` writes
``results/<device>/shared-expert.json``. Needs a CUDA GPU; about a minute on an H200.

The counting runs anywhere. Two tokens of DeepSeek-V3 that share one routed expert::

    >>> ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [7, 8, 9, 10, 11, 12, 13, 14]])
    >>> work = count_work(MODELS["deepseek-v3"], ids, bytes_per_element=2)
    >>> work["experts_touched"], work["shared_weight_bytes"] == 3 * 7168 * 2048 * 2
    (15, True)
    >>> round(work["shared_weight_bytes"] / (work["routed_weight_bytes"] + work["shared_weight_bytes"]), 4)
    0.0625
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..model.shapes import MODELS, MoEModel
from .cli import add_record_arguments, positive_ints, write_record

BATCHES = (1, 8, 64, 512, 4096)
MAX_REL_ERR = 1e-2  # bf16 outputs of a 7168 x 2048 expert FFN
TIMED = ("separate_us", "routed_us", "shared_us", "shared_dense_us", "shared_read_us", "fused_us", "fused_gemms_us")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref))


def count_work(model: MoEModel, topk_ids: torch.Tensor, bytes_per_element: float) -> dict:
    """Weight bytes of the routed experts these ids touch and of the shared expert, activation
    bytes in and out, and the FLOPs of all ``k + 1`` slots per token."""
    num_tokens, top_k = topk_ids.shape
    touched = int(torch.unique(topk_ids).numel())
    return {
        "experts_touched": touched,
        "routed_weight_bytes": touched * model.expert_params * bytes_per_element,
        "shared_weight_bytes": model.expert_params * bytes_per_element,
        "activation_bytes": 2 * num_tokens * model.hidden_size * bytes_per_element,
        "flops": num_tokens * (top_k + 1) * model.expert_flops_per_token,
    }


def measure(batch: int, w1_all: torch.Tensor, w2_all: torch.Tensor, ceilings: dict, seed: int = 0,
            model: MoEModel = MODELS["deepseek-v3"]) -> dict:
    """Check, then time, both ways at one batch; ``w*_all`` hold the E routed experts and the shared one."""
    from ..kernels import index_gather
    from ..kernels.config import get_config
    from ..model import costs
    from ..kernels.blocks import use_naive_block_assignment
    from .problems import make_batch
    from ..reference import moe_reference
    from ..kernels.routing import append_shared_expert
    from ..kernels.config import TABLE_REACH, choose_config, choose_fused_shared_config
    from ..kernels.formats import FORMATS
    from ..kernels.shared import moe_with_shared_fused, moe_with_shared_separate, shared_expert_separate
    from .ceilings import weight_reader
    from .timing import graph_us

    num_experts, top_k = model.num_experts, model.top_k
    d, f = model.hidden_size, model.moe_intermediate_size
    dtype = w1_all.dtype
    # Views into the stacked tensors: the separate way reads the very same memory, no second copy.
    w1, w2, w1_shared, w2_shared = w1_all[:num_experts], w2_all[:num_experts], w1_all[num_experts], w2_all[num_experts]
    hidden, _, weights, ids = make_batch(model, batch, dtype, seed + batch, device=w1_all.device)
    config = get_config(batch, num_experts, f, d, dtype, hidden.device)

    def separate():
        return moe_with_shared_separate(hidden, w1, w2, weights, ids, w1_shared, w2_shared, config=config,
                                        validate_ids=False)

    fused_choice = choose_fused_shared_config(batch, num_experts, f, d, dtype, hidden.device)

    def fused():
        return moe_with_shared_fused(hidden, w1_all, w2_all, weights, ids, config=fused_choice.config,
                                     validate_ids=False)

    shared_choice = choose_config(batch, 1, f, d, dtype, hidden.device, reach=TABLE_REACH)   # as the layer does

    def shared_dense():
        return index_gather.dense_expert(hidden, w1_shared, w2_shared, fmt=FORMATS["none"],
                                         config=shared_choice.config)

    weights9, ids9 = append_shared_expert(weights, ids, num_experts)
    reference = moe_reference(hidden, w1_all, w2_all, weights9, ids9)
    out_separate, out_fused = separate(), fused()
    errors = {"rel_err_separate": _rel_err(out_separate, reference), "rel_err_fused": _rel_err(out_fused, reference),
              "rel_err_between": _rel_err(out_fused, out_separate.double()),
              "rel_err_shared_dense": _rel_err(shared_dense(), shared_expert_separate(hidden, w1_shared, w2_shared))}
    del reference, out_separate, out_fused
    if not all(err < MAX_REL_ERR for err in errors.values()):
        raise RuntimeError(f"batch {batch}: outputs disagree {errors} (limit {MAX_REL_ERR})")

    times = {
        "separate_us": graph_us(separate),
        "routed_us": graph_us(lambda: index_gather.fused_experts(hidden, w1, w2, weights, ids, config=config,
                                                              validate_ids=False)),
        "shared_us": graph_us(lambda: shared_expert_separate(hidden, w1_shared, w2_shared)),
        "shared_dense_us": graph_us(shared_dense),
        "shared_read_us": graph_us(weight_reader(w1_shared, w2_shared)),
        "fused_us": graph_us(fused),
        "fused_gemms_us": graph_us(lambda: index_gather.fused_experts(hidden, w1_all, w2_all, weights9, ids9,
                                                                   config=fused_choice.config, validate_ids=False)),
    }
    work = count_work(model, ids, dtype.itemsize)
    nbytes = work["routed_weight_bytes"] + work["shared_weight_bytes"] + work["activation_bytes"]
    floor_s = max(nbytes / ceilings["hbm_bandwidth"], work["flops"] / ceilings["gemm_rate_bf16"])
    shared_floor_s = max(work["shared_weight_bytes"] / ceilings["read_bandwidth"],
                         batch * model.expert_flops_per_token / ceilings["gemm_rate_bf16"])
    return {
        "batch": batch,
        **work,
        "experts_touched_model": costs.experts_touched(batch, num_experts, top_k),
        "floor_us": floor_s * 1e6,
        "shared_floor_us": shared_floor_s * 1e6,
        "shared_config": {"source": shared_choice.source, "table": shared_choice.table, "entry": shared_choice.entry,
                          **shared_choice.config.to_dict()},
        "naive_blocks_separate": use_naive_block_assignment(batch, top_k, num_experts),
        "naive_blocks_fused": use_naive_block_assignment(batch, top_k + 1, num_experts + 1),
        **errors,
        **times,
        "config": config.to_dict(),
        "fused_config": {"source": fused_choice.source, "table": fused_choice.table, "entry": fused_choice.entry,
                         **fused_choice.config.to_dict()},
    }


def _print_row(row: dict) -> None:
    def us(key):
        return "   n/a" if row[key] is None else f"{row[key]:8.1f}"

    share = row["shared_weight_bytes"] / (row["routed_weight_bytes"] + row["shared_weight_bytes"])
    print(f"B={row['batch']:5d} touched {row['experts_touched']:3d} shared share {share:6.2%} | "
          f"separate {us('separate_us')} (routed {us('routed_us')} + shared {us('shared_us')}) | "
          f"fused {us('fused_us')} (GEMMs {us('fused_gemms_us')}) | floor {row['floor_us']:8.1f} us | "
          f"shared dense {us('shared_dense_us')} read {us('shared_read_us')} floor {row['shared_floor_us']:6.1f} | "
          f"err {max(row['rel_err_separate'], row['rel_err_fused']):.1e}", flush=True)


def weights_with_shared_expert(model: MoEModel, seed: int = 0):
    """``model``'s random bf16 routed experts on the GPU with a random shared expert stacked as
    expert ``E`` (``w1_all [E+1, 2F, d]``, ``w2_all [E+1, d, F]``): the weights :func:`measure`
    takes. For DeepSeek-V3 that is 22.6 GB, and twice that while stacking."""
    from ..kernels.shared import stack_shared_expert
    from .problems import make_weights

    w1, w2 = make_weights(model, torch.bfloat16, seed)
    d, f = model.hidden_size, model.moe_intermediate_size
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    w1_shared = torch.randn(2 * f, d, device="cuda", dtype=torch.bfloat16, generator=g).mul_(d**-0.5)
    w2_shared = torch.randn(d, f, device="cuda", dtype=torch.bfloat16, generator=g).mul_(f**-0.5)
    w1_all, w2_all = stack_shared_expert(w1, w2, w1_shared, w2_shared)
    del w1, w2, w1_shared, w2_shared
    torch.cuda.empty_cache()
    return w1_all, w2_all


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=positive_ints, default=list(BATCHES), help="comma list of token counts")
    parser.add_argument("--seed", type=int, default=0)
    add_record_arguments(parser, "shared-expert")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels.bench.shared: needs a CUDA GPU", file=sys.stderr)
        return 2
    from .ceilings import measure_gemm_rate, measure_hbm_bandwidth, measure_read_bandwidth

    ceilings = {"hbm_bandwidth": measure_hbm_bandwidth(), "read_bandwidth": measure_read_bandwidth(),
                "gemm_rate_bf16": measure_gemm_rate()}
    print(f"ceilings: {ceilings['hbm_bandwidth'] / 1e12:.2f} TB/s, {ceilings['gemm_rate_bf16'] / 1e12:.0f} TFLOP/s")
    w1_all, w2_all = weights_with_shared_expert(MODELS["deepseek-v3"], args.seed)
    rows = []
    for batch in args.batches:
        rows.append(measure(batch, w1_all, w2_all, ceilings, args.seed))
        _print_row(rows[-1])
        torch.cuda.empty_cache()
    if args.record:
        data = {"model": "deepseek-v3", "dtype": "bf16", "ceilings": ceilings, "rows": rows}
        write_record(args.name or "shared-expert", data, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
