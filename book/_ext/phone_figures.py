"""A figure's phone version on a phone: ``<picture>`` with a ``<source>`` for narrow screens.

``moe_kernels.book.figures.save_figure`` writes each wide figure twice, ``figures/<name>.svg`` (the
text column's 6.4 inches) and ``figures/<name>-phone.svg`` (narrow enough that its smallest text
shows at 10 CSS pixels in a phone's column, side-by-side panels stacked). The Markdown names the
first only, so JupyterLab and a desktop browser show it. After the build this extension copies each
phone version beside its figure in ``_images/`` and wraps the figure's ``<img>`` as

    <picture><source media="(max-width: 600px)" srcset=".../<name>-phone.svg"><img ...></picture>

so that a browser narrower than 600 pixels loads the phone version instead; the ``<img>`` (its alt
text, its place under the figure's caption) is unchanged.

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

IMG = re.compile(r'<img\b[^>]*\bsrc="(?P<prefix>[^"]*_images/)(?P<stem>[^"/]+)\.svg"[^>]*>')
PHONE_MEDIA = "(max-width: 600px)"
PHONE_COLUMN_PX, TEXT_PX = 340, 10      # as in moe_kernels.book.figures
GLYPH_SCALE = re.compile(r"scale\((0\.\d+) -\1\)")   # matplotlib's text as paths: scale = points / 100
SVG_WIDTH = re.compile(r'<svg[^>]*\bwidth="([\d.]+)pt"')


def legible_width(svg: str) -> int:
    """The CSS width at which this matplotlib SVG's smallest text is TEXT_PX pixels (0: no text)."""
    sizes = [100 * float(s) for s in GLYPH_SCALE.findall(svg)]
    width = SVG_WIDTH.search(svg)
    if not sizes or width is None:
        return 0
    return math.ceil(float(width.group(1)) * TEXT_PX / min(sizes))


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
        img = img.replace("<img ", f'<img style="min-width: {width}px" ', 1)
        img = f'<span class="figure-scroll">{img}</span>'
    return img


def add_phone_versions(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    figures = Path(app.srcdir) / "notebooks" / "figures"
    images = Path(app.outdir) / "_images"
    phone_stems = set()
    for phone in figures.glob("*-phone.svg"):
        stem = phone.name[: -len("-phone.svg")]
        if (images / f"{stem}.svg").exists():   # the figure is on a page
            shutil.copyfile(phone, images / phone.name)
            phone_stems.add(stem)
    for page in Path(app.outdir).rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        if "<picture>" in text or "figure-scroll" in text or "_images/" not in text:
            continue
        wrapped = IMG.sub(lambda m: _wrap(m, images, phone_stems), text)
        if wrapped != text:
            page.write_text(wrapped, encoding="utf-8")


def setup(app):
    app.connect("build-finished", add_phone_versions)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
