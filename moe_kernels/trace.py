"""One MoE layer of a decode step, run stage by stage through this package's kernels and traced.

:func:`trace_moe_layer` builds one layer of a model (random weights, a random correction bias)
and a batch of hidden states, then runs the layer the way an engine's decode step does, keeping
every intermediate tensor so that the quantities a reader wants to check can be read off the
tensors themselves rather than derived on paper:

1. the gate, a dense ``[T, d] @ [d, E]`` product (:func:`moe_kernels.kernels.routing.gate`);
2. grouped top-k with the correction bias (:func:`moe_kernels.kernels.grouped_routing.grouped_topk`);
3. the small-batch rule, vLLM's ``T·k·4 <= E`` (:func:`moe_kernels.kernels.blocks.use_naive_block_assignment`);
4. the alignment (:func:`moe_kernels.kernels.blocks.assign_blocks`, which runs
   :func:`moe_kernels.kernels.align.moe_align_block_size`);
5. GEMM 1 with SiLU·mul in its epilogue (:func:`moe_kernels.kernels.index_gather.expert_gate_up`);
6. GEMM 2 with the routed weight (:func:`moe_kernels.kernels.index_gather.expert_down`);
7. the sum over the k slots (:func:`moe_kernels.kernels.combine.moe_sum`), plus the shared expert.

The shared expert runs as a dense gated FFN beside the routed experts, as vLLM runs it
(:func:`moe_kernels.kernels.shared.shared_expert_separate`), and is added with weight 1
(``routed_scaling_factor`` is already inside the routed weights, see
:func:`moe_kernels.kernels.grouped_routing.grouped_topk`). The residual add is outside the MoE layer and not run.

``hidden_size`` and ``intermediate_size`` shrink d and F so that the trace runs under the Triton
interpreter; the number of experts, top-k and the groups stay the model's, so every count (experts
touched, buffer lengths, padded rows, program counts along M) is the real one. Bytes and FLOPs are
then computed for the model's real d and F from those counts.

Worked example: DeepSeek-V3 with 16 tokens, d and F shrunk to 32 and 16::

    >>> import torch
    >>> t = trace_moe_layer("deepseek-v3", 16, hidden_size=32, intermediate_size=16,
    ...                     dtype=torch.float32, device="cpu", seed=0)
    >>> t.naive, t.naive_rule_lhs, t.num_experts       # 16·8·4 = 512 > 256: align
    (False, 512, 256)
    >>> t.block_m, t.max_num_tokens_padded, t.expert_ids_len   # 128 + 256·15 rows, /16 blocks
    (16, 3968, 248)
    >>> t.gemm1_grid       # M-blocks (at most 128 + 128·15 rows in use, /16) x N-tiles at the real F = 2048
    (128, 64)
    >>> t.routed_flops_per_token                       # k · 2 · 3dF at the real d, F
    704643072
    >>> t.rel_error < 1e-5                             # against the float64 per-token reference
    True
"""

from __future__ import annotations

import dataclasses

import torch

from . import _runtime
from ._checks import check_int, fail
from .kernels.blocks import BlockAssignment, assign_blocks, use_naive_block_assignment
from .kernels.combine import moe_sum
from .kernels.config import MoEConfig, default_config, load_table, nearest, separate_sum_tiles, table_name
from .kernels.index_gather import expert_down, expert_gate_up
from .kernels.grouped_routing import grouped_topk
from .kernels.routing import gate
from .kernels.shared import shared_expert_separate
from .model.shapes import GPUS, MODELS, MoEModel, bytes_per_weight
from .reference import moe_reference

__all__ = ["DecodeLayer", "LayerTrace", "make_layer", "route", "shared_expert", "trace_config",
           "trace_moe_layer"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The device whose tuned tiles the trace uses: the GPU this project measures on.
TRACE_DEVICE_NAME = "NVIDIA H200"
# Standard deviation of the random correction bias. A trained bias offsets a trained gate's
# preferences; our random gate has none, so any sizeable random bias would only skew the load
# (at 0.05, 64 tokens touch ~185 experts instead of ~222). At this size it still changes the
# expert set of about a fifth of the tokens, which exercises the mechanism.
_BIAS_STD = 0.003


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeLayer:
    """One MoE layer and its input batch, with the model whose routing rules it follows.

    ``w1``/``w2`` are the routed experts (``[E, 2F, d]``, ``[E, d, F]``); ``shared_w1``/``shared_w2``
    the shared experts as one FFN (``[2S, d]``, ``[d, S]`` with ``S`` = shared experts × F), or
    None when the model has none.
    """

    model: MoEModel
    hidden_states: torch.Tensor
    gate_weight: torch.Tensor
    correction_bias: torch.Tensor | None
    w1: torch.Tensor
    w2: torch.Tensor
    shared_w1: torch.Tensor | None
    shared_w2: torch.Tensor | None


def _resolve_model(func: str, model) -> MoEModel:
    if isinstance(model, MoEModel):
        return model
    if isinstance(model, str) and model in MODELS:
        return MODELS[model]
    fail(func, "model", f"must be a MoEModel or one of {sorted(MODELS)}", repr(model))


def _check_layer_args(func: str, model, num_tokens, hidden_size, intermediate_size, dtype, seed):
    """Check the arguments that define a layer; return (model, d, F) of the run."""
    model = _resolve_model(func, model)
    check_int(func, "num_tokens", num_tokens, lo=1)
    d = model.hidden_size if hidden_size is None else check_int(func, "hidden_size", hidden_size, lo=1)
    f = model.moe_intermediate_size if intermediate_size is None else check_int(
        func, "intermediate_size", intermediate_size, lo=1)
    if dtype not in _DTYPES:
        fail(func, "dtype", "must be float32, float16 or bfloat16", dtype, TypeError)
    check_int(func, "seed", seed)
    return model, d, f


def make_layer(model: MoEModel | str, num_tokens: int, *, hidden_size: int | None = None,
               intermediate_size: int | None = None, dtype: torch.dtype, device, seed: int) -> DecodeLayer:
    """Random weights and hidden states for one layer of ``model`` (d, F optionally shrunk).

    Expert weights are scaled by ``1/sqrt(fan_in)`` so that activations stay O(1). Each gate row
    has unit norm, so for standard-normal hidden states every expert's logit is exactly standard
    normal: no expert is favoured, and routing is uniform in expectation (what
    :mod:`moe_kernels.model.costs` assumes). The correction bias exists only for sigmoid-scored models
    (DeepSeek-V3's auxiliary-loss-free balancing).
    """
    model, d, f = _check_layer_args("make_layer", model, num_tokens, hidden_size, intermediate_size, dtype, seed)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    E, s = model.num_experts, model.num_shared_experts * f

    def randn(*shape, scale=1.0, as_dtype=dtype):
        return torch.randn(*shape, device=device, dtype=as_dtype, generator=g).mul_(scale)

    hidden = randn(num_tokens, d)
    gate_weight = randn(E, d, as_dtype=torch.float32)
    gate_weight /= torch.linalg.norm(gate_weight, dim=1, keepdim=True)
    bias = randn(E, scale=_BIAS_STD, as_dtype=torch.float32) if model.scoring_func == "sigmoid" else None
    w1, w2 = randn(E, 2 * f, d, scale=d**-0.5), randn(E, d, f, scale=f**-0.5)
    shared_w1 = randn(2 * s, d, scale=d**-0.5) if s else None
    shared_w2 = randn(d, s, scale=s**-0.5) if s else None
    return DecodeLayer(model, hidden, gate_weight, bias, w1, w2, shared_w1, shared_w2)


def _for_kernels(layer: DecodeLayer) -> DecodeLayer:
    """The layer in the dtype the kernels can compute in here.

    Under the Triton interpreter a bfloat16 ``tl.dot`` is wrong (triton issue 11584), so there a
    bfloat16 layer is computed in float32 and the output cast back, as ``fused_experts`` does.
    """
    if not (_runtime.INTERPRET and layer.hidden_states.dtype == torch.bfloat16):
        return layer
    up = {f.name: getattr(layer, f.name).float() for f in dataclasses.fields(layer)
          if f.name in ("hidden_states", "w1", "w2", "shared_w1", "shared_w2") and getattr(layer, f.name) is not None}
    return dataclasses.replace(layer, **up)


def route(layer: DecodeLayer, logits: torch.Tensor | None = None):
    """Steps 1-2: the gate, then the model's grouped top-k: ``(topk_weights, topk_ids)``."""
    m = layer.model
    if logits is None:
        logits = gate(layer.hidden_states, layer.gate_weight)
    return grouped_topk(layer.hidden_states, logits, m.top_k, m.norm_topk_prob, m.num_expert_groups,
                        m.topk_groups, scoring_func=m.scoring_func,
                        routed_scaling_factor=m.routed_scaling_factor,
                        e_score_correction_bias=layer.correction_bias)


def shared_expert(layer: DecodeLayer) -> torch.Tensor | None:
    """The shared expert's output ``[T, d]`` (None when the model has none)."""
    if layer.shared_w1 is None:
        return None
    return shared_expert_separate(layer.hidden_states, layer.shared_w1, layer.shared_w2)


def trace_config(model: MoEModel, num_tokens: int) -> MoEConfig:
    """The tiles this package runs for ``num_tokens`` tokens of ``model`` on an H200 in bf16.

    The tuned entry at the model's real shape (the tuned table of :mod:`moe_kernels.kernels.config`), else
    :func:`moe_kernels.kernels.config.default_config`. The trace uses it on every machine, so that its
    M tile, and with it the alignment and the launch grid, is the one the GPU run uses; for
    DeepSeek-V3 at 64 tokens its M tile is 16.
    """
    d, f, e = model.hidden_size, model.moe_intermediate_size, model.num_experts
    table = load_table(table_name(TRACE_DEVICE_NAME, e, f, d, torch.bfloat16, "index_gather"))
    return nearest(table, num_tokens) if table else default_config(num_tokens, e, f, d)


# ----------------------------------------------------------------------------------------------
# The trace
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerTrace:
    """Everything one traced layer shows, read from its tensors (fields grouped by step).

    Counts are those of the run (real E, k and groups). Fields named ``real_*``, ``*_bytes_*``,
    ``*flops*``, ``intensity_*`` and ``gemm1_grid`` are for the model's real d and F.
    """

    model: str
    num_tokens: int
    hidden_size: int
    intermediate_size: int
    dtype: str
    num_experts: int
    top_k: int
    num_expert_group: int
    topk_group: int
    # steps 1-2: gate and grouped top-k
    router_logits: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    experts_touched: int
    max_rows_per_expert: int
    max_groups_per_token: int
    bias_changed_tokens: int
    # step 3: the small-batch rule
    naive_rule_lhs: int
    naive: bool
    # step 4: the alignment (for the naive path: the implicit one-assignment-per-block layout)
    block_m: int
    sorted_token_ids: torch.Tensor | None
    expert_ids: torch.Tensor
    max_num_tokens_padded: int
    expert_ids_len: int
    expert_ids_unused: int
    num_tokens_post_padded: int
    # step 5: GEMM 1 launch, our config at the real F
    gemm1_block_n: int
    gemm1_grid: tuple[int, int]
    gemm1_live_programs: int
    # byte and FLOP counts at the real shape
    real_hidden_size: int
    real_intermediate_size: int
    expert_params: int
    routed_bytes_bf16: float
    routed_bytes_fp8: float
    routed_flops_per_token: int
    routed_flops: int
    intensity_bf16: float
    intensity_fp8: float
    ridge_h100_fp8: float
    ridge_h200_bf16: float
    # step 7: the output
    routed_output: torch.Tensor
    shared_output: torch.Tensor | None
    output: torch.Tensor
    rel_error: float

    @property
    def assignments(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def padded_rows_per_real_row(self) -> float:
        """GEMM rows after padding (``num_tokens_post_padded``) per real row (assignment)."""
        return self.num_tokens_post_padded / self.assignments

    @property
    def gemm1_programs(self) -> int:
        return self.gemm1_grid[0] * self.gemm1_grid[1]

    def to_dict(self) -> dict:
        """The scalar fields (tensors left out), JSON-ready."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if not isinstance(getattr(self, f.name), torch.Tensor) and getattr(self, f.name) is not None}
        out["gemm1_grid"] = list(self.gemm1_grid)
        out["padded_rows_per_real_row"] = self.padded_rows_per_real_row
        out["gemm1_programs"] = self.gemm1_programs
        return out


def _fit_to_run(config: MoEConfig, d: int, f: int) -> MoEConfig:
    """``config`` with its N and K tiles clipped to a shrunk run's d and F (M tile unchanged).

    At the real shape nothing changes. At a teaching shape, tiles far wider than the matrices
    would only make the interpreter multiply masked zeros.
    """
    def fit(tile: int, size: int) -> int:
        return max(16, min(tile, 1 << (size - 1).bit_length()))  # tl.dot needs 16 at least

    def clip(tiles, n, k):
        return dataclasses.replace(tiles, block_n=fit(tiles.block_n, n), block_k=fit(tiles.block_k, k))

    return dataclasses.replace(config, gate_up=clip(config.gate_up, f, d), down=clip(config.down, d, f))


def _alignment_view(blocks: BlockAssignment, topk_ids: torch.Tensor):
    """(buffer rows, expert_ids, unused blocks, rows post padding) of either block map."""
    numel = topk_ids.numel()
    if blocks.naive:  # block m = assignment m: numel blocks, every one used
        return numel * blocks.block_m, blocks.expert_ids, 0, numel * blocks.block_m
    used = int(blocks.num_tokens_post_padded[0])
    unused = int((blocks.expert_ids == -1).sum())
    return blocks.sorted_token_ids.numel(), blocks.expert_ids, unused, used


def trace_moe_layer(model: MoEModel | str, num_tokens: int, *, hidden_size: int | None = None,
                    intermediate_size: int | None = None, dtype: torch.dtype, device, seed: int,
                    block_m: int | None = None) -> LayerTrace:
    """Run one MoE layer of ``model`` on ``num_tokens`` tokens step by step; return its trace.

    ``hidden_size``/``intermediate_size`` override d and F for the run (the counts stay real;
    bytes and FLOPs use the model's d and F). ``block_m`` overrides the M tile of
    :func:`trace_config`. Under the Triton interpreter a bfloat16 layer is computed in float32
    (see :func:`moe_kernels.kernels.index_gather.fused_experts`). Intermediate buffers are filled with NaN
    before the kernels write them, so a row a kernel forgot shows up in ``rel_error``.
    """
    func = "trace_moe_layer"
    model, _, _ = _check_layer_args(func, model, num_tokens, hidden_size, intermediate_size, dtype, seed)
    if block_m is not None:
        check_int(func, "block_m", block_m, lo=16)
    layer = make_layer(model, num_tokens, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       dtype=dtype, device=device, seed=seed)
    return _trace(layer, block_m)


def _trace(layer: DecodeLayer, block_m: int | None) -> LayerTrace:
    model = layer.model
    run = _for_kernels(layer)
    hidden = run.hidden_states
    T, d = hidden.shape
    E, k, f = model.num_experts, model.top_k, run.w2.shape[2]
    config = trace_config(model, T)
    if block_m is not None:
        config = dataclasses.replace(config, block_m=block_m)
    run_config = _fit_to_run(config, d, f)

    logits = gate(hidden, run.gate_weight)
    topk_weights, topk_ids = route(run, logits)
    counts = torch.bincount(topk_ids.flatten().long(), minlength=E)
    groups = topk_ids.long() // (E // model.num_expert_groups)
    groups_per_token = torch.zeros(T, model.num_expert_groups, dtype=torch.bool, device=groups.device)
    groups_per_token.scatter_(1, groups, True)
    bias_changed_tokens = 0
    if run.correction_bias is not None:  # the same routing without the bias: which tokens differ?
        _, unbiased_ids = route(dataclasses.replace(run, correction_bias=torch.zeros_like(run.correction_bias)), logits)
        changed = topk_ids.sort(dim=1).values != unbiased_ids.sort(dim=1).values
        bias_changed_tokens = int(changed.any(dim=1).sum())

    naive = use_naive_block_assignment(T, k, E)
    # The ids come from our own top-k over E experts: no range check (a host sync) needed.
    blocks = assign_blocks(topk_ids, config.block_m, E, naive=naive, validate_ids=False)
    buffer_rows, expert_ids, unused_blocks, post_padded = _alignment_view(blocks, topk_ids)
    live_blocks = post_padded // config.block_m
    if blocks.naive and blocks.naive_group:   # an expert's first block takes its assignments; the rest exit
        live_blocks = int((-(-counts // config.block_m)).sum())

    nan = float("nan")
    intermediate = torch.full((T * k, f), nan, dtype=hidden.dtype, device=hidden.device)
    per_slot = torch.full((T, k, d), nan, dtype=hidden.dtype, device=hidden.device)
    routed = torch.full((T, d), nan, dtype=hidden.dtype, device=hidden.device)
    expert_gate_up(hidden, run.w1, blocks, k, tiles=run_config.gate_up, out=intermediate)
    expert_down(intermediate, run.w2, topk_weights, blocks, tiles=separate_sum_tiles(run_config), out=per_slot)
    moe_sum(per_slot, out=routed)
    shared = shared_expert(run)
    output = routed if shared is None else routed + shared

    reference = moe_reference(hidden, run.w1, run.w2, topk_weights, topk_ids)
    if shared is not None:  # the shared FFN as a one-expert MoE every token picks with weight 1
        everyone = torch.zeros(T, 1, dtype=torch.int32, device=hidden.device)
        reference += moe_reference(hidden, run.shared_w1[None], run.shared_w2[None],
                                   torch.ones(T, 1, device=hidden.device), everyone)
    out_dtype = layer.hidden_states.dtype
    output = output.to(out_dtype)
    rel_error = float(torch.linalg.norm(output.double() - reference) / torch.linalg.norm(reference))

    touched = int((counts > 0).sum())
    real_d, real_f = model.hidden_size, model.moe_intermediate_size
    n_tiles = -(-real_f // config.gate_up.block_n)
    flops_per_token = k * model.expert_flops_per_token
    bytes_bf16 = touched * model.expert_params * bytes_per_weight("bf16")
    bytes_fp8 = touched * model.expert_params * bytes_per_weight("fp8")
    return LayerTrace(
        model=model.name, num_tokens=T, hidden_size=d, intermediate_size=f,
        dtype=str(out_dtype).replace("torch.", ""), num_experts=E, top_k=k,
        num_expert_group=model.num_expert_groups, topk_group=model.topk_groups,
        router_logits=logits, topk_weights=topk_weights, topk_ids=topk_ids,
        experts_touched=touched, max_rows_per_expert=int(counts.max()),
        max_groups_per_token=int(groups_per_token.sum(dim=1).max()),
        bias_changed_tokens=bias_changed_tokens,
        naive_rule_lhs=T * k * 4, naive=naive,
        block_m=config.block_m, sorted_token_ids=blocks.sorted_token_ids, expert_ids=expert_ids,
        max_num_tokens_padded=buffer_rows, expert_ids_len=expert_ids.numel(),
        expert_ids_unused=unused_blocks, num_tokens_post_padded=post_padded,
        gemm1_block_n=config.gate_up.block_n, gemm1_grid=(blocks.num_m_blocks, n_tiles),
        gemm1_live_programs=live_blocks * n_tiles,
        real_hidden_size=real_d, real_intermediate_size=real_f, expert_params=model.expert_params,
        routed_bytes_bf16=bytes_bf16, routed_bytes_fp8=bytes_fp8,
        routed_flops_per_token=flops_per_token, routed_flops=T * flops_per_token,
        intensity_bf16=T * flops_per_token / bytes_bf16, intensity_fp8=T * flops_per_token / bytes_fp8,
        ridge_h100_fp8=GPUS["H100 SXM"].ridge("fp8"), ridge_h200_bf16=GPUS["H200"].ridge("bf16"),
        routed_output=routed.to(out_dtype), shared_output=None if shared is None else shared.to(out_dtype),
        output=output, rel_error=rel_error,
    )
