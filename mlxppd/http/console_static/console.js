// The mlxpp web console: reads /console/v1/stream (server-sent events over fetch, so the API
// key travels in a header, never in a URL), draws what it says, and signs admin actions with
// sign.js. No framework, no build step: the coordinator ships these files as they are.
"use strict";

const KEY_STORE = "mlxpp.apiKey"; // sessionStorage: this tab only, gone when it closes
const MAX_POINTS = 300;
const PHASES = ["draining", "rebalancing", "resuming"];

const state = {
  apiKey: sessionStorage.getItem(KEY_STORE) || "",
  snapshot: null,
  series: [],
  whatIf: null,
  cluster: null,
  retry: 0,
};

const $ = (id) => document.getElementById(id);

// -- formatting: every number with its unit --------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}
const percent = (f) => (f === null || f === undefined ? "–" : `${(f * 100).toFixed(0)} %`);
const seconds = (s) =>
  s === null || s === undefined ? "–" : s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`;
const clock = (unix) => new Date(unix * 1000).toLocaleTimeString();

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function meter(used, total, label, budgeted = true) {
  // budgeted: total is a limit (colour the bar as it fills), not just the scale.
  const share = total ? Math.min(1, used / total) : 0;
  const cls = !total || !budgeted ? "meter" : used > total ? "meter over" : share >= 0.92 ? "meter high" : "meter";
  const bar = el("div", { class: cls, role: "meter", "aria-label": label,
    "aria-valuenow": String(used ?? 0), "aria-valuemax": String(total ?? 0) });
  const fill = el("span");
  fill.style.width = `${(share * 100).toFixed(1)}%`;
  bar.append(fill);
  return bar;
}

// -- requests ----------------------------------------------------------------------------------

function authHeaders() {
  return state.apiKey ? { Authorization: `Bearer ${state.apiKey}` } : {};
}

function showLogin(message) {
  $("login").hidden = false;
  $("main").hidden = true;
  $("login-error").textContent = message || "";
  setBadge("unknown", "sign in to see the cluster");
}

async function stream() {
  // One stream at a time; on any end, wait a little and open the next (a restarted
  // coordinator comes back on its own).
  for (;;) {
    try {
      const response = await fetch("/console/v1/stream", { headers: authHeaders(), cache: "no-store" });
      if (response.status === 401) {
        showLogin(state.apiKey ? "That key was refused." : "");
        return;
      }
      if (!response.ok || !response.body) throw new Error(`HTTP ${response.status}`);
      $("login").hidden = true;
      $("main").hidden = false;
      setLink(true);
      state.retry = 0;
      await readEvents(response.body.getReader());
    } catch (error) {
      // fall through to the retry below
    }
    setLink(false);
    state.retry = Math.min(state.retry + 1, 5);
    await new Promise((resolve) => setTimeout(resolve, 1000 * state.retry));
  }
}

async function readEvents(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      let data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) handle(name, JSON.parse(data));
    }
  }
}

function handle(name, message) {
  if (name === "snapshot") {
    state.series = message.series || [];
  } else if (name === "tick" && message.point) {
    state.series.push(message.point);
    if (state.series.length > MAX_POINTS) state.series.shift();
  }
  state.snapshot = message;
  render();
}

// -- rendering ---------------------------------------------------------------------------------

function setLink(up) {
  const link = $("link");
  link.textContent = up ? "live" : "reconnecting…";
  link.className = up ? "link" : "link down";
  link.dataset.state = up ? "live" : "down";
}

function setBadge(health, detail) {
  const badge = $("badge");
  badge.textContent = health;
  badge.className = `badge ${health}`;
  badge.dataset.health = health;
  $("badge-detail").textContent = detail || "";
}

function render() {
  const snap = state.snapshot;
  if (!snap) return;
  const status = snap.status;
  $("cluster").textContent = status.cluster || "";
  setBadge(status.health, status.detail);
  renderStages(status);
  renderCharts();
  renderPlan($("plan"), $("plan-warnings"), snap.plan);
  renderHistory(snap);
  renderProgress(snap);
  renderTimeline(snap.timeline || []);
}

function stageClass(card) {
  // Red: this stage is down. A stage not asked while the pipeline is down (process unknown)
  // is amber: its link went with the pipeline, not with it.
  if (card.process_alive === false) return "card bad";
  if (card.process_alive === null || card.transport_connected === false) return "card warn";
  const kvHigh = card.kv_budget_bytes && card.kv_used_bytes / card.kv_budget_bytes >= 0.92;
  const identityBad = card.identity && card.identity.state === "mismatch";
  if (kvHigh || identityBad || (card.elastic_state && card.elastic_state !== "idle")) return "card warn";
  return "card";
}

function renderStages(status) {
  const coordinator = status.coordinator || {};
  const backend = coordinator.transport || "";
  const cards = (status.stages || []).map((card) => {
    const alive = card.process_alive === false ? "no" : card.process_alive ? "yes" : "unknown";
    const link = card.transport_connected ? `connected${backend ? ` (${backend})` : ""}` : "down";
    const kv = card.kv_budget_bytes
      ? `${bytes(card.kv_used_bytes)} of ${bytes(card.kv_budget_bytes)}`
      : `${bytes(card.kv_used_bytes)} (no budget)`;
    const identity = card.identity ? card.identity.state : "not checked";
    return el("article", { class: stageClass(card), "data-testid": `stage-card-${card.stage}`,
      "data-node": card.node_id, "data-layers": card.layers || "" },
      el("h3", {}, el("span", { text: `Stage ${card.stage}` }), el("span", { class: "muted", text: card.node_id })),
      el("dl", {},
        el("dt", { text: "address" }), el("dd", { text: card.address }),
        el("dt", { text: "layers" }), el("dd", { text: card.layers ?? "–", "data-testid": "layers" }),
        el("dt", { text: "process" }), el("dd", { text: alive }),
        el("dt", { text: "link" }), el("dd", { text: link }),
        el("dt", { text: "in flight" }), el("dd", { text: card.in_flight === null || card.in_flight === undefined ? "–" : `${card.in_flight} sequence${card.in_flight === 1 ? "" : "s"}` }),
        el("dt", { text: "busy" }), el("dd", { text: `${percent(card.busy_fraction)} (bubble ${percent(card.bubble_fraction)})` }),
        el("dt", { text: "weights" }), el("dd", { text: card.parameter_bytes ? `${bytes(card.parameter_bytes)} ${card.weights || ""}` : card.weights || "–" }),
        el("dt", { text: "identity" }), el("dd", { text: identity }),
        el("dt", { text: "KV cache" }), el("dd", { text: kv }),
      ),
      meter(card.kv_used_bytes || 0, card.kv_budget_bytes, `KV cache of stage ${card.stage}`),
    );
  });
  $("stages").replaceChildren(...cards);
  const spares = (status.standbys || []).map((s) =>
    el("article", { class: "card", "data-testid": `standby-${s.node_id}` },
      el("h3", {}, el("span", { text: "Standby" }), el("span", { class: "muted", text: s.node_id })),
      el("dl", {}, el("dt", { text: "address" }), el("dd", { text: s.address }),
        el("dt", { text: "serving" }), el("dd", { text: s.stage === null ? "nothing yet" : `stage ${s.stage}` }))));
  $("standbys").replaceChildren(...spares);
}

function chart(target, title, unit, lines) {
  // lines: [{label, values: [[t, v]...]}]; one SVG, y from 0 to the largest value.
  const points = lines.reduce((n, line) => n + line.values.length, 0);
  const all = lines.flatMap((line) => line.values);
  const top = Math.max(1e-9, ...all.map(([, v]) => v));
  const t0 = Math.min(...all.map(([t]) => t));
  const t1 = Math.max(...all.map(([t]) => t));
  const width = 300;
  const height = 100;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", title);
  lines.forEach((line, i) => {
    if (!line.values.length) return;
    const poly = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    const span = t1 - t0 || 1;
    poly.setAttribute("points", line.values
      .map(([t, v]) => `${(((t - t0) / span) * width).toFixed(1)},${(height - (v / top) * (height - 4)).toFixed(1)}`)
      .join(" "));
    poly.setAttribute("stroke", `var(--series-${i % 4})`);
    svg.append(poly);
  });
  const last = lines.length === 1 && lines[0].values.length ? lines[0].values.at(-1)[1] : null;
  const caption = el("figcaption", {},
    el("span", { text: title }),
    el("span", { text: last === null ? `max ${format(top, unit)}` : `now ${format(last, unit)} · max ${format(top, unit)}` }));
  const legend = lines.length > 1
    ? el("div", { class: "legend" }, ...lines.map((line, i) => {
        const swatch = el("span", { class: "swatch" });
        swatch.style.background = `var(--series-${i % 4})`;
        return el("span", {}, swatch, line.label);
      }))
    : null;
  target.dataset.points = String(points);
  target.dataset.max = String(all.length ? Math.max(...all.map(([, v]) => v)) : 0);
  target.replaceChildren(caption, svg, legend || "");
}

function format(value, unit) {
  if (unit === "s") return seconds(value);
  if (unit === "%") return percent(value);
  return `${value.toFixed(value >= 10 ? 0 : 2)} ${unit}`;
}

function renderCharts() {
  const series = state.series;
  const of = (key) => series.filter((p) => p[key] !== null).map((p) => [p.at, p[key]]);
  chart($("chart-tokens"), "Tokens", "tokens/s", [{ label: "tokens/s", values: of("tokens_s") }]);
  chart($("chart-requests"), "Requests", "requests/s", [{ label: "requests/s", values: of("requests_s") }]);
  chart($("chart-ttft"), "First token", "s", [{ label: "mean", values: of("ttft_s") }]);
  const stages = [...new Set(series.flatMap((p) => Object.keys(p.busy || {})))].sort();
  chart($("chart-busy"), "Stage busy", "%", stages.map((stage) => ({
    label: `stage ${stage}`,
    values: series.filter((p) => p.busy && stage in p.busy).map((p) => [p.at, p.busy[stage]]),
  })));
}

function renderPlan(target, warningsTarget, plan) {
  if (!plan) {
    target.replaceChildren(el("p", { class: "muted", text: "no plan to show yet" }));
    warningsTarget.replaceChildren();
    return;
  }
  const largest = Math.max(...plan.stages.map((s) => Math.max(s.bytes, s.budget_bytes || 0)));
  const rows = plan.stages.map((s) => {
    const against = s.budget_bytes || largest;
    const what = s.budget_bytes
      ? `${bytes(s.bytes)} of ${bytes(s.budget_bytes)}`
      : `${bytes(s.bytes)} (no budget)`;
    return el("div", { class: "plan-row", "data-testid": `plan-stage-${s.stage}` },
      el("div", {}, el("strong", { text: `Stage ${s.stage}` }), el("div", { class: "muted small", text: `layers ${s.layers}` })),
      el("div", {}, meter(s.bytes, against, `weights of stage ${s.stage}`, Boolean(s.budget_bytes)),
        el("div", { class: "small muted", text: `${what}${s.measured ? "" : " estimated"}` })));
  });
  target.replaceChildren(...rows);
  warningsTarget.replaceChildren(...(plan.warnings || []).map((w) => el("li", { text: w })));
}

function repartitionRuns(events) {
  // Events in order; a run starts at idle/failed -> draining and ends back at idle or failed.
  const runs = [];
  let run = null;
  for (const event of events) {
    if (event.to === "draining" || !run) {
      run = { events: [], trigger: event.trigger };
      runs.push(run);
    }
    run.events.push(event);
    if (event.to === "idle" || event.to === "failed") run = null;
  }
  return runs;
}

function renderHistory(snap) {
  const items = [];
  for (const run of repartitionRuns(snap.repartitions || [])) {
    const last = run.events.at(-1);
    const done = last.to === "idle" || last.to === "failed";
    const outcome = done ? last.outcome : "running";
    items.push({
      order: -(last.seq ?? 0),
      node: el("li", { "data-kind": "repartition" },
        el("strong", { text: `Repartition (${run.trigger}) ` }),
        el("span", { class: `outcome-${outcome}`, text: outcome }),
        el("span", { text: ` · ${run.events[0].ranges_before} → ${last.ranges_after ?? "…"} · ${seconds(last.total_s)}` }),
        last.detail ? el("div", { class: "small muted", text: last.detail }) : null,
        el("div", { class: "phases" }, ...run.events.map((e) =>
          el("span", { class: "phase", text: `${e.from} ${seconds(e.phase_s)}` })))),
    });
  }
  const coordinator = snap.status.coordinator || {};
  for (const f of coordinator.failovers || []) {
    items.push({
      order: -f.at,
      node: el("li", { "data-kind": "failover" },
        el("strong", { text: `Lost stage ${f.lost_stage} (${f.lost_node}) ` }),
        el("span", { class: `outcome-${f.outcome}`, text: f.outcome }),
        el("span", { text: ` · ${clock(f.at)} · ${seconds(f.seconds)} · ${f.sequences} sequences in flight` }),
        el("div", { class: "small muted", text: `${f.reason}${f.detail ? `; ${f.detail}` : ""}` })),
    });
  }
  const prepare = coordinator.prepare;
  if (prepare) {
    items.push({
      order: -(prepare.started_at || 0),
      node: el("li", { "data-kind": "prepare" },
        el("strong", { text: "Prepare " }), el("span", { class: `outcome-${prepare.state}`, text: prepare.state }),
        el("span", { text: ` · ${clock(prepare.started_at)}` }),
        ...(prepare.nodes || []).map((n) => el("div", { class: "small" },
          el("span", { text: `${n.node} (stage ${n.stage}): ${n.state}, ${bytes(n.bytes_sent)} of ${bytes(n.bytes_total)} sent${n.rate_bytes_s ? ` at ${bytes(n.rate_bytes_s)}/s` : ""}${n.eta_s ? `, ${seconds(n.eta_s)} left` : ""}` }),
          meter(n.bytes_sent + (n.bytes_resumed || 0), n.bytes_total, `prepare of ${n.node}`)))),
    });
  }
  items.sort((a, b) => a.order - b.order);
  $("history").replaceChildren(...(items.length ? items.map((i) => i.node)
    : [el("li", { class: "muted", text: "no repartition, failover or prepare yet" })]));
}

function renderProgress(snap) {
  const elastic = (snap.status.coordinator || {}).elastic_state || "idle";
  const target = $("progress");
  target.dataset.state = elastic;
  const step = PHASES.indexOf(elastic);
  if (step < 0) {
    target.replaceChildren();
    return;
  }
  target.replaceChildren(
    el("div", { class: "small", text: `Repartition: ${elastic} (step ${step + 1} of ${PHASES.length})` }),
    meter(step + 0.5, PHASES.length, "repartition progress"));
}

function renderTimeline(marks) {
  if (!marks.length) {
    $("timeline").replaceChildren(el("li", { class: "muted", text: "no start recorded" }));
    return;
  }
  const first = marks[0].at;
  $("timeline").replaceChildren(...marks.map((m) =>
    el("li", {}, el("span", { class: "muted", text: `${clock(m.at)} (+${(m.at - first).toFixed(1)} s) ` }),
      el("span", { text: m.what }))));
}

// -- what if -----------------------------------------------------------------------------------

async function previewPlan(event) {
  event.preventDefault();
  const body = { stages: Number($("what-if-stages").value) };
  const memory = $("what-if-memory").value.trim();
  if (memory) body.stage_memory = memory;
  const response = await fetch("/console/v1/plan", {
    method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  if (!response.ok) {
    $("what-if-plan").replaceChildren(el("p", { class: "error", text: answer.error?.message || `HTTP ${response.status}` }));
    $("what-if-warnings").replaceChildren();
    return;
  }
  renderPlan($("what-if-plan"), $("what-if-warnings"), answer);
}

// -- actions, signed as mlxppctl signs them ----------------------------------------------------

async function clusterName() {
  if (!state.cluster) {
    const response = await fetch("/admin/v1/challenge", { cache: "no-store" });
    state.cluster = (await response.json()).cluster;
  }
  return state.cluster;
}

async function act(path, payload) {
  const result = $("action-result");
  const key = $("admin-key").value;
  if (!key.trim()) {
    result.className = "small error";
    result.textContent = "Enter the admin key first: actions are signed with it.";
    result.dataset.outcome = "refused";
    return;
  }
  const body = new TextEncoder().encode(payload === undefined ? "" : JSON.stringify(payload));
  let header;
  try {
    header = await MlxppSign.authorization(key, "POST", path, body, await clusterName(), location.host, Date.now() / 1000);
  } catch (error) {
    result.className = "small error";
    result.textContent = error.message;
    result.dataset.outcome = "refused";
    return;
  }
  const response = await fetch(path, {
    method: "POST", body, redirect: "error",
    headers: { Authorization: header, ...(payload === undefined ? {} : { "Content-Type": "application/json" }) },
  });
  const answer = await response.json().catch(() => ({}));
  const ok = response.ok;
  result.className = ok ? "small" : "small error";
  result.dataset.outcome = ok ? "accepted" : "refused";
  result.textContent = ok
    ? `${path.split("/").at(-1)}: ${JSON.stringify(answer)}`
    : answer.error?.message || answer.message || `refused (HTTP ${response.status})`;
}

function repartition(event) {
  event.preventDefault();
  const payload = {};
  const layers = $("repartition-layers").value.trim();
  const memory = $("repartition-memory").value.trim();
  if (layers) payload.pp_layers = layers;
  if (memory) {
    payload.stage_memory = memory.split(",").map((part) => {
      const text = part.trim().toLowerCase();
      const match = /^([0-9.]+)\s*(b|kib|mib|gib|tib|kb|mb|gb|tb|k|m|g|t)?$/.exec(text);
      if (!match) return null;
      const scale = { b: 1, k: 2 ** 10, kib: 2 ** 10, m: 2 ** 20, mib: 2 ** 20, g: 2 ** 30, gib: 2 ** 30,
        t: 2 ** 40, tib: 2 ** 40, kb: 1e3, mb: 1e6, gb: 1e9, tb: 1e12 }[match[2] || "b"];
      return Math.round(Number(match[1]) * scale);
    });
  }
  return act("/admin/v1/repartition", payload);
}

// -- start ---------------------------------------------------------------------------------------

function start() {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORE, state.apiKey);
    $("login-error").textContent = "";
    stream();
  });
  $("what-if").addEventListener("submit", previewPlan);
  $("drain").addEventListener("click", () => act("/admin/v1/drain"));
  $("resume").addEventListener("click", () => act("/admin/v1/resume"));
  $("repartition-form").addEventListener("submit", repartition);
  stream();
}

start();
