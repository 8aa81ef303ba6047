"""Matplotlib pictures the notebooks share: routing decisions and aligned segments.

Each function draws into an ``Axes`` it is given and returns it, so a notebook cell stays one call.
"""

from __future__ import annotations

import numpy as np
import torch


def grouped_routing_picture(ax, biased_scores: torch.Tensor, topk_ids: torch.Tensor, num_groups: int,
                            kept_groups: torch.Tensor, title: str = ""):
    """One token's biased scores as a ``groups x experts-per-group`` grid.

    Kept groups are outlined; the chosen experts are marked with a cross.
    """
    E = biased_scores.numel()
    per_group = E // num_groups
    grid = biased_scores.reshape(num_groups, per_group).float().cpu().numpy()
    ax.imshow(grid, cmap="Blues", aspect="auto")
    for g in kept_groups.tolist():
        ax.add_patch(_rect(-0.5, g - 0.5, per_group, 1.0, "tab:orange"))
    for e in topk_ids.tolist():
        ax.plot(e % per_group, e // per_group, marker="x", color="tab:red", markersize=9, mew=2.5)
    ax.set_xlabel("expert within group")
    ax.set_ylabel("group")
    ax.set_yticks(range(num_groups))
    ax.set_title(title)
    return ax


def _rect(x, y, w, h, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, fill=False, edgecolor=color, linewidth=2.5)


def batch_picks_picture(ax, topk_ids: torch.Tensor, num_experts: int, title: str = ""):
    """Which experts each token of a batch picked: a ``tokens x experts`` image."""
    T = topk_ids.shape[0]
    image = np.zeros((T, num_experts))
    rows = np.repeat(np.arange(T), topk_ids.shape[1])
    image[rows, topk_ids.reshape(-1).cpu().numpy()] = 1.0
    ax.imshow(image, cmap="Greys", aspect="auto", interpolation="nearest")
    ax.set_xlabel("expert id")
    ax.set_ylabel("token")
    ax.set_title(title)
    return ax


def alignment_picture(ax, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                      num_tokens_post_padded: int, block_size: int, numel: int, title: str = ""):
    """The aligned buffer as a strip of slots: real rows coloured by expert, padding grey.

    Block boundaries are drawn as thin lines, and each block is labelled with its expert id.
    """
    import matplotlib.pyplot as plt

    used = int(num_tokens_post_padded)
    slots = sorted_token_ids[:used].cpu().numpy()
    blocks = expert_ids[: used // block_size].cpu().numpy()
    cmap = plt.get_cmap("tab20")
    for i, token in enumerate(slots):
        expert = blocks[i // block_size]
        color = "lightgrey" if token >= numel else cmap(expert % 20)
        ax.add_patch(plt.Rectangle((i, 0), 1, 1, facecolor=color, edgecolor="white", linewidth=0.5))
        if used <= 64:
            ax.text(i + 0.5, 0.5, "pad" if token >= numel else str(token), ha="center", va="center", fontsize=7)
    for b, expert in enumerate(blocks):
        ax.axvline(b * block_size, color="black", linewidth=1)
        ax.text((b + 0.5) * block_size, 1.15, f"e{expert}", ha="center", fontsize=8)
    ax.set_xlim(0, used)
    ax.set_ylim(0, 1.4)
    ax.set_yticks([])
    ax.set_xlabel("slot in sorted_token_ids")
    ax.set_title(title)
    return ax


def _slot(ax, x, y, label, color, fontsize=9, width=1.0, height=1.0):
    import matplotlib.pyplot as plt

    ax.add_patch(plt.Rectangle((x, y), width, height, facecolor=color, edgecolor="white", linewidth=1.2))
    if label:
        ax.text(x + width / 2, y + height / 2, label, ha="center", va="center", fontsize=fontsize)


def _layout_colors(num_experts):
    """A light fill per expert (text stays readable on it) and grey for padding."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    base = plt.get_cmap("tab10")
    return [tuple(0.55 * c + 0.45 for c in to_rgba(base(e % 10))[:3]) for e in range(num_experts)]


def three_layouts_picture(axes, topk_ids: torch.Tensor, num_experts: int, block: int, m_max: int):
    """The same routing in the three grouped-GEMM layouts, one panel each (three Axes, stacked).

    Index-gather: the aligned ``sorted_token_ids`` (top row: assignment ``a``; bottom row: the
    token row ``a // k`` the GEMM reads; no copy). Permute: the token rows copied into per-expert
    segments aligned to ``block``. Masked: an ``[E, m_max]`` slab per expert, used up to
    ``masked_m[e]``. Slots are coloured by expert, padding is grey.
    """
    from ..kernels.align import moe_align_block_size_reference

    colors = _layout_colors(num_experts)
    pad = "0.88"
    k = topk_ids.shape[1]
    numel = topk_ids.numel()
    sorted_ids, expert_ids, used = moe_align_block_size_reference(topk_ids, block, num_experts)
    used = int(used)

    ax = axes[0]
    for i in range(used):
        a = int(sorted_ids[i])
        e = int(expert_ids[i // block])
        real = a < numel
        _slot(ax, i, 1, f"a{a}" if real else "pad", colors[e] if real else pad, fontsize=8)
        _slot(ax, i, 0, f"x{a // k}" if real else "·", colors[e] if real else pad)
    for b in range(used // block):
        ax.text((b + 0.5) * block, 2.15, f"tile {b}: expert {int(expert_ids[b])}", ha="center", fontsize=9)
        ax.plot([b * block, b * block], [-0.1, 2.1], color="black", lw=1.2)
    ax.plot([used, used], [-0.1, 2.1], color="black", lw=1.2)
    ax.text(-0.3, 1.5, "sorted_token_ids", ha="right", va="center", fontsize=9)
    ax.text(-0.3, 0.5, "row read (a // k)", ha="right", va="center", fontsize=9)
    ax.set_xlim(0, used)
    ax.set_ylim(0, 2.6)
    ax.set_title("index-gather: each tile lists assignments; the GEMM reads x[a // k] in place",
                 fontsize=10, loc="left")

    ax = axes[1]
    for i in range(used):
        a = int(sorted_ids[i])
        e = int(expert_ids[i // block])
        real = a < numel
        _slot(ax, i, 0, f"x{a // k}" if real else "", colors[e] if real else pad)
        ax.text(i + 0.5, -0.35, str(e) if real else "-1", ha="center", va="center", fontsize=8, color="0.3")
    for b in range(used // block + 1):
        ax.plot([b * block, b * block], [-0.1, 1.1], color="black", lw=1.2)
    ax.text(-0.3, 0.5, "packed rows", ha="right", va="center", fontsize=9)
    ax.text(-0.3, -0.35, "m_indices", ha="right", va="center", fontsize=8, color="0.3")
    ax.set_xlim(0, used)
    ax.set_ylim(-0.7, 1.5)
    ax.set_title(f"permute: rows copied into {block}-row segments, one segment per expert", fontsize=10, loc="left")

    ax = axes[2]
    flat = topk_ids.reshape(-1).tolist()
    for e in range(num_experts):
        rows = [a // k for a, expert in enumerate(flat) if expert == e]
        y = num_experts - 1 - e
        for slot in range(m_max):
            used_slot = slot < len(rows)
            _slot(ax, slot, y, f"x{rows[slot]}" if used_slot else "", colors[e] if used_slot else "0.95")
        ax.text(-0.3, y + 0.5, f"expert {e}", ha="right", va="center", fontsize=9)
        ax.text(m_max + 0.3, y + 0.5, f"masked_m = {len(rows)}", va="center", fontsize=9)
    ax.set_xlim(0, used)
    ax.set_ylim(0, num_experts)
    ax.set_title(f"masked: one [m_max = {m_max}]-row slab per expert, filled up to masked_m", fontsize=10, loc="left")
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_visible(False)
    return axes


def kernel_timings_picture(ax, rows: list[dict], ops: list[str], title: str = ""):
    """Recorded kernel times against batch: eager call, CUDA-graph replay, and the torch reference."""
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for op, color in zip(ops, colors):
        mine = sorted((r for r in rows if r["op"].startswith(op)), key=lambda r: r["batch"])
        if not mine:
            continue
        batches = [r["batch"] for r in mine]
        label = mine[0]["op"].split(" (")[0]
        ax.loglog(batches, [r["kernel_graph_us"] for r in mine], "-o", color=color, ms=3, label=f"{label}: kernel (graph)")
        ax.loglog(batches, [r["kernel_us"] for r in mine], ":", color=color, label=f"{label}: kernel (eager call)")
        ax.loglog(batches, [r["reference_us"] for r in mine], "--", color=color, alpha=0.6, label=f"{label}: torch reference")
    ax.set_xlabel("batch (tokens)")
    ax.set_ylabel("µs per call")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def layout_sweep_picture(ax, rows: list[dict], model: str, layouts: list[str], title: str = "",
                         labels: dict | None = None, reference_layout: str | None = None):
    """Recorded time over the floor against batch, one line per layout, for one model (log axes:
    the ratios span three decades). Each time is divided by its own row's floor, or, with
    ``reference_layout``, by the floor of that layout at the same batch (so that a baseline doing
    different work, such as a dense GEMM, is measured against the MoE layer's floor).
    ``labels`` renames layouts in the legend."""
    markers = "osD^vP*X"
    floors = {r["batch"]: r["floor_s"] for r in rows if r["model"] == model and r["layout"] == reference_layout}
    for i, layout in enumerate(layouts):
        mine = sorted((r for r in rows if r["model"] == model and r["layout"] == layout and "time_s" in r),
                      key=lambda r: r["batch"])
        if mine:
            ys = [r["time_s"] / (floors[r["batch"]] if reference_layout else r["floor_s"]) for r in mine]
            ax.loglog([r["batch"] for r in mine], ys, "-", marker=markers[i % len(markers)], ms=3.5, lw=1.3,
                      label=(labels or {}).get(layout, layout))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("batch (tokens)")
    ax.set_ylabel("time / read floor" if reference_layout is None else "time / the MoE layer's read floor")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    return ax


#: stage colours shared by the stage bars (copy-like stages purple, GEMMs blue/orange, sums green)
STAGE_COLORS = {"block map": "tab:gray", "permute copy": "tab:purple", "dispatch": "tab:purple",
                "gemm1": "tab:blue", "gemm2": "tab:orange", "sum": "tab:green", "unpermute": "tab:green",
                "gather": "tab:green"}


STAGE_LABELS = {"block map": "block map", "permute copy": "copy in (permute / dispatch)",
                "dispatch": "copy in (permute / dispatch)", "gemm1": "GEMM 1 (+SiLU·mul)",
                "gemm2": "GEMM 2 (+routed weight)", "sum": "sum / gather back", "unpermute": "sum / gather back",
                "gather": "sum / gather back"}


def layout_stages_picture(ax, rows: list[dict], model: str, title: str = ""):
    """Each layout's stages (CUDA-graph replays) as stacked bars, in units of the index-gather
    layer's time at the same batch (linear axis, so bar heights compare), with that time in µs
    written under each group. Bars: I = index-gather, P = permute, M = masked (token budget)."""
    mine = [r for r in rows if r["model"] == model and r["stages_us"]]
    batches = sorted({r["batch"] for r in mine})
    layouts = ["index-gather", "permute", "masked"]
    width = 0.27
    seen, units, top = set(), [], 0.0
    for j, batch in enumerate(batches):
        unit = sum(next(r for r in mine if r["batch"] == batch and r["layout"] == "index-gather")["stages_us"].values())
        units.append(unit)
        for i, layout in enumerate(layouts):
            row = next((r for r in mine if r["batch"] == batch and r["layout"].split(" (")[0] == layout), None)
            if row is None:
                continue
            x = j + (i - 1) * width
            bottom = 0.0
            for stage, value in row["stages_us"].items():
                label = STAGE_LABELS.get(stage, stage)
                ax.bar(x, value / unit, width * 0.92, bottom=bottom, color=STAGE_COLORS.get(stage, "tab:olive"),
                       label=label if label not in seen else None)
                seen.add(label)
                bottom += value / unit
            ax.text(x, bottom + 0.03, "IPM"[i], ha="center", va="bottom", fontsize=8)
            top = max(top, bottom)
    # (milliseconds from 1 ms up: six groups' labels must fit a phone's column side by side)
    ax.set_xticks(range(len(batches)), [f"{b}\n{u:.0f} µs" if u < 1e3 else f"{b}\n{u / 1e3:.{1 if u < 1e4 else 0}f} ms"
                                        for b, u in zip(batches, units)])
    ax.set_xlabel("batch (tokens), index-gather time")
    ax.set_ylabel("time / index-gather")
    ax.set_ylim(0, top + 0.35)
    ax.axhline(1.0, color="black", lw=0.6, ls=":")
    ax.set_title(title, fontsize=10, loc="left", pad=10)
    return ax


def grouped_gemm_targets_picture(ax_floor, ax_rate, rows: list[dict], fp8_rows: list[dict], model: str,
                                 gemm_rate: float, title: str = ""):
    """Our index-gather layer on one model against its two targets.

    ``ax_floor``: time over the read floor (bf16 GEMMs, bf16 layer, and the fp8 block layer over its
    own fp8 floor), with the decode target 1.05 drawn over batches 8..512 and, where the sweep
    measured it, the time of a plain streaming read of the same bytes. ``ax_rate``: TFLOP/s of
    the bf16 GEMMs and of cuBLAS batched GEMMs on perfectly balanced groups of the same work
    ("bmm balanced same work"), the target 0.95x that over batches >= 4096, and ``gemm_rate`` (the
    dense bf16 GEMM measured in the same run) as a ceiling.
    """
    def series(source, layout):
        mine = sorted((r for r in source if r["model"] == model and r["layout"] == layout and "time_s" in r),
                      key=lambda r: r["batch"])
        return [r["batch"] for r in mine], mine

    for layout, label, style in (("index-gather GEMMs graph", "bf16: the two GEMMs", "-o"),
                                 ("index-gather layer graph", "bf16: whole layer", "--s")):
        b, mine = series(rows, layout)
        ax_floor.semilogx(b, [r["time_s"] / r["floor_s"] for r in mine], style, ms=3.5, lw=1.3, label=label,
                          color="tab:blue" if "GEMMs" in layout else "tab:cyan")
    b, mine = series(fp8_rows, "fp8 block GEMMs")
    ax_floor.semilogx(b, [r["time_s"] / r["floor_s"] for r in mine], "-D", ms=3, lw=1.3, color="tab:red",
                      label="fp8 block layer / fp8 floor")
    b, mine = series(rows, "index-gather GEMMs graph")
    if mine and "read_same_bytes_s" in mine[0]:
        # What a plain streaming-read kernel takes for the same bytes: launch, ramp and tail
        # included, the part of the gap at small batches that no GEMM kernel can close.
        # Drawn up to 2,048 tokens, where both models' floors are still the read (past it, FLOPs).
        shown = [(x, r) for x, r in zip(b, mine) if x <= 2048]
        ax_floor.semilogx([x for x, _ in shown], [r["read_same_bytes_s"] / r["floor_s"] for _, r in shown], ":",
                          lw=1.6, color="0.3", label="a plain read of the same bytes")
    ax_floor.axhline(1.0, color="black", lw=0.8)
    ax_floor.plot([8, 512], [1.05, 1.05], color="tab:green", lw=2.5, alpha=0.8, label="target 1.05 (batch 8-512)")
    ax_floor.set_ylabel("time / read floor")
    ax_floor.set_xlabel("batch (tokens)")
    ax_floor.set_title(title, fontsize=10)
    ax_floor.grid(True, which="major", alpha=0.3)

    b, mine = series(rows, "index-gather GEMMs graph")
    ax_rate.semilogx(b, [r["flops"] / r["time_s"] / 1e12 for r in mine], "-o", ms=3.5, lw=1.3, color="tab:blue",
                     label="bf16: the two GEMMs")
    b, ref = series(rows, "bmm balanced same work")
    ax_rate.semilogx(b, [r["flops"] / r["time_s"] / 1e12 for r in ref], ":^", ms=3.5, lw=1.3, color="0.35",
                     label="cuBLAS bmm, balanced groups")
    big = [(x, 0.95 * r["flops"] / r["time_s"] / 1e12) for x, r in zip(b, ref) if x >= 4096]
    ax_rate.plot([x for x, _ in big], [y for _, y in big], color="tab:green", lw=2.5, alpha=0.8,
                 label="target 0.95 x bmm (batch >= 4096)")
    ax_rate.axhline(gemm_rate / 1e12, color="black", lw=0.8, ls="--", label="dense bf16 GEMM rate")
    ax_rate.set_ylabel("TFLOP/s")
    ax_rate.set_xlabel("batch (tokens)")
    ax_rate.set_ylim(0, gemm_rate / 1e12 * 1.08)
    ax_rate.grid(True, which="major", alpha=0.3)
    return ax_floor, ax_rate


def capacity_queues_picture(ax, topk_ids: torch.Tensor, num_experts: int, capacity: int, title: str = ""):
    """Each expert's queue under a capacity: one column per expert, slot 0 at the bottom.

    A box ``t3·2`` is token 3's second choice. Boxes below the line ``C`` got a slot; boxes above
    it are dropped (red). The order up a column is the priority rule of
    :func:`moe_kernels.model.capacity.expert_queue_positions`.
    """
    import matplotlib.pyplot as plt

    from ..model.capacity import expert_queue_positions

    ids = topk_ids.cpu()
    positions = expert_queue_positions(ids, num_experts)
    tallest = int(positions.max()) + 1 if ids.numel() else 1
    shades = plt.get_cmap("Blues")
    topk = ids.shape[1]
    for t in range(ids.shape[0]):
        for j in range(topk):
            e, slot = int(ids[t, j]), int(positions[t, j])
            color = "tab:red" if slot >= capacity else shades(0.75 - 0.45 * j / max(topk - 1, 1))
            ax.add_patch(plt.Rectangle((e + 0.05, slot + 0.05), 0.9, 0.9, facecolor=color, edgecolor="white"))
            ax.text(e + 0.5, slot + 0.5, f"t{t}·{j + 1}", ha="center", va="center", fontsize=7,
                    color="white" if slot >= capacity or j == 0 else "black")
    ax.axhline(capacity, color="black", lw=1.5, ls="--")
    ax.text(num_experts + 0.05, capacity + 0.1, f"C = {capacity}", va="bottom", fontsize=8)
    ax.set_xlim(0, num_experts + 0.9)
    ax.set_ylim(0, max(tallest, capacity) + 0.3)
    ax.set_xticks([e + 0.5 for e in range(num_experts)])
    ax.set_xticklabels([f"e{e}" for e in range(num_experts)])
    ax.set_yticks([])
    ax.set_ylabel("queue slot")
    for spine in ("top", "right", "left"):
        ax.spines[spine].set_visible(False)
    ax.set_title(title, fontsize=10)
    return ax


def kernel_timings_panels(axes, rows: list[dict], ops: list[str], titles: list[str] | None = None):
    """Recorded kernel times against batch, one panel per op (``axes`` holds one Axes per op).

    Each panel has the same three lines: the kernel replayed from a CUDA graph (GPU time), the
    kernel called eagerly from Python (launch overhead included) and the torch reference (eager).
    No legend is drawn inside the panels; the handles are returned so that the caller can put one
    legend below them (``fig.legend(handles=..., loc="lower center", ...)``), where it covers nothing.
    """
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator

    styles = [("kernel_graph_us", "kernel, CUDA-graph replay", dict(color="tab:blue", ls="-", marker="o", ms=3)),
              ("kernel_us", "kernel, eager Python call", dict(color="tab:orange", ls=":", lw=1.8)),
              ("reference_us", "torch reference, eager", dict(color="tab:gray", ls="--"))]
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for i, (ax, op) in enumerate(zip(axes, ops)):
        mine = sorted((r for r in rows if r["op"].startswith(op)), key=lambda r: r["batch"])
        batches = [r["batch"] for r in mine]
        for key, _, style in styles:
            ax.loglog(batches, [r[key] for r in mine], **style)
        ax.set_xlabel("batch (tokens)")
        ax.set_title(titles[i] if titles else op)
        ax.grid(True, which="major", alpha=0.3)
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 3.0)))
        ax.yaxis.set_major_formatter(plain)
    axes[0].set_ylabel("time per call (µs)")
    return [Line2D([], [], label=label, **style) for _, label, style in styles]

