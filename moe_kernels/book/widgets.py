"""Sliders that need no Python kernel: closed-form curves redrawn in the browser.

:func:`experts_touched_explorer` returns an HTML block (controls, two SVG plots, a JSON config and
the script in ``explorer.js``). The same block is live in three places: in JupyterLab (a trusted
output runs its script), on the static site (the page runs it on load), and offline (no CDN, no
library: about 300 lines of our own JavaScript). The script recomputes
:func:`moe_kernels.model.costs.experts_touched` and :func:`moe_kernels.model.costs.moe_intensity`; the browser
test moves the sliders and compares what is drawn with those functions.

Measured markers ride on the curves: :func:`recorded_points` reads them from the H200 records in
``results/``, and a notebook with a GPU builds the same structure from its own timings with
:func:`point_set` and :func:`points`. The explorer draws a set wherever the sliders match its
``E``, ``k`` (and bytes per weight) and says in its caption where the numbers came from.

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



#: Shown until the explorer's script runs (it hides it): JupyterLab does not run an untrusted
#: notebook's scripts, and a blank space would say nothing.
_JS_HINT = ('<p class="moe-js-hint" style="font-size:13px;color:#8a4b00">These plots draw themselves with '
            "JavaScript, which the page has not run yet. In JupyterLab, run this cell (or File &gt; Trust "
            "Notebook, then reopen it).</p>")

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


def _sig(x: float, digits: int = 5) -> float:
    """``x`` to ``digits`` significant digits (what a marker needs; keeps the page small)."""
    return float(f"{x:.{digits}g}")


def point_set(model, label: str, bytes_per_weight: float | None, rows, read_bandwidth: float | None = None) -> dict:
    """One measured layer as explorer markers.

    ``rows`` are dicts with ``batch`` and ``experts_touched`` (distinct experts of the ids actually
    drawn), and optionally ``flops``, ``time_s`` and ``floor_s`` (the shape of the rows that
    ``results/*/fused-moe-sweep.json`` and ``fp8-sweep.json`` hold). Each point keeps:

    * ``touched``: the experts touched;
    * ``intensity``: FLOPs over the weight bytes of those experts, ``2 B k / (b_w E_touched)``
      with the drawn count (so it lies on the closed-form curve up to sampling noise);
    * ``achieved``: the FLOP rate reached over the read bandwidth, ``flops / time_s /
      read_bandwidth``, in FLOP per byte: the roofline caps it at the lower of ``intensity`` and
      the ridge, and it falls below ``intensity`` by about the time over the floor;
    * ``ratio``: ``time_s / floor_s``.

        >>> from moe_kernels.model.shapes import MODELS
        >>> s = point_set(MODELS["qwen3-30b-a3b"], "bf16", 2.0, [{"batch": 1, "experts_touched": 8}])
        >>> s["E"], s["k"], s["points"][0]["intensity"]
        (128, 8, 1.0)
    """
    pts = []
    for r in sorted(rows, key=lambda r: r["batch"]):
        B, touched = int(r["batch"]), int(r["experts_touched"])
        p = {"B": B, "touched": touched}
        if bytes_per_weight:
            p["intensity"] = _sig(2.0 * B * model.top_k / (bytes_per_weight * touched))
        if r.get("time_s") and read_bandwidth and r.get("flops"):
            p["achieved"] = _sig(r["flops"] / r["time_s"] / read_bandwidth)
        if r.get("time_s") and r.get("floor_s"):
            p["ratio"] = _sig(r["time_s"] / r["floor_s"])
        pts.append(p)
    return {"label": f"{model.name}, {label}", "E": model.num_experts, "k": model.top_k,
            "bw": bytes_per_weight, "points": pts}


def points(source: str, sets: list[dict], *, live: bool, ceilings: dict | None = None) -> dict:
    """The markers the explorer draws: ``sets`` from :func:`point_set`, a ``source`` line that the
    explorer's caption shows, and optionally the ``ceilings`` they were measured against
    (``read_bandwidth``, ``gemm_rate_bf16``, ``gemm_rate_fp8``: FLOP/s and bytes/s), which become one
    more entry of the GPU menu, "measured"."""
    return {"source": source, "live": bool(live), "sets": sets, "ceilings": ceilings or {}}


# The recorded runs the explorer falls back on, and the rows of each it draws.
RECORDED_SETS = (
    ("fused-moe-sweep", "index-gather GEMMs graph", 2.0, "bf16"),
    ("fp8-sweep", "fp8 block GEMMs", 1.0, "fp8 block"),
)


def recorded_points(device: str = "nvidia-h200", models=("deepseek-v3", "qwen3-30b-a3b")) -> dict:
    """Explorer markers from the recorded GPU runs: the bf16 sweep (our index-gather GEMMs, replayed
    from a CUDA graph) and the fp8 sweep (the same layer with 128x128-block fp8 weights), each
    against the read bandwidth measured in its own run.

        >>> pts = recorded_points()
        >>> pts["live"], sorted({(s["E"], s["bw"]) for s in pts["sets"]})
        (False, [(128, 1.0), (128, 2.0), (256, 1.0), (256, 2.0)])
        >>> pts["source"].startswith("recorded on NVIDIA H200")
        True
    """
    from ..model.shapes import MODELS
    from ..results import load

    sets, parts, provs = [], [], []
    for name, layout, bw, label in RECORDED_SETS:
        rec = load(name, device)
        data, prov = rec["data"], rec["provenance"]
        provs.append(prov)
        parts.append(f"{label} at commit {str(prov['git_commit'])[:8]}")
        for key in models:
            rows = [r for r in data["rows"] if r["model"] == key and r["layout"] == layout and r.get("time_s")]
            sets.append(point_set(MODELS[key], label, bw, rows, data["ceilings"]["read_bandwidth"]))
    first = provs[0]
    source = (f"recorded on {first['device']} (torch {first['torch']}, triton {first['triton']}, "
              f"CUDA {first['cuda']}, {first['date_utc'][:10]}; {', '.join(parts)})")
    ceilings = load("ceilings", device)["data"]
    fp8 = load("fp8-sweep", device)["data"]["ceilings"]
    return points(source, sets, live=False, ceilings={
        "name": f"{first['device']}, measured", "read_bandwidth": ceilings["read_bandwidth"],
        "gemm_rate_bf16": ceilings["gemm_rate_bf16"],
        "gemm_rate_fp8": fp8.get("gemm_rate_fp8_block_scaled") or ceilings["gemm_rate_fp8"]})


def experts_touched_explorer(num_experts: int = 256, top_k: int = 8, bytes_per_weight: float = 1.0,
                             gpu: str = "H100 SXM", points: dict | None = None):
    """The experts-touched and intensity plots with sliders for E, k, bytes per weight and GPU.

    ``points`` (from :func:`recorded_points` or :func:`points`) adds measured markers and a
    caption line naming where they were measured; its ``ceilings`` add a "measured" GPU.
    """
    from IPython.display import HTML

    uid = f"moe-explorer-{next(_ids)}"  # deterministic per kernel session, so nbval can compare
    gpus = {name: {"name": name, "bandwidth": g.hbm_bandwidth, "bf16": g.dense_bf16_flops, "fp8": g.dense_fp8_flops}
            for name, g in GPUS.items()}
    measured = (points or {}).get("ceilings") or {}
    if measured.get("read_bandwidth"):
        gpus["measured"] = {"name": measured.get("name", "measured"), "bandwidth": measured["read_bandwidth"],
                            "bf16": measured["gemm_rate_bf16"], "fp8": measured["gemm_rate_fp8"]}
    config = {
        "batches": batch_grid(),
        "k_max": 32,
        "gpus": gpus,
        "points": points,
    }
    bw_options = {0.5: "0.5 (int4)", 1.0: "1 (fp8)", 2.0: "2 (bf16)"}
    bw_html = "".join(
        f'<option value="{v}"{" selected" if v == bytes_per_weight else ""}>{label}</option>'
        for v, label in bw_options.items()
    )
    gpu_html = "".join(
        f'<option value="{_html.escape(name)}"{" selected" if name == gpu else ""}>{_html.escape(g["name"])}</option>'
        for name, g in gpus.items()
    )
    body = f"""
<div class="moe-explorer" id="{uid}" style="font-family:sans-serif;font-size:13px;max-width:880px">
{_JS_HINT}
<script type="application/json" class="moe-explorer-config">{json.dumps(config)}</script>
<div style="display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin-bottom:6px">
<label>E <input type="range" style="height:32px;min-width:120px" name="E" min="8" max="512" step="8" value="{num_experts}"> <output for="E">{num_experts}</output></label>
<label>k <input type="range" style="height:32px;min-width:120px" name="k" min="1" max="32" step="1" value="{top_k}"> <output for="k">{top_k}</output></label>
<label>bytes/weight <select style="min-height:32px;font-size:14px" name="bw">{bw_html}</select></label>
<label>GPU <select style="min-height:32px;font-size:14px" name="gpu">{gpu_html}</select></label>
</div>
<div style="display:flex;flex-wrap:wrap;gap:8px">
<svg class="touched" width="420" height="300" role="img" aria-label="experts touched versus batch"></svg>
<svg class="intensity" width="420" height="300" role="img" aria-label="arithmetic intensity versus batch"></svg>
</div>
<p class="readout"></p>
<p class="provenance" style="font-size:12px;color:#444"></p>
<script>{_script()}</script>
</div>"""
    return HTML(body)


def _skew_script() -> str:
    return _read_js("svgplot.js") + _read_js("skew_explorer.js")


def padding_skew_explorer(model: str = "deepseek-v3", s: float = 1.0, batch: int = 4096, block: int = 128,
                          masked_round: str = "tile", points: dict | None = None):
    """Rows per expert and the two layouts' padding under Zipf-skewed routing, with sliders.

    Controls: the model (its E, k, d, F), the Zipf exponent ``s``, the batch (powers of two), the
    tile height ``b``, and what the masked ``m_max`` is rounded up to (``"tile"`` or ``"256"``).
    The script (``skew_explorer.js``) recomputes :func:`moe_kernels.model.skew.expected_rows_per_expert`,
    :func:`~moe_kernels.model.skew.expected_contiguous_rows`, :func:`~moe_kernels.model.skew.expected_masked_rows`,
    :func:`~moe_kernels.model.skew.expected_hottest_rows` and
    :func:`~moe_kernels.model.skew.expected_experts_touched`; the browser test compares them.

    ``points`` are measured routings drawn on the right-hand plot where model and batch match:
    ``{"source": str, "live": bool, "points": [{"model", "batch", "s", "block", "round",
    "contiguous", "masked", "index_gather_us", "masked_us"}, ...]}``, with ``contiguous`` and
    ``masked`` the padded and reserved rows over the real rows, ``block`` the tile height and
    ``round`` the ``m_max`` rounding they were taken with, and the two times those of the pair of
    GEMMs. By default they are the H200 record ``results/nvidia-h200/skew.json``; a notebook with
    a GPU passes its own (``"live": True``).

        >>> html = padding_skew_explorer(model="qwen3-30b-a3b", s=0.5, batch=512, block=32)
        >>> "moe-skew-explorer" in html.data and 'value="9"' in html.data   # 512 = 2**9
        True
        >>> '"live": false' in html.data and "results/nvidia-h200/skew.json" in html.data
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
    if points is None:
        from ..results import load

        record = load("skew")
        prov, rows = record["provenance"], record["data"]["rows"]
        round_to = int(record["data"]["config"]["masked_round"])
        sig = lambda x: float(f"{x:.5g}")  # noqa: E731 - five digits are plenty for a marker
        points = {
            "source": f"{prov['device']}, {prov['date_utc'][:10]}, commit {str(prov['git_commit'])[:8]}, "
                      "results/nvidia-h200/skew.json",
            "live": False,
            "points": [{"model": r["model"], "batch": r["batch"], "s": r["s"], "block": r["block_m"], "round": round_to,
                        "contiguous": sig(r["contiguous_rows"] / r["real_rows"]),
                        "masked": sig(r["masked_rows"] / r["real_rows"]),
                        "index_gather_us": sig(r["times_us"]["index-gather GEMMs"]),
                        "masked_us": sig(r["times_us"]["masked GEMMs"])} for r in rows],
        }
    uid = f"moe-skew-explorer-{next(_ids)}"
    config = {
        "models": {key: {"name": m.name, "E": m.num_experts, "k": m.top_k, "d": m.hidden_size,
                         "F": m.moe_intermediate_size} for key, m in MODELS.items()},
        "s_grid": [i / 10 for i in range(21)],
        "itemsize": 2,  # bf16 row buffers
        "points": points,
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
{_JS_HINT}
<script type="application/json" class="moe-skew-config">{json.dumps(config)}</script>
<div style="display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin-bottom:6px">
<label>model <select style="min-height:32px;font-size:14px" name="model">{model_html}</select></label>
<label>Zipf s <input type="range" style="height:32px;min-width:120px" name="s" min="0" max="2" step="0.05" value="{s}"> <output for="s">{s:.2f}</output></label>
<label>batch <input type="range" style="height:32px;min-width:120px" name="logB" min="0" max="14" step="1" value="{log_batch}"> <output for="logB">{batch}</output></label>
<label>tile b <select style="min-height:32px;font-size:14px" name="block">{block_html}</select></label>
<label>masked m_max rounded to <select style="min-height:32px;font-size:14px" name="round">{round_html}</select></label>
</div>
<div style="display:flex;flex-wrap:wrap;gap:8px">
<svg class="rows" width="420" height="300" role="img" aria-label="expected rows per expert by popularity rank"></svg>
<svg class="factors" width="420" height="300" role="img" aria-label="padded rows over real rows against the Zipf exponent, with measured points"></svg>
</div>
<p class="readout"></p>
<p class="measured" style="font-size:12px;color:#444"></p>
<script>{_skew_script()}</script>
</div>"""
    return HTML(body)
