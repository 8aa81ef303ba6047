"""Tile configurations of the grouped GEMMs: one class, a heuristic, and tuned tables as data.

(Over 400 lines, and kept whole: the config classes, their checks, the tables that hold checked
configs and the choice among tables are one mechanism; split, the tables and the checks would
import each other.)

Every layout launches the same two GEMMs (:mod:`moe_kernels.kernels._tile_gemm`), so one
:class:`MoEConfig` describes them all: the M tile ``block_m`` (for the index-gather layout also
the alignment block size; for the permute layout it must divide the segment alignment) and a
:class:`GemmTiles` for each GEMM.

Measured configurations are data, not code: ``configs/<name>.json`` beside this file, one file per
(device, E, N = F, K = d, dtype, layout), holding the best configuration per token count ``M``
(vLLM keeps its tuned tables the same way, as JSON beside its kernel). :func:`get_config` takes
the entry at the nearest ``M`` (by ratio) when a file matches, else :func:`default_config`.
``python -m moe_kernels.bench tune`` writes these files.

    >>> cfg = get_config(64, 256, 2048, 7168, torch.bfloat16, "cpu")   # no table for the CPU
    >>> cfg.block_m, cfg.gate_up.block_n, cfg.down.block_n
    (32, 32, 64)
    >>> table_name("NVIDIA H200", 128, 768, 2048, torch.bfloat16, "index_gather")
    'device=NVIDIA_H200,E=128,N=768,K=2048,dtype=bfloat16,layout=index_gather'
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import torch

from .._checks import check_device, check_dtype, check_int, check_number, fail
from .._replay import forget_all_plans
from .layouts import LAYOUTS, layout_named

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Tiles and launch settings of one grouped GEMM.

    ``block_n`` counts *output* columns: GEMM 1 loads ``2 * block_n`` weight rows per K step (the
    gate tile and the matching up tile). ``group_m`` M-blocks are visited before moving to the next
    N-tile, so that M-blocks of one expert share weight tiles in L2. ``split_k`` programs share
    one output tile, each over a slice of the K loop, and add their partial products: more
    programs where the tiles are too few to fill the SMs (GEMM 2 when it sums the top-k slots in
    its epilogue: see :class:`MoEConfig`; GEMM 1 of the index-gather layout, whose gate and up sums
    then go to an fp32 buffer and SiLU·mul to a launch of its own, :mod:`moe_kernels.kernels.activation`). ``tma`` loads the weight tiles through
    Hopper's tensor-memory accelerator (index-gather and permute layouts), and the permute layout's
    activation tiles too (its rows are consecutive; index-gather's gathered rows keep pointer
    loads). ``persistent`` (index-gather and permute layouts): 0 launches one program per tile; 1
    one program per SM, each walking the tiles ``pid, pid + grid, ...`` (the permute layout's only
    those of the rows its segments use); 2 the same with the tile loop and the K loop flattened
    into one software pipeline (those of the blocks in use only; without split-K and short last
    tiles, which keep the two loops nested, as 1 does). ``swap_ab`` (index-gather and permute) computes
    each tile transposed, ``W_tile @ A_tile^T``: the ``block_n`` weight rows become the MMA's M side
    and the few token rows its N side, because Hopper's wgmma needs an M side of 64 or more and a
    decode tile has 16 token rows (with 16- or 32-row M tiles Triton emits the older ``mma.sync``).
    ``k_chunks`` (index-gather): each K step loads that many K-adjacent ``block_k`` chunks of every row
    one after another, each multiplied with its own scales: a block-fp8 step stops at its 128-value
    scale block, and two chunks ask for 256 bytes of a row together (``_tile_gemm.expert_tile_product``).
    """

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    tma: bool = False
    persistent: int = 0
    swap_ab: bool = False
    k_chunks: int = 1

    def check(self, func: str, name: str) -> "GemmTiles":
        for field in ("block_n", "block_k"):
            size = getattr(self, field)
            if not isinstance(size, int) or size < 16 or size & (size - 1):
                fail(func, f"{name}.{field}", "must be a power of two >= 16 (a tl.dot tile)", size)
        for field, lo in (("group_m", 1), ("num_warps", 1), ("num_stages", 1), ("split_k", 1), ("k_chunks", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                fail(func, f"{name}.{field}", f"must be an int >= {lo}", value)
        persistent = self.persistent
        if isinstance(persistent, bool) or not isinstance(persistent, int) or persistent not in (0, 1, 2):
            fail(func, f"{name}.persistent", "must be 0 (one program per tile), 1 (one per SM) or 2 (one per SM, "
                 "flattened loops)", repr(self.persistent))
        for field in ("tma", "swap_ab"):
            if not isinstance(getattr(self, field), bool):
                fail(func, f"{name}.{field}", "must be a bool", repr(getattr(self, field)), TypeError)
        for field in ("num_warps", "k_chunks"):
            if getattr(self, field) & (getattr(self, field) - 1):
                fail(func, f"{name}.{field}", "must be a power of two", getattr(self, field))
        if self.k_chunks > 16:   # (an unrolled loop of that many loads and MMAs a step)
            fail(func, f"{name}.k_chunks", "must be at most 16", self.k_chunks)
        return self


@dataclasses.dataclass(frozen=True)
class OneLaunchTiles:
    """Both GEMMs in one launch, in one of two kernels.

    ``phases=1`` (:mod:`moe_kernels.kernels.one_launch`): a program per assignment and slice of
    ``block_f`` intermediate rows (a power of two, at most 128, so that a slice never straddles a
    128-row scale block) does both products for its slice; ``block_d`` columns of ``d`` per step (a
    power of two, at least 16), warps per program, and the software pipeline's depth over the steps
    (``num_stages``: Triton's ``tl.range``; 1 loads each step as it comes). Wide tiles in deep
    pipelines may not fit in shared memory (on the H200, 64 x 512 and 128 x 256 with 3 stages did
    not: Triton's OutOfResources at the first launch).

    ``phases=2`` (:mod:`moe_kernels.kernels.two_phase`): ``programs_per_sm`` programs per SM take
    work units by ticket, first GEMM 1's (an assignment's ``block_f`` gate rows and as many up rows,
    at least 16), then GEMM 2's (an assignment's ``block_d`` output rows); both step over K by
    ``block_k * k_chunks`` values of each weight row, in ``k_chunks`` chunks of ``block_k`` (fp8 block
    weights: chunks of their 128, one activation group each, so that 2 or 4 chunks read 256 or 512 bytes of
    an fp8 row a step, as 1 or 2 do of a bf16 row). ``swap_ab`` puts the weights
    on the MMA's M side (``2 * block_f`` and ``block_d`` rows; 64 or more make Hopper's wgmma, which
    reads fp8 as it is), the token on N; without it the token is row 0 of a 16-row M tile (mma.sync,
    which on Hopper converts fp8 operands to fp16 first)."""

    block_f: int = 32
    block_d: int = 256
    num_warps: int = 4
    num_stages: int = 1
    phases: int = 1
    block_k: int = 128
    programs_per_sm: int = 4
    swap_ab: bool = False
    k_chunks: int = 1

    def __post_init__(self):
        func = "OneLaunchTiles"
        for name, lo, hi in (("block_f", 1, 128), ("block_d", 16, 4096), ("num_warps", 1, 16), ("num_stages", 1, 8),
                             ("phases", 1, 2), ("block_k", 16, 512), ("programs_per_sm", 1, 32),
                             ("k_chunks", 1, 16)):
            value = getattr(self, name)
            check_int(func, name, value, lo=lo, hi=hi)
            if name in ("block_f", "block_d", "num_warps", "block_k", "k_chunks") and value & (value - 1):
                fail(func, name, "must be a power of two", value)
        if self.phases == 2 and self.block_f < 16:
            fail(func, "block_f", "must be >= 16 with phases=2 (the N side of a tensor-core product)", self.block_f)
        if not isinstance(self.swap_ab, bool):
            fail(func, "swap_ab", "must be a bool", repr(self.swap_ab), TypeError)
        if self.swap_ab and self.phases != 2:
            fail(func, "swap_ab", "must be False with phases=1 (only the two-phase kernel swaps its operands)",
                 self.swap_ab)
        if self.k_chunks > 1 and self.phases != 2:
            fail(func, "k_chunks", "must be 1 with phases=1 (only the two-phase kernel reads chunks)", self.k_chunks)
        if self.phases == 2 and self.block_d > 256:
            fail(func, "block_d", "must be <= 256 with phases=2 (output rows of one GEMM 2 unit)", self.block_d)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


#: MoEConfig's switches (bools, default off), each a feature a layout may lack (moe_kernels.kernels.layouts).
_SWITCHES = ("sum_in_gemm", "pdl", "quant_in_gemm", "gather_rows", "short_last_tile")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The M tile and the tiles of both GEMMs (GEMM 1: gate/up with SiLU·mul; GEMM 2: down).

    ``sum_in_gemm`` (index-gather and permute layouts): GEMM 2 adds each routed row straight into an fp32
    ``[T, d]`` accumulator with atomics, instead of writing ``[T, k, d]`` for a separate top-k sum;
    one cast to the output dtype follows. It saves writing and re-reading ``k`` rows per token
    and allows ``down.split_k > 1``; the order of the fp32 additions then varies from run to run
    (as it does with ``gate_up.split_k > 1``, GEMM 1 split over K).

    ``pdl`` (index-gather layout, Hopper): GEMM 2 is launched as a programmatic dependent of GEMM 1,
    so that its launch overlaps GEMM 1's end (:mod:`moe_kernels.kernels._pdl`; measured within
    1.5% of the plain launch in a CUDA graph, and kept off by the tuner).
    ``quant_in_gemm`` (index-gather layout, fp8 block weights, ``gate_up.block_n`` a multiple of
    128): GEMM 1's epilogue writes GEMM 2's fp8 activations and their 1x128 scales itself, one
    quantiser launch fewer; elsewhere it is ignored.
    """

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    sum_in_gemm: bool = False
    pdl: bool = False
    quant_in_gemm: bool = False
    #: Permute layout: no copy of the rows into their segments. GEMM 1 reads each row from its
    #: token through the permutation (pointer loads), and writes its output into the segments, so
    #: that GEMM 2 still reads contiguous rows (through TMA with ``down.tma``): one pass over the
    #: activations fewer (:func:`moe_kernels.kernels.permute.permute_experts`).
    gather_rows: bool = False
    #: Permute layout: a segment's last M tile with at most ``block_m // 2`` real rows runs as a
    #: ``block_m // 2``-row tile, in a second launch of each GEMM, so that its padding rows are
    #: not multiplied (:func:`moe_kernels.kernels.contiguous_gemm.grouped_gemm_contiguous`).
    short_last_tile: bool = False
    #: Both GEMMs in one launch instead (index-gather layout, no block map: tiny batches).
    one_launch: OneLaunchTiles | None = None
    #: Both GEMMs as one stream of tiles, GEMM 2's a lag of this many blocks behind GEMM 1's
    #: (index-gather layout; :mod:`moe_kernels.kernels.streamed_pair`); None: two launches. The one
    #: kernel runs with ``gate_up``'s warps and stages (``down``'s are not used), walks the tiles in
    #: its own order (``group_m`` unused), has no launch between the GEMMs (``pdl`` unused) and in
    #: fp8 always quantises GEMM 2's input in GEMM 1's epilogue (as ``quant_in_gemm`` does).
    stream_lag: int | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for key in ("one_launch", "stream_lag"):   # (the tables written before they existed hold no such key)
            if d[key] is None:
                del d[key]
        for key in ("gather_rows", "short_last_tile"):   # (nor these)
            if not d[key]:
                del d[key]
        for gemm in ("gate_up", "down"):   # (nor a GEMM's k_chunks)
            if d[gemm]["k_chunks"] == 1:
                del d[gemm]["k_chunks"]
        return d

    @staticmethod
    def from_dict(d: dict, *, func: str = "MoEConfig.from_dict", name: str = "d") -> "MoEConfig":
        """The inverse of :meth:`to_dict` (what the tuned tables hold); unknown or missing keys
        and values of the wrong type are errors naming ``name`` (the caller's argument or file)."""
        if not isinstance(d, dict):
            fail(func, name, "must be a dict (MoEConfig.to_dict())", type(d).__name__, TypeError)
        missing = [key for key in ("block_m", "gate_up", "down") if key not in d]
        unknown = sorted(set(d) - {"block_m", "gate_up", "down", "one_launch", "stream_lag", *_SWITCHES})
        if missing or unknown:
            fail(func, name, f"must have the keys block_m, gate_up, down (and optionally {', '.join(_SWITCHES)}, "
                 "one_launch, stream_lag)",
                 f"{'missing ' + ', '.join(missing) if missing else ''}{'; ' if missing and unknown else ''}"
                 f"{'unknown ' + ', '.join(unknown) if unknown else ''}")
        tiles = {}
        fields = {f.name for f in dataclasses.fields(GemmTiles)}
        for gemm in ("gate_up", "down"):
            entry = d[gemm]
            if not isinstance(entry, dict) or not {"block_n", "block_k"} <= set(entry) or set(entry) - fields:
                fail(func, f"{name}['{gemm}']", f"must be a dict of GemmTiles fields ({', '.join(sorted(fields))}) "
                     "with block_n and block_k", repr(entry))
            tiles[gemm] = GemmTiles(**entry)
        one_launch = d.get("one_launch")
        if one_launch is not None:
            fields = {f.name for f in dataclasses.fields(OneLaunchTiles)}
            if not isinstance(one_launch, dict) or set(one_launch) - fields:
                fail(func, f"{name}['one_launch']", f"must be None or a dict of OneLaunchTiles fields "
                     f"({', '.join(sorted(fields))})", repr(one_launch))
            one_launch = OneLaunchTiles(**one_launch)
        return MoEConfig(d["block_m"], tiles["gate_up"], tiles["down"], **{k: d[k] for k in _SWITCHES if k in d},
                         one_launch=one_launch, stream_lag=d.get("stream_lag"))

    def with_block_m(self, block_m: int) -> "MoEConfig":
        return dataclasses.replace(self, block_m=block_m)


def check_config(func: str, config: object, *, align: int | None = None, layout: str = "index_gather") -> MoEConfig:
    """``config`` must be a :class:`MoEConfig` of power-of-two tiles; with ``align`` (the permute
    layout's segment alignment), ``block_m`` must divide it so that no tile straddles two experts.
    The top-k sum in GEMM 2 (and split-K with it) exists in the index-gather and permute
    ``layout``s (:data:`~moe_kernels.kernels.layouts.LAYOUTS`)."""
    if not isinstance(config, MoEConfig):
        fail(func, "config", "must be a moe_kernels.MoEConfig (or None for the default)",
             type(config).__name__, TypeError)
    check_block_m(func, "config.block_m", config.block_m)
    config.gate_up.check(func, "config.gate_up")
    config.down.check(func, "config.down")
    for field in _SWITCHES:
        if not isinstance(getattr(config, field), bool):
            fail(func, f"config.{field}", "must be a bool", repr(getattr(config, field)), TypeError)
    if config.one_launch is not None:
        if not isinstance(config.one_launch, OneLaunchTiles):
            fail(func, "config.one_launch", "must be None or a OneLaunchTiles", type(config.one_launch).__name__,
                 TypeError)
        if not layout_named(func, layout).one_launch:
            fail(func, "config.one_launch", f"must be None for the {layout} layout (both GEMMs in one launch read "
                 "the routing's ids directly, with no block map: index_gather only)", config.one_launch)
    if config.stream_lag is not None:
        check_stream(func, config.gate_up, config.down, config.stream_lag, prefix="config.", lag_name="stream_lag")
        if not layout_named(func, layout).streamed:
            fail(func, "config.stream_lag", f"must be None for the {layout} layout (the streamed pair reads the "
                 "index-gather block map: index_gather only)", config.stream_lag)
        if config.sum_in_gemm:
            fail(func, "config.sum_in_gemm", "must be False when config.stream_lag is set (the stream writes the "
                 "[T, k, d] rows)", config.sum_in_gemm)
        if config.one_launch is not None:
            fail(func, "config.stream_lag", "must be None when config.one_launch is set (both GEMMs run in the one "
                 "launch already)", config.stream_lag)
    for gemm in ("gate_up", "down"):   # (a stream's tiles: check_stream)
        if getattr(config, gemm).k_chunks != 1 and layout != "index_gather":
            fail(func, f"config.{gemm}.k_chunks", f"must be 1 for the {layout} layout (chunked K steps are wired into "
                 "the index-gather GEMM kernel only)", getattr(config, gemm).k_chunks)
    if config.down.split_k != 1 and not config.sum_in_gemm:
        fail(func, "config.down.split_k", "must be 1 unless config.sum_in_gemm=True (split-K partial products "
             "are added with atomics, into the summed output)", config.down.split_k)
    supports = layout_named(func, layout)
    machinery = [(f"config.{g}.{f}", getattr(getattr(config, g), f), f, what) for g in ("gate_up", "down")
                 for f, what in (("persistent", "the persistent grid"), ("tma", "tensor-descriptor loads"),
                                 ("swap_ab", "the transposed tile product"))]
    machinery += [(f"config.{f}", getattr(config, f), f, what) for f, what in (
        ("pdl", "programmatic dependent launch"), ("quant_in_gemm", "GEMM 1's fp8 epilogue"),
        ("gather_rows", "GEMM 1 reading rows through the permutation"),
        ("short_last_tile", "a segment's last tile on half the rows"))]
    for name, value, field, what in machinery:
        if value and not getattr(supports, field):
            fail(func, name, f"must be {0 if name.endswith('persistent') else False} for the {layout} layout ({what} "
                 "is not wired into it: see moe_kernels.kernels.layouts)", value)
    if config.gate_up.split_k != 1 and not supports.split_gate_up:
        fail(func, "config.gate_up.split_k", f"must be 1 for the {layout} layout (SiLU·mul in GEMM 1's epilogue "
             "needs the whole K sum; only index_gather splits GEMM 1)", config.gate_up.split_k)
    if config.gate_up.split_k != 1 and config.quant_in_gemm:
        fail(func, "config.quant_in_gemm", "must be False when config.gate_up.split_k > 1 (GEMM 1's epilogue "
             "sees partial sums only)", config.quant_in_gemm)
    if not supports.sum_in_gemm and (config.sum_in_gemm or config.down.split_k != 1):
        fail(func, "config.sum_in_gemm", f"must be False with down.split_k=1 for the {layout} layout (its rows are "
             "summed by the unpermute pass)", f"sum_in_gemm={config.sum_in_gemm}, split_k={config.down.split_k}")
    if config.short_last_tile and config.block_m < 32:
        fail(func, "config.block_m", "must be at least 32 with config.short_last_tile (its half tile is a tl.dot "
             "tile of at least 16 rows)", config.block_m)
    if align is not None and align % config.block_m:
        fail(func, "config.block_m", f"must divide align={align} (no tile may straddle two segments)", config.block_m)
    return config


def check_stream(func: str, gate_up: GemmTiles, down: GemmTiles, lag: object, *, prefix: str = "",
                 lag_name: str = "lag") -> None:
    """The settings one stream of both GEMMs can run (:mod:`moe_kernels.kernels.streamed_pair`): a
    lag of at least 0 blocks, and tiles with no split K and no persistent grid (in the stream a tile
    is one program's, and the tickets are the schedule). Errors name ``prefix + field``."""
    if isinstance(lag, bool) or not isinstance(lag, int):
        fail(func, prefix + lag_name, "must be an int >= 0 (blocks between GEMM 1's tiles and GEMM 2's in one "
             "stream; None in a config: two launches)", repr(lag), TypeError)
    if lag < 0:
        fail(func, prefix + lag_name, "must be an int >= 0 (blocks between GEMM 1's tiles and GEMM 2's in one "
             "stream; None in a config: two launches)", lag)
    for name, tiles in (("gate_up", gate_up), ("down", down)):
        if tiles.k_chunks != 1:   # (the stream's kernel has no chunked K loop)
            fail(func, f"{prefix}{name}.k_chunks", "must be 1 to run as one stream (chunked K steps are wired into "
                 "the index-gather GEMM kernel only)", tiles.k_chunks)
        if tiles.split_k != 1 or tiles.persistent:
            fail(func, f"{prefix}{name}", "must have split_k=1 and persistent=0 to run as one stream (a tile is "
                 "one program's, and the tickets are the schedule)",
                 f"split_k={tiles.split_k}, persistent={tiles.persistent}")


def check_block_m(func: str, name: str, block_m: object) -> int:
    if isinstance(block_m, bool) or not isinstance(block_m, int):
        fail(func, name, "must be an int", type(block_m).__name__, TypeError)
    if block_m < 16 or block_m & (block_m - 1):
        fail(func, name, "must be a power of two >= 16 (a tl.dot tile)", block_m)
    return block_m


def _check_layout(func: str, layout: object, align: object) -> None:
    layout_named(func, layout)
    check_int(func, "align", align, lo=1)
    # The permute layout's M tile must divide align, and no tile is smaller than 16 rows.
    if layout == "permute" and align % 16:
        fail(func, "align", "must be a multiple of 16 for the permute layout (an M tile, a power of two "
             ">= 16, must divide it so that no tile straddles two experts' segments)", align)


def default_config(M: int, E: int, N: int, K: int, *, layout: str = "index_gather", align: int = 128,
                   dtype: torch.dtype = torch.bfloat16) -> MoEConfig:
    """The configuration used when no tuned table matches, for ``M`` tokens, ``N = F``, ``K = d``.

    Follows vLLM 0.33.0's ``get_default_config`` (``fused_moe/fused_moe.py``): its bf16 branch for
    16/32-bit weights, its block-fp8 branch for fp8 ones (an M tile of 16 up to 64 tokens, then 64;
    K steps of 128, one weight-scale block each). vLLM runs one config for both GEMMs, and its GEMM 1
    tile of ``BLOCK_SIZE_N`` columns of ``[2F, d]`` covers half gate and half up columns; our fused
    GEMM 1 computes both halves per program, so it takes half the N tile to keep the same weight
    tile per program. The permute layout uses the same tiles (every M tile divides the 128-row
    alignment); the masked layout, whose M tiles cover ``m_max``-row slabs, takes 128x128x64
    (128x128x32 in fp32, whose operands are twice as wide).
    """
    _check_layout("default_config", layout, align)
    if layout == "masked":
        tiles = GemmTiles(128, 32 if dtype == torch.float32 else 64, 1, 8, 3)
        return MoEConfig(128, tiles, tiles)
    if dtype == torch.float8_e4m3fn:
        block_m = 16 if M <= 64 else 64
        block_n = 64 if M <= 8 else 128
        group_m = 1 if M <= 16 else 32
        num_stages = 4 if M <= 4 else 3
        config = MoEConfig(block_m, GemmTiles(max(32, block_n // 2), 128, group_m, 4, num_stages),
                           GemmTiles(block_n, 128, group_m, 4, num_stages))
    else:
        block_m = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
        block_n = 64 if M <= 64 else 128
        block_k = 128 if M <= 64 else 64
        group_m = 16 if M // max(E, 1) > 128 else 1
        num_warps = 4 if M <= 128 else 8
        num_stages = 4 if M <= 32 else 3
        config = MoEConfig(block_m, GemmTiles(max(16, block_n // 2), block_k, group_m, num_warps, num_stages),
                           GemmTiles(block_n, block_k, group_m, num_warps, num_stages))
    while align % config.block_m and config.block_m > 16:   # the permute layout: tiles inside segments
        config = config.with_block_m(config.block_m // 2)
    return config


def table_name(device_name: str, E: int, N: int, K: int, dtype: torch.dtype, layout: str) -> str:
    """The file stem of the tuned table for this GPU, shape, dtype and layout."""
    dtype_name = str(dtype).replace("torch.", "")
    return f"device={device_name.replace(' ', '_')},E={E},N={N},K={K},dtype={dtype_name},layout={layout}"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[int, MoEConfig] | None:
    """``configs/<name>.json`` as ``{M: MoEConfig}``, or None if there is no such file. Every
    entry is checked as a config of the table's layout: a file that is not JSON, lacks its
    ``configs``, or holds an invalid entry is an error naming the file (and the entry)."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.exists():
        return None
    func, where = "load_table", f"configs/{path.name}"
    try:
        entries = json.loads(path.read_text())["configs"]
        if not isinstance(entries, dict):
            raise TypeError("'configs' is not an object")
    except (ValueError, KeyError, TypeError) as err:
        fail(func, where, "must be a tuned table: JSON with a 'configs' object of token count -> config "
             "(python -m moe_kernels.bench tune --write-tables writes them)", f"{type(err).__name__}: {err}")
    layout = name.rsplit("layout=", 1)[-1] if "layout=" in name else "index_gather"
    table = {}
    for m, entry in entries.items():
        try:
            tokens = int(m)
            if tokens < 1:
                raise ValueError(f"token count {m}")
            table[tokens] = check_config(func, MoEConfig.from_dict(entry), layout=layout)
        except (ValueError, TypeError) as err:
            fail(func, f"{where} entry {m!r}", f"must be a valid {layout} configuration", str(err))
    return table


def nearest(table: dict[int, MoEConfig], M: int) -> MoEConfig:
    """The entry at the token count nearest to ``M`` by ratio (the smaller one on a tie)."""
    return table[nearest_entry(table, M)]


def nearest_entry(table: dict[int, MoEConfig], M: int) -> int:
    return min(table, key=lambda m: (abs(math.log(m / max(M, 1))), m))


#: How far past its ends, as a ratio of token counts, a table that covers only part of the range
#: stands for a batch: the shared expert's bf16 E=1 tables are tuned at decode sizes only (the H200's 1-16 tokens,
#: the H100's 1-512; fp8: 1-16,384), and tiles tuned for 16 tokens say nothing about 4096. Lookups that pass
#: ``reach=TABLE_REACH`` to :func:`choose_config` take their fallback beyond it: the layer's shared
#: expert apart the defaults, the shared slot (:func:`choose_fused_shared_config`) the routed table; the
#: routed experts' tables keep the nearest entry at any batch.
TABLE_REACH = 2.0


def covers(table: dict[int, MoEConfig], M: int, reach: float) -> bool:
    """Whether ``table`` stands for a batch of ``M``: between its smallest entry over ``reach`` and
    its largest times ``reach`` (gaps inside it are the tuner's choice, not checked here).

        >>> table = dict.fromkeys([1, 2, 4, 128])
        >>> covers(table, 256, 2.0), covers(table, 257, 2.0), covers(table, 0, 2.0), covers(table, 30, 2.0)
        (True, False, True, True)
    """
    m = max(M, 1)
    return min(table) <= reach * m and m <= reach * max(table)


def write_table(device_name: str, E: int, N: int, K: int, dtype: torch.dtype, layout: str,
                configs: dict[int, MoEConfig], measured: dict) -> Path:
    """Write a tuned table (``measured`` says where and how; see the tuner)."""
    name = table_name(device_name, E, N, K, dtype, layout)
    path = CONFIG_DIR / f"{name}.json"
    body = {"measured": measured,
            "configs": {str(m): configs[m].to_dict() for m in sorted(configs)}}
    path.write_text(json.dumps(body, indent=1) + "\n")
    load_table.cache_clear()
    _cached_choice.cache_clear()
    forget_all_plans()   # recorded calls baked in the old tables' configs
    return path


@functools.lru_cache(maxsize=None)
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def gpu_of(func: str, device, device_name: str | None) -> tuple[torch.device, str | None]:
    """``(device, GPU name)`` of a lookup in measured data (tables, crossovers): ``device`` checked, and the
    GPU it is looked up as, ``device_name`` where given (what that GPU would run, asked from any machine:
    ``device`` need not exist then), else ``device``'s own GPU, None off a GPU."""
    if device_name is not None and not isinstance(device_name, str):
        fail(func, "device_name", "must be a GPU name such as 'NVIDIA H200' (or None)", repr(device_name), TypeError)
    device = check_device(func, "device", device, must_exist=device_name is None)
    if device_name is None and device.type == "cuda":
        device_name = _device_name(device.index)
    return device, device_name


@dataclasses.dataclass(frozen=True)
class ConfigChoice:
    """Which configuration a call runs, and where it came from (what the path tests pin).

    ``source`` is ``"table"`` (the layout's own tuned table), ``"borrowed"`` (another layout's
    table for the same shape, its machinery switched off where this layout lacks it) or
    ``"default"`` (:func:`default_config`: no table for this device, shape and dtype, none that
    covers the batch within the ``reach`` asked, or not a GPU); a layer also records
    ``"argument"`` (a config it was given) and ``"layout-choice"`` (the tiles a measured layout
    crossover was timed with, :mod:`moe_kernels.kernels.layout_choice`). ``asked`` is the table
    the lookup tried first, also on a CPU, where none is read; ``table``/``entry`` the file stem
    and token count of the entry taken."""

    config: MoEConfig
    source: str
    asked: str
    table: str | None = None
    entry: int | None = None


def _adapted(config: MoEConfig, layout: str, align: int) -> MoEConfig | None:
    """Another layout's tuned config made valid for ``layout``: machinery it lacks off, the M
    tile halved until it divides the segment alignment (None if it cannot be)."""
    supports = LAYOUTS[layout]
    tiles = {gemm: getattr(config, gemm) for gemm in ("gate_up", "down")}
    for gemm, t in tiles.items():
        # The persistent grid is not borrowed: another layout's tables chose it against that
        # layout's plain grid, and the permute layout's has not been measured against its own.
        splits = supports.sum_in_gemm if gemm == "down" else supports.split_gate_up
        tiles[gemm] = dataclasses.replace(t, tma=t.tma and supports.tma, persistent=0,
                                          split_k=t.split_k if splits else 1,
                                          swap_ab=t.swap_ab and supports.swap_ab)
    adapted = MoEConfig(config.block_m, tiles["gate_up"], tiles["down"],
                        **{f: getattr(config, f) and getattr(supports, f) for f in _SWITCHES},
                        one_launch=config.one_launch if supports.one_launch else None,
                        stream_lag=config.stream_lag if supports.streamed else None)
    while supports.rows == "align" and align % adapted.block_m:
        if adapted.block_m <= 16:
            return None
        adapted = adapted.with_block_m(adapted.block_m // 2)
    if adapted.short_last_tile and adapted.block_m < 32:   # (its half tile would be under 16 rows)
        adapted = dataclasses.replace(adapted, short_last_tile=False)
    return adapted


def choose_config(M: int, E: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str, *,
                  layout: str = "index_gather", align: int = 128, device_name: str | None = None,
                  reach: float | None = None) -> ConfigChoice:
    """:func:`get_config`'s choice with its provenance (a :class:`ConfigChoice`); cached, so a
    decode loop pays for the lookup once per batch size. ``device_name`` looks the tables up as
    on that GPU, whatever ``device`` is (how a CPU test pins what an H200 would run). With
    ``reach``, a table that does not :func:`cover <covers>` ``M`` is passed over."""
    try:
        return _cached_choice(M, E, N, K, dtype, device, layout, align, device_name, reach)
    except TypeError as err:   # an unhashable argument: let the checks name it
        if "unhashable" not in str(err):
            raise
        return _choose(M, E, N, K, dtype, device, layout, align, device_name, reach)


def _choose(M, E, N, K, dtype, device, layout, align, device_name, reach=None) -> ConfigChoice:
    func = "get_config"
    check_int(func, "M", M, lo=0)
    for name, value in (("E", E), ("N", N), ("K", K)):
        check_int(func, name, value, lo=1)
    check_dtype(func, "dtype", dtype)
    _check_layout(func, layout, align)
    if reach is not None:
        check_number(func, "reach", reach, ge=1)
    device, device_name = gpu_of(func, device, device_name)   # (device_name: the tables as on that GPU)
    on_gpu = device_name is not None
    tables = LAYOUTS[layout].tables
    asked = table_name(device_name or device.type, E, N, K, dtype, tables[0])
    for source_layout in tables if on_gpu else ():
        name = table_name(device_name, E, N, K, dtype, source_layout)
        table = load_table(name)
        if not table:
            continue
        if reach is not None and not covers(table, M, reach):
            continue
        entry = nearest_entry(table, M)
        config = table[entry] if source_layout == layout else _adapted(table[entry], layout, align)
        if config is not None and (LAYOUTS[layout].rows != "align" or align % config.block_m == 0):
            return ConfigChoice(config, "table" if source_layout == layout else "borrowed", asked, name, entry)
    return ConfigChoice(default_config(M, E, N, K, layout=layout, align=align, dtype=dtype), "default", asked)


_cached_choice = functools.lru_cache(maxsize=4096)(_choose)


def get_config(M: int, E: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str, *,
               layout: str = "index_gather", align: int = 128) -> MoEConfig:
    """The tile configuration for ``M`` tokens over ``E`` experts with ``F = N``, ``d = K``, for
    weights of ``dtype`` (the table key: the activations' dtype, or fp8 for fp8 weights): the
    ``layout``'s tuned entry for this GPU when a table exists, else another layout's tuned entry
    for the same shape adapted to this layout, else :func:`default_config`
    (:func:`choose_config` says which)."""
    return choose_config(M, E, N, K, dtype, device, layout=layout, align=align).config


def choose_fused_shared_config(M: int, num_routed: int, N: int, K: int, dtype: torch.dtype,
                               device: torch.device | str, *, layout: str = "index_gather",
                               device_name: str | None = None) -> ConfigChoice:
    """The tiles for ``num_routed`` routed experts with a shared expert fused as slot ``E``
    (top-``(k+1)`` over ``E + 1`` experts): the table tuned for that problem (key ``E + 1``,
    ``bench tune --fused-shared``) where this GPU has one that covers ``M`` (within
    :data:`TABLE_REACH` of its entries), else the routed shape's table (the extra slot is no reason
    to fall back to the untuned default). A table with entries at small batches only so stops
    answering above them: the H100's DeepSeek-V3 fp8 one keeps its one-token entry, since from 4
    tokens the slot measured faster in the whole layer on the routed table's tiles (the entry's
    ``measured`` block says how).

    Why a table of its own: the routed table's tiles fit the routed work, and one more expert can
    tip them into another wave. DeepSeek-V3's bf16 entry at one token gives GEMM 1 one program per
    SM (three stages of a 16 x 128 activation tile and two 128 x 128 weight tiles: 204 KiB of
    shared memory) over 16 column tiles an expert: 8 experts make 128 programs for the H200's 132
    SMs, 9 make 144, and 12 of them run in a second wave (``shared-expert.json``: the fused call's
    GEMMs took 218.7 us against 170.7 for the routed experts alone).

        >>> choose_fused_shared_config(1, 256, 2048, 7168, torch.bfloat16, "cpu").source   # no table on a CPU
        'default'
    """
    fused = choose_config(M, num_routed + 1, N, K, dtype, device, layout=layout, device_name=device_name,
                          reach=TABLE_REACH)
    if fused.source == "table":
        return fused
    return choose_config(M, num_routed, N, K, dtype, device, layout=layout, device_name=device_name)


def tuned_block_m(num_experts: int, intermediate_size: int, hidden_size: int, *,
                  device_name: str = "NVIDIA H200", dtype: torch.dtype = torch.bfloat16) -> dict[int, int]:
    """The M tile the tuned index-gather table picked at each token count it was tuned for, for
    this shape and GPU; empty if there is no table.

        >>> tuned_block_m(256, 2048, 7168)[4096]   # DeepSeek-V3 on the H200, batch 4096
        128
    """
    table = load_table(table_name(device_name, num_experts, intermediate_size, hidden_size, dtype, "index_gather"))
    return {m: config.block_m for m, config in sorted((table or {}).items())}


def separate_sum_tiles(config: MoEConfig) -> GemmTiles:
    """GEMM 2's tiles for a caller that runs the top-k sum as a stage of its own (the trace and the
    stage-by-stage benchmarks): the config's tiles without split-K, which needs the sum in GEMM 2."""
    return dataclasses.replace(config.down, split_k=1)


def check_tiles(func: str, tiles: object) -> GemmTiles:
    if not isinstance(tiles, GemmTiles):
        fail(func, "tiles", "must be a GemmTiles", type(tiles).__name__, TypeError)
    return tiles.check(func, "tiles")
