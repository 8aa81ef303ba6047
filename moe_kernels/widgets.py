"""Sliders that need no Python kernel: closed-form curves redrawn in the browser.

:func:`experts_touched_explorer` returns an HTML block (controls, two SVG plots, a JSON config and
the script in ``explorer.js``). The same block is live in three places: in JupyterLab (a trusted
output runs its script), on the static site (the page runs it on load), and offline (no CDN, no
library: about 200 lines of our own JavaScript). The script recomputes
:func:`moe_kernels.costs.experts_touched` and :func:`moe_kernels.costs.moe_intensity`; the browser
test moves the sliders and compares what is drawn with those functions.

Example::

    >>> html = experts_touched_explorer(num_experts=128, top_k=8)
    >>> "moe-explorer" in html.data and 'value="128"' in html.data
    True
"""

from __future__ import annotations

import html as _html
import itertools
import json
from importlib import resources

from .shapes import GPUS

_ids = itertools.count()


def batch_grid(max_batch: int = 16384, points_per_octave: int = 8) -> list[int]:
    """Integer batches from 1 to ``max_batch``, evenly spaced on a log axis (duplicates removed)."""
    grid, i = [], 0
    while True:
        b = round(2 ** (i / points_per_octave))
        if b > max_batch:
            break
        if not grid or b != grid[-1]:
            grid.append(b)
        i += 1
    return grid


def _script() -> str:
    return resources.files("moe_kernels").joinpath("explorer.js").read_text()


def experts_touched_explorer(num_experts: int = 256, top_k: int = 8, bytes_per_weight: float = 1.0,
                             gpu: str = "H100 SXM"):
    """The experts-touched and intensity plots with sliders for E, k, bytes per weight and GPU."""
    from IPython.display import HTML

    uid = f"moe-explorer-{next(_ids)}"  # deterministic per kernel session, so nbval can compare
    config = {
        "batches": batch_grid(),
        "k_max": 32,
        "gpus": {
            name: {"name": name, "bandwidth": g.hbm_bandwidth, "bf16": g.dense_bf16_flops, "fp8": g.dense_fp8_flops}
            for name, g in GPUS.items()
        },
    }
    bw_options = {0.5: "0.5 (int4)", 1.0: "1 (fp8)", 2.0: "2 (bf16)"}
    bw_html = "".join(
        f'<option value="{v}"{" selected" if v == bytes_per_weight else ""}>{label}</option>'
        for v, label in bw_options.items()
    )
    gpu_html = "".join(
        f'<option value="{_html.escape(name)}"{" selected" if name == gpu else ""}>{_html.escape(name)}</option>'
        for name in GPUS
    )
    body = f"""
<div class="moe-explorer" id="{uid}" style="font-family:sans-serif;font-size:13px;max-width:880px">
<script type="application/json" class="moe-explorer-config">{json.dumps(config)}</script>
<div style="display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin-bottom:6px">
<label>E <input type="range" name="E" min="8" max="512" step="8" value="{num_experts}"> <output for="E">{num_experts}</output></label>
<label>k <input type="range" name="k" min="1" max="32" step="1" value="{top_k}"> <output for="k">{top_k}</output></label>
<label>bytes/weight <select name="bw">{bw_html}</select></label>
<label>GPU <select name="gpu">{gpu_html}</select></label>
</div>
<div style="display:flex;flex-wrap:wrap;gap:8px">
<svg class="touched" width="420" height="260" role="img" aria-label="experts touched versus batch"></svg>
<svg class="intensity" width="420" height="260" role="img" aria-label="arithmetic intensity versus batch"></svg>
</div>
<p class="readout"></p>
<script>{_script()}</script>
</div>"""
    return HTML(body)
