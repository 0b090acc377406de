"""The trainer's dashboard page (`GET /`), embedded as a string so the package needs no data files.

Self-contained on purpose: the trainer pods usually have no route to a CDN, so styles, charts
(inline SVG drawn by a few lines of JS) and polling of `status` all live in this one page. If the
page is behind the job's token, its polls carry the session cookie the login form set
(trainer/report/status_api.py); the page itself never sees the token.

While the trainer waits out an outage (the report's `degraded`), an amber banner under the header
says Degraded, why (RedisUnavailable, EngineUnavailable), since when and the trainer's own words:
the charts alone would only show training standing still, which looks the same as a slow step.
While no group is accepted for training and the trainer says why (the report's `stalled`), a
second banner says Stalled, the cause (RewardFailures, TooStale, ...), for how long, the count and
the last error.

Held-out evaluations (the report's `evaluations`, spec.evaluation) get their own chart against
policy version, not step: an evaluation is of a version, and lands a few steps after it was
published. Training reward is measured on sampled answers to training prompts; pass@1 on held-out
prompts is the figure that says whether the model got better, so it is not folded into the reward
chart. Until the first evaluation the card says so instead of drawing an empty frame.

A job that trains on a mixture (spec.datasets) gets a "per source" row: each source's reward per
step (the history's `reward_by_source`) and the groups trained from it so far against its share of
the weights, which is how one task regressing while another improves shows. A job with one
dataset has no such row.
"""

from __future__ import annotations

import json
from functools import cache

from asyncrl.api.figures import figures
from asyncrl.api.status_report import RecoveryReport, StepMetrics

DASHBOARD_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>asyncrl trainer</title>
<style>
  :root {
    --bg: #f4f6f9; --card: #ffffff; --ink: #111827; --muted: #6b7280; --line: #e5e7eb;
    --reward: #2563eb; --stale: #ea580c; --stalemax: #b91c1c; --limit: #9ca3af; --ok: #15803d;
    --eval: #059669; --evalreward: #7c3aed; --evalk: #0891b2;
  }
  * { box-sizing: border-box; }
  body { margin: 0; background: var(--bg); color: var(--ink);
         font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
  header { display: flex; align-items: center; gap: 14px; padding: 12px 22px; background: #111827; color: #f9fafb; }
  header h1 { font-size: 17px; margin: 0; font-weight: 600; letter-spacing: .2px; }
  header .job { color: #d1d5db; font-size: 15px; }
  header .spacer { flex: 1; }
  header .conn { font-size: 12px; color: #d1d5db; display: flex; align-items: center; gap: 6px; }
  .dot { width: 9px; height: 9px; border-radius: 50%; background: #9ca3af; display: inline-block; }
  .dot.ok { background: #22c55e; } .dot.bad { background: #ef4444; }
  .badge { padding: 3px 10px; border-radius: 999px; font-weight: 600; font-size: 13px; color: #fff; background: #6b7280; }
  .badge.Training { background: #2563eb; } .badge.Publishing { background: #7c3aed; }
  .badge.Waiting { background: #d97706; } .badge.Succeeded { background: #15803d; }
  .badge.Evaluating { background: #059669; }
  .badge.Failed { background: #dc2626; } .badge.Stopped, .badge.Starting { background: #6b7280; }
  main { padding: 16px 22px 24px; max-width: 1400px; margin: 0 auto; }
  .progress { height: 6px; background: var(--line); border-radius: 3px; overflow: hidden; margin: 0 0 14px; }
  .progress > div { height: 100%; background: var(--reward); width: 0; transition: width .4s; }
  #message { margin: -6px 0 12px; color: var(--muted); }
  #message.failed { color: #991b1b; font-weight: 600; }
  #message:empty { display: none; }
  .degraded { display: flex; gap: 10px; align-items: baseline; margin: 0 0 12px; padding: 10px 14px;
              background: #fef3c7; border: 1px solid #f59e0b; border-left: 6px solid #d97706; border-radius: 10px; color: #78350f; }
  .degraded[hidden], .charts[hidden] { display: none; }
  .degraded strong { font-size: 15px; white-space: nowrap; }
  .degraded .why { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; white-space: nowrap; }
  .degraded .what { flex: 1; word-break: break-word; }
  .kpis { display: grid; grid-template-columns: repeat(6, minmax(0, 1fr)); gap: 12px; margin-bottom: 14px; }
  .card { background: var(--card); border: 1px solid var(--line); border-radius: 10px; padding: 12px 14px; }
  .kpi .label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .6px; }
  .kpi .value { font-size: 30px; font-weight: 700; line-height: 1.15; margin-top: 2px;
                font-variant-numeric: tabular-nums; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
  .kpi .value small { font-size: 16px; color: var(--muted); font-weight: 500; }
  .kpi .sub { color: var(--muted); font-size: 12px; margin-top: 2px; min-height: 2.8em; }
  .charts { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; margin-bottom: 14px; }
  .card h2 { font-size: 14px; margin: 0 0 4px; font-weight: 600; }
  .legend { color: var(--muted); font-size: 12px; display: flex; gap: 14px; flex-wrap: wrap; }
  .legend i { display: inline-block; width: 14px; height: 3px; vertical-align: middle; margin-right: 5px; border-radius: 2px; }
  .chart { width: 100%; height: 230px; display: block; }
  .chart text { font-size: 11px; fill: var(--muted); font-family: inherit; }
  .chart .grid { stroke: var(--line); stroke-width: 1; }
  .chart .empty { font-size: 13px; }
  .bottom { display: grid; grid-template-columns: 1fr 1fr 1.3fr; gap: 12px; }
  .evals { display: grid; grid-template-columns: 2fr 1fr; gap: 12px; margin-bottom: 14px; }
  .evals [hidden] { display: none; }
  .evals .none { color: var(--muted); padding: 28px 0; text-align: center; }
  .newest { font-weight: 600; color: var(--eval); font-variant-numeric: tabular-nums; margin-left: 8px; }
  table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
  td, th { padding: 5px 6px; border-bottom: 1px solid var(--line); text-align: left; font-size: 13px; }
  th { color: var(--muted); font-weight: 500; font-size: 12px; }
  td.num { text-align: right; }
  .kv td:first-child { color: var(--muted); }
  .kv td:last-child { text-align: right; font-weight: 600; white-space: nowrap; }
  .figures td:first-child { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; cursor: help; }
  .scroll { max-height: 320px; overflow-y: auto; }
  .ready { color: var(--ok); font-weight: 600; } .notready { color: #dc2626; font-weight: 600; }
  .url { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; word-break: break-all; }
  @media (max-width: 1100px) { .kpis { grid-template-columns: repeat(3, 1fr); } .charts, .bottom, .evals { grid-template-columns: 1fr; } }
</style>
</head>
<body>
<header>
  <h1>asyncrl trainer</h1>
  <span class="job" id="job"></span>
  <span class="badge" id="phase" data-testid="phase">…</span>
  <span class="spacer"></span>
  <span class="conn"><span class="dot" id="conn-dot"></span><span id="conn-text">connecting…</span></span>
</header>
<main>
  <div class="progress" title="step / max steps"><div id="progress"></div></div>
  <div id="message"></div>
  <div class="degraded" id="degraded" data-testid="degraded" role="alert" hidden>
    <strong>Degraded</strong><span class="why" id="degraded-reason"></span><span class="what" id="degraded-text"></span>
  </div>
  <div class="degraded" id="stalled" data-testid="stalled" role="alert" hidden>
    <strong>Stalled</strong><span class="why" id="stalled-reason"></span><span class="what" id="stalled-text"></span>
  </div>
  <section class="kpis">
    <div class="card kpi"><div class="label">Step</div><div class="value" id="k-step">–</div><div class="sub" id="k-step-sub">&nbsp;</div></div>
    <div class="card kpi"><div class="label">Policy version</div><div class="value" id="k-version">–</div><div class="sub" id="k-version-sub">&nbsp;</div></div>
    <div class="card kpi"><div class="label">Reward (last step)</div><div class="value" id="k-reward" style="color:var(--reward)">–</div><div class="sub" id="k-reward-sub">&nbsp;</div></div>
    <div class="card kpi"><div class="label">Staleness mean / max</div><div class="value" id="k-stale" style="color:var(--stale)">–</div><div class="sub" id="k-stale-sub">&nbsp;</div></div>
    <div class="card kpi"><div class="label">Tokens / s</div><div class="value" id="k-tps">–</div><div class="sub" id="k-tps-sub">&nbsp;</div></div>
    <div class="card kpi"><div class="label">Step time</div><div class="value" id="k-steptime">–</div><div class="sub" id="k-steptime-sub">&nbsp;</div></div>
  </section>
  <section class="charts">
    <div class="card">
      <h2>Reward per step</h2>
      <div class="legend"><span><i style="background:var(--reward)"></i>batch mean</span><span><i style="background:#93c5fd"></i>moving average (5)</span></div>
      <svg class="chart" id="reward-chart" data-testid="reward-chart" role="img" aria-label="reward over steps"></svg>
    </div>
    <div class="card">
      <h2>Staleness per step (policy versions behind)</h2>
      <div class="legend"><span><i style="background:var(--stale)"></i>mean</span><span><i style="background:var(--stalemax)"></i>max</span><span><i style="background:var(--limit)"></i>limit η</span></div>
      <svg class="chart" id="staleness-chart" data-testid="staleness-chart" role="img" aria-label="staleness over steps"></svg>
    </div>
  </section>
  <section class="charts" id="sources" data-testid="sources" hidden>
    <div class="card">
      <h2>Reward per source</h2>
      <div class="legend" id="source-legend"></div>
      <svg class="chart" id="source-chart" data-testid="source-chart" role="img" aria-label="reward per mixture source over steps"></svg>
    </div>
    <div class="card">
      <h2>Groups trained per source</h2>
      <table><thead><tr><th>source</th><th>groups</th><th>share</th><th>reward (last step)</th></tr></thead>
      <tbody id="source-table" data-testid="source-table"></tbody></table>
    </div>
  </section>
  <section class="evals">
    <div class="card">
      <h2>Held-out evaluation per policy version<span class="newest" id="eval-newest" data-testid="eval-newest"></span></h2>
      <div id="eval-body" hidden>
      <div class="legend"><span><i style="background:var(--eval)"></i>pass@1</span><span id="eval-legend-k" hidden><i style="background:var(--evalk)"></i><span id="eval-legend-k-text">pass@k</span></span><span><i style="background:var(--evalreward)"></i>reward mean</span></div>
      <svg class="chart" id="eval-chart" data-testid="eval-chart" role="img" aria-label="held-out pass@1 and reward per policy version"></svg>
      </div>
      <div class="none" id="eval-none" data-testid="eval-none">no evaluation yet (held-out evaluation runs when the job sets spec.evaluation)</div>
    </div>
    <div class="card">
      <h2>Newest evaluation</h2>
      <table class="kv"><tbody id="eval-latest" data-testid="eval-latest"></tbody></table>
    </div>
  </section>
  <section class="bottom">
    <div class="card">
      <h2>Tokens trained by staleness</h2>
      <svg class="chart" id="staleness-histogram" data-testid="staleness-histogram" role="img" aria-label="tokens per version lag"></svg>
    </div>
    <div class="card">
      <h2>Training</h2>
      <table class="kv"><tbody id="details"></tbody></table>
    </div>
    <div class="card">
      <h2>Last step</h2>
      <div class="scroll"><table class="kv figures"><tbody id="last-step" data-testid="last-step"></tbody></table></div>
    </div>
    <div class="card">
      <h2>Recovery</h2>
      <table class="kv"><tbody id="recovery" data-testid="recovery"></tbody></table>
    </div>
    <div class="card">
      <h2>Rollout engines</h2>
      <table><thead><tr><th>engine</th><th>weights</th><th>lag</th><th>state</th></tr></thead>
      <tbody id="engines"></tbody></table>
    </div>
  </section>
</main>
<script>
"use strict";
const params = new URLSearchParams(location.search);
const REFRESH_MS = Math.max(500, 1000 * (parseFloat(params.get("refresh")) || 2));
const SVGNS = "http://www.w3.org/2000/svg";
// The figures of the step's record and of the recovery totals (name, description) in declaration
// order, filled in by the server from the report's models.
const FIGURES = /*FIGURES*/{};
let lastReport = null, lastOk = 0;

const $ = (id) => document.getElementById(id);
const fmt = (v, d = 2) => (v === null || v === undefined || !isFinite(v)) ? "–" : Number(v).toFixed(d);
const big = (v) => {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(2) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  return a >= 100 ? Math.round(v).toLocaleString("en-US") : Number(v).toFixed(a >= 10 ? 1 : 2);
};
const secs = (v) => (!isFinite(v)) ? "–" : v >= 120 ? (v / 60).toFixed(1) + " min" : v >= 10 ? v.toFixed(1) + " s" : v.toFixed(2) + " s";
function setText(id, text) { $(id).textContent = text; }
function setHTML(id, value, unit) { const el = $(id); el.textContent = value; if (unit) { const s = document.createElement("small"); s.textContent = unit; el.appendChild(s); } }

function el(name, attrs, parent) {
  const n = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, v);
  if (parent) parent.appendChild(n);
  return n;
}

function niceTicks(lo, hi, count) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-6; t += step) ticks.push(+t.toFixed(10));
  return ticks;
}

// series: [{points:[[x,y],...], color, width, dash, cls, step}], hlines: [{y, color, dash, label}]
function lineChart(svg, series, opts) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.clientWidth || 600, H = svg.clientHeight || 230;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const m = { l: 46, r: 14, t: 12, b: 28 };
  const pts = series.flatMap((s) => s.points);
  if (pts.length === 0) {
    el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg).textContent = opts.empty || "waiting for the first step…";
    return;
  }
  const xs = pts.map((p) => p[0]);
  let ys = pts.map((p) => p[1]).concat((opts.hlines || []).map((h) => h.y));
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  let y0 = opts.yMin !== undefined ? Math.min(opts.yMin, ...ys) : Math.min(...ys);
  let y1 = Math.max(...ys);
  if (opts.yMaxAtLeast !== undefined) y1 = Math.max(y1, opts.yMaxAtLeast);
  if (y1 === y0) { y1 = y0 + 1; }
  const pad = (y1 - y0) * 0.08; if (opts.yMin === undefined) y0 -= pad; y1 += pad;
  const yt = niceTicks(y0, y1, 4); y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
  const X = (x) => m.l + (x - x0) / (x1 - x0) * (W - m.l - m.r);
  const Y = (y) => H - m.b - (y - y0) / (y1 - y0) * (H - m.t - m.b);
  for (const t of yt) {
    el("line", { x1: m.l, x2: W - m.r, y1: Y(t), y2: Y(t), class: "grid" }, svg);
    el("text", { x: m.l - 6, y: Y(t) + 4, "text-anchor": "end" }, svg).textContent = opts.yInt ? String(Math.round(t)) : +t.toFixed(3);
  }
  const xt = niceTicks(x0, x1, 6).filter((t) => Number.isInteger(t));
  for (const t of xt) el("text", { x: X(t), y: H - m.b + 16, "text-anchor": "middle" }, svg).textContent = t;
  el("text", { x: W - m.r, y: H - 2, "text-anchor": "end" }, svg).textContent = opts.xLabel || "step";
  for (const h of opts.hlines || []) {
    el("line", { x1: m.l, x2: W - m.r, y1: Y(h.y), y2: Y(h.y), stroke: h.color, "stroke-width": 1.5, "stroke-dasharray": h.dash || "" }, svg);
    if (h.label) el("text", { x: W - m.r - 2, y: Y(h.y) - 4, "text-anchor": "end" }, svg).textContent = h.label;
  }
  for (const s of series) {
    if (!s.points.length) continue;
    let d = "";
    s.points.forEach(([x, y], i) => {
      if (s.step && i > 0) d += `H${X(x).toFixed(1)}V${Y(y).toFixed(1)}`;
      else d += `${i ? "L" : "M"}${X(x).toFixed(1)},${Y(y).toFixed(1)}`;
    });
    if (s.area) {
      const a = `${d}L${X(s.points[s.points.length - 1][0]).toFixed(1)},${Y(Math.max(y0, 0)).toFixed(1)}L${X(s.points[0][0]).toFixed(1)},${Y(Math.max(y0, 0)).toFixed(1)}Z`;
      el("path", { d: a, fill: s.color, opacity: 0.12, class: "area" }, svg);
    }
    el("path", { d, fill: "none", stroke: s.color, "stroke-width": s.width || 2, "stroke-dasharray": s.dash || "",
                 "stroke-linejoin": "round", "stroke-linecap": "round", class: "series " + (s.cls || "") }, svg);
    if (s.dots && s.points.length <= 80) for (const [x, y] of s.points) el("circle", { cx: X(x), cy: Y(y), r: s.r || 2.6, fill: s.color, class: "dot " + (s.cls || "") }, svg);
  }
}

function barChart(svg, hist, limit) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.clientWidth || 400, H = svg.clientHeight || 230;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const entries = Object.entries(hist || {}).map(([k, v]) => [parseInt(k, 10), v]).filter(([k]) => isFinite(k));
  if (!entries.length) { el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg).textContent = "no tokens trained yet"; return; }
  const top = Math.max(limit || 0, ...entries.map((e) => e[0]));
  const counts = new Map(entries); const total = entries.reduce((a, e) => a + e[1], 0);
  const m = { l: 12, r: 12, t: 18, b: 30 }, n = top + 1, bw = (W - m.l - m.r) / n;
  const maxC = Math.max(...entries.map((e) => e[1]), 1);
  for (let lag = 0; lag <= top; lag++) {
    const c = counts.get(lag) || 0, h = (H - m.t - m.b) * c / maxC, x = m.l + lag * bw + bw * 0.12;
    el("rect", { x, y: H - m.b - h, width: bw * 0.76, height: Math.max(h, c ? 1 : 0), rx: 3,
                 fill: limit !== undefined && lag > limit ? "var(--stalemax)" : "var(--stale)", class: "bar" }, svg);
    el("text", { x: x + bw * 0.38, y: H - m.b + 14, "text-anchor": "middle" }, svg).textContent = lag;
    if (c) el("text", { x: x + bw * 0.38, y: H - m.b - h - 4, "text-anchor": "middle" }, svg).textContent = (100 * c / total).toFixed(0) + "%";
  }
  el("text", { x: W - m.r, y: H - 2, "text-anchor": "end" }, svg).textContent = "versions behind";
}

function render(r) {
  lastReport = r;
  setText("job", r.job || "");
  const ph = $("phase"); ph.textContent = r.phase; ph.className = "badge " + r.phase;
  setText("message", r.message || (r.phase === "Failed" ? "trainer failed" : ""));
  $("message").className = r.phase === "Failed" ? "failed" : "";
  renderDegraded(r.degraded);
  renderStalled(r.stalled);
  $("progress").style.width = r.max_steps > 0 ? Math.min(100, 100 * r.step / r.max_steps) + "%" : "0";
  setHTML("k-step", String(r.step), r.max_steps > 0 ? ` / ${r.max_steps}` : "");
  setText("k-step-sub", r.max_steps > 0 ? `${(100 * r.step / r.max_steps).toFixed(0)}% done` : "no step limit");
  setHTML("k-version", "v" + r.policy_version);
  const engines = r.rollout || [], versions = engines.map((e) => e.weight_version).filter((v) => v !== null);
  setText("k-version-sub", versions.length ? `engines serve v${Math.min(...versions)}–v${Math.max(...versions)}` : "no engine reports");
  const ls = r.last_step || null;
  setHTML("k-reward", ls ? fmt(ls.reward_mean, 3) : "–");
  const rh = r.reward_history || [];
  const firstQ = rh.slice(0, Math.max(1, Math.floor(rh.length / 4)));
  const avg = (a) => a.reduce((x, y) => x + y, 0) / a.length;
  setText("k-reward-sub", rh.length >= 4 ? `first ¼ ${fmt(avg(firstQ), 3)} · last 5 ${fmt(avg(rh.slice(-5)), 3)}` : " ");
  const st = r.staleness || {};
  setHTML("k-stale", ls ? fmt(ls.staleness_mean, 2) : "–", ` / ${ls ? ls.staleness_max : "–"}`);
  setText("k-stale-sub", `limit η = ${st.limit} · dropped ${st.dropped} groups`);
  setHTML("k-tps", ls ? big(ls.tokens_per_second) : "–");
  setText("k-tps-sub", `${big(r.tokens_trained)} tokens · ${big(r.groups_trained)} groups`);
  setHTML("k-steptime", ls ? secs(ls.step_seconds) : "–");
  setText("k-steptime-sub", ls ? `proximal ${secs(ls.proximal_seconds)} · weight sync ${secs(ls.weight_sync_seconds)}` : " ");

  const hist = r.history || [];
  let rewardPts = hist.map((h) => [h.step, h.reward_mean]);
  if (!rewardPts.length && rh.length) rewardPts = rh.map((v, i) => [i + 1, v]);
  const ma = rewardPts.map((p, i) => { const w = rewardPts.slice(Math.max(0, i - 4), i + 1); return [p[0], avg(w.map((q) => q[1]))]; });
  lineChart($("reward-chart"), [
    { points: ma, color: "#93c5fd", width: 4, cls: "ma" },
    { points: rewardPts, color: "var(--reward)", width: 2, dots: true, cls: "reward" },
  ], {});
  lineChart($("staleness-chart"), [
    { points: hist.map((h) => [h.step, h.staleness_mean]), color: "var(--stale)", width: 2, area: true, dots: true, cls: "staleness-mean" },
    { points: hist.map((h) => [h.step, h.staleness_max]), color: "var(--stalemax)", width: 1.5, step: true, cls: "staleness-max" },
  ], { yMin: 0, yInt: true, yMaxAtLeast: (st.limit || 0) + 0.5, hlines: st.limit !== undefined ? [{ y: st.limit, color: "var(--limit)", dash: "6 4", label: `η = ${st.limit}` }] : [] });
  barChart($("staleness-histogram"), st.histogram, st.limit);

  const rows = [
    ["groups trained", big(r.groups_trained)], ["tokens trained", big(r.tokens_trained)],
    ["replay buffer", ls && ls.replay ? `${ls.replay.trajectories} / ${ls.replay.capacity} trajectories, ` +
      `${fmt(ls.replay.bytes / 1048576, 1)} MiB, ${ls.replay.replayed_groups} groups replayed` : "off"],
    ["stale groups dropped", String(st.dropped ?? 0)],
    ["zero-signal groups skipped / starved steps", `${r.zero_signal_groups ?? 0} / ${r.dynamic_sampling_starved_steps ?? 0}`],
    ["last checkpoint", r.last_checkpoint ? r.last_checkpoint.split("/").filter(Boolean).pop() : "none yet"],
    ["running for", r.started_at ? secs(Math.max(0, (r.updated_at || Date.now() / 1000) - r.started_at)) : "–"],
  ];
  const tb = $("details"); tb.textContent = "";
  for (const [k, v] of rows) { const tr = tb.insertRow(); tr.insertCell().textContent = k; tr.insertCell().textContent = v; }

  renderLastStep(ls);

  const adm = r.admission || {};
  const rb = $("recovery"); rb.textContent = "";
  for (const [k, v] of [["admission accepted / running / free", `${adm.accepted ?? 0} / ${adm.running ?? 0} / ${adm.capacity ?? 0}`],
                        ["stale groups dropped", String(st.dropped ?? 0)]]) {
    const tr = rb.insertRow(); tr.insertCell().textContent = k; tr.insertCell().textContent = v;
  }
  renderFigures(rb, FIGURES.recovery, r.recovery || {});

  const eb = $("engines"); eb.textContent = "";
  if (!engines.length) { const c = eb.insertRow().insertCell(); c.colSpan = 4; c.textContent = "no rollout engines registered"; c.style.color = "var(--muted)"; }
  for (const e of engines) {
    const tr = eb.insertRow();
    const u = tr.insertCell(); u.textContent = e.url; u.className = "url";
    tr.insertCell().textContent = e.weight_version === null ? "–" : "v" + e.weight_version;
    const lag = tr.insertCell(); lag.textContent = e.weight_version === null ? "–" : String(r.policy_version - e.weight_version); lag.className = "num";
    const s = tr.insertCell(); s.textContent = e.ready ? "ready" : "not ready"; s.className = e.ready ? "ready" : "notready";
  }
  renderEvaluations(r.evaluations || []);
  renderSources(hist, r.groups_by_source || {}, ls ? ls.reward_by_source || {} : {});
  document.body.dataset.step = String(r.step);
}

const SOURCE_COLORS = ["#2563eb", "#ea580c", "#059669", "#7c3aed", "#db2777", "#0891b2", "#ca8a04", "#4b5563"];

// A mixture's sources (spec.datasets): reward per step per source, groups trained per source.
function renderSources(hist, groups, lastRewards) {
  const names = [...new Set([...Object.keys(groups), ...hist.flatMap((h) => Object.keys(h.reward_by_source || {}))])].sort();
  $("sources").hidden = names.length === 0;
  if (!names.length) return;
  const legend = $("source-legend"); legend.textContent = "";
  const series = names.map((name, i) => {
    const color = SOURCE_COLORS[i % SOURCE_COLORS.length];
    const item = document.createElement("span"); const mark = document.createElement("i");
    mark.style.background = color; item.appendChild(mark); item.appendChild(document.createTextNode(name)); legend.appendChild(item);
    const points = hist.filter((h) => h.reward_by_source && name in h.reward_by_source).map((h) => [h.step, h.reward_by_source[name]]);
    return { points, color, width: 2, dots: true, cls: "source source-" + name };
  });
  lineChart($("source-chart"), series, {});
  const total = names.reduce((n, name) => n + (groups[name] || 0), 0);
  const tb = $("source-table"); tb.textContent = "";
  for (const name of names) {
    const tr = tb.insertRow(); tr.dataset.source = name;
    tr.insertCell().textContent = name;
    const g = tr.insertCell(); g.textContent = big(groups[name] || 0); g.className = "num";
    const share = tr.insertCell(); share.textContent = total ? (100 * (groups[name] || 0) / total).toFixed(1) + "%" : "–"; share.className = "num";
    const rw = tr.insertCell(); rw.textContent = name in lastRewards ? fmt(lastRewards[name], 3) : "–"; rw.className = "num";
  }
}

// Every figure of the last step, as declared (hover a name for what it is); absent ones (an
// objective's figures when it is not the job's) are left out.
function renderLastStep(ls) {
  const tb = $("last-step"); tb.textContent = "";
  if (!ls) { const c = tb.insertRow().insertCell(); c.colSpan = 2; c.textContent = "no step yet"; c.style.color = "var(--muted)"; return; }
  renderFigures(tb, FIGURES.last_step, ls);
}

// One row per declared figure of `obj` that has a value: its name (the description on hover), its value.
function renderFigures(tbody, declared, obj) {
  for (const f of declared) {
    const v = f.name.split(".").reduce((o, k) => (o === null || o === undefined ? o : o[k]), obj);
    if (v === null || v === undefined || typeof v === "object") continue;
    const tr = tbody.insertRow(); tr.dataset.figure = f.name;
    const k = tr.insertCell(); k.textContent = f.name; k.title = f.help;
    tr.insertCell().textContent = Math.abs(v) >= 1e4 ? big(v) : Number.isInteger(v) ? String(v) : Number(v).toPrecision(4);
  }
}

// One point per policy version (a version evaluated twice, e.g. after a trainer restart, shows
// its newest result); the newest evaluation is the one of the highest version.
function renderEvaluations(evals) {
  const byVersion = new Map();
  for (const e of evals) byVersion.set(e.policy_version, e);
  const pts = [...byVersion.values()].sort((a, b) => a.policy_version - b.policy_version);
  const chart = $("eval-chart"), body = $("eval-body"), none = $("eval-none"), tb = $("eval-latest");
  tb.textContent = "";
  if (!pts.length) {
    body.hidden = true; none.hidden = false; setText("eval-newest", "");
    const c = tb.insertRow().insertCell(); c.colSpan = 2; c.textContent = "no evaluation yet"; c.style.color = "var(--muted)";
    delete document.body.dataset.evaluations;
    return;
  }
  body.hidden = false; none.hidden = true;  // (an <svg> has no `hidden` property: hide its HTML parent)
  const withK = pts.filter((e) => e.k > 1 && e.pass_at_k !== null && e.pass_at_k !== undefined);
  const kText = withK.length ? `pass@${withK[withK.length - 1].k}` : "";
  $("eval-legend-k").hidden = !withK.length; setText("eval-legend-k-text", kText);
  lineChart(chart, [
    { points: pts.map((e) => [e.policy_version, e.reward_mean]), color: "var(--evalreward)", width: 1.5, dash: "5 4", dots: true, r: 2, cls: "eval-reward" },
    { points: withK.map((e) => [e.policy_version, e.pass_at_k]), color: "var(--evalk)", width: 2, dots: true, cls: "eval-passk" },
    { points: pts.map((e) => [e.policy_version, e.pass_at_1]), color: "var(--eval)", width: 2.5, dots: true, r: 3.2, cls: "eval-pass1" },
  ], { yMin: 0, yMaxAtLeast: 1, xLabel: "policy version", empty: "no evaluation yet" });
  const n = pts[pts.length - 1];
  setText("eval-newest", `pass@1 ${fmt(n.pass_at_1, 2)}@v${n.policy_version}`);
  const rows = [
    ["policy version", "v" + n.policy_version],
    ["pass@1", fmt(n.pass_at_1, 3)],
    ...(n.k > 1 && n.pass_at_k !== null && n.pass_at_k !== undefined ? [[`pass@${n.k}`, fmt(n.pass_at_k, 3)]] : []),
    ["reward mean", fmt(n.reward_mean, 3)],
    ...Object.keys(n.pass_at_1_by_source || {}).sort().map((src) =>
      [`pass@1 · ${src}`, `${fmt(n.pass_at_1_by_source[src], 3)} (reward ${fmt((n.reward_by_source || {})[src], 3)})`]),
    ["prompts × answers", `${n.prompts} × ${n.k}`],
    ["answered on that version", fmt(100 * n.on_version, 0) + "%"],
    ["mean answer length", fmt(n.response_length, 1) + " tokens"],
    ["took", secs(n.seconds) + (n.engine_id ? ` on ${n.engine_id}` : "")],
  ];
  for (const [k, v] of rows) { const tr = tb.insertRow(); tr.insertCell().textContent = k; tr.insertCell().textContent = v; }
  document.body.dataset.evaluations = String(pts.length);
}

// Absent (or status false) when nothing is down: the banner hides again.
function renderDegraded(d) {
  const banner = $("degraded");
  if (!d || !d.status) { banner.hidden = true; delete document.body.dataset.degraded; return; }
  banner.hidden = false;
  setText("degraded-reason", d.reason || "DependencyUnavailable");
  const since = d.since ? ` since ${new Date(d.since * 1000).toLocaleTimeString()}` : "";
  setText("degraded-text", `training waits${since}: ${d.message || "a dependency is unreachable"}`);
  document.body.dataset.degraded = d.reason || "true";
}

// Absent while groups are accepted (or nothing says why not): the banner hides again.
function renderStalled(s) {
  const banner = $("stalled");
  if (!s || !s.reason) { banner.hidden = true; delete document.body.dataset.stalled; return; }
  banner.hidden = false;
  setText("stalled-reason", s.reason);
  setText("stalled-text", `no group accepted for training for ${secs(s.seconds)}: ${s.message}`);
  document.body.dataset.stalled = s.reason;
}

function setConn(ok, text) { $("conn-dot").className = "dot " + (ok ? "ok" : "bad"); setText("conn-text", text); }

async function poll() {
  try {
    const resp = await fetch("status", { credentials: "same-origin", cache: "no-store" });
    if (!resp.ok) {
      let msg = resp.status + " " + resp.statusText;
      try { msg = (await resp.json()).error || msg; } catch (e) {}
      setConn(false, msg);
    } else {
      render(await resp.json()); lastOk = Date.now(); setConn(true, "live · updated " + new Date().toLocaleTimeString());
      document.body.dataset.loaded = "true";
    }
  } catch (e) {
    setConn(false, "trainer unreachable" + (lastOk ? ` (last update ${Math.round((Date.now() - lastOk) / 1000)} s ago)` : ""));
  }
  setTimeout(poll, REFRESH_MS);
}
window.addEventListener("resize", () => { if (lastReport) render(lastReport); });
poll();
</script>
</body>
</html>
"""


@cache
def dashboard_html() -> str:
    """The page, with the figures (name and description) of the step's record and of the recovery
    totals, for its "Last step" and "Recovery" cards."""
    declared = {key: [{"name": f.name, "help": f.description} for f in figures(model)]
                for key, model in (("last_step", StepMetrics), ("recovery", RecoveryReport))}
    return DASHBOARD_HTML.replace("/*FIGURES*/{}", json.dumps(declared).replace("</", "<\\/"))
