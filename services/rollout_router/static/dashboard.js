// Tandem dashboard: polls the router's read-only JSON routes every POLL_MS and redraws.
// GET /workers, GET /rollout/status, GET /rollout/metrics?after=ID (new records only),
// GET /rollout/samples. Pause and resume POST /rollout/pause|resume with the pasted token.
// The trainer charts mark the router's control/* records (pause, resume, stop, PATCH).
// Every text shown is set with textContent: sample text is model output, never HTML.
"use strict";

const POLL_MS = 2000;
const MAX_POINTS = 5000; // per series: older points are thinned out of the chart
const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#2f6fdf", "#e0692b", "#12805c", "#8e44ad"];

// Each chart: series of [label, source, value(record values) -> number or null].
const CHARTS = {
  reward: {
    series: [
      ["rollout reward", "router", (v) => v["rollout/reward_mean"]],
      ["trained reward", "trainer", (v) => v["train/reward_mean"]],
    ],
  },
  accuracy: {
    yMin: 0, yMax: 1,
    series: [["eval accuracy", "router", (v) => v["eval/accuracy"]]],
  },
  throughput: {
    series: [
      ["rollout samples/s", "router", (v) => v["rollout/samples_per_s"]],
      ["trainer samples/s", "trainer",
        (v) => (v["train/step_time_s"] ? v["train/samples"] / v["train/step_time_s"] : null)],
    ],
  },
  staleness: {
    yMin: 0,
    series: [
      ["mean", "trainer", (v) => v["train/staleness_mean"]],
      ["max", "trainer", (v) => v["train/staleness_max"]],
    ],
  },
  // The trainer's health, one chart a quantity (their scales differ by orders of magnitude);
  // `marks`: the pauses, resumes, stops and config PATCHes asked of the router, as lines.
  loss: { marks: true, series: [["policy loss", "trainer", (v) => v["train/loss"]]] },
  grad_norm: { marks: true, yMin: 0, series: [["grad norm", "trainer", (v) => v["train/grad_norm"]]] },
  entropy: { marks: true, yMin: 0, series: [["entropy", "trainer", (v) => v["train/entropy"]]] },
  kl: {
    marks: true,
    series: [
      ["approx KL (policy vs old)", "trainer", (v) => v["train/approx_kl"]],
      ["KL to the reference", "trainer", (v) => v["train/kl_ref"]],
    ],
  },
  mismatch: {
    marks: true, yMin: 0,
    series: [
      ["log-prob max abs diff", "trainer", (v) => v["train/logprob_abs_diff_max"]],
      ["mismatch KL", "trainer", (v) => v["train/mismatch_kl"]],
    ],
  },
};
const MARKS = ["pause", "resume", "stop", "patch"]; // control/<event> records of the router
const MARK_COLOR = { pause: "#b54708", resume: "#12805c", stop: "#c4320a", patch: "#8e44ad" };

// The metric names the charts read: the metrics route sends only these.
const KEYS = [
  "rollout/reward_mean", "train/reward_mean", "eval/accuracy", "rollout/samples_per_s",
  "train/samples", "train/step_time_s", "train/staleness_mean", "train/staleness_max",
  "train/loss", "train/grad_norm", "train/entropy", "train/approx_kl", "train/kl_ref",
  "train/logprob_abs_diff_max", "train/mismatch_kl", ...MARKS.map((m) => `control/${m}`),
].join(",");

const points = {}; // chart name -> one [[t, y], ...] per series
for (const name of Object.keys(CHARTS)) points[name] = CHARTS[name].series.map(() => []);
const marks = []; // [[t, event], ...]: the control events, drawn on the charts with `marks`
let lastId = "0";
let t0 = null;

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  return Math.abs(x) < 10 ** -digits ? x.toExponential(1) : x.toFixed(digits); // (1e-4 is not 0.000)
}

async function getJson(path) {
  const resp = await fetch(path, { cache: "no-store" });
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status} ${await resp.text()}`);
  return resp.json();
}

// --- workers and rollout state -------------------------------------------------------------

function showWorkers(data) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of data.workers) {
    const row = el("tr");
    row.dataset.worker = w.id;
    const name = el("td", w.id);
    name.title = w.url;
    name.append(el("div", w.url, "muted"));
    row.append(name);
    const health = el("td", w.healthy ? "healthy" : "unhealthy", w.healthy ? "ok" : "bad");
    if (w.last_error) health.title = w.last_error;
    row.append(health, el("td", w.weight_version, "version"), el("td", w.outstanding),
      el("td", w.requests), el("td", w.errors, w.errors ? "warn" : ""));
    body.append(row);
  }
  if (!data.workers.length) body.append(el("tr", "no worker registered", "muted"));
}

function showStatus(s) {
  const state = $("state");
  state.textContent = s.paused && s.state !== "paused" ? `${s.state} (pausing)` : s.state;
  state.className = "pill " + ({ failed: "bad", generating: "ok" }[s.state] || "");
  const waiting = s.error ? `error: ${s.error}`
    : s.waiting_for ? `waiting for ${s.waiting_for}` : s.busy ? `busy with ${s.busy}` : "";
  $("waiting").textContent = [waiting, s.note].filter(Boolean).join("; ");
  const drops = s.drops ? Object.entries(s.drops).map(([k, n]) => `${k} ${n}`).join(", ") : "";
  const rows = [
    ["workers admitted", s.workers],
    ["batch", s.batch],
    ["engines version", s.engines_version],
    ["trainer version", s.trainer_version],
    ["buffer depth (groups)", s.buffer_depth],
    ["groups put / consumed", `${fmt(s.groups_put)} / ${fmt(s.groups_consumed)}`],
    ["groups in flight", s.groups_in_flight],
    ["requests in flight", s.in_flight],
    ["samples/s", fmt(s.samples_per_s, 1)],
    ["last eval", s.last_eval && s.last_eval["eval/accuracy"] !== undefined
      ? `${fmt(s.last_eval["eval/accuracy"])} at version ${s.last_eval_version}` : "–"],
    ["drops", drops || "none"],
  ];
  const dl = $("rollout");
  dl.replaceChildren();
  for (const [k, v] of rows) {
    const dd = el("dd", v === undefined || v === null ? "–" : v);
    dd.dataset.key = k;
    dl.append(el("dt", k), dd);
  }
}

// --- metrics curves ----------------------------------------------------------------------

function addRecords(records) {
  for (const r of records) {
    if (t0 === null) t0 = r.time;
    for (const m of MARKS) if (r.values[`control/${m}`] !== undefined) marks.push([r.time - t0, m]);
    for (const [name, chart] of Object.entries(CHARTS)) {
      chart.series.forEach(([, source, value], k) => {
        if (r.source !== source) return;
        const y = value(r.values);
        if (typeof y !== "number" || !isFinite(y)) return;
        const line = points[name][k];
        line.push([r.time - t0, y]);
        if (line.length > MAX_POINTS) points[name][k] = line.filter((_, i) => i % 2 === 0);
      });
    }
  }
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawChart(name) {
  const chart = CHARTS[name];
  const lines = points[name];
  const box = $(`chart-${name}`);
  const all = lines.flat();
  box.dataset.points = String(Math.max(0, ...lines.map((l) => l.length)));
  const W = 420, H = 170, L = 44, R = 8, T = 8, B = 22;
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  const shown = chart.marks ? marks : [];
  const xMax = Math.max(1, ...all.map((p) => p[0]), ...shown.map((m) => m[0]));
  let yMin = chart.yMin ?? Math.min(...all.map((p) => p[1]));
  let yMax = chart.yMax ?? Math.max(...all.map((p) => p[1]));
  if (!all.length) { yMin = chart.yMin ?? 0; yMax = chart.yMax ?? 1; }
  if (yMax - yMin < 1e-9) { // a flat line: give it room, below only when the axis is free
    yMax += chart.yMin === undefined ? 0.5 : 1;
    if (chart.yMin === undefined) yMin -= 0.5;
  }
  const X = (x) => L + (x / xMax) * (W - L - R);
  const Y = (y) => T + (1 - (y - yMin) / (yMax - yMin)) * (H - T - B);
  root.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#e4e7ec" }));
  for (const y of [yMin, (yMin + yMax) / 2, yMax]) {
    root.append(svg("text", { x: L - 4, y: Y(y) + 4, "text-anchor": "end", "font-size": 10, fill: "#667085" }, fmt(y, 2)));
  }
  root.append(svg("text", { x: L, y: H - 6, "font-size": 10, fill: "#667085" }, "0 s"));
  root.append(svg("text", { x: W - R, y: H - 6, "text-anchor": "end", "font-size": 10, fill: "#667085" },
    `${xMax.toFixed(0)} s since the first record`));
  for (const [x, event] of shown) { // a dashed line and the event's name at its time
    root.append(svg("line", { x1: X(x), x2: X(x), y1: T, y2: H - B, stroke: MARK_COLOR[event],
      "stroke-dasharray": "3,3", "vector-effect": "non-scaling-stroke", "data-mark": event }));
    const right = X(x) > W - 60; // (a name at the right edge goes to the line's left)
    root.append(svg("text", { x: X(x) + (right ? -2 : 2), y: T + 10, "font-size": 9,
      "text-anchor": right ? "end" : "start", fill: MARK_COLOR[event] }, event));
  }
  lines.forEach((line, k) => {
    if (!line.length) return;
    const color = COLORS[k % COLORS.length];
    const d = line.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { points: d, fill: "none", stroke: color, "stroke-width": 1.5,
      "vector-effect": "non-scaling-stroke", "data-series": chart.series[k][0] }));
    const [x, y] = line[line.length - 1];
    root.append(svg("circle", { cx: X(x), cy: Y(y), r: 2.5, fill: color }));
  });
  const legend = el("div", null, "legend");
  chart.series.forEach(([label], k) => {
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = COLORS[k % COLORS.length];
    const last = lines[k].length ? fmt(lines[k][lines[k].length - 1][1]) : "–";
    item.append(swatch, `${label}: ${last}`);
    legend.append(item);
  });
  box.replaceChildren(root, legend);
}

async function pollMetrics() {
  for (let page = 0; page < 20; page++) { // at most 20 pages a poll: a long run loads over a few polls
    const query = `after=${encodeURIComponent(lastId)}&limit=2000&keys=${encodeURIComponent(KEYS)}`;
    const data = await getJson(`/rollout/metrics?${query}`);
    addRecords(data.records);
    lastId = data.last_id;
    if (!data.more) break;
  }
  for (const name of Object.keys(CHARTS)) drawChart(name);
}

// --- recent samples ----------------------------------------------------------------------

function showSamples(data) {
  const body = $("samples").tBodies[0];
  body.replaceChildren();
  for (const g of data.groups) {
    const row = el("tr");
    const responses = el("td");
    for (const s of g.samples) {
      const line = el("pre", `${s.text}  (${fmt(s.reward, 2)}, ${s.finish_reason})`);
      line.className = s.reward > 0 ? "ok" : "muted";
      responses.append(line);
    }
    row.append(el("td", g.group_id), el("td", g.weight_version), el("td", null), el("td", null), responses);
    row.children[2].append(el("pre", g.prompt));
    row.children[3].append(el("pre", g.label));
    body.append(row);
  }
  if (!data.groups.length) body.append(el("tr", "no group put yet", "muted"));
}

// --- control -----------------------------------------------------------------------------

async function control(action) {
  const token = $("token").value.trim();
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const msg = $("control-msg");
  try {
    const resp = await fetch(`/rollout/${action}`, { method: "POST", headers });
    const body = await resp.json().catch(() => ({}));
    if (resp.status === 401) msg.textContent = "401: paste the run's API token (TANDEM_API_TOKEN; tandem up: RUN_DIR/api_token)";
    else if (!resp.ok) msg.textContent = `${action}: HTTP ${resp.status} ${body.detail || ""}`;
    else msg.textContent = `${action} requested`;
  } catch (err) {
    msg.textContent = `${action} failed: ${err}`;
  }
  poll();
}

// --- the poll ----------------------------------------------------------------------------

let polling = false; // a slow poll is not overlapped: two would read the same metrics twice

async function poll() {
  if (polling) return;
  polling = true;
  try {
    await pollOnce();
  } finally {
    polling = false;
  }
}

async function pollOnce() {
  const problems = [];
  const tasks = [
    getJson("/workers").then(showWorkers),
    getJson("/rollout/status").then(showStatus),
    pollMetrics(),
    getJson("/rollout/samples?limit=8").then(showSamples),
  ];
  for (const result of await Promise.allSettled(tasks)) {
    if (result.status === "rejected") problems.push(String(result.reason));
  }
  const banner = $("banner");
  banner.style.display = problems.length ? "block" : "none";
  banner.textContent = problems.length ? `router unreachable or failing: ${problems.join("; ")}` : "";
  document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
}

$("pause").addEventListener("click", () => control("pause"));
$("resume").addEventListener("click", () => control("resume"));
$("token").value = sessionStorage.getItem("tandem-token") || "";
$("token").addEventListener("change", () => sessionStorage.setItem("tandem-token", $("token").value));
poll();
setInterval(poll, POLL_MS);
