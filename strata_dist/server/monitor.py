"""The Monitor page at `/`: one card per device (a rank that runs a stage and hosts a helper tier
is one card), refreshed from `/v1/status` once a second. With --api-key, open `/?api_key=K`: the
page sends the key to /v1/status as a bearer token."""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>strata-dist monitor</title>
<style>
  :root { --bg:#0f1419; --card:#18202a; --fg:#e6e6e6; --dim:#8a96a3; --acc:#4fb3ff; --ok:#3ecf8e;
          --warn:#f5a524; --bad:#ff5d5d; --bar:#2a3542; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif; background:var(--bg);
         color:var(--fg); }
  header { display:flex; flex-wrap:wrap; gap:24px; align-items:baseline; padding:16px 24px;
           border-bottom:1px solid var(--bar); }
  header h1 { font-size:18px; margin:0; }
  .stat { color:var(--dim); }
  .stat b { color:var(--fg); font-size:16px; font-variant-numeric:tabular-nums; }
  .state-ready { color:var(--ok); } .state-loading { color:var(--warn); } .state-failed { color:var(--bad); }
  main { display:grid; grid-template-columns:repeat(auto-fill,minmax(300px,1fr)); gap:16px; padding:24px; }
  .card { background:var(--card); border-radius:10px; padding:16px; border:1px solid var(--bar); }
  .card h2 { font-size:15px; margin:0 0 4px; display:flex; justify-content:space-between; }
  .role { font-size:12px; padding:2px 8px; border-radius:10px; background:var(--bar); color:var(--acc); }
  .sub { color:var(--dim); font-size:12px; margin-bottom:10px; }
  table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
  td { padding:2px 0; } td.v { text-align:right; }
  .mem { margin-top:10px; }
  .barbox { height:8px; background:var(--bar); border-radius:4px; overflow:hidden; margin-top:4px; }
  .barfill { height:100%; background:var(--acc); width:0%; }
  .rates { margin-top:8px; color:var(--dim); font-size:12px; }
  #error { color:var(--bad); padding:0 24px; }
</style>
</head>
<body>
<header>
  <h1>strata-dist</h1>
  <span class="stat">model <b id="model">–</b></span>
  <span class="stat">state <b id="state">–</b></span>
  <span class="stat">tok/s <b id="tok_s" data-field="tok_s">0.0</b></span>
  <span class="stat">queue <b id="queue">0</b></span>
  <span class="stat">generated <b id="generated">0</b></span>
  <span class="stat">expert slots <b id="slots">0</b></span>
  <span class="stat">predicted <b id="pred">–</b> ms/token</span>
</header>
<div id="error"></div>
<main id="cards"></main>
<script>
"use strict";
const key = new URLSearchParams(location.search).get("api_key");
const headers = key ? {"Authorization": "Bearer " + key} : {};
const fmt = (x, d = 1) => (x === null || x === undefined) ? "–" : Number(x).toFixed(d);
const ROWS = [["weights", "weights"], ["kv", "KV"], ["prompt_loan", "prompt loan"],
              ["expert_cache", "expert cache"], ["helper", "helper"]];

function card(r) {
  let el = document.querySelector(`.card[data-rank="${r.rank}"]`);
  if (!el) {
    el = document.createElement("section");
    el.className = "card";
    el.dataset.rank = r.rank;
    el.innerHTML = `<h2><span>rank <span data-field="rank"></span> · <span data-field="device"></span></span>
      <span class="role" data-field="role"></span></h2>
      <div class="sub">layers <span data-field="layers"></span> · <span data-field="host"></span></div>
      <table>${ROWS.map(([k, label]) =>
        `<tr><td>${label}</td><td class="v"><span data-field="${k}"></span> MiB</td></tr>`).join("")}
      </table>
      <div class="mem">memory <span data-field="mem_used"></span> / <span data-field="mem_total"></span> MiB
        <span class="sub" data-field="mem_source"></span>
        <div class="barbox"><div class="barfill"></div></div></div>
      <div class="rates" data-field="rates"></div>`;
    document.getElementById("cards").appendChild(el);
  }
  const set = (f, v) => { el.querySelector(`[data-field="${f}"]`).textContent = v; };
  set("rank", r.rank);
  set("device", r.device.name);
  set("role", r.role);
  set("layers", r.lb === null ? "none (helper)" : `[${r.lb}, ${r.le})`);
  set("host", `${r.device.host} pid ${r.device.pid}`);
  for (const [k] of ROWS) set(k, fmt(r.mib[k], 1));
  const m = r.memory || {};
  set("mem_used", fmt((m.used_bytes || 0) / 1048576, 1));
  set("mem_total", fmt((m.total_bytes || 0) / 1048576, 1));
  set("mem_source", m.source ? `(${m.source})` : "");
  el.querySelector(".barfill").style.width =
    m.total_bytes ? Math.min(100, 100 * m.used_bytes / m.total_bytes) + "%" : "0%";
  const rates = Object.entries(r.hit_rates || {}).map(([t, v]) => `${t} ${(100 * v).toFixed(1)}%`);
  set("rates", rates.length ? "expert lookups: " + rates.join(" · ") : "");
}

async function tick() {
  try {
    const res = await fetch("/v1/status", {headers, cache: "no-store"});
    const s = await res.json();
    if (!res.ok) throw new Error((s.error && s.error.message) || res.statusText);
    document.getElementById("error").textContent = s.error || "";
    document.getElementById("model").textContent = s.model ? s.model.id : "–";
    const st = document.getElementById("state");
    st.textContent = s.state + (s.loading && s.state === "loading" ?
      ` (${s.loading.ranks_ready}/${s.loading.ranks_total} ranks)` : "");
    st.className = "state-" + s.state;
    document.getElementById("tok_s").textContent = fmt(s.throughput.tokens_per_second, 1);
    document.getElementById("queue").textContent =
      `${s.queue ? s.queue.waiting : 0}/${s.queue ? s.queue.capacity : 0}` +
      (s.queue && s.queue.running ? " +1 running" : "");
    document.getElementById("generated").textContent = s.requests ? s.requests.generated_tokens : 0;
    document.getElementById("slots").textContent = s.totals.expert_slots;
    document.getElementById("pred").textContent = fmt(s.totals.predicted_ms_per_token, 3);
    for (const r of s.ranks) card(r);
    document.body.dataset.loaded = s.ranks.length ? "1" : "0";
  } catch (e) {
    document.getElementById("error").textContent = "status: " + e.message;
  }
}
tick();
setInterval(tick, 1000);
</script>
</body>
</html>
"""
