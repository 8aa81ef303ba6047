// Shared drawing code for the kernel-free explorers (explorer.js, skew_explorer.js).
//
// Defines window.moePlots once: a tiny SVG plotter (linear or log axes, one polyline per series, each
// series' numbers kept on its data-values attribute so tests can read what was drawn) and
// ready(selector, setup), which wires every explorer root on the page once the DOM exists.
(function () {
  "use strict";
  if (window.moePlots) return;

  var SVG_NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, parent) {
    var node = document.createElementNS(SVG_NS, name);
    for (var key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmt(x) {
    if (x === 0) return "0";
    if (x >= 1e4 || x < 1e-2) return x.toExponential(1);
    return x >= 100 ? x.toFixed(0) : String(Number(x.toPrecision(3)));
  }
  function decades(lo, hi) {
    var ticks = [];
    for (var p = Math.ceil(Math.log10(lo)); p <= Math.floor(Math.log10(hi)); p++) ticks.push(Math.pow(10, p));
    return ticks;
  }

  // A small plot: linear or log axes, one polyline per series, optional vertical marker.
  function drawPlot(svg, series, opts) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var W = 420, H = 260, L = 56, R = 12, T = 12, Bm = 40;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    function tx(v, log) { return log ? Math.log10(v) : v; }
    var x0 = tx(opts.xmin, opts.xlog), x1 = tx(opts.xmax, opts.xlog);
    var y0 = tx(opts.ymin, opts.ylog), y1 = tx(opts.ymax, opts.ylog);
    function px(x) { return L + ((tx(x, opts.xlog) - x0) / (x1 - x0)) * (W - L - R); }
    function py(y) {
      var v = tx(Math.min(Math.max(y, opts.ymin), opts.ymax), opts.ylog);
      return H - Bm - ((v - y0) / (y1 - y0)) * (H - T - Bm);
    }
    el("rect", { x: L, y: T, width: W - L - R, height: H - T - Bm, fill: "none", stroke: "#999" }, svg);
    opts.xticks.forEach(function (t) {
      el("line", { x1: px(t), x2: px(t), y1: T, y2: H - Bm, stroke: "#eee" }, svg);
      el("text", { x: px(t), y: H - Bm + 14, "font-size": 10, "text-anchor": "middle" }, svg).textContent = fmt(t);
    });
    opts.yticks.forEach(function (t) {
      el("line", { x1: L, x2: W - R, y1: py(t), y2: py(t), stroke: "#eee" }, svg);
      el("text", { x: L - 4, y: py(t) + 3, "font-size": 10, "text-anchor": "end" }, svg).textContent = fmt(t);
    });
    el("text", { x: (L + W - R) / 2, y: H - 6, "font-size": 11, "text-anchor": "middle" }, svg).textContent = opts.xlabel;
    el("text", { x: 12, y: (T + H - Bm) / 2, "font-size": 11, "text-anchor": "middle",
                 transform: "rotate(-90 12 " + (T + H - Bm) / 2 + ")" }, svg).textContent = opts.ylabel;
    if (opts.marker !== undefined) {
      el("line", { x1: px(opts.marker), x2: px(opts.marker), y1: T, y2: H - Bm, stroke: "#888",
                   "stroke-dasharray": "2 2" }, svg);
    }
    var ly = T + 14;
    series.forEach(function (s) {
      var pts = s.values.map(function (v) { return px(v[0]).toFixed(2) + "," + py(v[1]).toFixed(2); });
      var line = el("polyline", { points: pts.join(" "), fill: "none", stroke: s.color,
                                  "stroke-width": s.width || 2, "stroke-dasharray": s.dash || "none" }, svg);
      line.setAttribute("class", "series series-" + s.name);
      line.setAttribute("data-values", JSON.stringify(s.values));
      if (!s.label) return;
      var lx = opts.legendLeft ? L + 8 : W - R - 150;
      el("line", { x1: lx, x2: lx + 20, y1: ly - 4, y2: ly - 4, stroke: s.color, "stroke-width": 2,
                   "stroke-dasharray": s.dash || "none" }, svg);
      el("text", { x: lx + 24, y: ly, "font-size": 10 }, svg).textContent = s.label;
      ly += 13;
    });
  }

  // Run setup(root) once for every element matching selector, now or when the DOM is ready.
  // A root may appear several times (a page re-rendered in JupyterLab): data-ready guards it.
  function ready(selector, setup) {
    function all() {
      var roots = document.querySelectorAll(selector);
      for (var i = 0; i < roots.length; i++) {
        if (roots[i].getAttribute("data-ready") === "1") continue;
        roots[i].setAttribute("data-ready", "1");
        setup(roots[i]);
      }
    }
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
    else all();
  }

  window.moePlots = { el: el, fmt: fmt, decades: decades, drawPlot: drawPlot, ready: ready };
})();
