"""The notebooks in JupyterLab 4 with jupyterlab-myst, in headless Chromium.

Starts `jupyter lab` on a loopback port, serving a temporary copy of the notebooks (a Run All and
JupyterLab's autosave must never touch the committed files), opens each notebook and checks what a
reader sees in its Markdown cells:

* every inline {eval} number stored in the cell's `user_expressions` metadata is shown, before any
  cell has run (no kernel needed) and again after Run All (recomputed by the kernel);
* no MyST source shows through: no `{eval}`, `{glue`, `[^label]`, fences or unresolved references;
* admonitions are rendered as admonitions, dropdown answers are collapsed `<details>` until clicked;
* a `{figure}` has its number, caption, alt text and a loaded image;
* after Run All and Save, jupyterlab-myst's `user_expressions` equal those that
  tools/execute_notebooks.py committed (same format, same values);
* after Run All, the kernel-free explorer draws its curves and redraws when a slider moves;
* citations read as text: the sections cite with plain links, ``[Author, year](#ref-key "title")``,
  because jupyterlab-myst reads no .bib file and shows a ``{cite}`` role as a warning key (a
  yellow warning icon and the bare key: "⚠ lepikhin2020gshard"). Each link shows its "Author,
  year", and no warning key (the icon, or a "⚠" character) appears anywhere in the rendered
  notebook, opened or after Run All. (On the site the links point into the reference list:
  tests/test_site.py.)

Skips without Playwright, Chromium or JupyterLab unless REQUIRE_BROWSER=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from moe_testing import headless_chromium, skip_or_fail_browser

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
# Three notebooks: the kernel-free explorer (02), the kernels on the page and a live-GPU cell (05), and
# a whole (tiny) model run under Run All (11).
NOTEBOOKS = ["02_experts_touched.ipynb", "05_grouped_gemm.ipynb", "11_measure_on_an_engine.ipynb"]
EXTRA = ["figures"]                          # files the notebooks' Markdown refers to
RUN_ALL_TIMEOUT_MS = int(os.environ.get("LAB_RUN_ALL_TIMEOUT_S", "300")) * 1000

# User settings for the test server: every cell stays in the DOM (JupyterLab 4 otherwise only
# renders the cells near the viewport), and no "official Jupyter news?" toast over the page.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}

# Text of each rendered Markdown cell (MyST widget only: the hidden editor holds the source), with
# KaTeX's MathML copy removed so that math reads once.
CELLS_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-MarkdownCell')].map(cell => {
  const myst = cell.querySelector('.myst');
  if (!myst) return null;
  const clone = myst.cloneNode(true);
  clone.querySelectorAll('.katex-mathml, mjx-assistive-mml').forEach(e => e.remove());
  return {
    text: clone.textContent,
    code: [...myst.querySelectorAll('code')].map(e => e.textContent),
    pre: myst.querySelectorAll('pre').length,
    admonitions: myst.querySelectorAll('aside.myst-admonition').length,
    details: [...myst.querySelectorAll('details')].map(d => ({open: d.open,
        summary: d.querySelector('summary').innerText})),
    footnoteRefs: myst.querySelectorAll('sup a[href^="#fn-"]').length,
    citations: [...myst.querySelectorAll('a[href^="#ref-"]')].map(a => a.textContent),
    unresolved: [...myst.querySelectorAll('[title$="Not Found"]')].map(e => e.title + ': ' + e.textContent),
    figures: [...myst.querySelectorAll('figure')].map(f => ({
        caption: (f.querySelector('figcaption') || {}).innerText || '',
        alt: (f.querySelector('img') || {}).alt || '',
        loaded: !!f.querySelector('img') && f.querySelector('img').naturalWidth > 0})),
  };
})"""


# MyST role or directive names that would show if a construct were not rendered.
# Every code cell's prompt ("[3]:", "[*]:", "[ ]:"), hidden inputs included (textContent, not innerText).
PROMPTS_JS = "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim())"

RAW_ROLE = re.compile(r"\{(?:eval|glue(?::\w+)?|numref|eq|ref|doc|cite(?::\w+)?|term|admonition|dropdown|note|tip|"
                      r"warning|important|figure|math|exercise|solution)\}")



def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stored(cell):
    """{expression: shown text} from a cell's user_expressions (text/plain, quotes stripped as
    both renderers do)."""
    out = {}
    for item in cell.metadata.get("user_expressions", []):
        text = item["result"]["data"]["text/plain"]
        out[item["expression"]] = re.sub(r"^(['\"])(.*)\1$", r"\2", text, flags=re.S)
    return out


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        skip_or_fail_browser("JupyterLab is not installed (make lab installs it)")
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    root.mkdir()
    for name in NOTEBOOKS:
        shutil.copy(NB_DIR / name, root / name)
    for name in EXTRA:
        if (NB_DIR / name).is_dir():
            shutil.copytree(NB_DIR / name, root / name)
    settings = tmp / "settings"
    for rel, value in SETTINGS.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(value))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               IPYTHONDIR=str(tmp / "ipython"))
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "jupyter-lab"), "--no-browser", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", "--ServerApp.token=", "--ServerApp.password=",
           "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={root}",
           f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
           "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp / "lab.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/api/status", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() - t0 > 90:
                    pytest.fail("JupyterLab did not start:\n" + (tmp / "lab.log").read_text()[-3000:])
                time.sleep(0.2)
        print(f"JupyterLab answered after {time.time() - t0:.1f} s")
        yield url, root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    yield from headless_chromium()


def _open(browser, lab, name):
    import nbformat
    url, root = lab
    nb = nbformat.read(root / name, as_version=4)
    n_md = sum(c.cell_type == "markdown" for c in nb.cells)
    context = browser.new_context(viewport={"width": 1280, "height": 2200})
    page = context.new_page()
    blocked = []
    # Offline: anything but the loopback server is aborted and recorded.
    page.route(re.compile(r"^(?!http://127\.0\.0\.1:)https?://.*"),
               lambda route: (blocked.append(route.request.url), route.abort()))
    t0 = time.time()
    page.goto(f"{url}/lab/tree/{name}?reset")
    page.wait_for_function(
        f"document.querySelectorAll('.jp-Notebook .jp-MarkdownCell .myst').length >= {n_md}", timeout=90000)
    # jupyterlab-myst renders each cell, then numbers figures/equations over the whole notebook.
    page.wait_for_function("!document.querySelector('.jp-Notebook .myst [title=\"Cross Reference Not Found\"]')",
                           timeout=15000)
    page.wait_for_timeout(1000)
    print(f"{name}: rendered in {time.time() - t0:.1f} s")
    return context, page, nb, blocked


def _footnote_texts(page, i):
    """The text of each footnote of the i-th Markdown cell: jupyterlab-myst shows a footnote only
    as a hover card on its [n] reference."""
    texts = []
    refs = page.locator(".jp-Notebook .jp-MarkdownCell").nth(i).locator('.myst sup a[href^="#fn-"]')
    for k in range(refs.count()):
        refs.nth(k).hover()
        card = page.locator("[data-radix-popper-content-wrapper]").last
        card.wait_for(timeout=5000)
        texts.append(card.evaluate("""e => { const c = e.cloneNode(true);
            c.querySelectorAll('.katex-mathml').forEach(m => m.remove()); return c.textContent; }"""))
        page.mouse.move(0, 0)
        page.wait_for_timeout(300)
    return texts


# The whole rendered notebook (Markdown and outputs), folded answers included (textContent, not innerText).
NOTEBOOK_TEXT_JS = "() => document.querySelector('.jp-Notebook').textContent"
# jupyterlab-myst's warning key: what it cannot resolve (a {cite} key, a cross-reference) shows as a
# yellow warning icon (an SVG, not a character) and the bare key, in a span titled "... Not Found".
WARNING_KEYS_JS = """() => [...document.querySelectorAll(
    '.jp-Notebook .myst [title$="Not Found"], .jp-Notebook .myst .text-yellow-600')]
    .map(e => (e.title || e.className) + ': ' + e.textContent)"""
# [Author, year](#ref-key "title"): a citation as the sections write it.
CITATION = re.compile(r'\[([^\]]+)\]\(#ref-\w+ "')


def _check(page, nb, shots, tag):
    md = [c for c in nb.cells if c.cell_type == "markdown"]
    cells = page.evaluate(CELLS_JS)
    assert len(cells) == len(md)
    # No warning key anywhere in the notebook: neither jupyterlab-myst's icon nor a "⚠" in the text.
    shown = page.evaluate(NOTEBOOK_TEXT_JS)
    warnings = [shown[max(0, m.start() - 40):m.end() + 60] for m in re.finditer("\u26a0", shown)]
    warnings += page.evaluate(WARNING_KEYS_JS)
    assert not warnings, f"{tag}: warning keys in the rendered notebook: {warnings[:5]}"
    footnotes = {}  # cell index -> its footnotes' texts (opening the answers does not change them)
    for i, dom in enumerate(cells):
        if dom and dom["footnoteRefs"]:
            dom["footnotes"] = footnotes[i] = _footnote_texts(page, i)
            dom["text"] += " " + " ".join(dom["footnotes"])
    for i, (cell, dom) in enumerate(zip(md, cells)):
        where = f"markdown cell {i} ({tag})"
        assert dom is not None, f"{where}: not rendered by jupyterlab-myst"
        src = cell.source
        for raw in ("[^", "```", ":::"):
            assert raw not in dom["text"], f"{where}: raw {raw!r} shows: {dom['text'][:300]!r}"
        role = RAW_ROLE.search(dom["text"])
        assert not role, f"{where}: raw {role.group(0)!r} shows: {dom['text'][:300]!r}"
        assert not dom["unresolved"], f"{where}: {dom['unresolved']}"   # citations included: none is a bare key
        cited = [m.group(1) for m in CITATION.finditer(src)]
        assert sorted(dom["citations"]) == sorted(cited), f"{where}: citations shown {dom['citations']}, written {cited}"
        stored = _stored(cell)
        # an expression without a result is shown as inline code: that is the failure we look for
        assert not set(stored) & set(dom["code"]), f"{where}: unevaluated {set(stored) & set(dom['code'])}"
        n_adm = len(re.findall(r"^(?:```+|:::+)\{(?:admonition|note|tip|hint|warning|important|caution|"
                               r"attention|danger|error|seealso)\}", src, re.M))
        assert dom["admonitions"] >= n_adm, f"{where}: {dom['admonitions']} admonitions rendered, {n_adm} in source"
        n_drop = len(re.findall(r"^(?:```+|:::+)\{dropdown\}", src, re.M))
        assert len(dom["details"]) == n_drop, f"{where}: {dom['details']}"
        assert not any(d["open"] for d in dom["details"]), f"{where}: an answer is open"
        if re.search(r"\[\^[^\]]+\](?!:)", src):
            assert dom["footnoteRefs"] >= 1, f"{where}: footnote reference not rendered"
            assert all(t.strip() for t in dom["footnotes"]), f"{where}: empty footnote"
        if "{figure}" in src:
            assert dom["figures"], f"{where}: no figure"
            for f in dom["figures"]:
                # numbered per section, as on the site (the front matter's enumerator "N.%s")
                section = int(tag[:2])
                assert re.match(rf"Figure\s+{section}\.\d+:", f["caption"]), f"{where}: caption {f['caption']!r}"
                assert f["alt"] and f["loaded"], f"{where}: {f}"
        for expr, shown in stored.items():
            if n_drop:
                continue  # checked below, once the answers are opened
            assert shown in dom["text"], f"{where}: {{eval}}`{expr}` = {shown!r} not shown"
    page.screenshot(path=str(shots / f"lab-{tag}.png"), full_page=True)
    # Open every answer: its numbers are there, and it is now visible.
    for summary in page.locator(".jp-MarkdownCell .myst details > summary").all():
        summary.click()
    page.wait_for_timeout(500)
    cells = page.evaluate(CELLS_JS)
    for i, (cell, dom) in enumerate(zip(md, cells)):
        dom["text"] += " " + " ".join(footnotes.get(i, []))
        assert all(d["open"] for d in dom["details"])
        for expr, shown in _stored(cell).items():
            assert shown in dom["text"], f"markdown cell {i} ({tag}, opened): {shown!r} not shown"
    page.screenshot(path=str(shots / f"lab-{tag}-answers.png"), full_page=True)
    for summary in page.locator(".jp-MarkdownCell .myst details > summary").all():
        summary.click()  # fold the answers again, as a reader would find them
    page.wait_for_timeout(300)


def tmp_path_factory_default():
    import tempfile

    return Path(tempfile.gettempdir()) / "moe-lab-shots"


@pytest.fixture(scope="module")
def shots():
    d = Path(os.environ.get("LAB_SHOTS", tmp_path_factory_default()))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_reads_in_lab_before_and_after_run_all(browser, lab, shots, name):
    """Opened, nothing run: the numbers come from the metadata tools/execute_notebooks.py stored.
    Then Run All: jupyterlab-myst evaluates the expressions in the kernel; after Save, the metadata
    it wrote equals the committed one, so the committed numbers are the ones the code computes."""
    import nbformat
    url, root = lab
    context, page, nb, blocked = _open(browser, lab, name)
    try:
        _check(page, nb, shots, name.removesuffix(".ipynb") + "-opened")
        assert not blocked, f"requests off the machine: {blocked[:5]}"
        page.wait_for_function("document.body.innerText.includes('| Idle')", timeout=90000)
        # Clear every output first: that also blanks the execution counts, so a numbered prompt below
        # is one this run wrote, not one read from the file.
        page.locator(".lm-MenuBar-item", has_text="Edit").first.click()
        page.locator(".lm-Menu-item", has_text="Clear Outputs of All Cells").first.click()
        page.wait_for_function(f"({PROMPTS_JS})().every(t => !/\\d/.test(t))", timeout=15000)
        # Unfold the folded inputs (cells that only compute prose values), so that every cell shows its prompt.
        page.locator(".lm-MenuBar-item", has_text="View").first.click()
        page.locator(".lm-Menu-item", has_text="Expand All Code").first.click()
        t0 = time.time()
        page.locator(".lm-MenuBar-item", has_text="Run").first.click()
        page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
        try:
            # The counts run 1..n over the n code cells: the last reaching n, no "[*]" left, means all ran.
            n_code = sum(c.cell_type == "code" for c in nb.cells)
            page.wait_for_function(f"""(p => !p.some(t => t.includes('*'))
                && Math.max(0, ...p.map(t => Number((t.match(/\\[(\\d+)\\]/) || [0, 0])[1]))) === {n_code})
                (({PROMPTS_JS})())""", timeout=RUN_ALL_TIMEOUT_MS)
        except Exception:
            prompts = page.evaluate(PROMPTS_JS)
            errors = page.evaluate("() => [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="
                                   "\\'application/vnd.jupyter.stderr\\']')].map(e => e.innerText.slice(0, 500))")
            page.screenshot(path=str(shots / f"lab-{name}-run-timeout.png"), full_page=True)
            pytest.fail(f"{name}: Run All did not finish in {RUN_ALL_TIMEOUT_MS / 1000:.0f} s; prompts {prompts}; "
                        f"errors {errors}")
        page.wait_for_function("document.body.innerText.includes('| Idle')", timeout=60000)
        page.wait_for_timeout(1500)
        print(f"{name}: Run All took {time.time() - t0:.1f} s")
        _check(page, nb, shots, name.removesuffix(".ipynb") + "-run")
        if page.locator(".moe-explorer").count():
            _check_explorer_responds(page)
        page.keyboard.press("Control+s")
        page.wait_for_function("!document.querySelector('.jp-mod-dirty')", timeout=30000)
        saved = nbformat.read(root / name, as_version=4)
        got = [c.metadata.get("user_expressions") for c in saved.cells if c.cell_type == "markdown"]
        want = [c.metadata.get("user_expressions") for c in nb.cells if c.cell_type == "markdown"]
        for i, (g, w) in enumerate(zip(got, want)):
            g, w = {e["expression"]: e["result"] for e in g or []}, {e["expression"]: e["result"] for e in w or []}
            diff = {x: (w.get(x), g.get(x)) for x in set(g) | set(w) if g.get(x) != w.get(x)}
            assert not diff, f"markdown cell {i}: committed vs Run All {diff}"
        assert len(got) == len(want)
    finally:
        context.close()


def _check_explorer_responds(page):
    """The kernel-free explorer, run from the kernel, draws its curves and redraws when a slider moves."""
    explorer = page.locator(".moe-explorer").first
    explorer.scroll_into_view_if_needed()
    explorer.locator("svg polyline").first.wait_for(timeout=15000)
    before = explorer.locator("svg").first.inner_html()
    slider = explorer.locator("input[type=range]").first
    slider.evaluate("(e) => { e.value = String(Number(e.min) + 1); e.dispatchEvent(new Event('input', {bubbles: true})); }")
    page.wait_for_timeout(500)
    assert explorer.locator("svg").first.inner_html() != before, "the explorer did not redraw when its slider moved"


def test_make_lab_serves_a_working_copy():
    """`make lab` opens JupyterLab on .lab/ (a copy of the notebooks that git ignores), never on the
    committed notebooks, and passes --allow-root exactly when it runs as root."""
    plan = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    launch = [line for line in plan.splitlines() if "jupyter lab" in line]
    assert "cp -r notebooks .lab" in plan and launch and launch[-1].split()[-1] == ".lab", plan
    assert ("--allow-root" in launch[-1]) == (os.geteuid() == 0), launch
    ignored = subprocess.run(["git", "check-ignore", "-q", ".lab/01_symptom_in_bytes.ipynb"], cwd=ROOT)
    assert ignored.returncode == 0, ".lab/ must be ignored by git"
