"""The built site in a real browser, offline.

Headless Chromium (Debian's /usr/bin/chromium, driven by Playwright) opens the built pages from a
loopback HTTP server with every non-loopback request aborted, moves the explorer's sliders, and
compares the plotted numbers with the Python byte model. Needs `make book` first (`make test` does
it). Skips without a browser unless REQUIRE_BROWSER=1 (CI sets it).
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

from moe_kernels.model import costs
from moe_testing import headless_chromium, skip_or_fail_browser
from moe_kernels.book.figures import svg_text_points
from moe_kernels.model.shapes import GPUS

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "_build" / "html"
# No console error is accepted (book/_ext/single_scripts.py removed the doubled THEBE_JS_URL).
ALLOWED_CONSOLE = ()



class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    if not (SITE / "index.html").exists():
        pytest.fail("no built site at _build/html: run `make book` first")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    yield from headless_chromium()


class OfflinePage:
    """A page whose non-loopback requests are aborted and recorded, with console errors kept."""

    def __init__(self, browser):
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _route(self, route):
        host = urlparse(route.request.url).hostname
        if host in ("127.0.0.1", "localhost", "::1"):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def close(self):
        self.context.close()

    def unexpected_errors(self):
        return [e for e in self.errors if not any(a in e for a in ALLOWED_CONSOLE)]


@pytest.fixture
def offline(browser):
    page = OfflinePage(browser)
    yield page
    page.close()


def _series(page, name):
    raw = page.locator(f"div.moe-explorer polyline.series-{name}").first.get_attribute("data-values")
    return json.loads(raw)


def _set(page, name, value):
    page.evaluate(
        """([name, value]) => {
            const el = document.querySelector(`div.moe-explorer [name=${name}]`);
            el.value = String(value);
            el.dispatchEvent(new Event('input', {bubbles: true}));
        }""",
        [name, value],
    )


def _assert_close(got, want, rel=1e-9):
    assert abs(got - want) <= rel * abs(want), f"{got} != {want} (relative {abs(got - want) / abs(want):.2e})"


def _toc_pages() -> list[str]:
    """Every page of the book, from _toc.yml, as built HTML paths."""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [entry["file"] for part in toc["parts"] for entry in part["chapters"]]
    return ["index.html"] + [f"{f}.html" for f in files]


PAGES = _toc_pages()


@pytest.mark.parametrize("path", PAGES)
def test_pages_load_offline(server, offline, path):
    """Every page loads with no request leaving the machine and no script error; math renders."""
    offline.page.goto(f"{server}/{path}", wait_until="networkidle")
    assert offline.blocked == [], f"{path} tried to reach the network: {offline.blocked}"
    assert offline.unexpected_errors() == []
    if path.startswith("notebooks/02"):
        offline.page.wait_for_selector("mjx-container", timeout=10_000)


def _assert_touch_sized(page, root):
    """Sliders and menus at least 32 px tall (a finger's target; the page's CSS px, any screen); and
    the hint for pages whose JavaScript has not run is hidden once it has."""
    assert page.evaluate(f"getComputedStyle(document.querySelector('{root} .moe-js-hint')).display") == "none"
    heights = page.evaluate(f"""() => [...document.querySelectorAll('{root} input, {root} select')]
        .map(c => c.getBoundingClientRect().height)""")
    assert heights and min(heights) >= 32, f"{root}: control heights {heights}"


def test_explorer_matches_byte_model(server, offline):
    page = offline.page
    page.goto(f"{server}/notebooks/02_experts_touched.html", wait_until="networkidle")
    page.wait_for_selector('div.moe-explorer[data-ready="1"]')
    _assert_touch_sized(page, "div.moe-explorer")

    # Initial state is DeepSeek-V3 on an H100 in fp8.
    for B, y in _series(page, "touched"):
        _assert_close(y, costs.experts_touched(B, 256, 8))
    before = page.locator("polyline.series-touched").first.get_attribute("points")

    # A real slider move: focus E and press the right arrow (one step of 8 experts).
    page.locator("div.moe-explorer input[name=E]").first.focus()
    page.keyboard.press("ArrowRight")
    assert page.locator("output[for=E]").first.text_content() == "264"
    assert page.locator("polyline.series-touched").first.get_attribute("points") != before
    for B, y in _series(page, "touched"):
        _assert_close(y, costs.experts_touched(B, 264, 8))

    # A grid of (E, k) and bytes per weight: every plotted value against the Python formulas.
    for E in (8, 64, 128, 256, 512):
        for k in (1, 2, 8, 32):
            if k > E:
                continue
            for bw in (0.5, 1.0, 2.0):
                _set(page, "E", E)
                _set(page, "k", k)
                page.select_option("div.moe-explorer select[name=bw]", str(bw))
                for B, y in _series(page, "touched"):
                    _assert_close(y, costs.experts_touched(B, E, k))
                for B, y in _series(page, "moe"):
                    _assert_close(y, costs.moe_intensity(B, E, k, bw))
                for B, y in _series(page, "dense"):
                    _assert_close(y, costs.dense_intensity(B, bw))
                readout = page.locator("div.moe-explorer .readout").first
                gpu = GPUS["H100 SXM"]
                ridge = gpu.ridge(bw)
                _assert_close(float(readout.get_attribute("data-ridge-batch")),
                              costs.ridge_batch_moe(E, k, ridge, bw), rel=1e-6)
                if k < E:
                    _assert_close(float(readout.get_attribute("data-half")), costs.batch_for_fraction(0.5, E, k))

    # The GPU selector moves the ridge line.
    page.select_option("div.moe-explorer select[name=gpu]", "H200")
    ridge_values = {y for _, y in _series(page, "ridge")}
    assert len(ridge_values) == 1
    _assert_close(ridge_values.pop(), GPUS["H200"].ridge(2.0))
    assert offline.blocked == []
    assert offline.unexpected_errors() == []


def test_skew_explorer_matches_closed_forms(server, offline):
    """The padding-under-skew sliders against moe_kernels.model.skew, on a grid of settings, to 1e-9."""
    from moe_kernels.model import skew
    from moe_kernels.model.shapes import MODELS

    page = offline.page
    page.goto(f"{server}/notebooks/06_padding_tax.html", wait_until="networkidle")
    page.wait_for_selector('div.moe-skew-explorer[data-ready="1"]')
    root = "div.moe-skew-explorer"
    _assert_touch_sized(page, root)

    def series(name):
        return json.loads(page.locator(f"{root} polyline.series-{name}").first.get_attribute("data-values"))

    def readout(name):
        return float(page.locator(f"{root} .readout").first.get_attribute(f"data-{name}"))

    def set_value(name, value):
        page.evaluate(
            """([root, name, value]) => {
                const el = document.querySelector(`${root} [name=${name}]`);
                el.value = String(value);
                el.dispatchEvent(new Event('input', {bubbles: true}));
            }""",
            [root, name, value],
        )

    # A real slider move: focus s and press the right arrow (one step of 0.05).
    s_before = float(page.locator(f"{root} input[name=s]").first.input_value())
    before = page.locator(f"{root} polyline.series-rows").first.get_attribute("points")
    page.locator(f"{root} input[name=s]").first.focus()
    page.keyboard.press("ArrowRight")
    assert float(page.locator(f"{root} output[for=s]").first.text_content()) == pytest.approx(s_before + 0.05)
    assert page.locator(f"{root} polyline.series-rows").first.get_attribute("points") != before

    for key in ("deepseek-v3", "qwen3-30b-a3b"):
        model = MODELS[key]
        E, k = model.num_experts, model.top_k
        page.select_option(f"{root} select[name=model]", key)
        for s in (0.35, 1.5):
            set_value("s", s)
            pi = skew.inclusion_probabilities(skew.zipf_popularity(E, s), k)
            for log_batch in (0, 12):
                B = 2**log_batch
                set_value("logB", log_batch)
                for block in (16, 128):
                    page.select_option(f"{root} select[name=block]", str(block))
                    for rounding in ("tile", "256"):
                        page.select_option(f"{root} select[name=round]", rounding)
                        round_to = block if rounding == "tile" else 256
                        rows = series("rows")
                        assert [r for r, _ in rows] == list(range(1, E + 1))
                        for (_, got), want in zip(rows, skew.expected_rows_per_expert(B, pi).tolist()):
                            _assert_close(got, want)
                        _assert_close(readout("hottest"), skew.expected_hottest_rows(B, pi))
                        _assert_close(readout("touched"), skew.expected_experts_touched(B, pi))
                        _assert_close(readout("contiguous"), skew.expected_contiguous_rows(B, pi, block))
                        masked_rows = skew.expected_masked_rows(B, pi, round_to)
                        _assert_close(readout("masked"), masked_rows)
                        _assert_close(readout("masked-bytes"),
                                      masked_rows * (model.hidden_size + model.moe_intermediate_size) * 2)
                        if s == 0.35 and rounding == "tile":  # the curves over s do not depend on s:
                            # check them once per tile height (the 256 rounding is in the readouts)
                            for (sg, got_c), (_, got_m) in zip(series("contiguous"), series("masked")):
                                pi_g = skew.inclusion_probabilities(skew.zipf_popularity(E, sg), k)
                                _assert_close(got_c, skew.expected_contiguous_rows(B, pi_g, block) / (B * k))
                                _assert_close(got_m, skew.expected_masked_rows(B, pi_g, round_to) / (B * k))
    assert offline.blocked == []
    assert offline.unexpected_errors() == []


# ---- reading on a phone, figures, citations, kernels ------------------------------------------


@pytest.mark.parametrize("path", PAGES)
def test_pages_fit_a_phone(server, browser, path):
    """At 390 x 844 (a phone) no page scrolls sideways: long code paths wrap, wide tables and
    figures that cannot be narrowed scroll inside themselves; every figure's text shows at 10 CSS
    pixels or more."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2)
    try:
        page = context.new_page()
        page.route("**/*", lambda r: r.continue_() if urlparse(r.request.url).hostname == "127.0.0.1" else r.abort())
        page.goto(f"{server}/{path}", wait_until="networkidle")
        widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert widths[0] <= widths[1] + 1, f"{path} scrolls sideways at 390 px: {widths[0]} > {widths[1]}"
        # Code keeps its indentation: no block of code wraps its lines (a wrapped line of Python
        # restarts at column 0); a block wider than the column scrolls inside itself instead.
        wrapped = page.evaluate("""() => [...document.querySelectorAll('article pre')]
            .map(p => getComputedStyle(p))
            .filter(style => style.whiteSpace !== 'pre' || !['auto', 'scroll'].includes(style.overflowX)).length""")
        assert wrapped == 0, f"{path}: {wrapped} code blocks wrap their lines or cannot scroll sideways"
        if path == "notebooks/05_grouped_gemm.html":   # the page of the kernel listings has code to check
            assert page.evaluate("document.querySelectorAll('article div.highlight pre').length") >= 7
        small = small_figure_text(page)
        assert not small, f"{path} at 390 px: " + "; ".join(small)
    finally:
        context.close()


def small_figure_text(page) -> list[str]:
    """The figures of a page whose smallest text shows below 10 CSS pixels (the phone version
    counts where the page has one: book/_ext/phone_figures.py); a figure's text shows at its
    point size times the figure's shown width over its width in points."""
    shown = page.evaluate("""() => [...document.querySelectorAll('article figure img')].map(img => ({
        src: img.currentSrc, width: img.getBoundingClientRect().width}))""")
    small = []
    for figure in shown:
        name = figure["src"].rsplit("/", 1)[-1]
        if (SITE / "_images" / name.replace(".svg", "-phone.svg")).exists():
            small.append(f"{name} (the desktop version, though a phone version exists)")
            continue
        points, width_pt = svg_text_points((SITE / "_images" / name).read_text())
        pixels = points * figure["width"] / width_pt
        if pixels < 10:
            small.append(f"{name}: {points:g} pt text at {pixels:.1f} px ({figure['width']:.0f} px wide)")
    return small




@pytest.mark.parametrize("path", [p for p in PAGES if p.startswith("notebooks/")])
def test_every_figure_is_numbered_and_described(server, offline, path):
    """Every picture in the text is a numbered figure with a caption and an alt text."""
    page = offline.page
    page.goto(f"{server}/{path}", wait_until="networkidle")
    images = page.evaluate("""() => [...document.querySelectorAll('article img')].map(img => ({
        src: img.getAttribute('src'), alt: img.getAttribute('alt') || '',
        caption: (img.closest('figure') && img.closest('figure').querySelector('figcaption')
                  ? img.closest('figure').querySelector('figcaption').innerText : ''),
        opens: img.closest('a.figure-open') ? img.closest('a.figure-open').href : ''}))""")
    for img in images:
        assert img["alt"].strip() and len(img["alt"]) > 20, f"{path}: {img['src']} has no real alt text"
        assert re.match(r"Figure \d+", img["caption"]), f"{path}: {img['src']} has no numbered caption"
        # a tap opens the figure by itself (full screen, zoomable on a phone)
        assert img["opens"].endswith(img["src"].rsplit("/", 1)[-1]), f"{path}: {img['src']} opens {img['opens']!r}"
        assert page.request.get(img["opens"]).ok, img["opens"]


def _tables(cells):
    return [i for i, c in enumerate(cells) if c["cell_type"] == "code" and any(
        "|---" in "".join(o.get("data", {}).get("text/markdown", "")) for o in c.get("outputs", []))]


def test_phone_versions_fit_a_phone_column():
    """Every figure's phone version shows its smallest text at 10 CSS pixels in a phone's column
    without scrolling sideways (the scrolling block is for diagrams that cannot be narrowed). The
    log axes' superscripts (10^3 at 70% of the tick size) were the smallest text of seven of them."""
    from book._ext.phone_figures import legible_width
    from moe_kernels.book.figures import PHONE_COLUMN_PX

    too_wide = {svg.name: legible_width(svg.read_text()) for svg in (ROOT / "notebooks" / "figures").glob("*-phone.svg")}
    assert {name: px for name, px in too_wide.items() if px > PHONE_COLUMN_PX} == {}


def test_notes_are_admonitions_not_footnotes():
    """A note to the text is a ``{note}`` admonition after its paragraph, not a footnote:
    jupyterlab-myst shows a footnote only as a hover card on its marker (nothing to read on a
    touch screen), and an admonition reads the same on the site and in JupyterLab."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        text = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        assert not re.search(r"\[\^[\w-]+\]", text), f"{path.name}: a footnote"


def test_tables_figures_and_equations_are_numbered_per_section():
    """Section N numbers its figures, tables and equations N.1, N.2, ... on the site (the numbered
    table of contents) and in JupyterLab (each notebook's front matter, ``enumerator: N.%s``,
    which the site build removes). Every table has its caption, ``**Table N.k.** ...``, as the
    paragraph right above it, k counting the section's tables in order."""
    html = ROOT / "_build" / "html" / "notebooks"
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        n = int(path.name[:2])
        cells = json.loads(path.read_text())["cells"]
        first = "".join(cells[0]["source"])
        assert first.startswith(f"---\nnumbering:\n  enumerator: {n}.%s\n---\n# "), f"{path.name}: front matter"
        for k, i in enumerate(_tables(cells), 1):
            above = "".join(cells[i - 1]["source"]).strip().split("\n\n")[-1]
            assert cells[i - 1]["cell_type"] == "markdown" and above.startswith(f"**Table {n}.{k}.** "), \
                f"{path.name}: the table of cell {i} has no caption 'Table {n}.{k}.' right above it"
        page = (html / f"{path.stem}.html").read_text()
        assert "enumerator" not in page, f"{path.stem}: the front matter shows on the site"
        figures = re.findall(r'<span class="caption-number">Figure ([\d.]+)', page)
        equations = re.findall(r'<span class="eqno">\(([\d.]+)\)', page)
        for number in figures + equations:
            assert number.startswith(f"{n}."), f"{path.stem}: numbered {number}, not {n}.k"
        tables_shown = re.findall(r"<strong>Table ([\d.]+)\.</strong>", page)
        assert tables_shown == [f"{n}.{k}" for k in range(1, len(_tables(cells)) + 1)], (path.stem, tables_shown)


def test_every_reference_is_cited():
    """Each entry of book/references.bib is cited somewhere in the chapter's text (the reading
    guide on the references page, which cites them all, does not count)."""
    keys = re.findall(r"^@\w+\{([^,]+),", (ROOT / "book" / "references.bib").read_text(), re.M)
    text = "".join(p.read_text() for p in (ROOT / "notebooks").glob("*.ipynb")) + \
        "".join(p.read_text() for p in (ROOT / "book").glob("*.md") if p.name != "references.md")
    cited = set(re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", text))
    cited = {k.strip() for group in cited for k in group.split(",")}
    cited |= set(re.findall(r"\]\(#ref-(\w+) ", text))   # the sections cite by link: [Author, year](#ref-key "title")
    assert keys and not set(keys) - cited, f"never cited: {sorted(set(keys) - cited)}"


def test_citations_read_in_jupyterlab_and_link_on_the_site():
    """The sections cite as plain links, ``[Lepikhin et al., 2020](#ref-lepikhin2020gshard "title")``
    (jupyterlab-myst reads no .bib file: a ``{cite}`` role shows there as a warning sign and the
    bare key), each naming a target on the references page; on the site each resolves to it."""
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"^@\w+\{([^,]+),", bib, re.M))
    guide = (ROOT / "book" / "references.md").read_text()
    assert keys <= set(re.findall(r"^\s*(?:- )?\(ref-(\w+)\)=$", guide, re.M)), "a reference without its target"
    html = ROOT / "_build" / "html" / "notebooks"
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        text = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        assert not re.search(r"\{cite(?::\w+)?\}", text), f"{path.name}: a {{cite}} role (a warning key in JupyterLab)"
        linked = set(re.findall(r"\]\(#ref-(\w+) ", text)) & keys
        page = (html / f"{path.stem}.html").read_text() if linked else ""
        for key in linked:
            assert f'href="../book/references.html#ref-{key}"' in page, f"{path.stem}: the link to {key} is not resolved"


def test_every_section_ends_on_its_takeaway():
    """Each notebook's last cell closes with its Takeaway admonition, after the exercises."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        last = "".join(json.loads(path.read_text())["cells"][-1]["source"]).rstrip()
        start = last.rfind("```{admonition} Takeaway")
        assert start >= 0 and last.endswith("```") and "Exercise" not in last[start:], path.name


def test_every_reference_says_what_to_read_it_for():
    """The references page's reading guide names every entry of book/references.bib."""
    keys = re.findall(r"^@\w+\{([^,]+),", (ROOT / "book" / "references.bib").read_text(), re.M)
    guide = (ROOT / "book" / "references.md").read_text().split("## Bibliography")[0]
    assert not [k for k in keys if f"`{k}`" not in guide]


def test_kernels_appear_on_the_page():
    """The kernels are part of the text: at least five blocks of package source are shown, each
    between markers that exist in the package (so page and code cannot drift)."""
    shown = set()
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        shown |= set(re.findall(r'kernel_source\(\\"([^"\\]+)\\", \\"([^"\\]+)\\"\)', nb.read_text()))
    assert len(shown) >= 5, f"only {len(shown)} kernels on the page: {sorted(shown)}"
    for path, name in shown:
        source = (ROOT / "moe_kernels" / path).read_text()
        assert f"# >>> book: {name}" in source and f"# <<< book: {name}" in source, (path, name)


@pytest.mark.parametrize("width", [390, 1280])
def test_the_menu_button_opens_the_chapter_list(server, browser, width):
    """The visible menu button works on a phone (the chapter list opens as a dialog) and on a
    desktop (the sidebar hides and comes back): both themes once bound it to a hidden twin."""
    context = browser.new_context(viewport={"width": width, "height": 844})
    try:
        page = context.new_page()
        page.route("**/*", lambda r: r.continue_() if urlparse(r.request.url).hostname == "127.0.0.1" else r.abort())
        page.goto(f"{server}/notebooks/05_grouped_gemm.html", wait_until="networkidle")
        toggle = page.locator("button.primary-toggle:visible").first
        assert toggle.count() == 1, "no visible menu button"
        hidden = "() => document.querySelector('#pst-primary-sidebar').classList.contains('pst-sidebar-hidden')"
        if width < 992:
            toggle.click()
            page.wait_for_function("() => document.querySelector('#pst-primary-sidebar-modal').open", timeout=5000)
            links = page.evaluate("""() => [...document.querySelectorAll('#pst-primary-sidebar-modal a')]
                .filter(a => a.offsetParent !== null).map(a => a.textContent.trim())""")
            assert "6. The padding tax" in links and "10. One DeepSeek-V3 decode step, end to end" in links, links
        else:
            assert not page.evaluate(hidden)
            toggle.click()
            page.wait_for_function(hidden, timeout=5000)
            toggle.click()
            page.wait_for_function(f"() => !({hidden})()", timeout=5000)
    finally:
        context.close()



def test_the_site_offers_the_whole_source(server, offline):
    """A notebook saved alone from a page finds neither its figures nor the package, so the site
    offers the chapter's source as one archive (book/_ext/source_archive.py), linked from the
    introduction: the notebooks with their figures, the package, the results, the Makefile."""
    import zipfile

    page = offline.page
    page.goto(f"{server}/book/intro.html", wait_until="networkidle")
    href = page.evaluate("""() => [...document.querySelectorAll('article a')]
        .map(a => a.href).find(h => h.endsWith('moe-chapter.zip'))""")
    assert href, "the introduction does not link to moe-chapter.zip"
    archive = SITE / urlparse(href).path.lstrip("/")
    assert archive.exists(), f"{href} is not in the built site"
    names = set(zipfile.ZipFile(archive).namelist())
    for needed in ("Makefile", "requirements.txt", "moe_kernels/__init__.py", "notebooks/05_grouped_gemm.ipynb",
                   "notebooks/figures/12-baselines.svg", "results/nvidia-h200/decode-step.json"):
        assert f"moe-chapter/{needed}" in names, f"moe-chapter.zip lacks {needed}"
    assert not any("/.venv/" in n or "/_build/" in n for n in names)


NOTEBOOK_PAGES = [p for p in PAGES if p.startswith("notebooks/")]


@functools.cache
def _source_archive():
    """book/_ext/source_archive.py, the site's extension (not an importable package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("source_archive", ROOT / "book" / "_ext" / "source_archive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", NOTEBOOK_PAGES)
def test_every_section_says_how_to_get_the_source(path):
    """Every section's page says, once and right under its title, that the page's download is the
    notebook alone, and links to the whole source (moe-chapter.zip), which the build wrote beside
    the pages (book/_ext/source_archive.py adds the note; the notebooks do not carry it)."""
    ARCHIVE, NOTE_CLASS = _source_archive().ARCHIVE, _source_archive().NOTE_CLASS
    assert sorted(NOTEBOOK_PAGES) == sorted(f"notebooks/{p.stem}.html" for p in (ROOT / "notebooks").glob("*.ipynb"))
    page = (SITE / path).read_text()
    notes = re.findall(rf'<div class="[^"]*\b{NOTE_CLASS}\b[^"]*">(.*?)</div>', page, re.S)
    assert len(notes) == 1, f"{path}: {len(notes)} notes about the source"
    hrefs = [h for h in re.findall(r'href="([^"]+)"', notes[0]) if h.endswith(ARCHIVE)]
    assert hrefs, f"{path}: the note does not link to {ARCHIVE}"
    assert ((SITE / path).parent / hrefs[0]).resolve() == (SITE / ARCHIVE).resolve(), hrefs[0]
    assert (SITE / ARCHIVE).is_file(), f"the build wrote no {ARCHIVE}"
    text = re.sub(r"<[^>]+>", "", notes[0])
    assert "moe_kernels" in text and "make lab" in text, text
    # near the top: right under the page's title, before its first paragraph
    assert re.search(rf'</h1>\s*<div class="[^"]*\b{NOTE_CLASS}\b', page), f"{path}: the note is not under the title"
    # and the notebook itself is untouched: the note comes from the build
    assert ARCHIVE not in (ROOT / path.replace(".html", ".ipynb")).read_text()


def _bound_names(source: str) -> set[str]:
    """The names a code cell binds at its top level (assignments, loop and ``with`` targets, functions,
    classes, imports), looking into ``if``/``for``/``while``/``with``/``try`` blocks but not into functions."""
    import ast

    names: set[str] = set()

    def bind(target):
        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))

    def visit(statements):
        for s in statements:
            if isinstance(s, ast.Assign):
                for target in s.targets:
                    bind(target)
            elif isinstance(s, (ast.AugAssign, ast.AnnAssign)):
                bind(s.target)
            elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(s.name)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in s.names)
            elif isinstance(s, (ast.For, ast.AsyncFor)):
                bind(s.target)
                visit(s.body + s.orelse)
            elif isinstance(s, (ast.If, ast.While)):
                visit(s.body + s.orelse)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        bind(item.optional_vars)
                visit(s.body)
            elif isinstance(s, ast.Try):
                visit(s.body + [h for handler in s.handlers for h in handler.body] + s.orelse + s.finalbody)

    visit(ast.parse(source).body)
    return names


def test_no_inline_value_reads_a_name_a_later_cell_binds_again():
    """An ``{eval}`` value is stored when its cell runs, but JupyterLab evaluates it again after Run All, in the
    kernel's final state: a name that a later code cell binds again then shows the later value (session 49's
    Chapter 12 reused ``h200_decode``, and Lab showed another number than the site). So no name an inline value
    reads may be bound by a code cell after it (names bound inside the expression, as comprehension variables, are
    the expression's own)."""
    import ast

    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        later: set[str] = set()
        for i in range(len(cells) - 1, -1, -1):
            cell = cells[i]
            if cell["cell_type"] == "code":
                later |= _bound_names("".join(cell["source"]))
                continue
            for item in cell.get("metadata", {}).get("user_expressions", []):
                tree = ast.parse(item["expression"], mode="eval")
                read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                own = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                rebound = (read - own) & later
                assert not rebound, f"{path.name} cell {i}: {item['expression']!r} reads {sorted(rebound)}, bound " \
                                    "again by a later code cell"
