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
scales to any column width, but a 6.4-inch figure shrunk into a phone's 360-pixel column would
print its 9-point labels at 6 pixels. So ``save_figure`` also writes a phone version,
``<name>-phone.svg``: the same figure redrawn narrow enough that its smallest text shows at 10
pixels in a phone's column (:func:`phone_width`), its side-by-side panels stacked into one column,
the text at the same point sizes. The site shows it below 600 pixels (``book/_ext/phone_figures.py``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

FIGURE_DIR = Path(__file__).resolve().parents[2] / "notebooks" / "figures"
#: Width of the text column at full size, in inches (figures are drawn at it, or narrower).
COLUMN_WIDTH = 6.4
#: The text column of the site on a 390-pixel phone, in CSS pixels (342 measured, tests/test_site.py),
#: and the smallest text a reader should get there.
PHONE_COLUMN_PX, PHONE_TEXT_PX = 340, 10


def phone_width(fig) -> float:
    """The width, in inches, at which ``fig``'s smallest text shows at :data:`PHONE_TEXT_PX` in a
    :data:`PHONE_COLUMN_PX` column (a point is 4/3 CSS pixels, an inch 96): 4.25 in for 9-point
    text, 3.3 in for 7-point. Wider figures get a phone version that wide.

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig, ax = plt.subplots()
        >>> _ = ax.set_title("title", fontsize=9)
        >>> ax.tick_params(labelsize=9)
        >>> round(phone_width(fig), 2)
        4.25
        >>> plt.close(fig)
    """
    from matplotlib.text import Text

    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    smallest = min(sizes, default=10.0)
    return smallest * 4 / 3 * PHONE_COLUMN_PX / PHONE_TEXT_PX / 96

STYLE = {
    "font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "xtick.labelsize": 9, "ytick.labelsize": 9,
    "legend.fontsize": 9, "legend.framealpha": 0.85, "figure.dpi": 100, "savefig.bbox": "tight",
    "axes.spines.top": False, "axes.spines.right": False, "svg.hashsalt": "moe-chapter", "svg.fonttype": "path",
}


def use_chapter_style():
    """Apply the chapter's matplotlib style (call once, at the top of a notebook). It also makes
    ``fig.tight_layout(...)`` and ``legend(...)`` remember their arguments, so that the phone
    version (:func:`save_figure`) can lay the figure out again with the same reserved margins and
    draw each legend again in one column."""
    import matplotlib
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, FigureBase

    matplotlib.rcParams.update(STYLE)
    if not getattr(Figure.tight_layout, "_remembers", False):
        plain_layout, plain_figure_legend, plain_axes_legend = Figure.tight_layout, FigureBase.legend, Axes.legend

        def tight_layout(self, **kwargs):
            self._chapter_tight_layout = kwargs
            return plain_layout(self, **kwargs)

        def remembered(plain):
            def legend(self, *args, **kwargs):
                made = plain(self, *args, **kwargs)
                made._chapter_call = (args, kwargs)   # phone_layout redraws it in one column
                return made
            return legend

        tight_layout._remembers = True
        Figure.tight_layout = tight_layout
        FigureBase.legend, Axes.legend = remembered(plain_figure_legend), remembered(plain_axes_legend)


def _figure_dir() -> Path:
    """Where a notebook's figures go: ``figures/`` beside the running notebook (Jupyter runs it in
    its own folder), so a working copy (``make lab``'s ``.lab/``, a test's temporary copy) writes
    into its own copy; the package's ``notebooks/figures`` when there is none."""
    here = Path.cwd() / "figures"
    return here if here.is_dir() else FIGURE_DIR


def save_figure(fig, name: str, directory: Path | None = None, *, reflows_on_a_phone: bool | None = None) -> None:
    """Write ``fig`` as ``<directory or figures/ beside the notebook>/<name>.svg`` (no timestamp, fixed ids, so
    the file only changes when the picture does) and close it. Returns nothing, so a cell that ends
    with it has no output. A file whose picture differs only by float noise (another CPU's BLAS
    moving a coordinate in its sixth decimal) is left as it is: re-running the notebooks, as the
    tests do, writes nothing into the repository. ``reflows_on_a_phone`` overrides :func:`reflows`
    (a bar chart whose only texts are one-letter labels over its bars can be narrowed)."""
    import matplotlib.pyplot as plt

    folder = directory or _figure_dir()
    folder.mkdir(parents=True, exist_ok=True)
    versions = {name: _svg(fig)}
    narrowable = reflows(fig) if reflows_on_a_phone is None else reflows_on_a_phone
    if fig.get_figwidth() > phone_width(fig) and narrowable:
        phone_layout(fig, phone_width(fig))
        phone = _svg(fig)
        # Kept only if clearly narrower: labels and legends that cannot shrink may leave it as
        # wide as the figure itself, which the site then shows legibly in a scrolling block.
        if _width_pt(phone) < 0.9 * _width_pt(versions[name]):
            versions[f"{name}-phone"] = phone
    plt.close(fig)
    if f"{name}-phone" not in versions:   # a phone version from an earlier run is out of date
        (folder / f"{name}-phone.svg").unlink(missing_ok=True)
    for stem, svg in versions.items():
        path = folder / f"{stem}.svg"
        if not (path.exists() and same_picture(path.read_text(), svg)):
            path.write_text(svg)


# matplotlib's text as paths (``svg.fonttype: path``): a run of glyphs is a group scaled by its
# size in points / 100, and mathtext's superscripts (the 3 of 10^3) are glyphs in it scaled again.
_TEXT_RUN = re.compile(r'<g transform="[^"]*scale\((0\.\d+) -\1\)">(.*?)</g>', re.S)
_GLYPH_SCALE = re.compile(r'<use [^>]*transform="[^"]*scale\(([\d.]+)\)"')
_SVG_WIDTH = re.compile(r'<svg[^>]*\bwidth="([\d.]+)pt"')


def _width_pt(svg: str) -> float:
    return float(_SVG_WIDTH.search(svg).group(1))


def svg_text_points(svg: str) -> tuple[float, float]:
    """(the smallest text in points, superscripts included; the width in points) of an SVG that
    :func:`save_figure` wrote (inf: no text). The site (``book/_ext/phone_figures.py``) and its
    phone test size figures by it.

        >>> svg_text_points('<svg width="300pt"><g transform="translate(1 2) scale(0.08 -0.08)">'
        ...                 '<use xlink:href="#a" transform="translate(9 9) scale(0.7)"/></g></svg>')
        (5.6, 300.0)
    """
    sizes = [round(100 * float(run) * min([float(g) for g in _GLYPH_SCALE.findall(body)] + [1.0]), 6)
             for run, body in _TEXT_RUN.findall(svg)]
    return min(sizes, default=float("inf")), _width_pt(svg)


def _svg(fig) -> str:
    import io

    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    return buffer.getvalue()


def reflows(fig) -> bool:
    """Whether ``fig`` survives being narrowed: plots do (their axes shrink, their labels stay),
    diagrams and heat maps with text in their cells do not (the labels would overlap). Those keep
    one version, which a phone shows at a legible size in a block that scrolls sideways
    (``book/_ext/phone_figures.py``)."""
    return sum(len(ax.texts) for ax in fig.axes) <= 8


def phone_layout(fig, width: float) -> None:
    """Redraw ``fig`` for a phone: ``width`` inches wide (:func:`phone_width`), the panels of a one-grid
    figure stacked into a single column column by column (a grid's columns are usually one model or
one quantity each, titled at the top, so a column stays together), each panel as tall as
    before; text keeps its point size. A figure whose panels do not sit one per cell of one grid
    (a colorbar's own axes, a panel spanning columns) keeps its arrangement and only narrows.

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig, axes = plt.subplots(1, 2, figsize=(COLUMN_WIDTH, 3.0))
        >>> phone_layout(fig, 3.5)
        >>> [round(float(v), 2) for v in fig.get_size_inches()], [ax.get_subplotspec().rowspan.start for ax in axes]
        ([3.5, 6.0], [0, 1])
        >>> plt.close(fig)
    """
    from matplotlib.gridspec import GridSpec
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    height = fig.get_figheight()
    panels = [ax for ax in fig.axes if ax.get_visible()]
    specs = [ax.get_subplotspec() for ax in panels]
    grids = {id(spec.get_gridspec()) for spec in specs if spec is not None}
    rows = cols = 1
    if specs and None not in specs and len(grids) == 1:
        rows, cols = specs[0].get_gridspec().get_geometry()
    single_cells = all(spec is not None and len(spec.rowspan) == 1 and len(spec.colspan) == 1 for spec in specs)
    if cols > 1 and single_cells:
        stacked = GridSpec(rows * cols, 1, figure=fig)
        for ax, spec in zip(panels, specs):
            ax.set_subplotspec(stacked[spec.colspan.start * rows + spec.rowspan.start, 0])
            ax.tick_params(labelleft=True, labelbottom=True)   # shared axes hid the inner panels' labels
        fig.set_size_inches(width, height * cols)
    else:
        fig.set_size_inches(width, height)
    for ax in panels:
        ax.title.set_wrap(True)
        _plain_log_ticks(ax)
        if getattr(ax.get_legend(), "_chapter_call", None):   # one entry per line in a narrow column
            args, kwargs = ax.get_legend()._chapter_call
            ax.legend(*args, **_one_column(kwargs))
    for legend in [legend for legend in fig.legends if getattr(legend, "_chapter_call", None)]:
        args, kwargs = legend._chapter_call
        legend.remove()
        fig.legend(*args, **_one_column(kwargs))
    if isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):
        return   # constrained layout runs again when the figure is drawn
    with warnings.catch_warnings():   # a margin tight_layout cannot meet: the site lets the figure scroll
        warnings.simplefilter("ignore", UserWarning)
        _fit(fig, width)


def _plain_log_ticks(ax) -> None:
    """Label a base-10 log axis 1, 10, 100, 1k, 10k instead of 10^0 .. 10^4 (and its labelled minor
    ticks 20, 30 instead of 2x10^1): a superscript is drawn at 70% of the tick size, which on a
    phone is the figure's smallest text. Which ticks get a label stays matplotlib's choice."""
    from matplotlib.ticker import LogFormatterSciNotation

    class PlainLogFormatter(LogFormatterSciNotation):
        def __call__(self, x, pos=None):
            return _plain_number(x) if super().__call__(x, pos) else ""

    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() != "log" or getattr(axis.get_transform(), "base", None) != 10:
            continue
        for current, setter in ((axis.get_major_formatter(), axis.set_major_formatter),
                                (axis.get_minor_formatter(), axis.set_minor_formatter)):
            if type(current) is LogFormatterSciNotation:   # matplotlib's default, not a figure's own
                plain = PlainLogFormatter(base=10, labelOnlyBase=current.labelOnlyBase,
                                          minor_thresholds=current.minor_thresholds)
                setter(plain)


def _plain_number(value: float, _position=None) -> str:
    """``1``, ``10``, ``1k``, ``16.4k``, ``2M``, ``0.01``: a tick label without superscripts.

        >>> [_plain_number(v) for v in (0.01, 1, 100, 1000, 10_000, 16384, 2e6, 999_500, 1e9)]
        ['0.01', '1', '100', '1k', '10k', '16.4k', '2M', '1M', '1G']
        >>> _plain_number(1e-5)
        '1e-05'
    """
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale * 0.9995:   # (999,500 rounds to 1.00e3k: it is 1M)
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _one_column(kwargs: dict) -> dict:
    return {**kwargs, "ncols" if "ncols" in kwargs else "ncol": 1}


def _fit(fig, width: float) -> None:
    """``tight_layout`` with the figure's own arguments, narrowed until the saved picture (labels and
    legends included) is ``width`` inches wide, or as close as the labels allow."""
    renderer = fig.canvas.get_renderer()
    for _ in range(3):   # labels and legends that stick out widen the saved picture: narrow until it fits
        layout = dict(getattr(fig, "_chapter_tight_layout", {}))
        if "rect" in layout and fig.legends:   # the room kept below the panels: the legend's height now
            legend_height = max(legend.get_window_extent(renderer).height for legend in fig.legends) / fig.dpi
            left, _, right, top = layout["rect"]
            layout["rect"] = (left, (legend_height + 0.1) / fig.get_figheight(), right, top)
        fig.tight_layout(**layout)
        overflow = fig.get_tightbbox(renderer).width - width
        if overflow <= 0.02 or fig.get_figwidth() - overflow < width / 2:
            return
        fig.set_size_inches(fig.get_figwidth() - overflow, fig.get_figheight())
    fig.tight_layout(**layout)   # the last narrowing, laid out too


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
