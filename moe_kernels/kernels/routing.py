"""The router: gate logits to ``(topk_weights, topk_ids)``, one fused Triton launch per call.

A MoE layer's router is a bias-free linear layer (:func:`gate`, ``d -> E`` logits) followed by a
selection. Two selections are in use:

* :func:`fused_topk` (Mixtral, Qwen3-MoE): score every expert (softmax over the ``E`` logits, or a
  sigmoid per expert), keep the ``k`` best, optionally renormalise the ``k`` weights to sum to 1.
* :func:`~moe_kernels.kernels.grouped_routing.grouped_topk` (DeepSeek-V3): the experts form
  ``num_expert_group`` groups; only the ``topk_group`` best groups may contribute experts, and an
  optional per-expert ``e_score_correction_bias`` steers the *selection* while the *weights* stay
  the unbiased scores (:mod:`moe_kernels.kernels.grouped_routing`).

Both are single Triton kernels (scores, group choice, top-k, renormalisation and scaling fused; no
host synchronisation), each with a float32 torch reference beside it that states the rules
explicitly. Ties always go to the lower expert id (and the lower group id), and the ``k`` outputs
of a token are in descending score order, so kernel and reference agree id for id.
:func:`append_shared_expert` then splices an always-on shared expert in as one more slot.

Worked example: four experts, one token, top-2::

    >>> import torch
    >>> from moe_kernels.kernels.routing import fused_topk
    >>> tokens = torch.zeros(1, 16)                  # only its row count is used
    >>> logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    >>> weights, ids = fused_topk(tokens, logits, topk=2, renormalize=False)
    >>> ids.tolist()
    [[0, 2]]
    >>> [round(w, 4) for w in weights[0].tolist()]   # e^2 and e^1 over e^2 + e^0 + e^1 + e^-1
    [0.6439, 0.2369]
    >>> weights, ids = fused_topk(tokens, logits, topk=2, renormalize=True)
    >>> [round(w, 4) for w in weights[0].tolist()]   # = softmax([2, 1]): the Z cancels
    [0.7311, 0.2689]
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._runtime import HAS_TRITON, INTERPRET, cdiv, kernel, next_power_of_2, note_launch, tl, triton, use_triton
from .._checks import check_int, check_number, check_tensor, fail

__all__ = ["gate", "fused_topk", "fused_topk_reference", "append_shared_expert"]

_SCORING_FUNCS = ("softmax", "sigmoid")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Elements of the [tokens x experts] tile one program holds in registers. With 4 warps this is
# 16 fp32 values per thread per live tile: DeepSeek-V3's E=256 gives 8 tokens per program, so a
# 16384-token batch spreads over 2048 programs.
_TILE_ELEMENTS = 2048
#: How the routing kernels take the top-k: k rounds of argmax (False), one partial sort (True,
#: :mod:`moe_kernels.kernels.sorted_topk`) or k rounds of one reduction over packed keys ("keyed"):
#: the same ids and weights (to float32's last bit on a GPU). Read at each launch. "keyed": on an
#: H100 1.02-1.48x as fast as the rounds in both kernels from 1 to 16,384 tokens; the sort won by
#: over 5% only for Qwen3-30B-A3B at 1-8 tokens (``routing-align-{rounds,keyed,sort}-s43.json``).
TOPK_BY_SORT = "keyed"


# --------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------


def gate(hidden_states: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Router logits ``hidden_states @ gate_weight.T`` as float32 ``[T, E]``; no bias.

    ``gate_weight`` is ``[E, d]`` (``nn.Linear`` layout). The products accumulate, and the logits
    are returned, in float32: rounding logits to bf16 would create ties and flip near-ties between
    experts. On a GPU, bf16 (or fp16) operands of one dtype go to the tensor cores as they are,
    with float32 accumulation and float32 output: the product of two bf16 numbers is exact in
    float32, so this differs from upcasting both operands only in the order of the additions (what
    any two float32 GEMMs differ in), and it avoids a float32 copy of the activations and a float32
    GEMM on the CUDA cores (at DeepSeek-V3's 4096 tokens, 15 GFLOP). Elsewhere both operands are
    upcast to float32. A plain torch matmul: the gate is a tiny dense GEMM, not a MoE mechanism.

        >>> gate(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, -1.0]]))
        tensor([[ 1.0000,  1.5000, -2.0000]])
    """
    func = "gate"
    check_tensor(func, "hidden_states", hidden_states, ndim=2, dtypes=_FLOAT_DTYPES)
    check_tensor(func, "gate_weight", gate_weight, ndim=2, dtypes=_FLOAT_DTYPES,
                 device=hidden_states.device)
    if gate_weight.shape[1] != hidden_states.shape[1]:
        fail(func, "gate_weight", f"must be [E, {hidden_states.shape[1]}] (d of hidden_states)",
             f"shape {tuple(gate_weight.shape)}")
    return router_logits(hidden_states, gate_weight)


# --------------------------------------------------------------------------------------------
# Argument checks (shared by the public functions and their references)
# --------------------------------------------------------------------------------------------


def _check_common(func, hidden_states, gating_output, topk, renormalize, scoring_func) -> int:
    """Checks every router shares; returns the number of experts E."""
    check_tensor(func, "hidden_states", hidden_states, ndim=2)
    # Rows may be strided (a view into a wider buffer); experts within a row must be adjacent.
    check_tensor(func, "gating_output", gating_output, ndim=2, dtypes=_FLOAT_DTYPES,
                 device=hidden_states.device, last_dim_contiguous=True)
    if gating_output.shape[0] != hidden_states.shape[0]:
        fail(func, "gating_output",
             f"must have one row per token ({hidden_states.shape[0]}, the rows of hidden_states)",
             f"{gating_output.shape[0]} rows")
    num_experts = gating_output.shape[1]
    check_int(func, "topk", topk, lo=1, hi=num_experts,
              what_hi="the number of experts, gating_output.shape[1]")
    if not isinstance(renormalize, bool):
        fail(func, "renormalize", "must be a bool", type(renormalize).__name__, TypeError)
    if scoring_func not in _SCORING_FUNCS:
        fail(func, "scoring_func", "must be 'softmax' or 'sigmoid'", repr(scoring_func))
    return num_experts


# --------------------------------------------------------------------------------------------
# Torch references (float32, explicit tie rule)
# --------------------------------------------------------------------------------------------


def _scores(gating_output: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = gating_output.float()
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if logits.device.type == "cpu":
        # CPU torch.sigmoid rounds by position (sigmoid(-15) differs in the last bit at index 32 of
        # 33), which can break a tie the other way. The kernels' float32 1 / (1 + exp(-x)), exp taken
        # in float64 and rounded, scores equal logits equally (their own exp may differ by an ulp).
        return 1.0 / (1.0 + torch.exp(-logits.double()).float())
    return torch.sigmoid(logits)   # (on a GPU: the kernels' expf and IEEE division, bit for bit)


def _rank_descending(values: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest values per row, largest first, ties to the lower index.

    A stable descending sort keeps equal values in index order, which is the tie rule; NaN
    ranks as -inf so that it can never push a real candidate out (the kernels do the same).
    """
    values = torch.where(values.isnan(), float("-inf"), values)
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :count]


def fused_topk_reference(hidden_states, gating_output, topk, renormalize, scoring_func="softmax"):
    """Torch reference for :func:`fused_topk`, in float32."""
    _check_common("fused_topk_reference", hidden_states, gating_output, topk, renormalize,
                  scoring_func)
    scores = _scores(gating_output, scoring_func)
    ids = _rank_descending(scores, topk)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:
    from triton.language.extra import libdevice

    from .sorted_topk import take_topk_keyed, take_topk_sorted

    @kernel
    def _exp(x, PRECISE: tl.constexpr):
        # Compiled, tl.exp is ex2.approx, a few ulps off the expf that torch's CUDA softmax and
        # sigmoid kernels call. libdevice's expf is that same function, so (with the IEEE
        # division below) sigmoid scores should match the reference bit for bit, and softmax
        # scores up to the order in which the normaliser is summed: near-ties then break the
        # same way in kernel and reference. The interpreter has no libdevice; there tl.exp is
        # numpy's exp.
        if PRECISE:
            return libdevice.exp(x)
        return tl.exp(x)

    @kernel
    def _load_scores(logits_ptr, token, expert, is_expert, num_tokens, logits_row_stride,
                     USE_SIGMOID: tl.constexpr, PRECISE: tl.constexpr):
        """float32 scores of a [BLOCK_T, N] tile; ``expert`` maps each column to its logit."""
        # Rows past the batch load zeros (finite, so their discarded softmax stays NaN-free).
        logits = tl.load(logits_ptr + token.to(tl.int64) * logits_row_stride + expert,
                         mask=(token < num_tokens) & is_expert, other=0.0).to(tl.float32)
        logits = tl.where(is_expert, logits, float("-inf"))
        if USE_SIGMOID:
            return tl.div_rn(1.0, 1.0 + _exp(-logits, PRECISE))
        shifted = _exp(logits - tl.max(logits, axis=1)[:, None], PRECISE)
        return tl.div_rn(shifted, tl.sum(shifted, axis=1)[:, None])

    @kernel
    def _take_topk(selection, weight_source, expert_ids, available, topk,
                   BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, NO_EXPERT: tl.constexpr):
        """``topk`` rounds of argmax over ``selection`` (``[BLOCK_T, N]``), lowest id on ties.

        Each round takes the best still-available entry, records its id and its
        ``weight_source`` value in slot ``j``, and marks it taken. Availability is a separate
        mask rather than a -inf overwrite, so even -inf scores cannot make a round pick nothing.
        """
        slot = tl.arange(0, K_PAD)[None, :]
        weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        for j in range(topk):
            best = tl.max(tl.where(available, selection, float("-inf")), axis=1)
            is_best = available & (selection == best[:, None])
            chosen = tl.min(tl.where(is_best, expert_ids, NO_EXPERT), axis=1)
            picked = expert_ids == chosen[:, None]
            weight = tl.sum(tl.where(picked, weight_source, 0.0), axis=1)
            available = available & ~picked
            weights = tl.where(slot == j, weight[:, None], weights)
            ids = tl.where(slot == j, chosen[:, None], ids)
        return weights, ids

    @kernel
    def _store_topk(weights, ids, weights_ptr, ids_ptr, first_token, num_tokens, topk,
                    renormalize, scale, BLOCK_T: tl.constexpr, K_PAD: tl.constexpr):
        if renormalize:
            # Unused slots hold 0, so the row sum is the sum over the k chosen weights.
            weights = weights / tl.sum(weights, axis=1)[:, None]
        weights = weights * scale
        token = first_token + tl.arange(0, BLOCK_T)[:, None]
        slot = tl.arange(0, K_PAD)[None, :]
        mask = (token < num_tokens) & (slot < topk)
        tl.store(weights_ptr + token * topk + slot, weights, mask=mask)
        tl.store(ids_ptr + token * topk + slot, ids, mask=mask)

    @kernel
    def _fused_topk_kernel(
        logits_ptr, weights_ptr, ids_ptr,
        num_tokens, num_experts, logits_row_stride, topk, renormalize,
        USE_SIGMOID: tl.constexpr, PRECISE: tl.constexpr, BLOCK_T: tl.constexpr,
        E_PAD: tl.constexpr, K_PAD: tl.constexpr, SORTED: tl.constexpr,
    ):
        """One program routes BLOCK_T tokens over all experts (E padded to E_PAD)."""
        route_tokens(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * BLOCK_T, num_tokens, num_experts,
                     logits_row_stride, topk, renormalize, 1.0, USE_SIGMOID, PRECISE, BLOCK_T, E_PAD, K_PAD, SORTED)

    @kernel
    def route_tokens(logits_ptr, weights_ptr, ids_ptr, first_token, num_tokens, num_experts, logits_row_stride,
                     topk, renormalize, scale, USE_SIGMOID: tl.constexpr, PRECISE: tl.constexpr,
                     BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, SORTED: tl.constexpr = False):
        """Route tokens ``first_token`` to ``first_token + BLOCK_T`` (the body of the routing kernel,
        which :mod:`moe_kernels.kernels.gate_routing` also calls once the gate's logits are in).
        ``SORTED``: the top-k by one partial sort (:mod:`moe_kernels.kernels.sorted_topk`), not k rounds;
        ``"keyed"``: k rounds of one reduction over packed keys (the same module); the same ids each way."""
        token = first_token + tl.arange(0, BLOCK_T)[:, None]
        expert = tl.broadcast_to(tl.arange(0, E_PAD)[None, :], [BLOCK_T, E_PAD])
        is_expert = expert < num_experts
        scores = _load_scores(logits_ptr, token, expert, is_expert, num_tokens,
                              logits_row_stride, USE_SIGMOID, PRECISE)
        # NaN ranks as -inf (as in the reference), keeping the comparisons total.
        selection = tl.where(scores == scores, scores, float("-inf"))
        if SORTED == "keyed":
            weights, ids = take_topk_keyed(selection, scores, expert, is_expert, topk, BLOCK_T, K_PAD, E_PAD)
        elif SORTED:
            weights, ids = take_topk_sorted(selection, scores, expert, is_expert, topk, BLOCK_T, K_PAD, E_PAD)
        else:
            weights, ids = _take_topk(selection, scores, expert, is_expert, topk,
                                      BLOCK_T, K_PAD, E_PAD)
        _store_topk(weights, ids, weights_ptr, ids_ptr, first_token, num_tokens, topk,
                    renormalize, scale, BLOCK_T, K_PAD)


def _launch_config(num_tokens: int, tile_columns: int) -> tuple[int, int]:
    """(tokens per program, warps): fill about _TILE_ELEMENTS, never more tokens than exist."""
    block_t = max(1, min(_TILE_ELEMENTS // tile_columns, next_power_of_2(num_tokens)))
    tile = block_t * tile_columns
    num_warps = 4 if tile >= 1024 else (2 if tile >= 512 else 1)
    return block_t, num_warps


def _empty_outputs(num_tokens: int, topk: int, device: torch.device):
    # Not poisoned: a fill would be a second and third launch, and the store mask covers every
    # [T, k] slot (the tests compare all of them against the reference).
    weights = torch.empty((num_tokens, topk), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, topk), dtype=torch.int32, device=device)
    return weights, ids


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def fused_topk(hidden_states: Tensor, gating_output: Tensor, topk: int, renormalize: bool,
               scoring_func: str = "softmax"):
    """Top-k routing: ``(topk_weights float32 [T, k], topk_ids int32 [T, k])``.

    Same arguments as vLLM's ``fused_topk`` (``vllm/model_executor/layers/fused_moe/router/
    fused_topk_router.py``), which also returns a third tensor, the token-expert indices, that
    this package does not need. ``hidden_states`` is only used to check the token count.
    ``gating_output`` is the ``[T, E]`` logits (float32, float16 or bfloat16; read as float32;
    rows may be strided, experts must be adjacent).

    Scores are ``softmax(logits)`` over all E experts, or ``sigmoid(logit)`` per expert. The k
    best scores are taken, largest first, ties to the lower expert id. With ``renormalize`` the
    k weights are divided by their sum. For softmax that is the same as a softmax over the k
    selected logits alone, because the normaliser Z = sum_e exp(l_e) cancels:

        (exp(l_i) / Z) / sum_{j in top-k} (exp(l_j) / Z) = exp(l_i) / sum_{j in top-k} exp(l_j).

    One Triton launch (:func:`fused_topk_reference` when Triton cannot run for these tensors).
    """
    func = "fused_topk"
    _check_common(func, hidden_states, gating_output, topk, renormalize, scoring_func)
    return topk_checked(hidden_states, gating_output, topk, renormalize, scoring_func)


def topk_checked(hidden_states: Tensor, gating_output: Tensor, topk: int, renormalize: bool,
                 scoring_func: str = "softmax"):
    """:func:`fused_topk` for arguments already checked (a layer checks its routing once)."""
    if not use_triton(hidden_states, gating_output):
        return fused_topk_reference(hidden_states, gating_output, topk, renormalize, scoring_func)
    num_tokens, num_experts = gating_output.shape
    weights, ids = _empty_outputs(num_tokens, topk, gating_output.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = next_power_of_2(num_experts)
    block_t, num_warps = _launch_config(num_tokens, e_pad)
    note_launch("routing.fused_topk", block_t=block_t, scoring=scoring_func, topk_body=TOPK_BY_SORT)
    _fused_topk_kernel[(cdiv(num_tokens, block_t),)](
        gating_output, weights, ids,
        num_tokens, num_experts, gating_output.stride(0), topk, renormalize,
        USE_SIGMOID=scoring_func == "sigmoid", PRECISE=not INTERPRET, BLOCK_T=block_t, E_PAD=e_pad,
        K_PAD=next_power_of_2(topk), SORTED=TOPK_BY_SORT, num_warps=num_warps,
    )
    return weights, ids


#: ``torch.mm(..., out_dtype=)`` (16-bit operands, float32 result) arrived in torch 2.8; older
#: releases take the float32 path.
_MM_OUT_DTYPE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def router_logits(hidden_states: Tensor, gate_weight: Tensor) -> Tensor:
    """:func:`gate` for operands already checked."""
    # >>> book: gate
    if (hidden_states.is_cuda and hidden_states.dtype in (torch.bfloat16, torch.float16)
            and gate_weight.dtype == hidden_states.dtype and _MM_OUT_DTYPE):
        # Tensor cores: 16-bit operands, float32 sums, float32 logits (exact products).
        return torch.mm(hidden_states, gate_weight.t(), out_dtype=torch.float32)
    return torch.nn.functional.linear(hidden_states.float(), gate_weight.float())
    # <<< book: gate


def append_shared_expert(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                         num_shared_experts: int = 1,
                         shared_weight: float | torch.Tensor = 1.0):
    """Splice a shared expert in as slot k+1: ``[T, k+1]`` weights and ids.

    Every token also goes to a shared expert, given the id ``num_experts + t % num_shared_experts``
    for token t (deterministic; SGLang draws it at random from the same range, in
    ``sgl-project/sglang python/sglang/srt/layers/moe/topk.py``), so the shared FFN runs inside
    the same grouped GEMM instead of a separate launch. The expert weight tensors must then hold
    ``num_experts + num_shared_experts`` experts, the shared expert's matrices at slot
    ``num_experts`` onward (SGLang's loader does that remapping, ``models/deepseek_v2.py``).

    ``shared_weight`` (a float, or a float32 tensor ``[T]``) is the synthetic routing weight.
    Which value is right depends on where ``routed_scaling_factor`` is applied:

    * 1.0 when the routed weights already carry the factor, as :func:`grouped_topk` returns
      them: the shared expert's output is then added unscaled, as in the model;
    * ``topk_weights.sum(-1) / routed_scaling_factor`` is SGLang's choice: its routed weights
      are unscaled and the whole MoE output is multiplied by the factor afterwards, which this
      weight undoes for the shared expert (with renormalised weights it is 1 / factor).

    ``topk_ids`` are not range-checked (that would cost a device-to-host sync).

        >>> w, ids = append_shared_expert(torch.tensor([[0.75, 0.25], [0.5, 0.5]]),
        ...                               torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), 4)
        >>> ids.tolist(), w.tolist()
        ([[2, 0, 4], [1, 3, 4]], [[0.75, 0.25, 1.0], [0.5, 0.5, 1.0]])
    """
    func = "append_shared_expert"
    check_tensor(func, "topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,))
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64),
                 device=topk_weights.device)
    if topk_ids.shape != topk_weights.shape:
        fail(func, "topk_ids", f"must have the shape of topk_weights {tuple(topk_weights.shape)}",
             f"shape {tuple(topk_ids.shape)}")
    check_int(func, "num_experts", num_experts, lo=1)
    check_int(func, "num_shared_experts", num_shared_experts, lo=1)
    num_tokens = topk_ids.shape[0]
    device = topk_ids.device
    if isinstance(shared_weight, torch.Tensor):
        check_tensor(func, "shared_weight", shared_weight, ndim=1, dtypes=(torch.float32,),
                     device=device)
        if shared_weight.shape[0] != num_tokens:
            fail(func, "shared_weight", f"must have shape ({num_tokens},), one per token",
                 f"shape {tuple(shared_weight.shape)}")
        shared_weights = shared_weight
    elif isinstance(shared_weight, (int, float)) and not isinstance(shared_weight, bool):
        # A NaN or infinite weight would reach every token's output.
        shared_weights = torch.full((num_tokens,), check_number(func, "shared_weight", shared_weight),
                                    dtype=torch.float32, device=device)
    else:
        fail(func, "shared_weight", "must be a float or a float32 tensor [T]",
             type(shared_weight).__name__, TypeError)
    shared_ids = num_experts + torch.arange(num_tokens, device=device) % num_shared_experts
    weights = torch.cat([topk_weights, shared_weights[:, None]], dim=1)
    ids = torch.cat([topk_ids, shared_ids[:, None].to(topk_ids.dtype)], dim=1)
    return weights, ids
