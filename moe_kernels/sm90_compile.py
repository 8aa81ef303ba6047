"""A Triton kernel of the package compiled for an H100/H200 (sm_90) on any machine, with no GPU.

The CPU tests run every kernel under Triton's interpreter, which executes it as Python and so
accepts code that the compiler refuses (a nested function's string default once failed every GPU
call while every CPU test passed). Compiling for sm_90 here says whether the compiler takes a kernel
and what it makes of it: wgmma or ``mma.sync``, TMA loads, atomics, a call to ``__assertfail``. CI
does it with the H200's Triton (3.6). :func:`assemble_for_sm90` runs that Triton's ptxas on a build (registers,
spills, the SASS; ``tools/id_check_sass.py`` and ``tools/table_audit.py`` read it) and :func:`loop_nesting` says
whether its loops were flattened.

The package picks interpreted or compiled kernels when it is imported, so a process that compiles
must say it has a GPU first, and must not set ``TRITON_INTERPRET``::

    import torch
    torch.cuda.is_available = lambda: True   # compiled, not interpreted, kernels; nothing is launched
    from moe_kernels.sm90_compile import compile_for_sm90
    from moe_kernels.kernels import one_launch

    kernel = compile_for_sm90(one_launch._one_launch_kernel,
                              {"TOP_K": 8, "SLICES": 24, "BLOCK_F": 32, "BLOCK_D": 256, "SCALES": 0,
                               "ID_CHECK": "", "STAGES": 1, "HAS_ADD": False, "ROUND": 2},
                              {"x_ptr": "*bf16", "w1_ptr": "*bf16", ...}, num_warps=4)
    "atom" in kernel.asm["ptx"]

Every argument not named as a constant or a pointer is a 32-bit integer (``scalar``); pointers
are taken as 16-byte aligned, as the launches specialise them, and so are the integers named in
``aligned``.
"""

from __future__ import annotations


def compile_for_sm90(fn, constants: dict, pointers: dict | None = None, *, scalar: str = "i32",
                     aligned: tuple = (), pointers_aligned: bool = True, **options):
    """``fn`` (a ``@kernel`` function) compiled for sm_90 with ``constants`` (name -> value of each
    ``tl.constexpr`` argument; one left out takes its default), ``pointers`` (name -> Triton type: ``"*bf16"``, a tensor
    descriptor's ``"tensordesc<fp8e4nv[128,128]>"``, or a scalar type such as ``"fp32"``) and the
    launch ``options`` (``num_warps``, ``num_stages``, ``debug``, ...): Triton's compiled kernel,
    whose ``asm`` holds ``"ptx"`` and ``"cubin"``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = pointers or {}
    names = fn.arg_names
    # A constexpr argument left out takes its default, as a launch that leaves it out does.
    defaults = {p.name: p.default for p in getattr(fn, "params", ()) if p.is_constexpr and p.has_default}
    constants = {**defaults, **constants}
    signature = {n: "constexpr" if n in constants else pointers.get(n, scalar) for n in names}
    values = {(i,): constants[n] for i, n in enumerate(names) if n in constants}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if (pointers_aligned and signature[n].startswith("*")) or n in aligned}
    return triton.compile(ASTSource(fn, signature, values, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def assemble_for_sm90(ptx: str) -> dict:
    """What ptxas (from the Triton that runs this) makes of ``ptx`` for sm_90a: ``{"registers", "spill_stores",
    "spill_loads"}`` (bytes), ``"log"`` (ptxas -v's report, warnings included) and ``"sass"`` (cuobjdump's listing).
    An error names the Triton whose ptxas refused the PTX (another release's bundled ptxas may not read it)."""
    import os
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        Path(source).write_text(ptx)
        done = subprocess.run([str(bin_dir / "ptxas"), "-v", "-arch=sm_90a", source, "-o", cubin],
                              capture_output=True, text=True)
        log = done.stdout + done.stderr
        if done.returncode:
            raise RuntimeError(f"ptxas of Triton {triton.__version__} failed: {log.strip()[-300:]}")
        sass = subprocess.run([str(bin_dir / "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(re.search(r"Used (\d+) registers", log).group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2)), "log": log, "sass": sass}


def loop_nesting(ttgir: str) -> int:
    """The deepest nesting of ``scf.for`` loops in a compiled kernel's TTGIR (printed two spaces per region
    level): 2 where a loop runs inside a loop, 1 where Triton flattened them.

        >>> loop_nesting("scf.for %i {\\n  scf.for %k {\\n  }\\n}"), loop_nesting("scf.for %t {\\n}")
        (2, 1)
    """
    depth, open_loops = 0, []
    for line in ttgir.split("\n"):
        indent = len(line) - len(line.lstrip())
        while open_loops and line.lstrip().startswith("}") and indent <= open_loops[-1]:
            open_loops.pop()
        if "scf.for" in line:
            open_loops.append(indent)
            depth = max(depth, len(open_loops))
    return depth
