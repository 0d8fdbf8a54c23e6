"""The dashboard's one page: plain HTML, a little JS and inline SVG, no framework.

The script reads the token from its own link, polls ``/api/state`` every half second and
redraws the tables: one per world, a row per proc (red when it is not alive); the
failures in words; each metric as an SVG line over time. A click on a row fetches that
proc's stacks (``/api/stacks``) and the last lines of its log (``/api/log``) into the
panel below. Element ids and classes (``proc-row``, ``health-Alive``, ``#stacks``) are
what the browser test reads.
"""

from __future__ import annotations

__all__ = ["PAGE"]

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>palatine dashboard</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 1em 2em; color: #222; }
h1 { font-size: 18px; margin: 0 0 .3em; } h2 { font-size: 15px; margin: 1.2em 0 .3em; }
#job { color: #555; } #silent { color: #b00; font-weight: bold; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: left; }
th { background: #eee; } tr.proc-row { cursor: pointer; } tr.proc-row:hover { background: #f4f4ff; }
tr.selected { outline: 2px solid #66c; }
tr.proc-row:not(.health-Alive) { background: #f8d0d0; color: #900; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
#failures li { color: #900; } #failures li.none { color: #555; }
pre { background: #f6f6f6; padding: .5em; max-height: 28em; overflow: auto; font-size: 12px; }
.plot { display: inline-block; margin: 0 1em 1em 0; } .plot text { font-size: 10px; }
</style></head>
<body>
<h1>palatine dashboard</h1>
<div id="job"></div><div id="silent"></div>
<div id="worlds"></div>
<h2>Recent failures</h2><ul id="failures"><li class="none">none</li></ul>
<h2>Metrics</h2><div id="metrics">none published (palatine.metrics: gauge("loss").set(x) in a worker)</div>
<h2 id="detail-title">Click a proc for its stacks and log</h2>
<div id="detail"><h3>Stacks</h3><pre id="stacks"></pre><h3>Log</h3><pre id="log"></pre></div>
<script>
"use strict";
const token = new URLSearchParams(location.search).get("token") || "";
const q = (path, args) => path + "?" + new URLSearchParams({...args, token});
let selected = null;

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}
const mib = b => b == null ? "-" : (b / 1048576).toFixed(0) + " MiB";
const pct = p => p == null ? "-" : p.toFixed(0) + "%";
const sec = s => s == null ? "-" : s.toFixed(1) + " s";
const ms = s => s == null ? "-" : (s * 1000).toFixed(1) + " ms";

function worldTable(w) {
  const gpu = w.procs.some(p => p.gpu_util_percent != null);
  const cols = ["rank", "proc", "health", "host", "pid", "heartbeat", "loop lag", "cpu", "rss"]
    .concat(gpu ? ["gpu", "gpu mem"] : [], ["doing", "failed actors", "reason"]);
  const t = el("table", {"class": "world", "data-world": w.name},
    el("tr", {}, ...cols.map(c => el("th", {}, c))));
  for (const p of w.procs) {
    const cells = [[p.rank, 1], [p.proc], [p.health], [p.host], [p.pid ?? "-", 1],
      [sec(p.heartbeat_age_s), 1], [ms(p.loop_lag_s), 1], [pct(p.cpu_percent), 1],
      [mib(p.rss_bytes), 1]];
    if (gpu) cells.push([pct(p.gpu_util_percent), 1], [mib(p.gpu_mem_bytes), 1]);
    cells.push([p.activity || "-"], [p.failed_actors.join(", ") || "-"], [p.reason]);
    const tr = el("tr", {"class": "proc-row health-" + p.health, "data-proc": p.proc,
                         "data-health": p.health},
      ...cells.map(([v, n]) => el("td", n ? {"class": "num"} : {}, String(v))));
    if (p.proc === selected) tr.classList.add("selected");
    tr.addEventListener("click", () => showProc(p.proc));
    t.append(tr);
  }
  return el("div", {}, el("h2", {}, `world ${w.name}: ${w.status}, ${w.alive}/${w.procs.length} procs alive`), t);
}

function plot(name, points) {
  const W = 320, H = 120, P = 30;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const ts = points.map(p => p[0]), vs = points.map(p => p[1]);
  const t0 = Math.min(...ts), t1 = Math.max(...ts), v0 = Math.min(...vs), v1 = Math.max(...vs);
  const x = t => P + (t1 > t0 ? (t - t0) / (t1 - t0) : 0) * (W - P - 5);
  const y = v => H - 15 - (v1 > v0 ? (v - v0) / (v1 - v0) : 0.5) * (H - 25);
  const ns = "http://www.w3.org/2000/svg";
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.map(p => x(p[0]) + "," + y(p[1])).join(" "));
  line.setAttribute("fill", "none"); line.setAttribute("stroke", "#36c");
  line.setAttribute("stroke-width", "1.5");
  const axis = document.createElementNS(ns, "rect");
  for (const [k, v] of Object.entries({x: P, y: 5, width: W - P - 5, height: H - 20,
                                        fill: "none", stroke: "#ccc"})) axis.setAttribute(k, v);
  svg.append(axis, line);
  for (const [tx, ty, s] of [[2, 12, v1.toPrecision(3)], [2, H - 15, v0.toPrecision(3)],
                             [P, H - 2, ((t1 - t0)).toFixed(0) + " s shown"]]) {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", tx); t.setAttribute("y", ty); t.textContent = s; svg.append(t);
  }
  const last = vs[vs.length - 1];
  return el("div", {"class": "plot", "data-metric": name},
            el("div", {}, `${name}: ${last.toPrecision(4)}`), svg);
}

function render(s) {
  const j = s.job;
  document.getElementById("job").textContent =
    `job ${j.id || "-"} · system ${j.system_addr || "-"} · execution ${j.execution_id}` +
    (j.log_dir ? ` · logs ${j.log_dir}` : "");
  const worlds = document.getElementById("worlds");
  worlds.replaceChildren(...s.worlds.map(worldTable));
  const fails = document.getElementById("failures");
  fails.replaceChildren(...(s.failures.length ? s.failures.map(f =>
    el("li", {"data-proc": f.proc}, new Date(f.time * 1000).toLocaleTimeString() + " " + f.text))
    : [el("li", {"class": "none"}, "none")]));
  const names = Object.keys(s.metrics).sort();
  if (names.length)
    document.getElementById("metrics").replaceChildren(
      ...names.filter(n => s.metrics[n].length).map(n => plot(n, s.metrics[n])));
}

async function poll() {
  try {
    const r = await fetch(q("/api/state", {}));
    if (!r.ok) throw new Error(r.status + " " + await r.text());
    const s = await r.json();
    render(s);
    document.getElementById("silent").textContent = s.system_error;
  } catch (e) {
    document.getElementById("silent").textContent = "no answer from the dashboard: " + e;
  }
  setTimeout(poll, 500);
}

async function showProc(proc) {
  selected = proc;
  document.querySelectorAll("tr.proc-row").forEach(
    r => r.classList.toggle("selected", r.dataset.proc === proc));
  document.getElementById("detail-title").textContent = proc;
  const stacks = document.getElementById("stacks"), log = document.getElementById("log");
  stacks.textContent = "asking " + proc + " for its stacks..."; log.textContent = "";
  const [st, lg] = await Promise.all([
    fetch(q("/api/stacks", {proc})).then(r => r.json()),
    fetch(q("/api/log", {proc, lines: 200})).then(r => r.json())]);
  if (selected !== proc) return;
  stacks.textContent = st.error ? "no stacks: " + st.error : st.text;
  stacks.dataset.proc = proc;
  log.textContent = lg.error ? "no log: " + lg.error : (lg.path + "\\n\\n" + lg.text);
}
poll();
</script></body></html>
"""
