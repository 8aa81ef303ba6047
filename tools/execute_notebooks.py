"""Re-execute notebooks in place so their committed outputs are fresh (what nbval then checks).

Usage: python tools/execute_notebooks.py notebooks/*.ipynb
Runs each notebook top to bottom on this machine (the CPU, in CI's configuration) with its folder
as the working directory, and writes the outputs back.
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

for name in sys.argv[1:]:
    path = Path(name)
    nb = nbformat.read(path, as_version=4)
    start = time.time()
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    print(f"{path}: executed in {time.time() - start:.1f} s")
