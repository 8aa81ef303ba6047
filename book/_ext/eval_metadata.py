"""Render MyST {eval}`expr` roles from the results stored in the notebook, with execution off.

myst-nb 1.x evaluates {eval} only with a live kernel (nb_execution_mode "inline"); with "off" it
warns "This document does not have a running kernel" and renders nothing (MyST-NB issue #596, the
fix in PR #597 is unmerged). jupyterlab-myst, and tools/execute_notebooks.py, store each Markdown
cell's results in its metadata:

    "user_expressions": [{"expression": "f'{x:.1f}'",
                          "result": {"status": "ok", "data": {"text/plain": "'3.1'"}, "metadata": {}}}]

This extension replaces the `eval` role with one that reads that metadata from the cell the role is
in, and renders the stored MIME bundle through myst-nb's own output renderer (text/plain has its
quotes stripped, as jupyterlab-myst does). A role without a stored result is a warning, so a build
with -W fails rather than print a blank.
"""

from __future__ import annotations

from docutils import nodes

from myst_nb.core.variables import VariableOutput, create_warning, render_variable_outputs
from myst_nb.ext.utils import RoleBase

_KEY = "user_expressions"


def _cell_index(notebook, line: int) -> int | None:
    """The index of the cell that source line `line` (1-based) belongs to.

    myst-nb numbers the lines of cell i from (i + 1) * 10000 for .ipynb, or from
    metadata.source_map[i] for text notebooks (jupytext / MyST-NB .md)."""
    smap = notebook.metadata.get("source_map")
    if smap:
        best = None
        for i, start in enumerate(smap):
            if start + 1 <= line:
                best = i
        return best
    index = (line - 1) // 10000 - 1
    return index if 0 <= index < len(notebook.cells) else None


def _lookup(document, expression: str, line: int):
    renderer = document.get("nb_renderer")
    if renderer is None:
        return None, "not a notebook"
    notebook = renderer.renderer.nb_client.notebook
    index = _cell_index(notebook, line)
    candidates = []
    if index is not None:
        candidates.append(notebook.cells[index])
    candidates += [c for c in notebook.cells if c.cell_type == "markdown"]  # fallback: first match
    for cell in candidates:
        for item in cell.get("metadata", {}).get(_KEY, []):
            if item.get("expression") == expression:
                return item.get("result", {}), renderer
    return None, renderer


class EvalFromMetadataRole(RoleBase):
    def run(self):
        result, renderer = _lookup(self.document, self.text, self.line)
        if result is None:
            msg = f"no stored result for {{eval}}`{self.text}` (run tools/execute_notebooks.py)"
            return [], [create_warning(msg, self.document, self.line, subtype="eval")]
        if result.get("status") != "ok":
            msg = f"{{eval}}`{self.text}` stored an error: {result.get('ename')}: {result.get('evalue')}"
            return [], [create_warning(msg, self.document, self.line, subtype="eval")]
        metadata = dict(result.get("metadata", {}))
        metadata["strip_text_quotes"] = True
        output = VariableOutput(
            data=result.get("data", {}), metadata=metadata, nb_renderer=renderer, vtype="eval", index=0
        )
        return render_variable_outputs([output], self.document, self.line, self.source, inline=True), []


def _override(app, config):
    app.add_role("eval", EvalFromMetadataRole(), override=True)


def setup(app):
    # myst-nb registers its own `eval` role in its setup; ours must come after it.
    app.connect("config-inited", _override, priority=900)
    return {"version": "0.1", "parallel_read_safe": True, "parallel_write_safe": True}
