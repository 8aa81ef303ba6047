"""Figures for the chapter: one style, saved as SVG files a Markdown ``{figure}`` shows.

A notebook cell draws with matplotlib, then ``save_figure(fig, "05-sweep")`` writes
``notebooks/figures/05-sweep.svg`` and closes the figure, so the cell has no output and the
picture appears where the prose places it, with its number, caption and alt text::

    ```{figure} figures/05-sweep.svg
    :name: fig-05-sweep
    :alt: Two panels of time over the floor against batch, ...

    Caption. The prose refers to it as {numref}`Figure %s <fig-05-sweep>`.
    ```

Both renderers number such figures (the site across the book, JupyterLab per notebook). SVG
scales to any column width; the style keeps text at least 9 points at the 6.4-inch width
the text column shows at full size, and half that on a phone is still legible when zoomed.
"""

from __future__ import annotations

import re
from pathlib import Path

FIGURE_DIR = Path(__file__).resolve().parents[2] / "notebooks" / "figures"
#: Width of the text column at full size, in inches (figures are drawn at it, or narrower).
COLUMN_WIDTH = 6.4

STYLE = {
    "font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "xtick.labelsize": 9, "ytick.labelsize": 9,
    "legend.fontsize": 9, "legend.framealpha": 0.85, "figure.dpi": 100, "savefig.bbox": "tight",
    "axes.spines.top": False, "axes.spines.right": False, "svg.hashsalt": "moe-chapter", "svg.fonttype": "path",
}


def use_chapter_style():
    """Apply the chapter's matplotlib style (call once, at the top of a notebook)."""
    import matplotlib

    matplotlib.rcParams.update(STYLE)


def _figure_dir() -> Path:
    """Where a notebook's figures go: ``figures/`` beside the running notebook (Jupyter runs it in
    its own folder), so a working copy (``make lab``'s ``.lab/``, a test's temporary copy) writes
    into its own copy; the package's ``notebooks/figures`` when there is none."""
    here = Path.cwd() / "figures"
    return here if here.is_dir() else FIGURE_DIR


def save_figure(fig, name: str, directory: Path | None = None) -> None:
    """Write ``fig`` as ``<directory or figures/ beside the notebook>/<name>.svg`` (no timestamp, fixed ids, so
    the file only changes when the picture does) and close it. Returns nothing, so a cell that ends
    with it has no output. A file whose picture differs only by float noise (another CPU's BLAS
    moving a coordinate in its sixth decimal) is left as it is: re-running the notebooks, as the
    tests do, writes nothing into the repository."""
    import io

    import matplotlib.pyplot as plt

    folder = directory or _figure_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.svg"
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    svg = buffer.getvalue()
    if not (path.exists() and same_picture(path.read_text(), svg)):
        path.write_text(svg)


_NUMBER = re.compile(r"-?\d+\.\d+")


def same_picture(old: str, new: str, tolerance: float = 1e-3) -> bool:
    """True when two SVG texts differ at most in their decimal numbers, each by ``tolerance`` (in
    points: a thousandth of a point is far below what any screen shows).

        >>> same_picture('<path d="M 1.000001 2.5"/>', '<path d="M 1.000003 2.5"/>')
        True
        >>> same_picture('<path d="M 1.0 2.5"/>', '<path d="M 1.2 2.5"/>')
        False
    """
    if _NUMBER.sub("#", old) != _NUMBER.sub("#", new):
        return False
    return all(abs(float(a) - float(b)) <= tolerance for a, b in zip(_NUMBER.findall(old), _NUMBER.findall(new)))
