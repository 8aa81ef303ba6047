// The experts-touched / intensity explorer: sliders that redraw two plots with no Python kernel.
//
// The Python side (moe_kernels/book/widgets.py) emits a <div class="moe-explorer"> holding the
// controls, two empty <svg> elements and a JSON config; this script finds every such div that
// has not been initialised yet and wires it up. It must compute exactly what
// moe_kernels.model.costs computes: the browser test compares the two to 1e-9.
//
// Every plotted curve keeps its numbers in data-values (JSON [[B, y], ...]) so that a test, or a
// curious reader in the developer tools, can read what was drawn. Measured markers (config.points,
// live from the reader's GPU or recorded on an H200) are drawn where the sliders match the
// measured layer's E, k and bytes per weight, and the caption under the plots says where they
// were measured.
(function () {
  "use strict";

  // E_touched(B) = E (1 - (1 - k/E)^B), written as -E expm1(B log1p(-k/E)) like costs.py.
  function expertsTouched(B, E, k) {
    if (k >= E) return B > 0 ? E : 0;
    return -E * Math.expm1(B * Math.log1p(-k / E));
  }
  // FLOP per weight byte: 2 B k / (b_w E_touched(B)).
  function moeIntensity(B, E, k, bw) {
    return (2 * B * k) / (bw * expertsTouched(B, E, k));
  }
  function denseIntensity(B, bw) {
    return (2 * B) / bw;
  }
  // Smallest B with moeIntensity(B) >= ridge, by bisection (the function increases with B).
  function ridgeBatch(E, k, ridge, bw) {
    var lo = 1, hi = 1;
    if (moeIntensity(lo, E, k, bw) >= ridge) return 1;
    while (moeIntensity(hi, E, k, bw) < ridge) hi *= 2;
    for (var i = 0; i < 200; i++) {
      var mid = 0.5 * (lo + hi);
      if (moeIntensity(mid, E, k, bw) < ridge) lo = mid; else hi = mid;
    }
    return hi;
  }

  var P = window.moePlots;  // svgplot.js, inlined before this script

  // The measured sets that match the sliders: same E and k (and bytes per weight, when asked).
  function matching(points, E, k, bw) {
    if (!points || !points.sets) return [];
    return points.sets.filter(function (s) {
      return s.E === E && s.k === k && (bw === undefined || s.bw === bw);
    });
  }
  function column(set, key) {
    return set.points.filter(function (p) { return p[key] !== undefined; })
                     .map(function (p) { return [p.B, p[key]]; });
  }
  function describeSets(points) {
    var seen = {}, out = [];
    points.sets.forEach(function (s) {
      var key = s.E + "/" + s.k;
      if (!seen[key]) { seen[key] = 1; out.push("E = " + s.E + ", k = " + s.k + " (" + s.label.split(",")[0] + ")"); }
    });
    return out.join(" or ");
  }

  function setup(root) {
    var cfg = JSON.parse(root.querySelector("script.moe-explorer-config").textContent);
    var grid = cfg.batches;
    var inputs = {};
    ["E", "k", "bw", "gpu"].forEach(function (name) { inputs[name] = root.querySelector("[name=" + name + "]"); });

    function redraw() {
      var E = +inputs.E.value;
      inputs.k.max = String(Math.min(cfg.k_max, E));
      var k = Math.min(+inputs.k.value, E);
      var bw = +inputs.bw.value;
      var gpu = cfg.gpus[inputs.gpu.value];
      var peak = bw <= 1 ? gpu.fp8 : gpu.bf16;
      var ridge = peak / gpu.bandwidth;
      root.querySelector("output[for=E]").textContent = E;
      root.querySelector("output[for=k]").textContent = k;
      var xopts = { xmin: grid[0], xmax: grid[grid.length - 1], xlog: true,
                    xticks: P.decades(grid[0], grid[grid.length - 1]), xlabel: "batch B (tokens)" };

      var touched = grid.map(function (B) { return [B, expertsTouched(B, E, k)]; });
      var total = grid.map(function (B) { return [B, E]; });
      var routed = matching(cfg.points, E, k).slice(0, 1);  // one routing draw per (E, k) is enough
      P.drawPlot(root.querySelector("svg.touched"), [
        { name: "touched", values: touched, color: "#1f77b4", label: "E_touched(B), uniform routing" },
        { name: "all", values: total, color: "#999", dash: "4 3", width: 1, label: "all E = " + E },
      ], Object.assign({}, xopts, {
        ymin: 0, ymax: E * 1.05, yticks: [0, E / 4, E / 2, (3 * E) / 4, E], ylabel: "experts touched",
        points: routed.map(function (s) {
          return { name: "touched", values: column(s, "touched"), color: "#000", fill: true, r: 3,
                   label: (cfg.points.live ? "counted, live" : "counted, recorded") + " (fused_topk ids)" };
        }) }));

      var moe = grid.map(function (B) { return [B, moeIntensity(B, E, k, bw)]; });
      var dense = grid.map(function (B) { return [B, denseIntensity(B, bw)]; });
      var ridgeLine = grid.map(function (B) { return [B, ridge]; });
      var layers = matching(cfg.points, E, k, bw);
      var marks = [];
      layers.forEach(function (s) {
        marks.push({ name: "intensity", values: column(s, "intensity"), color: "#d62728", fill: false,
                     label: "counted FLOP/byte" });
        marks.push({ name: "achieved", values: column(s, "achieved"), color: "#000", fill: true, r: 3,
                     label: "achieved FLOP/s ÷ read bandwidth" });
      });
      var lowest = Math.min(moe[0][1], dense[0][1]);
      marks.forEach(function (m) { m.values.forEach(function (v) { lowest = Math.min(lowest, v[1]); }); });
      var ymax = Math.max(dense[dense.length - 1][1], ridge) * 1.5;
      var ymin = lowest / 1.5;
      var ticks = [];
      for (var p = Math.ceil(Math.log10(ymin)); p <= Math.log10(ymax); p++) ticks.push(Math.pow(10, p));
      P.drawPlot(root.querySelector("svg.intensity"), [
        { name: "moe", values: moe, color: "#d62728", label: "MoE layer" },
        { name: "dense", values: dense, color: "#2ca02c", label: "dense layer" },
        { name: "ridge", values: ridgeLine, color: "#555", dash: "4 3", width: 1, label: gpu.name + " ridge" },
      ], Object.assign({}, xopts, { ymin: ymin, ymax: ymax, ylog: true, yticks: ticks,
                                    ylabel: "FLOP per weight byte", points: marks }));

      var half = Math.log1p(-0.5) / Math.log1p(-k / E);
      var bstar = ridgeBatch(E, k, ridge, bw);
      var readout = root.querySelector(".readout");
      readout.setAttribute("data-half", String(k >= E ? 1 : half));
      readout.setAttribute("data-ridge-batch", String(bstar));
      readout.textContent = "Half of the experts are touched at B = " + (k >= E ? "1" : half.toFixed(1)) +
        "; the MoE layer reaches the " + gpu.name + " ridge (" + ridge.toFixed(0) + " FLOP/byte) at B = " +
        bstar.toFixed(0) + ", a dense layer at B = " + (ridge * bw / 2).toFixed(0) + ".";

      var prov = root.querySelector(".provenance");
      if (!prov) return;
      if (!cfg.points || !cfg.points.sets || !cfg.points.sets.length) { prov.textContent = ""; return; }
      var text = "Markers: " + cfg.points.source + ". ";
      if (layers.length) {
        var s = layers[0], best = null;
        s.points.forEach(function (q) { if (q.ratio !== undefined && (!best || q.ratio < best.ratio)) best = q; });
        text += "Shown: " + s.label + (best ? "; closest to its floor at B = " + best.B + ", " +
                best.ratio.toFixed(2) + "× the floor" : "") + ".";
      } else if (routed.length) {
        text += "Experts touched shown for " + routed[0].label.split(",")[0] +
                "; the intensity markers need bytes/weight 1 (fp8 block) or 2 (bf16).";
      } else {
        text += "They appear at " + describeSets(cfg.points) + ".";
      }
      prov.textContent = text;
    }
    Object.keys(inputs).forEach(function (name) {
      inputs[name].addEventListener("input", redraw);
      inputs[name].addEventListener("change", redraw);
    });
    redraw();
  }

  P.ready("div.moe-explorer", setup);
})();
