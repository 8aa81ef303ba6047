"""Time the router and the alignment against their torch references: ``python -m moe_kernels.bench.routing``.

For batch 1 to 16384 at the two chapter shapes (DeepSeek-V3: grouped sigmoid top-8 of 256 with a
correction bias; Qwen3-30B-A3B: softmax top-8 of 128), and for ``moe_align_block_size`` at each
shape with the tile height vLLM's default config picks for that batch. Each call is timed by
``triton.testing.do_bench`` (median, CUDA events: "eager", launch cost included) and, for the
kernels, replayed from a CUDA graph (GPU time per call, launch cost gone: how a decode step runs
in an engine); see :mod:`moe_kernels.bench.timing`. Before timing, every kernel's output is compared
with its reference (ids exact). ``--record`` writes ``results/<device>/routing_align.json``.
``--gate`` measures instead how often the gate on tensor cores picks other experts than float64
logits (:func:`gate_agreement`; recorded as ``gate-agreement.json``); ``--gate-routing`` times the
router in one launch and in launches chained by PDL against the gate then the routing kernel
(:func:`gate_routing_ab`; ``gate-routing.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from ..kernels import align, blocks, grouped_routing, routing
from ..model.shapes import MODELS
from .cli import add_record_arguments, positive_ints, write_record
from .timing import eager_us, graph_us, graphed, median_ms

BATCHES = [2**i for i in range(15)]  # 1 .. 16384


def default_block_size(num_tokens: int) -> int:
    """vLLM's bf16 default M tile (``get_default_config`` in fused_moe.py): 16/32/64/128 by batch."""
    if num_tokens <= 32:
        return 16
    if num_tokens <= 96:
        return 32
    if num_tokens <= 512:
        return 64
    return 128


def routing_cases(num_tokens: int, generator: torch.Generator):
    """(name, kernel call, reference call) for the two shapes at one batch."""
    dsv3, qwen = MODELS["deepseek-v3"], MODELS["qwen3-30b-a3b"]
    hidden = torch.empty(num_tokens, 1, device="cuda")  # only the row count is read
    ds_logits = torch.randn(num_tokens, dsv3.num_experts, device="cuda", generator=generator)
    bias = 0.01 * torch.randn(dsv3.num_experts, device="cuda", generator=generator)
    qw_logits = torch.randn(num_tokens, qwen.num_experts, device="cuda", generator=generator)
    ds_args = (hidden, ds_logits, dsv3.top_k, True)
    ds_kwargs = dict(num_expert_group=dsv3.num_expert_groups, topk_group=dsv3.topk_groups, scoring_func="sigmoid",
                     routed_scaling_factor=dsv3.routed_scaling_factor, e_score_correction_bias=bias)
    qw_args = (hidden, qw_logits, qwen.top_k, True)
    return [
        ("grouped_topk DeepSeek-V3", lambda: grouped_routing.grouped_topk(*ds_args, **ds_kwargs),
         lambda: grouped_routing.grouped_topk_reference(*ds_args, **ds_kwargs)),
        ("fused_topk Qwen3-30B-A3B", lambda: routing.fused_topk(*qw_args),
         lambda: routing.fused_topk_reference(*qw_args)),
    ]


def align_cases(num_tokens: int, generator: torch.Generator):
    cases = []
    for model in (MODELS["deepseek-v3"], MODELS["qwen3-30b-a3b"]):
        E, k = model.num_experts, model.top_k
        ids = torch.rand(num_tokens, E, device="cuda", generator=generator).topk(k, dim=-1).indices.to(torch.int32)
        block = default_block_size(num_tokens)
        cases.append((f"moe_align_block_size {model.name} (block {block})",
                      lambda ids=ids, block=block, E=E: align.moe_align_block_size(ids, block, E, validate_ids=False),
                      lambda ids=ids, block=block, E=E: align.moe_align_block_size_reference(ids, block, E)))
    return cases


def gate_agreement(model_name: str, num_tokens: int, *, skewed: bool, seed: int = 0) -> dict:
    """How often the gate on tensor cores (bf16 operands, float32 sums: ``router_logits``) picks
    other experts than float64 logits do, against the float32 gate it replaced. A random bf16 gate
    of the model's real shape ``[E, d]`` and random bf16 tokens; ``skewed`` pushes every token
    toward experts 0-3 (their logits rise by about 2): they fill half of each top-8, and the top-k
    boundary moves into the tail of the other experts, where near-ties are rarer (a check that
    skew of this kind adds none). Each set of logits is routed by the model's rule (the package's kernels;
    float64 logits by the float32 torch reference). Returns the number of tokens whose expert set
    differs from float64's, and the largest logit error, for both gates; ``tie_explained``
    (plain top-k only) says whether every differing token had float64 logits at its top-k
    boundary closer than twice the tensor-core gate's largest error, i.e. was a near-tie."""
    from ..kernels.routing import router_logits
    from ..layer_spec import Routing

    model = MODELS[model_name]
    d, num_experts = model.hidden_size, model.num_experts
    generator = torch.Generator(device="cuda").manual_seed(seed)
    gate = (torch.randn(num_experts, d, device="cuda", generator=generator) * d**-0.5).to(torch.bfloat16)
    x = torch.randn(num_tokens, d, device="cuda", generator=generator)
    if skewed:
        x = x + 2.0 * gate[:4].float().sum(0) / gate[:4].float().pow(2).sum(1).mean()
    x = x.to(torch.bfloat16)
    bias = 0.01 * torch.randn(num_experts, device="cuda", generator=generator) if model.num_expert_groups > 1 else None
    rule = Routing.of(model)
    exact = x.double() @ gate.double().t()
    logits = {"tensor_core": router_logits(x, gate), "float32": torch.nn.functional.linear(x.float(), gate.float())}
    # The float32 reference routes the float64 logits rounded to float32 (a relative 6e-8, far
    # below the gates' errors).
    want = rule.route(x, exact.float(), bias, reference=True)[1].sort(dim=1).values
    row = {"model": model.name, "tokens": num_tokens, "skewed": skewed}
    for name, got in logits.items():
        ids = rule.route(x, got, bias)[1].sort(dim=1).values
        differ = (ids != want).any(dim=1)
        error = float((got.double() - exact).abs().max())
        row[f"differ_{name}"], row[f"max_logit_error_{name}"] = int(differ.sum()), error
        if name == "tensor_core" and bias is None:
            top = exact[differ].topk(rule.top_k + 1, dim=1).values
            row["tie_explained"] = bool(((top[:, -2] - top[:, -1]) <= 2 * error).all())
    return row


@contextlib.contextmanager
def topk_body(body):
    """The routing kernels' top-k body (:data:`~moe_kernels.kernels.routing.TOPK_BY_SORT`) set to ``body`` for
    the calls inside, as a variant to time (the launches read it; a CUDA graph keeps the one it captured)."""
    before, routing.TOPK_BY_SORT = routing.TOPK_BY_SORT, body
    try:
        yield
    finally:
        routing.TOPK_BY_SORT = before


def gate_routing_ab(model_name: str, num_tokens: int, *, seed: int = 0) -> dict:
    """The router several ways at one batch, each replayed from a CUDA graph (GPU us per call, with
    the L2 warm and flushed):

    * the gate on tensor cores then the routing kernel (two launches), and
      :func:`~moe_kernels.kernels.gate_routing.gate_and_route` (one launch, the gate split over the SMs);
    * with the alignment (blocks of :func:`default_block_size` rows): the two launches then
      ``moe_align_block_size`` (three launches, what the layer ran before the chain), the same with the
      routing kernel's top-k by one partial sort (``three launches sorted``), and
      :func:`~moe_kernels.kernels.gate_routing.gate_route_and_align` (one launch up to
      ``ALIGN_MAX_ASSIGNMENTS`` assignments; ``aligned_in_launch`` says whether it was);
    * up to ``chained_routing.MAX_TOKENS`` tokens,
      :func:`~moe_kernels.kernels.chained_routing.gate_route_chained` (the split gate, the routing
      and the alignment, three launches chained by PDL): ``chained`` (sorted top-k, PDL),
      ``chained rounds`` (k rounds of argmax), ``chained no pdl``, and ``chained routing only``
      (no alignment: two launches); the alignment launch's parts (``chained align wait only``: its
      wait and one read, the floor of a third launch; ``no tail``; ``other warps``; ``chunked``, the
      many-program body where the default is one program); and the gate's token
      block (``chained gate 16/32/64``, with and without the alignment);
    * ``read of the gate's operands``: one launch that only reads as many bytes as ``x`` and the gate's weight
      (:func:`~moe_kernels.bench.ceilings.weight_reader` on a buffer of that size, rounded up to 4 KiB): the
      floor of any router, which must read both before it can rank a token's experts.

    Checked first: the one-launch ids and weights equal the routing kernel's on its own logits, its
    logits are within the tensor-core gate's error of ``router_logits``', its alignment equals the
    reference's of its ids, and every chained variant with the one-launch router's gate tiles returns
    its ids, logits and alignment (weights to float32's last bits); the other gate blocks its logits
    to float32's rounding, and the same ids on at least 99% of the tokens (the count is recorded)."""
    from ..kernels import chained_routing, routing
    from ..kernels.gate_grid import gate_tiles
    from ..kernels.gate_routing import ALIGN_MAX_ASSIGNMENTS, gate_and_route, gate_route_and_align
    from ..kernels.routing import router_logits
    from ..layer_spec import Routing
    from .ceilings import weight_reader

    model = MODELS[model_name]
    d, num_experts = model.hidden_size, model.num_experts
    generator = torch.Generator(device="cuda").manual_seed(seed)
    gate = (torch.randn(num_experts, d, device="cuda", generator=generator) * d**-0.5).to(torch.bfloat16)
    x = torch.randn(num_tokens, d, device="cuda", generator=generator).to(torch.bfloat16)
    bias = 0.01 * torch.randn(num_experts, device="cuda", generator=generator) if model.num_expert_groups > 1 else None
    rule = Routing.of(model)
    grouped = dict(num_expert_group=rule.num_expert_group, topk_group=rule.topk_group,
                   routed_scaling_factor=rule.routed_scaling_factor, e_score_correction_bias=bias)
    block = default_block_size(num_tokens)

    def two_launches():
        return rule.route(x, router_logits(x, gate), bias, checked=True)

    def one_launch():
        return gate_and_route(x, gate, rule.top_k, rule.renormalize, rule.scoring_func, **grouped)

    def three_launches():
        weights, ids = two_launches()
        return weights, ids, align.moe_align_block_size(ids, block, num_experts, validate_ids=False)

    def three_launches_with(body):
        def call():
            with topk_body(body):   # read at the launch (captured so)
                return three_launches()
        return call

    # the routing kernel's other top-k bodies (its default, TOPK_BY_SORT, is "keyed" since session 43; records
    # before it have "three launches keyed" and three launches on the rounds)
    three_launches_sorted, three_launches_rounds = three_launches_with(True), three_launches_with(False)

    def one_launch_aligned():
        return gate_route_and_align(x, gate, rule.top_k, rule.renormalize, rule.scoring_func, block_size=block,
                                    **grouped)

    def chained(sorted_topk=True, pdl=True, aligned=True, gate_block_t=None, body="full", warps=None,
                one_tile_max=None):
        settings = ("ALIGN_BODY", "ALIGN_WARPS", "ONE_TILE_WARPS", "ONE_TILE_MAX_ASSIGNMENTS")   # read at the launch

        def call():
            before = [getattr(chained_routing, name) for name in settings]
            for name, value, old in zip(settings, (body, warps, warps, one_tile_max), before):
                setattr(chained_routing, name, old if value is None else value)
            try:
                return chained_routing.gate_route_chained(
                    x, gate, rule.top_k, rule.renormalize, rule.scoring_func, block_size=block if aligned else None,
                    sorted_topk=sorted_topk, pdl=pdl, gate_block_t=gate_block_t, **grouped)
            finally:
                for name, old in zip(settings, before):
                    setattr(chained_routing, name, old)
        return call

    weights, ids, logits = one_launch()
    own = rule.route(x, logits, bias, checked=True)
    # (ids exactly; weights to float32's last bits: the routing kernel alone sums over another tile of tokens)
    if not (torch.equal(ids, own[1]) and torch.allclose(weights, own[0], rtol=1e-5, atol=1e-7)):
        raise AssertionError(f"gate_and_route {model.name} at {num_tokens}: routing differs on its own logits")
    error = float((logits - router_logits(x, gate)).abs().max())
    differ = int((ids.sort(dim=1).values != two_launches()[1].sort(dim=1).values).any(dim=1).sum())
    aligned = one_launch_aligned()
    want = align.moe_align_block_size_reference(aligned[1], block, num_experts)
    if not (torch.equal(aligned[1], ids) and all(torch.equal(a, b) for a, b in zip(aligned[3:], want))):
        raise AssertionError(f"gate_route_and_align {model.name} at {num_tokens}: ids or alignment differ")
    plain_three = three_launches()
    for body, other in (("sorted", three_launches_sorted()), ("rounds", three_launches_rounds())):
        if not (torch.equal(other[1], plain_three[1]) and torch.allclose(other[0], plain_three[0])
                and all(torch.equal(a, b) for a, b in zip(other[2], plain_three[2]))):
            raise AssertionError(f"routing kernels {model.name} at {num_tokens}: the {body} top-k differs from the "
                                 "default's")
    fns = {"two launches": two_launches, "one launch": one_launch, "three launches": three_launches,
           "three launches sorted": three_launches_sorted, "three launches rounds": three_launches_rounds,
           "one launch aligned": one_launch_aligned}
    other_ids = {}   # chained variants with another gate block: tokens whose ids a near-tie flipped
    one_tile = num_tokens * rule.top_k <= chained_routing.ONE_TILE_MAX_ASSIGNMENTS
    if 0 < num_tokens <= chained_routing.MAX_TOKENS:
        # "chained" and its variants align with the full body (chained()'s default, the layer's until
        # ALIGN_BODY became "ranked": above 64 assignments the layer now runs "chained align ranked"); the
        # records keep that meaning so that they compare across sessions
        fns.update({"chained": chained(), "chained rounds": chained(sorted_topk=False),
                    "chained keyed": chained(sorted_topk="keyed"),
                    "chained routing only keyed": chained(sorted_topk="keyed", aligned=False),
                    "chained no pdl": chained(pdl=False), "chained routing only": chained(aligned=False),
                    # the alignment launch's parts: its floor (the wait and one read), without the tail, and
                    # with the other number of warps (4 for the chunked body's 8; 8 for one program's 4)
                    "chained align wait only": chained(body="wait only"),
                    "chained align no tail": chained(body="no tail"),
                    "chained align other warps": chained(warps=8 if one_tile else 4),
                    # the counts made by the routing programs (atomics), the alignment only scans and scatters
                    # (above one program's reach, 64 assignments: below it this is "chained" again; a
                    # segment's rows in the order they were counted)
                    "chained align ranked": chained(body="ranked"),
                    # up to ONE_TILE_MAX_ASSIGNMENTS the alignment is one program reading the ids once; this
                    # is the chunked body there instead
                    "chained align chunked": chained(one_tile_max=0)})
        # The gate's token block (16: the one-launch router's tiles; 64 from WIDE_GATE_FROM_TOKENS)
        for block_t in chained_routing.GATE_BLOCK_CHOICES:
            fns[f"chained gate {block_t}"] = chained(gate_block_t=block_t)
            fns[f"chained routing only gate {block_t}"] = chained(aligned=False, gate_block_t=block_t)
        capacity = num_tokens * rule.top_k + num_experts * (block - 1)
        for name in [n for n in fns if n.startswith("chained") and "wait only" not in n]:
            # Blocks of the sizes the call allocates, filled with -7 and freed first: a row the call leaves
            # unwritten then shows, instead of an earlier variant's identical result.
            for size in (capacity, -(-capacity // block)):
                torch.full((size,), -7, dtype=torch.int32, device=x.device)
            got = fns[name]()
            block_t = int(name.rsplit(" ", 1)[1]) if " gate " in name else chained_routing.gate_block_tokens(num_tokens)
            alignment_ok = True
            if len(got) > 3:   # the alignment of its own ids, always
                want, mine = align.moe_align_block_size_reference(got[1], block, num_experts), got[3:]
                if "no tail" in name:   # the tail past the used rows is left unwritten: compare the rest
                    used = int(got[5])
                    want, mine = ((a[:used], b[: used // block], c) for a, b, c in (want, mine))
                alignment_ok = (blocks.same_segments(mine, want, block, got[1].numel()) if "ranked" in name
                                else all(torch.equal(a, b) for a, b in zip(mine, want)))
            if block_t == 16:   # the one-launch router's gate tiles: the same sums in the same order
                same = (torch.equal(got[1], aligned[1]) and torch.equal(got[2], aligned[2])
                        and torch.allclose(got[0], aligned[0], rtol=1e-6, atol=1e-7) and alignment_ok)
            else:   # another grouping of the same partial products: float32 rounding, and a near-tie may flip
                flipped = (got[1] != aligned[1]).any(dim=1)
                other_ids[name] = int(flipped.sum())
                # (the tolerance: twice the one-launch gate's distance from cuBLAS's, another reordering)
                close = float((got[2] - aligned[2]).abs().max()) <= max(2 * error, 1e-5)
                kept = ~flipped
                same = (close and other_ids[name] <= num_tokens // 100 and alignment_ok
                        and torch.allclose(got[0][kept], aligned[0][kept], rtol=1e-5, atol=1e-6))
            if not same:
                raise AssertionError(f"{name} {model.name} at {num_tokens}: differs from the one-launch router "
                                     f"(largest logit difference {float((got[2] - aligned[2]).abs().max()):.2e}, "
                                     f"the gates' {error:.2e}; tokens with other ids {other_ids.get(name, 0)})")
    # What any launch that reads the gate's operands takes: one launch reading as many bytes (x and the gate's
    # weight, one fresh buffer), the floor under every router above (each reads at least these bytes first).
    operand_bytes = x.numel() * x.element_size() + gate.numel() * gate.element_size()
    read_block = 1024
    fns["read of the gate's operands"] = weight_reader(
        torch.empty(-(-operand_bytes // (4 * read_block)) * read_block, device=x.device), block=read_block)
    # Warm: graph replays back to back (the gate stays in L2). Cold: do_bench flushes the L2 before
    # each replay, as a decode step does in effect (the experts' weights evict the gate). Two rounds
    # each, interleaved; the lower kept.
    warm = {name: [] for name in fns}
    cold = {name: [] for name in fns}
    for _ in range(2):
        for name, fn in fns.items():
            warm[name].append(graph_us(fn))
            cold[name].append(1e3 * median_ms(graphed(fn), 5, 30))
    row = {"model": model.name, "tokens": num_tokens, "block_size": block,
           "aligned_in_launch": num_tokens * rule.top_k <= ALIGN_MAX_ASSIGNMENTS,
           "tiles": gate_tiles(num_tokens, num_experts, d), "max_logit_difference": error,
           "chained_gate_block_t": chained_routing.gate_block_tokens(num_tokens),
           "chained_tokens_with_other_ids": other_ids,
           "tokens_with_other_ids": differ}
    for name in fns:
        key = name.replace(" ", "_")
        row[f"{key}_us"], row[f"{key}_flushed_us"] = min(warm[name]), min(cold[name])
    return row


def _same(a, b) -> bool:
    return all(torch.equal(x, y) if x.dtype != torch.float32 else torch.allclose(x, y, atol=1e-6, rtol=0)
               for x, y in zip(a, b))


def run(batches=BATCHES, verbose: bool = True) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in batches:
        for name, kernel, reference in routing_cases(T, generator) + align_cases(T, generator):
            if not _same(kernel(), reference()):
                raise AssertionError(f"{name} at batch {T}: kernel output differs from the reference")
            row = {"op": name, "batch": T, "kernel_us": eager_us(kernel), "kernel_graph_us": graph_us(kernel),
                   "reference_us": eager_us(reference)}
            rows.append(row)
            if verbose:
                graph = f"{row['kernel_graph_us']:7.1f}" if row["kernel_graph_us"] is not None else "    n/a"
                print(f"{name:48s} B={T:6d}  kernel {row['kernel_us']:7.1f} us (graph {graph} us)"
                      f"  torch {row['reference_us']:8.1f} us  speed-up {row['reference_us'] / row['kernel_us']:5.1f}x",
                      flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_arguments(parser, "routing_align")
    parser.add_argument("--gate", action="store_true",
                        help="only the gate's id agreement (tensor-core and float32 gates against float64 logits); "
                             "with --record, results/<device>/gate-agreement.json")
    parser.add_argument("--gate-routing", action="store_true",
                        help="only the router in one launch (gate_and_route) and in launches chained by PDL "
                             "(gate_route_chained) against the gate then the routing kernel, graph-replayed; with --record, results/<device>/gate-routing.json")
    parser.add_argument("--batches", type=positive_ints, default=(1, 8, 16, 64, 128, 256, 512),
                        help="token counts of --gate-routing (comma-separated)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels.bench.routing: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.gate_routing:
        rows = []
        for model in ("qwen3-30b-a3b", "deepseek-v3"):
            for tokens in args.batches:
                rows.append(gate_routing_ab(model, tokens))
                times = "  ".join(f"{key[:-3]} {value:.1f}" for key, value in rows[-1].items()
                                  if key.endswith("_us") and not key.endswith("flushed_us"))
                print(f"{model} {tokens}: {times}", flush=True)
        if args.record:
            write_record(args.name or "gate-routing", {"rows": rows}, args.results_dir)
        return 0
    if args.gate:
        rows = [gate_agreement(model, 4096, skewed=skewed, seed=seed) for model in ("qwen3-30b-a3b", "deepseek-v3")
                for skewed in (False, True) for seed in range(8)]
        for row in rows:
            print(row, flush=True)
        if args.record:
            write_record(args.name or "gate-agreement", {"rows": rows, "tokens_per_draw": 4096, "draws": 8},
                         args.results_dir)
        return 0
    rows = run()
    if args.record:
        write_record(args.name or "routing_align", {"rows": rows, "batches": BATCHES}, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
