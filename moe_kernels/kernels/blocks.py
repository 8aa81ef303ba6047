"""The block map: which rows each M-block of the grouped GEMM reads, and which expert it multiplies.

Two ways to build it:

* aligned (:func:`moe_kernels.kernels.align.moe_align_block_size`): the assignments grouped by
  expert, each expert padded to whole blocks;
* naive, for tiny batches (:func:`use_naive_block_assignment`, vLLM's ``T * k * 4 <= E``; block-fp8
  weights up to 2 tokens only, measured): block ``m`` is just assignment ``m``, because nearly every
  expert that is hit is hit once, so sorting would buy nothing. :func:`naive_block_assignment` writes
  that layout in the aligned format, so one GEMM kernel can read either; :class:`BlockAssignment` keeps
  it implicit (no tensors at all), and from two tokens on lets the first block of an expert's
  assignments take them all (``naive_group``), so that an expert two tokens share is read once.

    >>> import torch
    >>> ids = torch.tensor([[5, 1]])                 # one token, top-2 of 16 experts
    >>> use_naive_block_assignment(1, 2, 16)         # 1 * 2 * 4 <= 16
    True
    >>> sorted_ids, expert_ids, used = naive_block_assignment(ids, 4)
    >>> sorted_ids.view(-1, 4).tolist(), expert_ids.tolist(), int(used)
    ([[0, 2, 2, 2], [1, 2, 2, 2]], [5, 1], 8)

:func:`check_alignment` states every invariant of the aligned layout and names the first one a
layout breaks; the tests run it on the kernel and on the reference.

Over 400 lines: the map's two builders, the dataclass that checks what the kernels will trust,
and the invariants of the aligned layout are one mechanism, read together.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .._checks import ID_DTYPES, check_bool, check_ids_in_range, check_int, check_tensor, device_id_check, fail
from .align import align_checked, alignment_buffer_sizes
from .config import check_block_m

_ID_DTYPES = ID_DTYPES


def use_naive_block_assignment(num_tokens: int, topk: int, num_experts: int, *,
                               has_expert_map: bool = False, block_fp8: bool = False) -> bool:
    """vLLM's rule for skipping the alignment: ``num_tokens * topk * 4 <= num_experts``; for
    block-fp8 weights (``block_fp8``) also at most :data:`NAIVE_MAX_TOKENS_BLOCK_FP8` tokens.

    With at most one assignment per four experts, nearly every expert that is hit is hit once,
    so nearly every aligned block would hold one real row anyway: sorting costs a launch and
    saves almost nothing. vLLM also requires that there is no expert map (under expert
    parallelism ids must be remapped, so the alignment always runs), and it keeps the
    alignment for int8/int4 weight-only kernels with a group-quantised K
    (``_prepare_expert_assignment`` in vllm-project/vllm,
    ``vllm/model_executor/layers/fused_moe/fused_moe.py``). For DeepSeek-V3 (E=256, top-8)
    the rule holds up to 8 tokens; its block-fp8 layer ran faster aligned from 3 (below).

        >>> use_naive_block_assignment(8, 8, 256), use_naive_block_assignment(8, 8, 256, block_fp8=True)
        (True, False)
    """
    func = "use_naive_block_assignment"
    check_int(func, "num_tokens", num_tokens, lo=0)
    check_int(func, "topk", topk, lo=1)
    check_int(func, "num_experts", num_experts, lo=1)
    check_bool(func, "block_fp8", block_fp8)
    return not has_expert_map and _naive_rule(num_tokens, topk, num_experts, block_fp8)


def _naive_rule(num_tokens: int, topk: int, num_experts: int, block_fp8: bool) -> bool:
    """:func:`use_naive_block_assignment` without its checks (what :func:`build_blocks` asks at every call)."""
    return num_tokens * topk * NAIVE_RULE_FACTOR <= num_experts and (not block_fp8 or
                                                                    num_tokens <= NAIVE_MAX_TOKENS_BLOCK_FP8)


#: The 4 of vLLM's rule. ``tools/naive_map_ab.py`` raises it past any batch to time the aligned map where the
#: rule would take the naive one.
NAIVE_RULE_FACTOR = 4
#: The most tokens for which block-fp8 weights take the naive map. On an H100 (``tools/naive_map_ab.py``,
#: ``naive-map-ab-s46*.json``, the routed layer in CUDA graphs with the L2 flushed) DeepSeek-V3's block-fp8 layer ran
#: 0.8-3.7% faster on the aligned map at 3-8 tokens (885.2 against 858.6 us at 8) and 0.7-0.8% slower at 2, and its
#: experts call alone 1.8-4.1% faster; its bf16 layer was level (within 0.4%). Qwen3-30B-A3B's layer runs both GEMMs
#: in one two-phase launch at these batches (no block map), but its block-fp8 experts call alone ran 1.5-2.1% faster
#: aligned too.
NAIVE_MAX_TOKENS_BLOCK_FP8 = 2


def naive_block_assignment(topk_ids: torch.Tensor, block_size: int):
    """The small-batch layout in :func:`moe_align_block_size`'s format: block ``m`` = assignment m.

    ``sorted_token_ids[m * block_size] = m`` and the other ``block_size - 1`` rows of each block
    hold the sentinel ``numel``; ``expert_ids`` is ``topk_ids.flatten()`` (int32);
    ``num_tokens_post_padded = numel * block_size``. Every row is used, so the GEMM runs
    :func:`naive_padded_rows` rows. A few torch ops, no kernel: there is nothing to sort.
    """
    func = "naive_block_assignment"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES)
    check_int(func, "block_size", block_size, lo=1)
    numel = topk_ids.numel()
    device = topk_ids.device
    sorted_ids = torch.full((numel, block_size), numel, dtype=torch.int32, device=device)
    sorted_ids[:, 0] = torch.arange(numel, dtype=torch.int32, device=device)
    expert_ids = topk_ids.flatten().to(torch.int32)
    used = torch.full((1,), numel * block_size, dtype=torch.int32, device=device)
    return sorted_ids.flatten(), expert_ids, used


def naive_padded_rows(num_tokens: int, topk: int, block_size: int) -> int:
    """GEMM rows the naive layout runs: ``num_tokens * topk * block_size`` (a block per assignment).

    The aligned layout runs ``sum_e ceil(c_e / block_size) * block_size`` rows (its
    ``num_tokens_post_padded``): the same ``numel * block_size`` when every assignment has an
    expert to itself, which is what the naive rule bets on, and fewer as soon as experts are
    shared (``c`` assignments of one expert share ``ceil(c / block_size)`` blocks instead of
    taking ``c``). So at the rule's batch sizes the naive path costs no extra rows and saves the
    alignment launch; above them it would run up to ``block_size`` times the aligned rows.
    """
    func = "naive_padded_rows"
    check_int(func, "num_tokens", num_tokens, lo=0)
    check_int(func, "topk", topk, lo=1)
    check_int(func, "block_size", block_size, lo=1)
    return num_tokens * topk * block_size


def _broken(reason: str) -> AssertionError:
    return AssertionError(f"check_alignment: {reason}")


def check_alignment(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                    sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                    num_tokens_post_padded: torch.Tensor) -> None:
    """Assert that the three tensors align ``topk_ids`` correctly; if not, say what is wrong.

    Checked, in this order (the first failure raises ``AssertionError`` with the reason):

    * dtypes (int32) and sizes: ``numel + E*(block_size-1)`` rows, ``ceil(rows/block_size)``
      blocks, one used-length;
    * ``num_tokens_post_padded`` equals the sum over experts of the count rounded up to the block;
    * every row past it holds the sentinel ``numel``, every block past it is ``-1``;
    * inside the used region every assignment index ``0..numel-1`` appears exactly once and
      everything else is the sentinel;
    * the used blocks carry the segments in expert order, each starting on a block boundary and
      ``ceil(c_e/block_size)`` blocks long (checked through ``expert_ids``);
    * every real row sits in a block labelled with its own expert;
    * inside each segment the ``c_e`` real rows come first, the padding after.

    The order of assignments inside a segment is not checked: it is free as far as the GEMM
    cares (compare against the reference for that).
    """
    func = "check_alignment"
    capacity, num_blocks = alignment_buffer_sizes(func, topk_ids, block_size, num_experts)
    check_ids_in_range(func, "topk_ids", topk_ids, num_experts, on_device=False)
    for name, tensor, length in (("sorted_token_ids", sorted_token_ids, capacity),
                                 ("expert_ids", expert_ids, num_blocks),
                                 ("num_tokens_post_padded", num_tokens_post_padded, 1)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32:
            raise _broken(f"{name} must be an int32 tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        if tuple(tensor.shape) != (length,):
            raise _broken(f"{name} must have shape ({length},), got {tuple(tensor.shape)}")

    assignment_experts = topk_ids.detach().flatten().to("cpu", torch.int64)
    numel = assignment_experts.numel()
    sentinel = numel
    rows = sorted_token_ids.detach().to("cpu", torch.int64)
    labels = expert_ids.detach().to("cpu", torch.int64)
    used = int(num_tokens_post_padded[0])

    counts = torch.bincount(assignment_experts, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    segment_start = torch.cumsum(padded, 0) - padded
    expected_used = int(padded.sum())
    if used != expected_used:
        raise _broken(f"num_tokens_post_padded is {used}, expected {expected_used} (each expert's "
                      f"count rounded up to a multiple of block_size={block_size}, summed)")

    def first(mask: torch.Tensor) -> int:
        return int(mask.nonzero()[0, 0])

    wrong_tail = rows[used:] != sentinel
    if wrong_tail.any():
        at = used + first(wrong_tail)
        raise _broken(f"sorted_token_ids[{at}] = {int(rows[at])} lies past the used region "
                      f"({used} rows); expected the sentinel {sentinel}")
    used_blocks = used // block_size
    wrong_tail = labels[used_blocks:] != -1
    if wrong_tail.any():
        at = used_blocks + first(wrong_tail)
        raise _broken(f"expert_ids[{at}] = {int(labels[at])} lies past the {used_blocks} used "
                      f"blocks; expected -1")

    head = rows[:used]
    out_of_range = (head < 0) | (head > sentinel)
    if out_of_range.any():
        at = first(out_of_range)
        raise _broken(f"sorted_token_ids[{at}] = {int(head[at])} is neither an assignment "
                      f"index in [0, {numel}) nor the sentinel {sentinel}")
    is_real = head != sentinel
    real_rows = is_real.nonzero().flatten()
    occurrences = torch.bincount(head[real_rows], minlength=numel)
    if (occurrences == 0).any():
        missing = first(occurrences == 0)
        raise _broken(f"assignment index {missing} is missing from the used region")
    if (occurrences > 1).any():
        repeated = first(occurrences > 1)
        where = (head == repeated).nonzero().flatten().tolist()
        raise _broken(f"assignment index {repeated} appears {int(occurrences[repeated])} times "
                      f"(rows {where})")

    expected_labels = torch.repeat_interleave(torch.arange(num_experts), padded // block_size)
    wrong_label = labels[:used_blocks] != expected_labels
    if wrong_label.any():
        block = first(wrong_label)
        expert = int(expected_labels[block])
        start, end = int(segment_start[expert]), int(segment_start[expert] + padded[expert])
        raise _broken(f"expert_ids[{block}] = {int(labels[block])}, expected {expert}: expert "
                      f"{expert}'s segment is rows [{start}, {end}) ({int(counts[expert])} "
                      f"assignments rounded up to block_size={block_size})")

    row_expert = expected_labels.repeat_interleave(block_size)
    wrong_expert = assignment_experts[head[real_rows]] != row_expert[real_rows]
    if wrong_expert.any():
        row = int(real_rows[first(wrong_expert)])
        raise _broken(f"row {row} holds assignment {int(head[row])} of expert "
                      f"{int(assignment_experts[head[row]])}, but its block {row // block_size} "
                      f"belongs to expert {int(row_expert[row])}")

    should_be_real = (torch.arange(used) - segment_start[row_expert]) < counts[row_expert]
    misplaced = is_real != should_be_real
    if misplaced.any():
        row = first(misplaced)
        expert = int(row_expert[row])
        raise _broken(f"row {row} holds {int(head[row])}, but expert {expert}'s segment starts "
                      f"at row {int(segment_start[expert])} with its {int(counts[expert])} "
                      f"assignments first and padding after")


#: The most assignments for which a naive block map groups each expert's assignments into one
#: block (``gather_tile._naive_group_rows``: every program compares its expert with all of them).
#: vLLM's rule takes the naive map only while ``T * k * 4 <= E``: 64 assignments at E = 256.
#: (``MOE_KERNELS_NAIVE_GROUP_MAX=0``: no grouping, to time the map as vLLM runs it.)
NAIVE_GROUP_MAX = os.environ.get("MOE_KERNELS_NAIVE_GROUP_MAX") or "256"
if not NAIVE_GROUP_MAX.isdigit():
    raise ValueError("environment variable MOE_KERNELS_NAIVE_GROUP_MAX must be a whole number of assignments "
                     f"(0: no grouping; unset: 256), got {NAIVE_GROUP_MAX!r}")
NAIVE_GROUP_MAX = int(NAIVE_GROUP_MAX)


def naive_group_size(num_tokens: int, top_k: int) -> int:
    """``BlockAssignment.naive_group`` for a naive map of ``num_tokens x top_k`` assignments: the
    power of two the kernel's id vector takes (at least 16); 0 (one block per assignment) for one
    token, whose experts are its own top-k and so distinct, and above :data:`NAIVE_GROUP_MAX`.

        >>> naive_group_size(1, 8), naive_group_size(2, 8), naive_group_size(8, 8), naive_group_size(33, 8)
        (0, 16, 64, 0)
    """
    numel = num_tokens * top_k
    if num_tokens <= 1 or numel > NAIVE_GROUP_MAX:
        return 0
    return max(16, 1 << (numel - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockAssignment:
    """What each M-block of ``block_m`` rows reads, and which expert it multiplies by.

    ``sorted_token_ids is None`` marks the naive assignment: block ``m`` is assignment ``m``
    alone (with ``naive_group``, block ``m`` takes the assignments of its expert, or none), and
    ``expert_ids`` is ``topk_ids.flatten()``. Otherwise the three tensors are
    :func:`moe_align_block_size`'s outputs. ``num_m_blocks`` is the launch grid along M: an upper
    bound on the blocks in use (programs past ``num_tokens_post_padded`` do no work).
    """

    block_m: int
    expert_ids: torch.Tensor
    sorted_token_ids: torch.Tensor | None
    num_tokens_post_padded: torch.Tensor | None
    num_m_blocks: int
    #: ``T*k``, the assignments the map was built for (None: not recorded), so that a map built for
    #: another batch can be refused instead of leaving rows of the output unwritten.
    num_assignments: int | None = None
    #: A naive map's ids are checked by one of the GEMMs that read them (GEMM 2 unless
    #: ``index_gather.NAIVE_ID_CHECK_IN`` says otherwise), on the GPU: the message of that
    #: device-side assert ("" when the ids need no check, or were checked on the host).
    id_check: str = ""
    #: One expert that every row uses, rows in order (a shared expert through the grouped GEMMs):
    #: block ``m`` is rows ``m * block_m`` onward, all of expert 0, and no index tensor is read
    #: (``expert_ids`` is only a placeholder). Built by :func:`dense_blocks`.
    dense: bool = False
    #: On a naive map, the first block of each expert's assignments takes them all (up to
    #: ``block_m``) as its rows and the others compute nothing, so that two tokens on one expert
    #: read its weights once: the power of two of ids each block compares (0: one block per
    #: assignment, as vLLM's naive map). Set by :func:`assign_blocks` (:func:`naive_group_size`).
    naive_group: int = 0

    def __post_init__(self):
        # A kernel would compile BLOCK_M into tl.arange (a power of two) and use every index as an
        # address: check what it will trust.
        func = "BlockAssignment"
        check_block_m(func, "block_m", self.block_m)
        check_tensor(func, "expert_ids", self.expert_ids, ndim=1, dtypes=ID_DTYPES)
        if (self.sorted_token_ids is None) != (self.num_tokens_post_padded is None):
            fail(func, "num_tokens_post_padded" if self.num_tokens_post_padded is None else "sorted_token_ids",
                 "must be given together with the other alignment output (both None: the naive map)",
                 "only one of the two")
        if self.sorted_token_ids is not None:
            device = self.expert_ids.device
            check_tensor(func, "sorted_token_ids", self.sorted_token_ids, ndim=1, dtypes=(torch.int32,),
                         device=device, contiguous=True)
            check_tensor(func, "num_tokens_post_padded", self.num_tokens_post_padded, ndim=1,
                         dtypes=(torch.int32,), device=device)
        if self.dense:
            if self.sorted_token_ids is not None or self.num_assignments is None:
                fail(func, "dense", "needs sorted_token_ids=None and num_assignments (see dense_blocks)",
                     "an aligned map" if self.sorted_token_ids is not None else "num_assignments=None")
            check_int(func, "num_m_blocks", self.num_m_blocks, lo=-(-self.num_assignments // self.block_m))
        else:
            check_int(func, "num_m_blocks", self.num_m_blocks, lo=0, hi=self.expert_ids.numel(),
                      what_hi="one block per entry of expert_ids")
        if self.num_assignments is not None:
            check_int(func, "num_assignments", self.num_assignments, lo=0)
        if self.naive_group:   # (every block must see every id: a power of two, at least all of them)
            group = self.naive_group
            if not self.naive or not isinstance(group, int) or group & (group - 1) or group < max(
                    16, self.expert_ids.numel()):
                fail(func, "naive_group", f"must be 0 or, on a naive map, a power of two >= max(16, "
                     f"expert_ids.numel() = {self.expert_ids.numel()})", repr(group))

    @property
    def naive(self) -> bool:
        return self.sorted_token_ids is None and not self.dense


def assign_blocks(topk_ids: torch.Tensor, block_m: int, num_experts: int, *, naive: bool | None = None,
                  validate_ids: bool = True) -> BlockAssignment:
    """Build the block map for ``topk_ids``: naive when ``naive`` says so, or by default when
    :func:`moe_kernels.kernels.align.use_naive_block_assignment` (vLLM's ``T * k * 4 <= E``) holds.

    The naive map needs no index tensors at all (the kernel computes "row 0 of block ``m`` is
    assignment ``m``" itself, or from two tokens on which assignments share block ``m``'s expert:
    ``naive_group``), so at decode no kernel runs before the GEMMs. The alignment's
    own :func:`moe_kernels.kernels.align.naive_block_assignment` builds the same map as explicit
    tensors, which the aligned path also accepts.

    ``validate_ids`` checks the ids on either path: on the CPU at once; on a GPU inside a kernel
    that reads them (the alignment, or on the naive path GEMM 2: ``index_gather.NAIVE_ID_CHECK_IN``),
    as a device-side assert that costs no launch and no host sync.
    """
    func = "assign_blocks"
    check_tensor(func, "topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES)
    check_block_m(func, "block_m", block_m)
    check_int(func, "num_experts", num_experts, lo=1)
    alignment_buffer_sizes(func, topk_ids, block_m, num_experts)
    return build_blocks(func, topk_ids, block_m, num_experts, naive, validate_ids)


def build_blocks(func: str, topk_ids: torch.Tensor, block_m: int, num_experts: int, naive: bool | None,
                 validate_ids: bool, block_fp8: bool = False) -> BlockAssignment:
    """:func:`assign_blocks` after its argument checks (the layer and ``fused_experts`` check
    once, then call this); the id check, when asked, blames ``func``. ``naive`` None: the rule, for block-fp8
    weights where ``block_fp8``."""
    num_tokens, top_k = topk_ids.shape
    numel = num_tokens * top_k
    if naive is None:
        naive = _naive_rule(num_tokens, top_k, num_experts, block_fp8)
    if naive:
        # The naive map uses the ids themselves as the block labels; each GEMM reads each once.
        id_check = device_id_check(func, "topk_ids", topk_ids, num_experts) if validate_ids else ""
        return _trusted_blocks(block_m=block_m, expert_ids=topk_ids.reshape(-1).contiguous(), sorted_token_ids=None,
                               num_tokens_post_padded=None, num_m_blocks=numel, num_assignments=numel,
                               id_check=id_check, naive_group=naive_group_size(num_tokens, top_k))
    sorted_ids, expert_ids, num_post_padded = align_checked(func, topk_ids, block_m, num_experts, validate_ids)
    return aligned_blocks(sorted_ids, expert_ids, num_post_padded, block_m, numel, num_experts)


def aligned_blocks(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_padded: torch.Tensor, block_m: int,
                   numel: int, num_experts: int) -> BlockAssignment:
    """The block map of an alignment this package computed (:func:`~moe_kernels.kernels.align.moe_align_block_size`,
    or the router's :func:`~moe_kernels.kernels.gate_routing.gate_route_and_align`), unchecked."""
    # Each non-empty expert wastes at most block_m - 1 padding rows, and at most min(E, numel)
    # experts are non-empty: no need to launch programs for the worst case of every expert.
    bound = numel + min(num_experts, numel) * (block_m - 1)
    num_m_blocks = min(expert_ids.numel(), -(-bound // block_m))
    return _trusted_blocks(block_m=block_m, expert_ids=expert_ids, sorted_token_ids=sorted_ids,
                           num_tokens_post_padded=num_post_padded, num_m_blocks=num_m_blocks, num_assignments=numel,
                           id_check="")


def dense_blocks(num_rows: int, block_m: int, placeholder: torch.Tensor) -> BlockAssignment:
    """The block map of one expert that all ``num_rows`` rows use, in order: no alignment runs and
    the GEMMs read no index (``placeholder``, any tensor on the device, fills the unused fields).

        >>> blocks = dense_blocks(40, 16, torch.empty(0, dtype=torch.int32))
        >>> blocks.num_m_blocks, blocks.dense, blocks.naive
        (3, True, False)
    """
    return _trusted_blocks(block_m=block_m, expert_ids=placeholder, sorted_token_ids=None, num_tokens_post_padded=None,
                           num_m_blocks=-(-num_rows // block_m), num_assignments=num_rows, id_check="", dense=True)


def _trusted_blocks(**fields) -> BlockAssignment:
    """A BlockAssignment built from this module's own outputs, without re-checking them (a
    frozen dataclass keeps its fields in ``__dict__``)."""
    blocks = object.__new__(BlockAssignment)
    blocks.__dict__.update(fields)
    return blocks


def assignments_by_block(blocks: BlockAssignment, numel: int):
    """(assignment index, expert id) for every real row of the block map, as the kernel sees them."""
    if blocks.dense:
        return (torch.arange(numel, device=blocks.expert_ids.device),
                torch.zeros(numel, dtype=torch.int64, device=blocks.expert_ids.device))
    if blocks.naive:
        return torch.arange(numel, device=blocks.expert_ids.device), blocks.expert_ids.long()
    used = int(blocks.num_tokens_post_padded[0])
    rows = blocks.sorted_token_ids[:used].long()
    experts = blocks.expert_ids.long().repeat_interleave(blocks.block_m)[:used]
    real = rows < numel
    return rows[real], experts[real]


def check_blocks(func: str, blocks: object, numel: int) -> BlockAssignment:
    if not isinstance(blocks, BlockAssignment):
        fail(func, "blocks", "must be a BlockAssignment (from assign_blocks)", type(blocks).__name__, TypeError)
    if blocks.naive and blocks.expert_ids.numel() != numel:
        fail(func, "blocks", f"must be built for {numel} assignments (T*k)",
             f"a naive map of {blocks.expert_ids.numel()}")
    if blocks.num_assignments is not None and blocks.num_assignments != numel:
        fail(func, "blocks", f"must be built for {numel} assignments (T*k)", f"a map of {blocks.num_assignments}")
    return blocks


def same_segments(got, want, block_size: int, numel: int) -> bool:
    """Whether two alignments ``(sorted_token_ids, expert_ids, num_tokens_post_padded)`` of ``numel``
    assignments in blocks of ``block_size`` agree but for the order of the real rows inside each expert's
    segment: the same used length, block labels, padding rows (the sentinel ``numel``, at the same places)
    and tail, and each segment the same assignments. (An alignment whose ranks come from atomics, as
    ``chained_routing``'s "ranked" body's do on a GPU, places a segment's rows in the order the routing
    programs counted them; the GEMMs compute every row alike wherever it sits.)

        >>> want = (torch.tensor([0, 2, 4, 1, 3, 4, 4, 4]), torch.tensor([0, 1, -1]), torch.tensor([6]))
        >>> same_segments((torch.tensor([2, 0, 4, 1, 3, 4, 4, 4]), *want[1:]), want, 3, 4)
        True
        >>> same_segments((torch.tensor([1, 0, 4, 2, 3, 4, 4, 4]), *want[1:]), want, 3, 4)   # 1, 2 swap experts
        False
        >>> same_segments((torch.tensor([4, 2, 0, 1, 3, 4, 4, 4]), *want[1:]), want, 3, 4)   # padding first
        False
    """
    (ids_a, experts_a, used_a), (ids_b, experts_b, used_b) = ((t.cpu() for t in x) for x in (got, want))
    if not (torch.equal(used_a, used_b) and torch.equal(experts_a, experts_b) and ids_a.shape == ids_b.shape
            and ids_a.dtype == ids_b.dtype):
        return False
    used = int(used_b)
    if not (torch.equal(ids_a[used:], ids_b[used:]) and torch.equal(ids_a[:used] >= numel, ids_b[:used] >= numel)):
        return False
    segment = torch.repeat_interleave(experts_b[: used // block_size], block_size)
    return all(torch.equal(ids_a[:used][segment == e].sort().values, ids_b[:used][segment == e].sort().values)
               for e in torch.unique(segment).tolist())
