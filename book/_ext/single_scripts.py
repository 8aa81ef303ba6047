"""Each script once per page: the THEBE_JS_URL error on every page, removed.

Under Jupyter Book 1.0.4, every page carried two copies of sphinx-thebe's and
sphinx-togglebutton's inline scripts, and the second ``const THEBE_JS_URL = ...`` is a SyntaxError
("Identifier 'THEBE_JS_URL' has already been declared") in every browser console. This extension
drops a page's repeated scripts (same file, or same inline body, same attributes) just before the
page is written; the first copy stays where it was. (The copies differ only in the file name of an
inline script, None for one and "" for the other, which is why Sphinx's own check lets both in.)
"""

from __future__ import annotations


def _key(script) -> tuple:
    attributes = getattr(script, "attributes", {}) or {}
    # An inline script's file is None or "" depending on which extension added it: the same script.
    filename = getattr(script, "filename", str(script)) or ""
    return filename, tuple(sorted((k, str(v)) for k, v in attributes.items()))


def drop_repeated_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for script in scripts:
        key = _key(script)
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


def setup(app):
    # Late (priority 900): after every extension has added its page scripts.
    app.connect("html-page-context", drop_repeated_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
