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
