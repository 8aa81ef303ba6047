"""Re-execute notebooks in place, and store the value of every inline {eval} expression.

Usage: python tools/execute_notebooks.py [--check] [--out DIR] NOTEBOOK.ipynb [...]

--check executes in memory, writes nothing, and exits 1 if any stored inline value differs from
what the code computes now (stale prose numbers), listing each one.
--out DIR writes each executed notebook to DIR instead of in place (with --check too): on a GPU
machine this keeps the live cells' outputs for reading without touching the committed notebooks.

Code cells run top to bottom as in nbclient's normal run. Each Markdown cell that contains
{eval}`expr` roles is evaluated when the run reaches it (after every code cell above it, exactly as
JupyterLab's "Run All" with jupyterlab-myst does), by the kernel protocol's `user_expressions`
field of an execute request with empty code. The results are written to the cell's metadata in
jupyterlab-myst's format:

    "user_expressions": [{"expression": "f'{x:.1f}'",
                          "result": {"status": "ok", "data": {"text/plain": "'3.1'"}, "metadata": {}}}]

which jupyterlab-myst shows on opening without a kernel, and which the book's Sphinx extension
(book/_ext/eval_metadata.py) renders with execution off. An expression that raises (a name defined only
further down, a typo) makes the run fail, so a broken number never reaches a commit.
"""

import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.util import ensure_async

# {eval}`expr` or {eval}``expr with ` inside`` (MyST's role syntax: a code span after the name).
EVAL_ROLE = re.compile(r"\{eval\}(`+)(.+?)(?<!`)\1(?!`)", re.S)
FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,}|:{3,})(.*)$")


def _prose(source):
    """The source without the bodies of plain code fences (```python ...), which MyST does not
    parse; directive fences (```{note}, :::{note}) keep their bodies, which it does."""
    kept, stack = [], []  # stack of (fence, is_directive)
    for line in source.splitlines():
        m = FENCE_OPEN.match(line)
        if stack and m and m.group(1)[0] == stack[-1][0][0] and len(m.group(1)) >= len(stack[-1][0]) \
                and not m.group(2).strip():
            stack.pop()  # a closing fence
            continue
        if m and (not stack or stack[-1][1]) and (m.group(1)[0] != ":" or m.group(2).startswith("{")):
            stack.append((m.group(1), m.group(2).strip().startswith("{")))
            continue
        if not stack or stack[-1][1]:
            kept.append(line)
    return "\n".join(kept)


def eval_expressions(source):
    """The expressions of the {eval} roles in a Markdown source, in order, without duplicates."""
    seen = []
    for m in EVAL_ROLE.finditer(_prose(source)):
        expr = m.group(2)
        # CommonMark code spans strip one leading and trailing space when both are present
        if len(expr) > 2 and expr[0] == " " and expr[-1] == " " and expr.strip():
            expr = expr[1:-1]
        if expr not in seen:
            seen.append(expr)
    return seen


class ExpressionError(RuntimeError):
    pass


class UserExpressionClient(NotebookClient):
    """nbclient's NotebookClient that also evaluates the {eval} roles of Markdown cells."""

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        if cell.cell_type != "markdown":
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        exprs = eval_expressions(cell.source)
        if not exprs:
            cell.metadata.pop("user_expressions", None)
            return cell
        msg_id = await ensure_async(
            self.kc.execute(
                "", silent=False, store_history=False, user_expressions={str(i): e for i, e in enumerate(exprs)}
            )
        )
        reply = await self.async_wait_for_reply(msg_id, cell)
        content = reply["content"]
        if content["status"] != "ok":
            raise ExpressionError(f"cell {cell_index}: kernel answered {content['status']}")
        results = content["user_expressions"]
        stored = []
        for i, expr in enumerate(exprs):
            result = results[str(i)]
            if result.get("status") != "ok":
                raise ExpressionError(
                    f"cell {cell_index}: {{eval}}`{expr}` raised {result.get('ename')}: {result.get('evalue')}"
                )
            stored.append({"expression": expr, "result": result})
        cell.metadata["user_expressions"] = stored
        return cell


def _shown(cell):
    return [(e["expression"], e["result"].get("data", {}).get("text/plain"))
            for e in cell.metadata.get("user_expressions", [])]


def main(argv):
    check = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    out_dir = None
    if "--out" in argv:
        i = argv.index("--out")
        out_dir = Path(argv[i + 1])
        out_dir.mkdir(parents=True, exist_ok=True)
        del argv[i:i + 2]
    stale = 0
    for name in argv:
        path = Path(name)
        nb = nbformat.read(path, as_version=4)
        before = [_shown(c) for c in nb.cells]
        start = time.time()
        UserExpressionClient(
            nb, timeout=900, kernel_name="python3", record_timing=False,  # no timestamps in the commits
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
        n = sum(len(c.metadata.get("user_expressions", [])) for c in nb.cells)
        if check:
            for i, (old, cell) in enumerate(zip(before, nb.cells)):
                if old != _shown(cell):
                    stale += 1
                    print(f"{path}: cell {i}: stored {old} but the code gives {_shown(cell)}")
            print(f"{path}: checked {n} inline expressions in {time.time() - start:.1f} s")
        if out_dir is not None:
            nbformat.write(nb, out_dir / path.name)
        elif not check:
            nbformat.write(nb, path)
            print(f"{path}: executed in {time.time() - start:.1f} s, {n} inline expressions stored")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
