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


def _slot(ax, x, y, label, color, fontsize=7):
    import matplotlib.pyplot as plt

    ax.add_patch(plt.Rectangle((x, y), 1, 1, facecolor=color, edgecolor="white", linewidth=0.8))
    ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=fontsize)


def three_layouts_picture(axes, topk_ids: torch.Tensor, num_experts: int, block: int, m_max: int):
    """The same routing in the three grouped-GEMM layouts, one panel each (a row of 3 Axes).

    Index-gather: ``sorted_token_ids`` tiles name which token row each GEMM row reads (no copy).
    Permute: the token rows copied into per-expert segments aligned to ``block``.
    Masked: an ``[E, m_max]`` grid per expert, used up to ``masked_m[e]``.
    """
    import matplotlib.pyplot as plt

    from ..kernels.align import moe_align_block_size_reference

    cmap = plt.get_cmap("tab10")
    k = topk_ids.shape[1]
    numel = topk_ids.numel()
    sorted_ids, expert_ids, used = moe_align_block_size_reference(topk_ids, block, num_experts)
    used = int(used)
    ax = axes[0]
    for i in range(used):
        a = int(sorted_ids[i])
        e = int(expert_ids[i // block])
        _slot(ax, i, 0, "·" if a >= numel else f"t{a // k}", "lightgrey" if a >= numel else cmap(e % 10))
    for b in range(used // block):
        ax.text((b + 0.5) * block, 1.25, f"tile → e{int(expert_ids[b])}", ha="center", fontsize=7)
    ax.set_xlim(0, used)
    ax.set_ylim(0, 1.6)
    ax.set_title("index-gather: tiles of indices into x (no copy)", fontsize=9)

    ax = axes[1]
    for i in range(used):
        a = int(sorted_ids[i])
        e = int(expert_ids[i // block])
        _slot(ax, i, 0, "0" if a >= numel else f"x{a // k}", "lightgrey" if a >= numel else cmap(e % 10))
    ax.set_xlim(0, used)
    ax.set_ylim(0, 1.6)
    ax.set_title(f"permute: rows copied into segments aligned to {block}", fontsize=9)

    ax = axes[2]
    flat = topk_ids.reshape(-1).tolist()
    for e in range(num_experts):
        rows = [a // k for a, expert in enumerate(flat) if expert == e]
        for slot in range(m_max):
            if slot < len(rows):
                _slot(ax, slot, num_experts - 1 - e, f"x{rows[slot]}", cmap(e % 10))
            else:
                _slot(ax, slot, num_experts - 1 - e, "", "whitesmoke")
        ax.text(m_max + 0.2, num_experts - 0.5 - e, f"e{e}: masked_m={len(rows)}", va="center", fontsize=7)
    ax.set_xlim(0, m_max + 3.5)
    ax.set_ylim(0, num_experts)
    ax.set_title(f"masked: [E, m_max={m_max}] slabs", fontsize=9)
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


def layout_sweep_picture(ax, rows: list[dict], model: str, layouts: list[str], title: str = ""):
    """Recorded time over the floor against batch, one line per layout, for one model."""
    for layout in layouts:
        mine = sorted((r for r in rows if r["model"] == model and r["layout"] == layout and "time_s" in r),
                      key=lambda r: r["batch"])
        if mine:
            ax.loglog([r["batch"] for r in mine], [r["time_s"] / r["floor_s"] for r in mine], "-o", ms=3, label=layout)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("batch (tokens)")
    ax.set_ylabel("time / floor")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    return ax


def layout_stages_picture(ax, rows: list[dict], model: str, title: str = ""):
    """Stacked per-stage times (CUDA-graph replays) of each layout at each recorded batch."""
    mine = [r for r in rows if r["model"] == model and r["stages_us"]]
    batches = sorted({r["batch"] for r in mine})
    layouts = []
    for r in mine:
        name = r["layout"].split(" (")[0]
        if name not in layouts:
            layouts.append(name)
    width = 0.8 / len(layouts)
    palette = {"block map": "tab:gray", "permute copy": "tab:purple", "dispatch": "tab:purple",
               "gemm1": "tab:blue", "gemm2": "tab:orange", "sum": "tab:green", "unpermute": "tab:green",
               "gather": "tab:green"}
    seen = set()
    for i, layout in enumerate(layouts):
        for j, batch in enumerate(batches):
            row = next((r for r in mine if r["batch"] == batch and r["layout"].split(" (")[0] == layout), None)
            if row is None:
                continue
            total = sum(row["stages_us"].values())
            bottom = 0.0
            for stage, value in row["stages_us"].items():
                share = value / total
                label = stage if stage not in seen else None
                seen.add(stage)
                ax.bar(j + (i - (len(layouts) - 1) / 2) * width, share, width * 0.95, bottom=bottom,
                       color=palette.get(stage, "tab:olive"), label=label)
                bottom += share
            ax.text(j + (i - (len(layouts) - 1) / 2) * width, 1.01, layout[0].upper(), ha="center", fontsize=7)
    ax.set_xticks(range(len(batches)))
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel("batch (tokens); I = index-gather, P = permute, M = masked")
    ax.set_ylabel("share of the layer's time")
    ax.set_ylim(0, 1.1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="lower right")
    return ax


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
