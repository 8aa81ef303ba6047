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


def below(err: float, tol: str = "1e-6") -> str:
    """An error figure as the verdict it stands for. Float rounding differs between CPUs (BLAS
    kernels, thread counts), so a printed ``2.3e-07`` would not reproduce; "below 1e-6" does, and
    a real failure still shows its value.

        >>> below(2.3e-07), below(0.0, "1e-12"), below(3e-3, "1e-6")
        ('below 1e-6', 'below 1e-12', '3.0e-03, above 1e-6')
    """
    return f"below {tol}" if err < float(tol) else f"{err:.1e}, above {tol}"


def beside(recorded: dict, live: dict | None, *, what: str, device: str = "this GPU") -> None:
    """Print each time measured here beside the H200's recorded one, saying which is which; with
    ``live`` None (no GPU in this kernel) the record alone. Keys are labels, values microseconds
    (None: not measured). The numbers come first, so that a phone shows them without scrolling.

        >>> beside({"batch 1": 10.04}, None, what="kernel, CUDA-graph replay")
        No GPU here: the times recorded on an NVIDIA H200 (kernel, CUDA-graph replay, µs).
           H200
           10.0  batch 1
        >>> beside({"batch 1": 10.04}, {"batch 1": 7.51}, what="kernel", device="GPU X")
        Measured now on GPU X beside the times recorded on an NVIDIA H200 (kernel, µs).
           here    H200
            7.5    10.0  batch 1
    """
    show = lambda us: "    n/a" if us is None else f"{us:7.1f}"  # noqa: E731
    if live is None:
        print(f"No GPU here: the times recorded on an NVIDIA H200 ({what}, µs).")
        print("   H200")
    else:
        print(f"Measured now on {device} beside the times recorded on an NVIDIA H200 ({what}, µs).")
        print("   here    H200")
    for label, us in recorded.items():
        here = "" if live is None else f"{show(live.get(label))} "
        print(f"{here}{show(us)}  {label}")


def kernel_source(path: str, name: str):
    """The lines of ``moe_kernels/<path>`` between ``# >>> book: <name>`` and ``# <<< book: <name>``,
    dedented, as a highlighted code block: the kernel on the page *is* the package's kernel, so the
    two cannot drift (nbval re-runs the cell and compares). The upstream file it is written after is
    named in the prose beside it.

        >>> print(kernel_source("kernels/routing.py", "gate").data.splitlines()[-1])
        return torch.nn.functional.linear(hidden_states.float(), gate_weight.float())
    """
    import textwrap
    from pathlib import Path

    from IPython.display import Code

    lines = (Path(__file__).resolve().parents[1] / path).read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"# >>> book: {name}"), None)
    end = next((i for i, line in enumerate(lines) if line.strip() == f"# <<< book: {name}"), None)
    if start is None or end is None or end <= start:
        raise ValueError(f"kernel_source: moe_kernels/{path} has no '# >>> book: {name}' ... '# <<< book: {name}' block")
    return Code(textwrap.dedent("\n".join(lines[start + 1:end])), language="python")
