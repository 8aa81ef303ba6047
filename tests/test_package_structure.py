"""The package's shape: no two modules of moe_kernels import each other, directly or around a loop,
and no module runs past 400 lines without saying why.

A cycle works only while every import in it stays inside a function, and breaks, with a half-built
module, as soon as one moves to the top of its file. The import graph is read from the source with
:mod:`ast` (nothing is imported), every import statement counted, those inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moe_kernels"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (a package is its ``__init__``)."""
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the file of module ``name`` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from .x import y`` imports the module x.y where there is one, else a name of x.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = module_files(package)
    # A module that imports itself (the tuner does, to hand worker processes a picklable
    # reference) is no cycle between modules.
    return {name: imported_modules(name, path, set(files)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None where the graph has none.

        >>> find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}})
        ['a', 'b', 'c', 'a']
        >>> find_cycle({"a": {"b"}, "b": set()}) is None
        True
    """
    done: set[str] = set()   # modules all of whose imports have been followed
    for start in sorted(graph):
        path, stack = [start], [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                done.add(path.pop())
                stack.pop()
            elif nxt in path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "moe_kernels.bench.timing" in graph["moe_kernels.bench.ceilings"]  # the graph is read at all
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_import_graph_reads_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def f():\n    from .b import g\n")
    (package / "sub" / "b.py").write_text("from ..c import h\n")
    (package / "c.py").write_text("import pkg.sub.a\n")
    graph = import_graph(package)
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert find_cycle(graph) == ["pkg.c", "pkg.sub.a", "pkg.sub.b", "pkg.c"]


def test_long_modules_say_why():
    """No module of the package runs past 400 lines without saying why at its top."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines > 400 and "Over 400 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{path.relative_to(PACKAGE.parent)} ({lines} lines)")
    assert not unexplained, "over 400 lines with no reason at the top: " + ", ".join(unexplained)


def test_host_code_does_not_call_tritons_constexpr_functions():
    """``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function``s: called from host
    Python each costs about a ``torch.empty`` (measured on the H200's host), several times per
    decode call. Host code uses ``moe_kernels._runtime.cdiv`` and ``next_power_of_2`` instead."""
    from moe_kernels._runtime import cdiv, next_power_of_2

    assert [cdiv(a, 16) for a in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert [next_power_of_2(n) for n in (1, 2, 3, 1024, 1025)] == [1, 2, 4, 1024, 2048]
    callers = [f"{path.relative_to(PACKAGE.parent)}:{number}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if "triton.cdiv(" in line or "triton.next_power_of_2(" in line]
    assert not callers, "host calls of Triton's constexpr functions: " + ", ".join(callers)


#: The longest line of code the book shows (a listing's lines, dedented): a phone scrolls a listing
#: sideways, and lines this short need little of it (issue 20: 05's listings reached 113 characters).
BOOK_LISTING_WIDTH = 88


def test_book_listings_are_narrow():
    """Every ``# >>> book: <name>`` block of the package, as ``kernel_source`` shows it."""
    import re
    import textwrap

    blocks, too_wide = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for start, line in enumerate(lines):
            found = re.fullmatch(r"\s*# >>> book: (\S+)", line)
            if not found:
                continue
            end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == f"# <<< book: {found[1]}")
            blocks += 1
            shown = textwrap.dedent("\n".join(lines[start + 1:end])).splitlines()
            too_wide += [f"{path.name} {found[1]}: {len(text)} chars" for text in shown if len(text) > BOOK_LISTING_WIDTH]
    assert blocks >= 12 and not too_wide, too_wide
