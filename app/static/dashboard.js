// The dashboard: polls /dashboard.json and redraws counters, chart and filter table.
// Plain JavaScript, no build step and nothing fetched from elsewhere.
"use strict";

const params = new URLSearchParams(location.search);
const INTERVAL_MS = Math.max(200, Number(params.get("interval")) || 2000);
const WINDOW_S = 300; // the chart shows the last five minutes
const SERIES = [
  ["blocked", "var(--blocked)"],
  ["passed", "var(--passed)"],
  ["db_queries", "var(--db)"],
];

const $ = (id) => document.getElementById(id);
const fmt = (n) => Number(n).toLocaleString("en-US");
const size = (n) => {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
};

// Per-second rates between consecutive samples.
function rates(history, key) {
  const out = [];
  for (let i = 1; i < history.length; i += 1) {
    const dt = history[i].t - history[i - 1].t;
    if (dt > 0) out.push([history[i].t, Math.max(0, history[i][key] - history[i - 1][key]) / dt]);
  }
  return out;
}

function drawChart(history) {
  const svg = $("chart");
  const W = 800, H = 240;
  const lines = SERIES.map(([key, color]) => [key, color, rates(history, key)]);
  const now = history.length ? history[history.length - 1].t : Date.now() / 1000;
  const t0 = now - WINDOW_S;
  let max = 1;
  for (const [, , pts] of lines) for (const [, v] of pts) max = Math.max(max, v);
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  for (let g = 1; g < 4; g += 1) {
    const y = (H * g) / 4;
    const line = document.createElementNS(ns, "line");
    line.setAttribute("class", "grid");
    line.setAttribute("x1", "0"); line.setAttribute("x2", String(W));
    line.setAttribute("y1", String(y)); line.setAttribute("y2", String(y));
    svg.appendChild(line);
  }
  for (const [key, color, pts] of lines) {
    const poly = document.createElementNS(ns, "polyline");
    poly.setAttribute("data-series", key);
    poly.style.stroke = color;
    poly.setAttribute("points", pts
      .map(([t, v]) => `${((t - t0) / WINDOW_S * W).toFixed(1)},${(H - (v / max) * (H - 4)).toFixed(1)}`)
      .join(" "));
    svg.appendChild(poly);
  }
  $("chart-max").textContent = `top: ${fmt(Math.round(max))}/s`;
}

function lastRate(history, key) {
  const r = rates(history, key);
  return r.length ? r[r.length - 1][1] : 0;
}

function render(data) {
  const s = data.stats;
  for (const key of ["blocked", "passed", "db_queries", "cache_hits", "false_positives"]) {
    $(key).textContent = fmt(s[key]);
  }
  $("saved").textContent = fmt(s.blocked);
  const dbTime = (s.blocked * data.db_latency_ms) / 1000;
  $("saved-note").textContent = data.db_latency_ms ? `${dbTime.toFixed(1)} s of database time` : "one per blocked read";
  $("blocked-rate").textContent = `${lastRate(data.history, "blocked").toFixed(1)}/s`;
  $("passed-rate").textContent = `${lastRate(data.history, "passed").toFixed(1)}/s`;
  $("db-rate").textContent = `${lastRate(data.history, "db_queries").toFixed(1)}/s`;
  $("negative-hits").textContent = `${fmt(s.negative_cache_hits)} negative`;
  const passed = s.passed || 0;
  $("fp-rate").textContent = passed ? `${((100 * s.false_positives) / passed).toFixed(2)} % of passed` : "";
  drawChart(data.history);

  const body = $("filters").tBodies[0];
  body.replaceChildren();
  const status = $("status");
  if (data.filters === null) {
    status.textContent = "Redis unreachable"; status.className = "status down";
    return;
  }
  status.textContent = "live"; status.className = "status ok";
  for (const f of data.filters) {
    const row = body.insertRow();
    row.dataset.filter = f.name;
    const cells = [f.name + (f.name === data.records_filter ? " (records)" : ""), fmt(f.items),
      fmt(f.capacity), f.load_factor.toFixed(3), size(f.memory_bytes), f.error_rate.toExponential(1)];
    for (const text of cells) row.insertCell().textContent = text;
  }
  if (!data.filters.length) body.insertRow().insertCell().textContent = "no filters yet";
}

async function poll() {
  try {
    const r = await fetch("/dashboard.json", { cache: "no-store" });
    if (r.ok) render(await r.json());
    else { $("status").textContent = `HTTP ${r.status}`; $("status").className = "status down"; }
  } catch (err) {
    $("status").textContent = "service unreachable"; $("status").className = "status down";
  }
  setTimeout(poll, INTERVAL_MS);
}

poll();
