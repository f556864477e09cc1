// A minimal SVG line chart for the relay dashboard (app.js draws the loss and throughput with it).
//
// A classic script loaded before app.js (both deferred, so in order): no modules, no framework, no
// external requests. Labels are written with textContent only.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const BOX = { w: 600, h: 220, left: 56, right: 12, top: 12, bottom: 30 };

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

/** Draw ``series`` ([{cls, points: [[x, y], ...]}]) into ``target``, keeping its <title>; each of
 * ``opts.refs`` ([{value, label}]) is a labelled horizontal line, inside the y range. */
function lineChart(target, series, opts) {
  const title = target.querySelector("title");
  const all = series.flatMap((s) => s.points);
  const refs = opts.refs || [];
  target.replaceChildren(title);
  target.dataset.points = String(series[0].points.length);
  if (all.length === 0) {
    target.append(svg("text", { x: BOX.w / 2, y: BOX.h / 2, class: "empty", "text-anchor": "middle" }, opts.empty));
    return;
  }
  const xs = all.map((p) => p[0]), ys = [...all.map((p) => p[1]), ...refs.map((r) => r.value)];
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [opts.yFromZero ? 0 : Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const px = (x) => BOX.left + ((x - x0) / (x1 - x0)) * (BOX.w - BOX.left - BOX.right);
  const py = (y) => BOX.h - BOX.bottom - ((y - y0) / (y1 - y0)) * (BOX.h - BOX.top - BOX.bottom);

  for (const frac of [0, 0.5, 1]) {
    const y = y0 + frac * (y1 - y0);
    target.append(svg("line", { x1: BOX.left, x2: BOX.w - BOX.right, y1: py(y), y2: py(y), class: "grid" }));
    target.append(svg("text", { x: BOX.left - 6, y: py(y) + 4, "text-anchor": "end", class: "tick" }, opts.y(y)));
  }
  target.append(svg("text", { x: BOX.left, y: BOX.h - 8, class: "tick" }, opts.x(x0)));
  target.append(svg("text", { x: BOX.w - BOX.right, y: BOX.h - 8, "text-anchor": "end", class: "tick" }, opts.x(x1)));
  for (const r of refs) {
    target.append(svg("line", { x1: BOX.left, x2: BOX.w - BOX.right, y1: py(r.value), y2: py(r.value), class: "ref" }));
    const y = py(r.value) < BOX.top + 14 ? py(r.value) + 13 : py(r.value) - 4;  // below the line at the top edge
    target.append(svg("text", { x: BOX.w - BOX.right - 4, y, "text-anchor": "end", class: "ref-label" },
      `${r.label} = ${opts.y(r.value)}`));
  }
  for (const s of series) {
    if (!s.points.length) continue;
    const coords = s.points.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
    target.append(svg("polyline", { points: coords, class: `line ${s.cls}` }));
    const [lx, ly] = s.points[s.points.length - 1];
    target.append(svg("circle", { cx: px(lx), cy: py(ly), r: 3, class: `dot ${s.cls}` }));
  }
}
