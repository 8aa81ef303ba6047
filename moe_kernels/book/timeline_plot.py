"""One launch's work units over time, one lane per program slot on each SM (Chapter 10's timeline figure).

Reads a timeline of ``tools/two_phase_variants.py`` (``results/<device>/two-phase-*.json``, a row's
``timelines[...]``): each unit's ``[start_us, end_us, sm]`` from the GPU's global clock, GEMM 1's ``n1``
units first.

    >>> lanes([[0.0, 2.0, 0], [1.0, 3.0, 0], [2.5, 4.0, 0], [0.0, 1.0, 1]])
    [0, 1, 0, 0]
"""

from __future__ import annotations

PHASE_COLORS = ("tab:blue", "tab:orange")


def lanes(units: list) -> list[int]:
    """Each unit's lane on its SM: the first lane free at its start (units on one SM in start order)."""
    lane_of = [0] * len(units)
    ends: dict[int, list[float]] = {}
    for i in sorted(range(len(units)), key=lambda i: units[i][0]):
        start, end, sm = units[i]
        busy = ends.setdefault(sm, [])
        free = next((j for j, e in enumerate(busy) if e <= start), len(busy))
        if free == len(busy):
            busy.append(end)
        else:
            busy[free] = end
        lane_of[i] = free
    return lane_of


def unit_timeline_picture(ax, units: list, n1: int, title: str = "", linewidth: float = 0.8):
    """Each unit as a horizontal bar from its start to its end, at its SM's row (one row per lane, the
    lanes of an SM side by side): GEMM 1's units (the first ``n1``) in blue, GEMM 2's in orange."""
    lane_of = lanes(units)
    per_sm = max(lane_of, default=0) + 1
    for phase, color in enumerate(PHASE_COLORS):
        mine = range(n1) if phase == 0 else range(n1, len(units))
        ax.hlines([units[i][2] + lane_of[i] / per_sm for i in mine], [units[i][0] for i in mine],
                  [units[i][1] for i in mine], color=color, linewidth=linewidth,
                  label="GEMM 1 units" if phase == 0 else "GEMM 2 units")
    ax.set_xlabel("µs from the first unit's start")
    ax.set_ylabel("SM")
    ax.set_xlim(left=0)
    ax.set_ylim(-1, max((u[2] for u in units), default=0) + 1)
    if title:
        ax.set_title(title)
