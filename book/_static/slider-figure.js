// Interactive figures written by tutorial_pkg.plotting.slider_figure: curves over x and a
// slider that steps through precomputed frames. Plain SVG, no library, nothing fetched.
(function () {
  "use strict";
  const SVG = "http://www.w3.org/2000/svg";
  const W = 640, H = 340, M = { left: 64, right: 16, top: 30, bottom: 48 };
  const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function ticks(lo, hi, n) {
    // about n round numbers between lo and hi
    const span = hi - lo || 1;
    const step0 = Math.pow(10, Math.floor(Math.log10(span / n)));
    const step = [1, 2, 5, 10].map((m) => m * step0).find((s) => span / s <= n) || step0 * 10;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-12 * span; t += step) {
      out.push(Math.abs(t) < 1e-12 * span ? 0 : t);
    }
    return out;
  }

  function fmt(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(0);
    return String(Number(v.toPrecision(4)));
  }

  function draw(box) {
    const spec = JSON.parse(box.dataset.figure);
    box.textContent = "";
    const xs = spec.x;
    let ylo = Infinity, yhi = -Infinity;
    for (const f of spec.frames) for (const y of f.ys) for (const v of y) {
      if (v < ylo) ylo = v;
      if (v > yhi) yhi = v;
    }
    if (ylo === yhi) { ylo -= 1; yhi += 1; }
    const pad = 0.04 * (yhi - ylo);
    ylo -= pad; yhi += pad;
    const tx = spec.logx ? Math.log10 : (v) => v;
    const xlo = tx(Math.min(...xs)), xhi = tx(Math.max(...xs));
    const px = (v) => M.left + (tx(v) - xlo) / (xhi - xlo || 1) * (W - M.left - M.right);
    const py = (v) => H - M.bottom - (v - ylo) / (yhi - ylo) * (H - M.top - M.bottom);

    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "pe-slider-svg",
                            "aria-label": spec.title || "interactive figure" }, box);
    el("rect", { x: M.left, y: M.top, width: W - M.left - M.right,
                 height: H - M.top - M.bottom, fill: "none", stroke: "#888" }, svg);
    const xt = spec.logx
      ? ticks(xlo, xhi, 6).filter((t) => Number.isInteger(t)).map((t) => Math.pow(10, t))
      : ticks(xlo, xhi, 6);
    for (const t of xt) {
      el("line", { x1: px(t), x2: px(t), y1: H - M.bottom, y2: H - M.bottom + 4,
                   stroke: "#888" }, svg);
      el("text", { x: px(t), y: H - M.bottom + 16, "text-anchor": "middle",
                   "font-size": 11 }, svg).textContent = fmt(t);
    }
    for (const t of ticks(ylo, yhi, 5)) {
      el("line", { x1: M.left - 4, x2: M.left, y1: py(t), y2: py(t), stroke: "#888" }, svg);
      el("text", { x: M.left - 6, y: py(t) + 4, "text-anchor": "end",
                   "font-size": 11 }, svg).textContent = fmt(t);
    }
    el("text", { x: (M.left + W - M.right) / 2, y: H - 10, "text-anchor": "middle",
                 "font-size": 12 }, svg).textContent = spec.xlabel;
    el("text", { x: 14, y: (M.top + H - M.bottom) / 2, "text-anchor": "middle",
                 "font-size": 12, transform: `rotate(-90 14 ${(M.top + H - M.bottom) / 2})` },
       svg).textContent = spec.ylabel;
    el("text", { x: (M.left + W - M.right) / 2, y: 18, "text-anchor": "middle",
                 "font-size": 13 }, svg).textContent = spec.title;
    const legend = document.createElement("div");
    legend.className = "pe-slider-legend";
    const lines = spec.labels.map((label, i) => {
      const colour = COLOURS[i % COLOURS.length];
      const item = document.createElement("span");
      const swatch = document.createElement("span");
      swatch.className = "pe-swatch";
      swatch.style.background = colour;
      item.append(swatch, label);
      legend.appendChild(item);
      return el("polyline", { fill: "none", stroke: colour, "stroke-width": 1.6,
                              class: "pe-curve" }, svg);
    });
    box.appendChild(legend);

    const controls = document.createElement("label");
    controls.className = "pe-slider-controls";
    const input = document.createElement("input");
    Object.assign(input, { type: "range", min: 0, max: spec.frames.length - 1, step: 1,
                           value: 0 });
    input.setAttribute("aria-label", spec.slider);
    const shown = document.createElement("output");
    controls.append(`${spec.slider}: `, input, " ", shown);
    box.appendChild(controls);

    function show(i) {
      const frame = spec.frames[i];
      frame.ys.forEach((y, j) => {
        lines[j].setAttribute("points", y.map((v, k) => `${px(xs[k]).toFixed(1)},${py(v).toFixed(1)}`).join(" "));
      });
      shown.textContent = frame.value;
    }
    input.addEventListener("input", () => show(Number(input.value)));
    show(0);
  }

  function init() {
    document.querySelectorAll(".pe-slider-figure").forEach((box) => {
      try { draw(box); } catch (err) { box.textContent = `figure failed: ${err}`; }
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
