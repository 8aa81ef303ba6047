// The experts-touched / intensity explorer: sliders that redraw two plots with no Python kernel.
//
// The Python side (moe_kernels/widgets.py) emits a <div class="moe-explorer"> holding the
// controls, two empty <svg> elements and a JSON config; this script finds every such div that
// has not been initialised yet and wires it up. It must compute exactly what
// moe_kernels.costs computes: the browser test compares the two to 1e-9.
//
// Every plotted curve keeps its numbers in data-values (JSON [[B, y], ...]) so that a test, or a
// curious reader in the developer tools, can read what was drawn.
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

  var SVG_NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, parent) {
    var node = document.createElementNS(SVG_NS, name);
    for (var key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmt(x) {
    if (x >= 1e4 || (x > 0 && x < 1e-2)) return x.toExponential(2);
    return x >= 100 ? x.toFixed(0) : x.toPrecision(3);
  }

  // A small log-x plot: axes, ticks, and one polyline per series.
  function drawPlot(svg, series, opts) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var W = 420, H = 260, L = 56, R = 12, T = 12, Bm = 40;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    var x0 = Math.log10(opts.xmin), x1 = Math.log10(opts.xmax);
    var ylog = !!opts.ylog;
    var y0 = ylog ? Math.log10(opts.ymin) : opts.ymin, y1 = ylog ? Math.log10(opts.ymax) : opts.ymax;
    function px(x) { return L + ((Math.log10(x) - x0) / (x1 - x0)) * (W - L - R); }
    function py(y) {
      var v = ylog ? Math.log10(Math.max(y, opts.ymin)) : y;
      return H - Bm - ((v - y0) / (y1 - y0)) * (H - T - Bm);
    }
    el("rect", { x: L, y: T, width: W - L - R, height: H - T - Bm, fill: "none", stroke: "#999" }, svg);
    for (var p = Math.ceil(x0); p <= Math.floor(x1); p++) {
      var tx = px(Math.pow(10, p));
      el("line", { x1: tx, x2: tx, y1: T, y2: H - Bm, stroke: "#eee" }, svg);
      el("text", { x: tx, y: H - Bm + 14, "font-size": 10, "text-anchor": "middle" }, svg).textContent = fmt(Math.pow(10, p));
    }
    var yt = opts.yticks;
    for (var i = 0; i < yt.length; i++) {
      var ty = py(yt[i]);
      el("line", { x1: L, x2: W - R, y1: ty, y2: ty, stroke: "#eee" }, svg);
      el("text", { x: L - 4, y: ty + 3, "font-size": 10, "text-anchor": "end" }, svg).textContent = fmt(yt[i]);
    }
    el("text", { x: (L + W - R) / 2, y: H - 6, "font-size": 11, "text-anchor": "middle" }, svg).textContent = opts.xlabel;
    el("text", { x: 12, y: (T + H - Bm) / 2, "font-size": 11, "text-anchor": "middle",
                 transform: "rotate(-90 12 " + (T + H - Bm) / 2 + ")" }, svg).textContent = opts.ylabel;
    series.forEach(function (s) {
      var pts = s.values.map(function (v) { return px(v[0]).toFixed(2) + "," + py(v[1]).toFixed(2); });
      var line = el("polyline", { points: pts.join(" "), fill: "none", stroke: s.color,
                                  "stroke-width": s.width || 2, "stroke-dasharray": s.dash || "none" }, svg);
      line.setAttribute("class", "series series-" + s.name);
      line.setAttribute("data-values", JSON.stringify(s.values));
    });
    var ly = T + 14;
    series.forEach(function (s) {
      if (!s.label) return;
      el("line", { x1: L + 8, x2: L + 28, y1: ly - 4, y2: ly - 4, stroke: s.color, "stroke-width": 2,
                   "stroke-dasharray": s.dash || "none" }, svg);
      el("text", { x: L + 32, y: ly, "font-size": 10 }, svg).textContent = s.label;
      ly += 13;
    });
  }

  function setup(root) {
    if (root.getAttribute("data-ready") === "1") return;
    root.setAttribute("data-ready", "1");
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

      var touched = grid.map(function (B) { return [B, expertsTouched(B, E, k)]; });
      var total = grid.map(function (B) { return [B, E]; });
      drawPlot(root.querySelector("svg.touched"), [
        { name: "touched", values: touched, color: "#1f77b4", label: "E_touched(B)" },
        { name: "all", values: total, color: "#999", dash: "4 3", width: 1, label: "E = " + E },
      ], { xmin: grid[0], xmax: grid[grid.length - 1], ymin: 0, ymax: E * 1.05,
           yticks: [0, E / 4, E / 2, (3 * E) / 4, E], xlabel: "batch B (tokens)", ylabel: "experts touched" });

      var moe = grid.map(function (B) { return [B, moeIntensity(B, E, k, bw)]; });
      var dense = grid.map(function (B) { return [B, denseIntensity(B, bw)]; });
      var ridgeLine = grid.map(function (B) { return [B, ridge]; });
      var ymax = Math.max(dense[dense.length - 1][1], ridge) * 1.5;
      var ymin = Math.min(moe[0][1], dense[0][1]) / 1.5;
      var ticks = [];
      for (var p = Math.ceil(Math.log10(ymin)); p <= Math.log10(ymax); p++) ticks.push(Math.pow(10, p));
      drawPlot(root.querySelector("svg.intensity"), [
        { name: "moe", values: moe, color: "#d62728", label: "MoE layer" },
        { name: "dense", values: dense, color: "#2ca02c", label: "dense layer" },
        { name: "ridge", values: ridgeLine, color: "#555", dash: "4 3", width: 1, label: gpu.name + " ridge" },
      ], { xmin: grid[0], xmax: grid[grid.length - 1], ymin: ymin, ymax: ymax, ylog: true,
           yticks: ticks, xlabel: "batch B (tokens)", ylabel: "FLOP per weight byte" });

      var half = Math.log1p(-0.5) / Math.log1p(-k / E);
      var bstar = ridgeBatch(E, k, ridge, bw);
      var readout = root.querySelector(".readout");
      readout.setAttribute("data-half", String(k >= E ? 1 : half));
      readout.setAttribute("data-ridge-batch", String(bstar));
      readout.textContent = "Half of the experts are touched at B = " + (k >= E ? "1" : half.toFixed(1)) +
        "; the MoE layer reaches the " + gpu.name + " ridge (" + ridge.toFixed(0) + " FLOP/byte) at B = " +
        bstar.toFixed(0) + ", a dense layer at B = " + (ridge * bw / 2).toFixed(0) + ".";
    }
    Object.keys(inputs).forEach(function (name) {
      inputs[name].addEventListener("input", redraw);
      inputs[name].addEventListener("change", redraw);
    });
    redraw();
  }

  function setupAll() {
    var roots = document.querySelectorAll("div.moe-explorer");
    for (var i = 0; i < roots.length; i++) setup(roots[i]);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setupAll);
  else setupAll();
})();
