"""Sliders that need no Python kernel: closed-form curves redrawn in the browser.

:func:`experts_touched_explorer` returns an HTML block (controls, two SVG plots, a JSON config and
the script in ``explorer.js``). The same block is live in three places: in JupyterLab (a trusted
output runs its script), on the static site (the page runs it on load), and offline (no CDN, no
library: about 200 lines of our own JavaScript). The script recomputes
:func:`moe_kernels.model.costs.experts_touched` and :func:`moe_kernels.model.costs.moe_intensity`; the browser
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

from ..model.shapes import GPUS

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


def _read_js(name: str) -> str:
    return resources.files("moe_kernels.book").joinpath("static", name).read_text()


def _script() -> str:
    # The shared plotter first: it defines window.moePlots once, which the explorer uses.
    return _read_js("svgplot.js") + _read_js("explorer.js")


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


def _skew_script() -> str:
    return _read_js("svgplot.js") + _read_js("skew_explorer.js")


def padding_skew_explorer(model: str = "deepseek-v3", s: float = 1.0, batch: int = 4096, block: int = 128,
                          masked_round: str = "tile"):
    """Rows per expert and the two layouts' padding under Zipf-skewed routing, with sliders.

    Controls: the model (its E, k, d, F), the Zipf exponent ``s``, the batch (powers of two), the
    tile height ``b``, and what the masked ``m_max`` is rounded up to (``"tile"`` or ``"256"``).
    The script (``skew_explorer.js``) recomputes :func:`moe_kernels.model.skew.expected_rows_per_expert`,
    :func:`~moe_kernels.model.skew.expected_contiguous_rows`, :func:`~moe_kernels.model.skew.expected_masked_rows`,
    :func:`~moe_kernels.model.skew.expected_hottest_rows` and
    :func:`~moe_kernels.model.skew.expected_experts_touched`; the browser test compares them.

        >>> html = padding_skew_explorer(model="qwen3-30b-a3b", s=0.5, batch=512, block=32)
        >>> "moe-skew-explorer" in html.data and 'value="9"' in html.data   # 512 = 2**9
        True
    """
    from IPython.display import HTML

    from ..model.shapes import MODELS

    if model not in MODELS:
        raise ValueError(f"padding_skew_explorer: argument 'model' must be one of {sorted(MODELS)}, got {model!r}")
    if batch < 1 or batch & (batch - 1) or batch > 2**14:
        raise ValueError(f"padding_skew_explorer: argument 'batch' must be a power of two in [1, 16384], got {batch}")
    blocks = (16, 32, 64, 128, 256)
    if block not in blocks:
        raise ValueError(f"padding_skew_explorer: argument 'block' must be one of {blocks}, got {block}")
    if masked_round not in ("tile", "256"):
        raise ValueError(f"padding_skew_explorer: argument 'masked_round' must be 'tile' or '256', got {masked_round!r}")
    if not 0 <= s <= 2:
        raise ValueError(f"padding_skew_explorer: argument 's' must be in [0, 2], got {s}")
    uid = f"moe-skew-explorer-{next(_ids)}"
    config = {
        "models": {key: {"name": m.name, "E": m.num_experts, "k": m.top_k, "d": m.hidden_size,
                         "F": m.moe_intermediate_size} for key, m in MODELS.items()},
        "s_grid": [i / 10 for i in range(21)],
        "itemsize": 2,  # bf16 row buffers
    }

    def options(values, chosen):
        return "".join(f'<option value="{_html.escape(str(v))}"{" selected" if v == chosen else ""}>'
                       f"{_html.escape(str(label))}</option>" for v, label in values)

    model_html = options([(key, f"{m.name} (E={m.num_experts}, k={m.top_k})") for key, m in MODELS.items()], model)
    block_html = options([(b, b) for b in blocks], block)
    round_html = options([("tile", "the tile height b"), ("256", "256 rows (SGLang's cap)")], masked_round)
    log_batch = batch.bit_length() - 1
    body = f"""
<div class="moe-skew-explorer" id="{uid}" style="font-family:sans-serif;font-size:13px;max-width:880px">
<script type="application/json" class="moe-skew-config">{json.dumps(config)}</script>
<div style="display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin-bottom:6px">
<label>model <select name="model">{model_html}</select></label>
<label>Zipf s <input type="range" name="s" min="0" max="2" step="0.05" value="{s}"> <output for="s">{s:.2f}</output></label>
<label>batch <input type="range" name="logB" min="0" max="14" step="1" value="{log_batch}"> <output for="logB">{batch}</output></label>
<label>tile b <select name="block">{block_html}</select></label>
<label>masked m_max rounded to <select name="round">{round_html}</select></label>
</div>
<div style="display:flex;flex-wrap:wrap;gap:8px">
<svg class="rows" width="420" height="260" role="img" aria-label="expected rows per expert by popularity rank"></svg>
<svg class="factors" width="420" height="260" role="img" aria-label="padded rows over real rows against the Zipf exponent"></svg>
</div>
<p class="readout"></p>
<script>{_skew_script()}</script>
</div>"""
    return HTML(body)
