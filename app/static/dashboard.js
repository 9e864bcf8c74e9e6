// The dashboard: polls /dashboard.json and redraws counters, chart and filter table.
// Plain JavaScript, no build step and nothing fetched from elsewhere.
"use strict";

const params = new URLSearchParams(location.search);
const INTERVAL_MS = Math.max(200, Number(params.get("interval")) || 2000);
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

// The chart: per-second rates the service sampled (null = not sampled: a gap in the line).
const W = 800, H = 260, LEFT = 56, RIGHT = 10, TOP = 10, BOTTOM = 36;
const ns = "http://www.w3.org/2000/svg";

function el(name, attrs, text) {
  const node = document.createElementNS(ns, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawChart(data) {
  const svg = $("chart");
  const rates = data.rates;
  const windowS = data.window_s;
  const now = data.time;
  const pw = W - LEFT - RIGHT, ph = H - TOP - BOTTOM;
  let max = 1;
  for (const r of rates) for (const [key] of SERIES) if (r[key] !== null) max = Math.max(max, r[key]);
  const x = (t) => LEFT + ((t - (now - windowS)) / windowS) * pw;
  const y = (v) => TOP + ph - (v / max) * ph;
  svg.replaceChildren();
  for (let g = 0; g <= 4; g += 1) {  // y axis: requests per second
    const v = (max * g) / 4;
    svg.appendChild(el("line", { class: g ? "grid" : "axis", x1: LEFT, x2: W - RIGHT, y1: y(v), y2: y(v) }));
    svg.appendChild(el("text", { x: LEFT - 6, y: y(v) + 4, "text-anchor": "end" },
      v >= 10 ? fmt(Math.round(v)) : v.toFixed(1)));
  }
  const stepS = windowS / 5;
  for (let i = 0; i <= 5; i += 1) {  // x axis: minutes before now
    const ago = windowS - i * stepS;
    const t = now - ago;
    svg.appendChild(el("line", { class: "axis", x1: x(t), x2: x(t), y1: TOP + ph, y2: TOP + ph + 4 }));
    svg.appendChild(el("text", { x: x(t), y: TOP + ph + 16, "text-anchor": "middle" },
      ago ? `-${(ago / 60).toFixed(ago % 60 ? 1 : 0)} min` : "now"));
  }
  svg.appendChild(el("text", { x: LEFT + pw / 2, y: H - 4, "text-anchor": "middle" }, "time (minutes ago)"));
  svg.appendChild(el("text", { x: 12, y: TOP + ph / 2, "text-anchor": "middle",
    transform: `rotate(-90 12 ${TOP + ph / 2})` }, "per second"));
  for (const [key, color] of SERIES) {
    // A null starts a new segment ("M"): a time without samples is left blank.
    let d = "", pen = "M";
    for (const r of rates) {
      if (r[key] === null || r.t < now - windowS) { pen = "M"; continue; }
      d += `${pen}${x(r.t).toFixed(1)},${y(r[key]).toFixed(1)} `;
      pen = "L";
    }
    const path = el("path", { "data-series": key, d: d.trim() });
    path.style.stroke = color;
    svg.appendChild(path);
  }
  $("chart-max").textContent = `top: ${fmt(Math.round(max))}/s`;
}

function lastRate(rates, key) {
  for (let i = rates.length - 1; i >= 0; i -= 1) if (rates[i][key] !== null) return rates[i][key];
  return 0;
}

function render(data) {
  const s = data.stats;
  for (const key of ["blocked", "passed", "db_queries", "cache_hits", "false_positives"]) {
    $(key).textContent = fmt(s[key]);
  }
  $("saved").textContent = fmt(s.blocked);
  const dbTime = (s.blocked * data.db_latency_ms) / 1000;
  $("saved-note").textContent = data.db_latency_ms ? `${dbTime.toFixed(1)} s of database time` : "one per blocked read";
  $("blocked-rate").textContent = `${lastRate(data.rates, "blocked").toFixed(1)}/s`;
  $("passed-rate").textContent = `${lastRate(data.rates, "passed").toFixed(1)}/s`;
  $("db-rate").textContent = `${lastRate(data.rates, "db_queries").toFixed(1)}/s`;
  $("negative-hits").textContent = `${fmt(s.negative_cache_hits)} negative`;
  const passed = s.passed || 0;
  $("fp-rate").textContent = passed ? `${((100 * s.false_positives) / passed).toFixed(2)} % of passed` : "";
  drawChart(data);

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
    // Capacity now, growth included (f.capacity is what the filter was created for).
    const slots = f.buckets * f.bucket_size;
    const cells = [f.name + (f.name === data.records_filter ? " (records)" : ""), fmt(f.items),
      fmt(slots), String(f.subfilters), f.load_factor.toFixed(3), size(f.memory_bytes),
      f.error_rate.toExponential(1)];
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
