"""A whole model's decode step against batch, per experts implementation (section 11's figure).

Reads the rows of ``python -m moe_kernels.bench model`` (``results/<device>/model-step*.json``):
one per (implementation, batch) with its step time (eager and CUDA graph), the step with the
experts skipped, and the byte model's time for the experts' weights.
"""

from __future__ import annotations


MODEL_STEP_STYLE = {"eager": ("tab:gray", ":"), "grouped_mm": ("tab:orange", "-"), "batched_mm": ("tab:green", "-"),
                    "moe_kernels": ("tab:blue", "-"), "no_experts": ("black", "--")}


def model_step_picture(ax_step, ax_token, rows: list[dict], mode: str = "graph"):
    """A whole model's decode step (``python -m moe_kernels.bench model``) against batch, one line
    per experts implementation: ``ax_step`` the step in ms (``mode``: "graph" replays or "eager"
    Python steps), with the byte model's time for the experts' weights and the step with the
    experts skipped (``no_experts``: the rest of the model); ``ax_token`` the same per token, in µs."""
    impls = [i for i in MODEL_STEP_STYLE if any(r["implementation"] == i for r in rows)]
    for impl in impls:
        mine = sorted((r for r in rows if r["implementation"] == impl and r.get(f"{mode}_ms") is not None),
                      key=lambda r: r["batch"])
        if not mine:
            continue
        color, style = MODEL_STEP_STYLE[impl]
        label = "rest of the step (experts skipped)" if impl == "no_experts" else impl
        batches = [r["batch"] for r in mine]
        ax_step.plot(batches, [r[f"{mode}_ms"] for r in mine], marker="o", ms=3, color=color, ls=style, label=label)
        ax_token.plot(batches, [r[f"{mode}_ms"] * 1e3 / r["batch"] for r in mine], marker="o", ms=3, color=color,
                      ls=style, label=label)
    predicted = sorted({(r["batch"], r["predicted_experts_ms"]) for r in rows if r.get("predicted_experts_ms")})
    if predicted:
        batches, ms = zip(*predicted)
        ax_step.plot(batches, ms, color="tab:red", lw=2, alpha=0.5, label="byte model: experts' weights")
        ax_token.plot(batches, [m * 1e3 / b for b, m in predicted], color="tab:red", lw=2, alpha=0.5,
                      label="byte model: experts' weights")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    batches = sorted({r["batch"] for r in rows})
    ticks = [batches[-1]]   # from the largest down, a tick only where its label has room (3x apart)
    for b in reversed(batches[:-1]):
        if ticks[-1] >= 3 * b:
            ticks.append(b)
    plain = FuncFormatter(lambda v, _: f"{v:,g}")
    for ax in (ax_step, ax_token):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(ticks))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.set_xlabel("sequences decoding")
    ax_step.set_ylabel(f"ms per step ({'CUDA graph' if mode == 'graph' else 'eager'})")
    ax_token.set_ylabel("µs per token")
    return ax_step, ax_token
