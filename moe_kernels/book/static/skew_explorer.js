// The padding-under-skew explorer: sliders that redraw two plots with no Python kernel.
//
// The Python side (padding_skew_explorer in moe_kernels/book/widgets.py) emits a
// <div class="moe-skew-explorer"> holding the controls, two empty <svg> elements and a JSON
// config; this script wires up every such div not yet initialised. Its arithmetic repeats
// moe_kernels/model/skew.py step for step (same windows, same recurrences, same order of
// operations) so that the browser test can compare the two to 1e-9.
//
// Measured points (config.points: recorded on an H200, or measured live by a notebook with a GPU)
// are drawn on the right plot wherever the model and batch match: filled when they were taken with
// the tile height and rounding the controls show, hollow otherwise. A line under the plots says
// where they come from and what the GEMMs took at the recorded exponent nearest the slider.
//
// Every plotted series keeps its numbers in data-values (JSON [[x, y], ...]) and the readout
// keeps the current point's numbers in data-* attributes.
(function () {
  "use strict";

  // ---- the closed forms (moe_kernels/skew.py) --------------------------------------------------

  // Expert e's share, proportional to (e + 1)^-s; expert 0 is the most popular.
  function zipfPopularity(E, s) {
    var weights = [], total = 0;
    for (var e = 0; e < E; e++) { weights.push(Math.pow(e + 1, -s)); total += weights[e]; }
    return weights.map(function (w) { return w / total; });
  }

  // min(1, c p_e) summing to k, capping the most popular first (p must be in descending order).
  function inclusionProbabilities(p, k) {
    var E = p.length, result = p.map(function () { return 1; });
    for (var capped = 0; capped < k; capped++) {
      var rest = 0;
      for (var j = capped; j < E; j++) rest += p[j];
      var scale = (k - capped) / rest;
      if (scale * p[capped] <= 1) {
        for (var i = capped; i < E; i++) result[i] = scale * p[i];
        break;
      }
    }
    return result;
  }

  // {lo, probs}: Binomial(n, q) in the window mode +- (10 sd + 10), built from the mode outwards.
  function binomialWindow(n, q) {
    if (q <= 0) return { lo: 0, probs: [1] };
    if (q >= 1) return { lo: n, probs: [1] };
    var mode = Math.min(n, Math.floor((n + 1) * q));
    var half = Math.ceil(10 * Math.sqrt(n * q * (1 - q))) + 10;
    var lo = Math.max(0, mode - half), hi = Math.min(n, mode + half);
    var odds = q / (1 - q);
    var left = [], right = [], w = 1, m;
    for (m = mode - 1; m >= lo; m--) { w *= (m + 1) / (n - m) / odds; left.push(w); }
    w = 1;
    for (m = mode + 1; m <= hi; m++) { w *= (n - m + 1) / m * odds; right.push(w); }
    var weights = left.reverse().concat([1], right);
    var total = 0;
    for (var i = 0; i < weights.length; i++) total += weights[i];
    return { lo: lo, probs: weights.map(function (x) { return x / total; }) };
  }

  function expertsTouched(B, pi) {
    var total = 0;
    pi.forEach(function (q) { total += q >= 1 ? 1 : -Math.expm1(B * Math.log1p(-q)); });
    return total;
  }

  // sum_e E[ceil(m_e / b) b], m_e ~ Binomial(B, pi_e): exact.
  function contiguousRows(windows, block) {
    var total = 0;
    windows.forEach(function (win) {
      var mean = 0;
      for (var i = 0; i < win.probs.length; i++) mean += win.probs[i] * Math.floor((win.lo + i + block - 1) / block);
      total += block * mean;
    });
    return total;
  }

  // E[ceil(M / r) r], M = max_e m_e, counts treated as independent, M >= ceil(B k / E).
  function hottestRows(windows, B, k, roundTo) {
    var E = windows.length, start = Math.ceil((B * k) / E), end = 0;
    var cdfs = windows.map(function (win) {
      start = Math.max(start, win.lo);
      end = Math.max(end, win.lo + win.probs.length - 1);
      var acc = 0;
      return win.probs.map(function (x) { acc += x; return acc; });
    });
    var firstJ = Math.ceil(start / roundTo), tail = 0;
    for (var point = firstJ * roundTo; point < end; point += roundTo) {
      var below = 1;
      for (var e = 0; e < E; e++) {
        var index = point - windows[e].lo, n = windows[e].probs.length;
        below *= index < 0 ? 0 : index >= n - 1 ? 1 : cdfs[e][index];
      }
      tail += 1 - below;
    }
    return roundTo * (firstJ + tail);
  }

  // Everything the plots and the readout need at one (model, s, B, b, rounding).
  function evaluate(model, s, B, block, roundTo) {
    var pi = inclusionProbabilities(zipfPopularity(model.E, s), model.k);
    var windows = pi.map(function (q) { return binomialWindow(B, q); });
    var real = B * model.k;
    var hottest = hottestRows(windows, B, model.k, 1);
    var mMax = hottestRows(windows, B, model.k, roundTo);
    var contiguous = contiguousRows(windows, block);
    return { pi: pi, real: real, hottest: hottest, mMax: mMax, contiguous: contiguous,
             masked: model.E * mMax, touched: expertsTouched(B, pi) };
  }

  // ---- drawing (svgplot.js) ----------------------------------------------------------------------

  var P = window.moePlots, drawPlot = P.drawPlot, decades = P.decades;
  function bytes(x) {
    return x >= 1e9 ? (x / 1e9).toFixed(2) + " GB" : (x / 1e6).toFixed(1) + " MB";
  }

  // The measured points of this model and batch, in order of s.
  function pointsAt(cfg, key, B) {
    var all = (cfg.points && cfg.points.points) || [];
    return all.filter(function (p) { return p.model === key && p.batch === B; })
              .sort(function (a, b) { return a.s - b.s; });
  }

  function describePoints(cfg, model, key, B, s, block, roundTo) {
    var pts = pointsAt(cfg, key, B);
    var where = cfg.points && cfg.points.live ? "measured on this GPU" : "recorded on an H200";
    if (!cfg.points || !cfg.points.points || !cfg.points.points.length) return "";
    if (!pts.length) {
      var batches = [];
      cfg.points.points.forEach(function (p) {
        if (p.model === key && batches.indexOf(p.batch) < 0) batches.push(p.batch);
      });
      batches.sort(function (a, b) { return a - b; });
      if (!batches.length) {
        var measured = [];
        cfg.points.points.forEach(function (p) {
          var name = (cfg.models[p.model] || {}).name || p.model;
          if (measured.indexOf(name) < 0) measured.push(name);
        });
        return "No dots for " + model.name + ": the run " + where + " measured " + measured.join(" and ") + " only.";
      }
      return "Dots " + where + " exist for " + model.name + " at B = " + batches.join(" and ") +
        "; move the batch slider there to see them.";
    }
    var near = pts[0];
    pts.forEach(function (p) { if (Math.abs(p.s - s) < Math.abs(near.s - s)) near = p; });
    var same = near.block === block && near.round === roundTo;
    var text = "Dots: " + where + " (" + cfg.points.source + "), one routing drawn per exponent, " +
      "tiles of " + near.block + " rows, m_max rounded to " + near.round + " rows" +
      (same ? "." : " (hollow: set b = " + near.block + " and the rounding to " + near.round +
       " rows to compare like for like).");
    if (near.masked_us && near.index_gather_us) {
      text += " At s = " + near.s.toFixed(1) + " the two masked GEMMs took " + near.masked_us.toFixed(0) +
        " us and the two index-gather GEMMs " + near.index_gather_us.toFixed(0) + " us (" +
        (near.masked_us / near.index_gather_us).toFixed(2) + "x), while masked reserved " +
        near.masked.toFixed(2) + "x the real rows and contiguous ran " + near.contiguous.toFixed(2) + "x.";
    }
    return text;
  }

  function setup(root) {
    var cfg = JSON.parse(root.querySelector("script.moe-skew-config").textContent);
    var inputs = {};
    ["model", "s", "logB", "block", "round"].forEach(function (name) {
      inputs[name] = root.querySelector("[name=" + name + "]");
    });

    function redraw() {
      var key = inputs.model.value, model = cfg.models[key];
      var s = +inputs.s.value, B = Math.pow(2, +inputs.logB.value), block = +inputs.block.value;
      var roundTo = inputs.round.value === "tile" ? block : +inputs.round.value;
      root.querySelector("output[for=s]").textContent = s.toFixed(2);
      root.querySelector("output[for=logB]").textContent = B;

      var here = evaluate(model, s, B, block, roundTo);
      var rows = here.pi.map(function (q, e) { return [e + 1, B * q]; });
      var flat = function (y) { return [[1, y], [model.E, y]]; };
      var ymax = Math.max(B, block) * 2, ymin = Math.min(rows[model.E - 1][1], 0.5) / 2;
      drawPlot(root.querySelector("svg.rows"), [
        { name: "rows", values: rows, color: "#1f77b4", label: "rows of expert (mean)" },
        { name: "mean", values: flat(here.real / model.E), color: "#2ca02c", dash: "4 3", width: 1, label: "mean Bk/E" },
        { name: "hottest", values: flat(here.hottest), color: "#d62728", dash: "4 3", width: 1, label: "hottest (expected)" },
        { name: "tile", values: flat(block), color: "#555", dash: "1 2", width: 1, label: "tile height b" },
      ], { xmin: 1, xmax: model.E, xlog: true, ymin: ymin, ymax: ymax, ylog: true,
           xticks: decades(1, model.E), yticks: decades(ymin, ymax),
           xlabel: "expert popularity rank", ylabel: "rows per expert" });

      var contiguous = [], maskedRows = [];
      cfg.s_grid.forEach(function (sg) {
        var point = sg === s ? here : evaluate(model, sg, B, block, roundTo);
        contiguous.push([sg, point.contiguous / point.real]);
        maskedRows.push([sg, point.masked / point.real]);
      });
      var top = Math.max.apply(null, maskedRows.map(function (v) { return v[1]; }));
      var pts = pointsAt(cfg, key, B), marks = [];
      if (pts.length) {
        var same = pts.every(function (p) { return p.block === block && p.round === roundTo; });
        var tag = cfg.points.live ? "this GPU" : "H200";
        marks = [
          { name: "measured-contiguous", values: pts.map(function (p) { return [p.s, p.contiguous]; }),
            color: "#1f77b4", fill: same, label: "contiguous, " + tag },
          { name: "measured-masked", values: pts.map(function (p) { return [p.s, p.masked]; }),
            color: "#d62728", fill: same, label: "masked, " + tag },
        ];
        pts.forEach(function (p) { top = Math.max(top, p.masked); });
      }
      drawPlot(root.querySelector("svg.factors"), [
        { name: "contiguous", values: contiguous, color: "#1f77b4", label: "contiguous: tiles" },
        { name: "masked", values: maskedRows, color: "#d62728", label: "masked: E x m_max" },
      ], { xmin: 0, xmax: cfg.s_grid[cfg.s_grid.length - 1], xlog: false, ymin: 1, ymax: top * 1.5, ylog: true,
           marker: s, xticks: [0, 0.5, 1, 1.5, 2], yticks: [1, 2, 5, 10, 20, 50, 100, 200, 500].filter(function (t) { return t <= top * 1.5; }),
           xlabel: "Zipf exponent s", ylabel: "rows / real rows", points: marks });

      var rowBytes = (model.d + model.F) * cfg.itemsize;
      var readout = root.querySelector(".readout");
      readout.setAttribute("data-hottest", String(here.hottest));
      readout.setAttribute("data-touched", String(here.touched));
      readout.setAttribute("data-contiguous", String(here.contiguous));
      readout.setAttribute("data-masked", String(here.masked));
      readout.setAttribute("data-masked-bytes", String(here.masked * rowBytes));
      readout.setAttribute("data-index-gather-bytes", String(here.real * rowBytes));
      readout.setAttribute("data-points", String(pts.length));
      readout.textContent = model.name + ", B = " + B + ", s = " + s.toFixed(2) + ": the top expert is picked by " +
        (100 * here.pi[0]).toFixed(1) + "% of tokens (uniform: " + (100 * model.k / model.E).toFixed(1) +
        "%); " + here.touched.toFixed(1) + " experts touched; the hottest has " + here.hottest.toFixed(1) +
        " rows against a mean of " + (here.real / model.E).toFixed(1) + ". Contiguous runs " +
        (here.contiguous / here.real).toFixed(3) + "x the real rows; masked reserves " +
        (here.masked / here.real).toFixed(3) + "x (m_max = " + here.mMax.toFixed(1) +
        " on average). Row buffers in bf16: index-gather " + bytes(here.real * rowBytes) + ", masked " +
        bytes(here.masked * rowBytes) + ".";
      root.querySelector(".measured").textContent = describePoints(cfg, model, key, B, s, block, roundTo);
    }
    Object.keys(inputs).forEach(function (name) {
      inputs[name].addEventListener("input", redraw);
      inputs[name].addEventListener("change", redraw);
    });
    redraw();
  }

  P.ready("div.moe-skew-explorer", setup);
})();
