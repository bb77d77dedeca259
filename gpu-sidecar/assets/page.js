// The sluice sidecar's operator page. Reads /v1/history every few seconds
// and draws it; flips the kill switch with the token the operator types.
//
// Safety rules of this file: operator text (reasons, names, tiers) goes
// into the page only through textContent or SVG attributes set one by
// one, never as markup; the admin token lives in a local variable for one
// request and is never written anywhere.
"use strict";

const SVG = "http://www.w3.org/2000/svg"; // the SVG namespace name, not a fetch
const REFRESH_MS = 5000;
let current = null; // the last /v1/history answer
let timer = null;

function $(sel) { return document.querySelector(sel); }

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmtTime(rfc3339) {
  if (!rfc3339) return "—";
  const d = new Date(rfc3339);
  return isNaN(d) ? String(rfc3339) : d.toLocaleString();
}

function num(v, digits) {
  if (v === null || v === undefined || !isFinite(v)) return "—";
  return Number(v).toFixed(digits === undefined ? 0 : digits);
}

// ---- kill switch ---------------------------------------------------------

function renderKillSwitch(ks) {
  const p = $("#ks-state");
  p.className = "ks " + (ks.active ? "on" : "off");
  p.textContent = (ks.active ? "ON: traffic goes to the fallback" : "off: traffic flows normally") +
    (ks.reason ? " — " + ks.reason : "") + (ks.since ? " · since " + fmtTime(ks.since) : "");
  p.dataset.active = ks.active ? "true" : "false";
  const b = $("#ks-button");
  b.textContent = ks.active ? "Turn the kill switch OFF" : "Turn the kill switch ON";
  b.className = ks.active ? "to-off" : "to-on";
  b.dataset.target = ks.active ? "off" : "on";
}

function result(text, ok) {
  const r = $("#ks-result");
  r.textContent = text;
  r.className = ok ? "good" : "bad";
  r.dataset.outcome = ok ? "ok" : "error";
}

async function flip(ev) {
  ev.preventDefault();
  const tokenField = $("#ks-token");
  let token = tokenField.value;
  tokenField.value = ""; // cleared at once, whatever happens next
  if (!current) { result("No state read yet; try again in a moment.", false); return; }
  const active = $("#ks-button").dataset.target === "on";
  const wasOn = current.state.kill_switch.active;
  if (!token) { result("Type the admin token first: nothing was changed.", false); return; }
  const reason = $("#ks-reason").value.trim();
  let res;
  try {
    res = await fetch("/v1/kill-switch", {
      method: "POST",
      headers: { "Authorization": "Bearer " + token, "Content-Type": "application/json" },
      body: JSON.stringify({ active: active, reason: reason || null }),
      cache: "no-store",
      credentials: "omit",
    });
  } catch (e) {
    result("The request did not go out (" + e.message + "): nothing was changed.", false);
    return;
  } finally {
    token = null;
  }
  let body = null;
  try { body = await res.json(); } catch (_) { body = null; }
  const still = "The kill switch is unchanged (still " + (wasOn ? "ON" : "off") + ").";
  if (res.status === 401) {
    result("Wrong admin token. " + still, false);
  } else if (res.status === 403) {
    result("Refused: " + ((body && body.error && body.error.message) || "admin calls are not allowed from here") + ". " + still, false);
  } else if (!res.ok) {
    result("Error " + res.status + ": " + ((body && body.error && body.error.message) || res.statusText) + ". " + still, false);
  } else {
    const ks = body.kill_switch;
    let text = "Done: the kill switch is now " + (ks.active ? "ON" : "off") + (ks.reason ? " (" + ks.reason + ")" : "") + ".";
    if (body.warning) text += " Warning: " + body.warning + ".";
    result(text, true);
    $("#ks-reason").value = "";
    current.state.kill_switch = ks;
    renderKillSwitch(ks);
  }
  refresh();
}

// ---- charts --------------------------------------------------------------

const W = 220, H = 64, PAD_TOP = 14;

// A small line chart of [t_ms, value] points over [t0, t1]; a gap longer
// than three sample periods breaks the line.
function lineChart(title, unit, points, yMax, color, t0, t1, gapMs) {
  const s = svg("svg", { class: "chart", width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img" });
  const last = points.length ? points[points.length - 1][1] : null;
  s.append(svg("title", {}, title));
  for (const f of [0, 0.5, 1]) {
    const y = PAD_TOP + (H - PAD_TOP - 2) * (1 - f);
    s.append(svg("line", { class: "grid", x1: 0, x2: W, y1: y, y2: y }));
  }
  const label = title + " " + (last === null ? "—" : num(last) + " " + unit);
  s.append(svg("text", { x: 3, y: 10 }, label));
  s.append(svg("text", { x: W - 3, y: 10, "text-anchor": "end" }, "max " + num(yMax) + " " + unit));
  const span = Math.max(1, t1 - t0);
  let run = [];
  let drawn = 0;
  const flush = () => {
    if (run.length === 1) {
      s.append(svg("circle", { class: "point", cx: run[0][0], cy: run[0][1], r: 1.5, fill: color }));
    } else if (run.length > 1) {
      s.append(svg("polyline", { class: "line", stroke: color, points: run.map(p => p.join(",")).join(" ") }));
    }
    drawn += run.length;
    run = [];
  };
  let prevT = null;
  for (const [t, v] of points) {
    if (v === null || v === undefined) { flush(); prevT = null; continue; }
    if (prevT !== null && t - prevT > gapMs) flush();
    const x = ((t - t0) / span) * W;
    const y = PAD_TOP + (H - PAD_TOP - 2) * (1 - Math.min(1, Math.max(0, v / yMax)));
    run.push([x.toFixed(1), y.toFixed(1)]);
    prevT = t;
  }
  flush();
  s.dataset.points = String(drawn);
  return s;
}

function renderGpus(h) {
  const box = $("#gpus");
  const t1 = h.now_ms, t0 = t1 - h.window_ms;
  const gap = h.sample_every_ms * 3;
  const win = h.window_ms >= 120000 ? Math.round(h.window_ms / 60000) + " min" : Math.round(h.window_ms / 1000) + " s";
  $("#gpu-window").textContent = "(last " + win + ", one point per " + (h.sample_every_ms / 1000) + " s)";
  const cards = [];
  for (const g of h.gpus) {
    const col = i => g.points.map(p => [p[0], p[i]]);
    const temps = col(3).filter(p => p[1] !== null).map(p => p[1]);
    const tMax = Math.max(100, ...temps);
    const card = el("div", { class: "gpu", "data-index": String(g.index) },
      el("h3", {}, "#" + g.index + " " + g.name),
      el("div", { class: "charts" },
        lineChart("utilization", "%", col(1), 100, "#1f6feb", t0, t1, gap),
        lineChart("memory", "%", col(2), 100, "#8250df", t0, t1, gap),
        lineChart("temperature", "°C", col(3), tMax, "#d1242f", t0, t1, gap)));
    cards.push(card);
  }
  if (!cards.length) cards.push(el("p", { class: "muted" }, "No GPU reading in the window."));
  const note = $("#gpu-note");
  const bad = h.gpu_error || h.gpu_missing;
  note.textContent = h.gpu_error ? "GPU source failing: " + h.gpu_error
    : h.gpu_missing ? "No GPU source: " + h.gpu_missing + ". GPU rules see no data."
    : "source: " + (h.gpu_source || "none");
  note.className = bad ? "bad" : "muted";
  box.replaceChildren(...cards);
}

// ---- backends, breakers, timeline, traffic --------------------------------

function renderBackends(h) {
  $("#backends-section").hidden = !h.backends.length;
  const rows = h.backends.map(b => {
    const signals = Object.entries(b.samples).map(([k, v]) => k + " " + num(v, 2));
    if (b.models.length) signals.push("models " + b.models.join(", "));
    return el("tr", { class: b.up ? "closed" : "open" },
      el("td", {}, b.name), el("td", {}, b.kind), el("td", { class: "state" }, b.up ? "yes" : "no"),
      el("td", {}, signals.join(", ")), el("td", {}, b.error || ""));
  });
  $("#backends tbody").replaceChildren(...rows);
}

function renderBreakers(h) {
  const rows = h.breakers.map(b => {
    const rules = el("ul", {});
    for (const r of b.rules) {
      const now = el("span", { class: r.hot ? "hot" : "" }, r.value === null ? "no data" : num(r.value, 2));
      rules.append(el("li", {}, r.text + " — now ", now));
    }
    const state = b.state.replace("_", "-") + (b.stale ? " (stale)" : "");
    return el("tr", { class: b.state },
      el("td", {}, b.scope), el("td", { class: "state" }, state),
      el("td", {}, fmtTime(b.since)), el("td", {}, b.reason || ""), el("td", {}, rules));
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "5", class: "muted" }, "No breaker scope.")));
  $("#breakers tbody").replaceChildren(...rows);
}

function renderTimeline(h) {
  const rows = h.events.map(e => el("tr", { class: "event " + e.kind },
    el("td", {}, fmtTime(e.at)),
    el("td", {}, e.kind === "kill_switch" ? "kill switch" : "breaker " + e.scope),
    el("td", {}, e.from.replace("_", "-") + " → " + e.to.replace("_", "-")),
    el("td", {}, e.reason || "")));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "4", class: "muted" }, "No change since the sidecar started.")));
  $("#timeline tbody").replaceChildren(...rows);
}

function bars(minutes, tier) {
  const n = Math.max(1, minutes.length);
  const w = 240, hgt = 40, bw = w / n;
  const counts = minutes.map(m => m.tiers[tier] || [0, 0, 0]);
  const max = Math.max(1, ...counts.map(c => c[0] + c[1] + c[2]));
  const s = svg("svg", { class: "bars", width: w, height: hgt, viewBox: "0 0 " + w + " " + hgt, role: "img" });
  s.append(svg("title", {}, tier + ": admitted / degraded / refused per minute (max " + max + ")"));
  counts.forEach((c, i) => {
    let y = hgt;
    ["admit", "degrade", "refuse"].forEach((k, j) => {
      const bh = (c[j] / max) * (hgt - 2);
      if (bh <= 0) return;
      y -= bh;
      s.append(svg("rect", { class: k, x: (i * bw + 1).toFixed(1), y: y.toFixed(1), width: Math.max(1, bw - 2).toFixed(1), height: bh.toFixed(1) }));
    });
  });
  return s;
}

function triple(c) {
  return c[0] + " admitted · " + c[1] + " degraded · " + c[2] + " refused";
}

function renderTraffic(h) {
  const t = h.traffic;
  const note = $("#traffic-note");
  if (!t.enabled) {
    note.textContent = "Not configured: give the sidecar envoy_admin.url (or --envoy-admin) to count requests per tier from Envoy's stats.";
    $("#traffic tbody").replaceChildren();
    return;
  }
  note.textContent = (t.error ? t.error + " · " : "") + "last read " + fmtTime(t.last_scrape);
  note.className = t.error ? "bad" : "muted";
  const rows = t.tiers.map(tier => {
    const last = t.minutes.length ? (t.minutes[t.minutes.length - 1].tiers[tier] || [0, 0, 0]) : [0, 0, 0];
    const sum = [0, 0, 0];
    for (const m of t.minutes) (m.tiers[tier] || [0, 0, 0]).forEach((v, i) => { sum[i] += v; });
    return el("tr", { class: "tier", "data-tier": tier },
      el("td", {}, tier), el("td", {}, triple(last)), el("td", { class: "window" }, triple(sum)),
      el("td", {}, bars(t.minutes, tier)));
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "4", class: "muted" }, "No request counted in the window.")));
  $("#traffic tbody").replaceChildren(...rows);
}

// ---- the response cache ----------------------------------------------------

function renderCache(h) {
  const c = h.cache;
  $("#cache-section").hidden = !c;
  if (!c) return;
  $("#cache-where").textContent = "(entries in " + c.where + (c.scopes === null ? "" : ", " + c.scopes + " scopes") + ")";
  const rate = c.hit_rate === null ? "no lookups yet" : num(100 * c.hit_rate, 1) + " %";
  const row = el("tr", {},
    el("td", { class: "hit-rate" }, rate),
    el("td", {}, c.hits + " (" + c.hits_exact + " / " + c.hits_semantic + ")"),
    el("td", {}, String(c.lookups)),
    el("td", {}, c.entries + " of " + c.max_entries),
    el("td", {}, c.bytes + " of " + c.max_bytes),
    el("td", {}, String(c.vectors)),
    el("td", {}, String(c.saved_tokens)),
    el("td", {}, num(c.saved_spend_micros / 1e6, 6)));
  $("#cache tbody").replaceChildren(row);
}

// ---- money ------------------------------------------------------------------

function money(micros) {
  if (micros === null || micros === undefined || !isFinite(micros)) return "—";
  return (Number(micros) / 1e6).toFixed(micros !== 0 && Math.abs(micros) < 10000 ? 6 : 2);
}

function runOut(r) {
  switch (r && r.state) {
    case "at": return fmtTime(r.at);
    case "spent": return "spent";
    case "never": return "not at this rate (nothing burning)";
    case "after_reset": return "not before the reset";
    case "unknown": return "not known yet (under a minute seen)";
    default: return "—";
  }
}

function burn(v) {
  return v === null || v === undefined ? "—" : money(v) + " / h";
}

function used(row) {
  const b = row.daily_budget_micros;
  if (!b) return "—";
  return num(100 * row.spent_today_micros / b, 1) + " %" + (row.per_caller ? " of one caller's" : "");
}

function emptyRow(cols, text) {
  return el("tr", {}, el("td", { colspan: String(cols), class: "muted" }, text));
}

function renderMoney(h) {
  const m = h.money;
  const note = $("#money-note");
  if (!m || !m.enabled) {
    note.textContent = "Not configured: give the sidecar envoy_admin.url (or --envoy-admin) to read spend and budgets from Envoy's stats.";
    for (const id of ["#budgets", "#rungs", "#spenders", "#saved"]) $(id + " tbody").replaceChildren();
    return;
  }
  note.textContent = "Counted since " + fmtTime(m.since) + " · resets " + fmtTime(m.resets_at) + " · last read " + fmtTime(m.last_scrape);
  note.className = "muted";
  const levels = m.levels.map(r => el("tr", { class: "budget " + r.run_out.state, "data-level": r.level, "data-name": r.name },
    el("td", {}, r.level), el("td", {}, r.name), el("td", { class: "spent" }, money(r.spent_today_micros)),
    el("td", {}, r.daily_budget_micros === null ? "—" : money(r.daily_budget_micros) + (r.per_caller ? " per caller" : "")),
    el("td", {}, used(r)), el("td", {}, burn(r.burn_per_hour_micros)), el("td", { class: "run-out" }, runOut(r.run_out))));
  if (!levels.length) levels.push(emptyRow(7, "No spend or budget in Envoy's stats yet."));
  $("#budgets tbody").replaceChildren(...levels);
  const rungs = m.rungs.map(r => el("tr", { class: String(r.state), "data-provider": r.name },
    el("td", {}, r.name), el("td", { class: "state", title: r.reason || "" }, String(r.state)),
    el("td", { class: "spent" }, money(r.spent_today_micros)), el("td", {}, money(r.daily_budget_micros)),
    el("td", {}, burn(r.burn_per_hour_micros)), el("td", { class: "run-out" }, runOut(r.run_out))));
  if (!rungs.length) rungs.push(emptyRow(6, "No rung watched (envoy_admin.rungs)."));
  $("#rungs tbody").replaceChildren(...rungs);
  const top = m.top_spenders || { enabled: false, rows: [] };
  const spenders = (top.rows || []).map(r => el("tr", { class: "spender", "data-principal": r.principal },
    el("td", { class: "principal" }, r.principal), el("td", {}, r.tier || "—"),
    el("td", { class: "spent" }, money(r.spent_today_micros)),
    el("td", {}, r.daily_budget_micros === null ? "—" : money(r.daily_budget_micros)),
    el("td", {}, burn(r.burn_per_hour_micros)), el("td", { class: "run-out" }, runOut(r.run_out))));
  if (!spenders.length) spenders.push(emptyRow(6, top.enabled ? "No spend in the audit log today." : "Not configured: give the sidecar envoy_admin.audit_log (the audit access log's path)."));
  $("#spenders tbody").replaceChildren(...spenders);
  const saved = m.saved.map(r => el("tr", { class: "saved", "data-tier": r.tier, "data-model": r.model },
    el("td", {}, r.tier), el("td", {}, r.model), el("td", { class: "tokens" }, num(r.tokens)),
    el("td", { class: "spend" }, money(r.spend_micros))));
  if (!saved.length) saved.push(emptyRow(4, "No cache hit counted by Envoy."));
  $("#saved tbody").replaceChildren(...saved);
}

// ---- the loop ------------------------------------------------------------

async function refresh() {
  clearTimeout(timer);
  try {
    const res = await fetch("/v1/history", { cache: "no-store", credentials: "omit" });
    if (!res.ok) throw new Error("status " + res.status);
    const h = await res.json();
    current = h;
    renderKillSwitch(h.state.kill_switch);
    renderGpus(h);
    renderBackends(h);
    renderBreakers(h);
    renderTimeline(h);
    renderTraffic(h);
    renderCache(h);
    renderMoney(h);
    const st = $("#status");
    st.textContent = "State version " + h.state.version + " · updated " + fmtTime(h.state.updated_at) +
      " · read " + fmtTime(h.now) + (h.state.stale ? " · some data is STALE" : "");
    st.className = h.state.stale ? "bad" : "muted";
    document.body.dataset.loaded = "true";
  } catch (e) {
    const st = $("#status");
    st.textContent = "Cannot read the sidecar (" + e.message + "); retrying.";
    st.className = "bad";
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("#ks-form").addEventListener("submit", flip);
  refresh();
});
