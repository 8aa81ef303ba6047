"""Each notebook opens with MyST front matter for JupyterLab; the site build removes it.

A notebook's first Markdown cell starts with::

    ---
    numbering:
      enumerator: 5.%s
    ---

so that jupyterlab-myst numbers the section's figures, tables and equations 5.1, 5.2, ... as the
site does (without it JupyterLab counts from 1 in every notebook, while the site counts per
section). myst-nb reads no front matter inside a cell: it would render the block as a rule and a
heading. This extension removes the block from the notebook's text before myst-nb parses it; the
site's numbers come from the numbered table of contents (``_toc.yml``) through Sphinx's numfig.
"""

from __future__ import annotations

import json
import re

FRONT_MATTER = re.compile(r"\A---\n.*?\n---\n", re.S)


def _strip_front_matter(app, docname, source):
    if not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    notebook = json.loads(source[0])
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            match = FRONT_MATTER.match(text)
            if match:
                cell["source"] = text[match.end():]
                source[0] = json.dumps(notebook)
            return


def setup(app):
    app.connect("source-read", _strip_front_matter)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
