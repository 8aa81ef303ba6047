"""A figure's phone version on a phone: ``<picture>`` with a ``<source>`` for narrow screens.

``moe_kernels.book.figures.save_figure`` writes each wide figure twice, ``figures/<name>.svg`` (the
text column's 6.4 inches) and ``figures/<name>-phone.svg`` (narrow enough that its smallest text
shows at 10 CSS pixels in a phone's column, side-by-side panels stacked). The Markdown names the
first only, so JupyterLab and a desktop browser show it. After the build this extension copies each
phone version beside its figure in ``_images/`` and wraps the figure's ``<img>`` as

    <picture><source media="(max-width: 600px)" srcset=".../<name>-phone.svg"><img ...></picture>

so that a browser narrower than 600 pixels loads the phone version instead; the ``<img>`` (its alt
text, its place under the figure's caption) is unchanged. Each figure is also a link to its SVG
(``figure-open``): a tap opens it by itself, full screen, where a phone can zoom it.

A figure that cannot be narrowed (a diagram or a heat map with text in its cells has no phone
version), or whose phone version is still too wide for its smallest text, gets a minimum width
at which that text shows at 10 CSS pixels, inside a block that scrolls sideways on a phone
(``figure-scroll`` in ``chapter.css``), as a wide table does.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

from moe_kernels.book.figures import PHONE_COLUMN_PX, PHONE_TEXT_PX as TEXT_PX, svg_text_points

IMG = re.compile(r'<img\b[^>]*\bsrc="(?P<prefix>[^"]*_images/)(?P<stem>[^"/]+)\.svg"[^>]*>')
PHONE_MEDIA = "(max-width: 600px)"


def legible_width(svg: str) -> int:
    """The CSS width at which this matplotlib SVG's smallest text is TEXT_PX pixels (0: no text)."""
    smallest, width = svg_text_points(svg)
    return 0 if smallest == math.inf else math.ceil(width * TEXT_PX / smallest)


def _wrap(match: re.Match, images: Path, phone_stems: set[str]) -> str:
    img, stem = match.group(0), match.group("stem")
    shown_on_phone = images / (f"{stem}-phone.svg" if stem in phone_stems else f"{stem}.svg")
    if not shown_on_phone.exists():
        return img
    width = legible_width(shown_on_phone.read_text(encoding="utf-8"))
    if stem in phone_stems:
        source = f'<source media="{PHONE_MEDIA}" srcset="{match.group("prefix")}{stem}-phone.svg">'
        img = f"<picture>{source}{img}</picture>"
    if width > PHONE_COLUMN_PX:   # too small in a phone's column: keep it legible and let it scroll
        img = img.replace("<img ", f'<img data-phone-min-width style="min-width: {width}px" ', 1)
    # A tap (or click) opens the figure by itself, full screen, where a phone can zoom it.
    img = f'<a class="figure-open" href="{match.group("prefix")}{stem}.svg" title="{OPEN_TITLE}">{img}</a>'
    if width > PHONE_COLUMN_PX:
        img = f'<span class="figure-scroll">{img}</span>'
    return img


OPEN_TITLE = "Open this figure by itself (full screen, zoomable)"
# What _wrap adds, to be taken off again (see add_phone_versions).
SCROLL = re.compile(r'<span class="figure-scroll">(.*?)</span>', re.S)
OPEN = re.compile(r'<a class="figure-open" href="[^"]*" title="[^"]*">(.*?)</a>', re.S)
PICTURE = re.compile(r'<picture><source [^>]*>(<img\b[^>]*>)</picture>')
MIN_WIDTH = re.compile(r'<img data-phone-min-width style="min-width: \d+px" ')


def add_phone_versions(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    figures = Path(app.srcdir) / "notebooks" / "figures"
    images = Path(app.outdir) / "_images"
    for stale in images.glob("*-phone.svg"):   # an earlier build's: the current ones are copied below
        stale.unlink()
    phone_stems = set()
    for phone in figures.glob("*-phone.svg"):
        stem = phone.name[: -len("-phone.svg")]
        if (images / f"{stem}.svg").exists():   # the figure is on a page
            shutil.copyfile(phone, images / phone.name)
            phone_stems.add(stem)
    for page in Path(app.outdir).rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        if "_images/" not in text:
            continue
        # A page an incremental build did not rewrite still has the last build's wrapping: undo it
        # first, so that each figure is wrapped for its phone version as it is now.
        plain = MIN_WIDTH.sub("<img ", PICTURE.sub(r"\1", OPEN.sub(r"\1", SCROLL.sub(r"\1", text))))
        wrapped = IMG.sub(lambda m: _wrap(m, images, phone_stems), plain)
        if wrapped != text:
            page.write_text(wrapped, encoding="utf-8")


def setup(app):
    app.connect("build-finished", add_phone_versions)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
