// Shared drawing code for the kernel-free explorers (explorer.js, skew_explorer.js).
//
// Defines window.moePlots once: a tiny SVG plotter (linear or log axes, one polyline per series,
// optional point markers, each series' numbers kept on its data-values attribute so tests can read
// what was drawn) and ready(selector, setup), which wires every explorer root on the page once the
// DOM exists. The legend sits below the axes, so it never covers a curve; the SVG grows to fit it.
(function () {
  "use strict";
  if (window.moePlots) return;

  var SVG_NS = "http://www.w3.org/2000/svg";
  var FONT = { tick: 12, label: 13, legend: 12 };  // in viewBox units: 420 wide, so >= 10 px on a phone
  function el(name, attrs, parent) {
    var node = document.createElementNS(SVG_NS, name);
    for (var key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmt(x) {
    if (x === 0) return "0";
    if (x >= 1000 && x < 1e7 && x % 1 === 0) return String(x).replace(/\B(?=(\d{3})+$)/g, ",");
    if (x >= 1e4 || x < 1e-2) return x.toExponential(1);
    return x >= 100 ? x.toFixed(0) : String(Number(x.toPrecision(3)));
  }
  function decades(lo, hi) {
    var ticks = [];
    for (var p = Math.ceil(Math.log10(lo)); p <= Math.floor(Math.log10(hi)); p++) ticks.push(Math.pow(10, p));
    return ticks;
  }

  // Legend items laid out left to right, wrapping at the plot's width. Returns the rows used.
  function legend(svg, items, x0, y0, width) {
    var x = x0, y = y0, rows = items.length ? 1 : 0, step = FONT.legend + 5;
    items.forEach(function (it) {
      var w = 30 + 0.56 * FONT.legend * it.label.length + 14;
      if (x > x0 && x + w > x0 + width) { x = x0; y += step; rows += 1; }
      if (it.kind === "point") {
        el("circle", { cx: x + 10, cy: y - 4, r: it.r || 3.5, fill: it.fill ? it.color : "white",
                       stroke: it.color, "stroke-width": 1.5 }, svg);
      } else {
        el("line", { x1: x, x2: x + 22, y1: y - 4, y2: y - 4, stroke: it.color, "stroke-width": 2,
                     "stroke-dasharray": it.dash || "none" }, svg);
      }
      el("text", { x: x + 28, y: y, "font-size": FONT.legend }, svg).textContent = it.label;
      x += w;
    });
    return rows;
  }

  // A small plot: linear or log axes, one polyline per series, optional vertical marker, optional
  // point markers (opts.points: [{name, values: [[x, y], ...], color, fill, label}]).
  function drawPlot(svg, series, opts) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var W = 420, H = 262, L = 64, R = 12, T = 10, Bm = 46;
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
      el("text", { x: px(t), y: H - Bm + FONT.tick + 3, "font-size": FONT.tick, "text-anchor": "middle" }, svg)
        .textContent = fmt(t);
    });
    opts.yticks.forEach(function (t) {
      el("line", { x1: L, x2: W - R, y1: py(t), y2: py(t), stroke: "#eee" }, svg);
      el("text", { x: L - 4, y: py(t) + 4, "font-size": FONT.tick, "text-anchor": "end" }, svg).textContent = fmt(t);
    });
    el("text", { x: (L + W - R) / 2, y: H - 8, "font-size": FONT.label, "text-anchor": "middle" }, svg)
      .textContent = opts.xlabel;
    el("text", { x: 14, y: (T + H - Bm) / 2, "font-size": FONT.label, "text-anchor": "middle",
                 transform: "rotate(-90 14 " + (T + H - Bm) / 2 + ")" }, svg).textContent = opts.ylabel;
    if (opts.marker !== undefined) {
      el("line", { x1: px(opts.marker), x2: px(opts.marker), y1: T, y2: H - Bm, stroke: "#888",
                   "stroke-dasharray": "2 2" }, svg);
    }
    var items = [];
    series.forEach(function (s) {
      var pts = s.values.map(function (v) { return px(v[0]).toFixed(2) + "," + py(v[1]).toFixed(2); });
      var line = el("polyline", { points: pts.join(" "), fill: "none", stroke: s.color,
                                  "stroke-width": s.width || 2, "stroke-dasharray": s.dash || "none" }, svg);
      line.setAttribute("class", "series series-" + s.name);
      line.setAttribute("data-values", JSON.stringify(s.values));
      if (s.label) items.push({ kind: "line", color: s.color, dash: s.dash, label: s.label });
    });
    (opts.points || []).forEach(function (s) {
      var g = el("g", { "class": "points points-" + s.name, "data-values": JSON.stringify(s.values) }, svg);
      s.values.forEach(function (v) {
        if (v[0] < opts.xmin || v[0] > opts.xmax) return;
        el("circle", { cx: px(v[0]).toFixed(2), cy: py(v[1]).toFixed(2), r: s.r || 3.5,
                       fill: s.fill ? s.color : "white", stroke: s.color, "stroke-width": 1.5 }, g);
      });
      if (s.label) items.push({ kind: "point", color: s.color, fill: s.fill, r: s.r, label: s.label });
    });
    var rows = legend(svg, items, 8, H + 6, W - 16);
    var total = H + rows * (FONT.legend + 5) + 4;
    svg.setAttribute("viewBox", "0 0 " + W + " " + total);
    svg.setAttribute("height", String(total));
  }

  // Run setup(root) once for every element matching selector, now or when the DOM is ready.
  // A root may appear several times (a page re-rendered in JupyterLab): data-ready guards it.
  function ready(selector, setup) {
    function all() {
      var roots = document.querySelectorAll(selector);
      for (var i = 0; i < roots.length; i++) {
        if (roots[i].getAttribute("data-ready") === "1") continue;
        roots[i].setAttribute("data-ready", "1");
        // The script runs: the hint for readers whose page has not run it (JupyterLab) goes.
        var hint = roots[i].querySelector(".moe-js-hint");
        if (hint) hint.style.display = "none";
        setup(roots[i]);
      }
    }
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
    else all();
  }

  window.moePlots = { el: el, fmt: fmt, decades: decades, drawPlot: drawPlot, ready: ready };
})();
