"""Small helpers for presenting numbers in the notebooks: tables and unit formatting.

Example::

    >>> print(markdown_table(["model", "E"], [["DeepSeek-V3", 256]]).data)
    | model | E |
    |---|---|
    | DeepSeek-V3 | 256 |
"""

from __future__ import annotations


def markdown_table(headers, rows):
    """A Markdown table as an IPython display object (rendered by JupyterLab and the site)."""
    from IPython.display import Markdown

    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return Markdown("\n".join(lines))


def si(value: float, unit: str = "", digits: int = 3) -> str:
    """``si(352_321_536, 'B')`` -> ``'352 MB'``: decimal prefixes, ``digits`` significant digits."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}".rstrip()
