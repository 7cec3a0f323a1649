// halo chat page and cluster view: plain JS, talks to the same server's OpenAI-compatible API.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, chat: false, history: [], abort: null };

function apiKey() { return $("api-key").value.trim(); }
function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

// Server-sent events over fetch (EventSource cannot send the API key): yields each event's data.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

async function errorText(response) {
  try { return (await response.json()).error.message; } catch { return "HTTP " + response.status; }
}

// ---- the model ---------------------------------------------------------------------------------------------------
async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) { $("model-name").textContent = "API key needed"; $("api-key").focus(); return false; }
  if (!r.ok) { $("model-name").textContent = await errorText(r); return false; }
  const card = (await r.json()).data[0];
  state.model = card.id;
  state.chat = !!(card.halo && card.halo.chat_template);
  $("model-name").textContent = card.id + (card.halo ? " · context " + card.halo.context : "");
  $("mode").textContent = state.chat ? "chat (the model's template)"
                                     : "this model has no chat template: it continues your text";
  return true;
}

// ---- chat --------------------------------------------------------------------------------------------------------
function bubble(kind, text) {
  const div = document.createElement("div");
  div.className = "msg " + kind;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function send(text) {
  if (!state.model && !(await loadModel())) return;
  bubble("user", text);
  const out = bubble("assistant streaming", "");
  const body = { model: state.model, stream: true, stream_options: { include_usage: true },
                 max_tokens: parseInt($("max-tokens").value, 10) || 128,
                 temperature: parseFloat($("temperature").value) || 0 };
  let url;
  if (state.chat) {
    state.history.push({ role: "user", content: text });
    body.messages = state.history;
    url = "/v1/chat/completions";
  } else {
    body.prompt = text;
    out.textContent = text;
    url = "/v1/completions";
  }
  state.abort = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const started = performance.now();
  let answer = "", usage = null, first = null, finish = null;
  try {
    const r = await fetch(url, { method: "POST", headers: headers(true), body: JSON.stringify(body),
                                 signal: state.abort.signal });
    if (!r.ok) throw new Error(await errorText(r));
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = state.chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
        if (piece && first === null) first = performance.now();
        answer += piece;
        out.textContent += piece;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    if (state.chat) state.history.push({ role: "assistant", content: answer });
    const meta = document.createElement("span");
    meta.className = "meta";
    const secs = (performance.now() - started) / 1000;
    meta.textContent = (usage ? usage.completion_tokens + " tokens · " : "") +
      (first !== null ? "first token " + ((first - started) / 1000).toFixed(2) + " s · " : "") +
      secs.toFixed(2) + " s" + (finish ? " · " + finish : "");
    out.appendChild(meta);
  } catch (e) {
    if (state.chat) state.history.pop();
    if (e.name === "AbortError") { out.appendChild(Object.assign(document.createElement("span"), { className: "meta", textContent: "stopped" })); }
    else { out.className = "msg error"; out.textContent = e.message; }
  } finally {
    out.classList.remove("streaming");
    $("send").disabled = false; $("stop").disabled = true;
    state.abort = null;
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value;
  if (!text.trim()) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("api-key").value = localStorage.getItem("halo-api-key") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("halo-api-key", apiKey());
  loadModel();
  watchCluster();
});

// ---- the cluster view --------------------------------------------------------------------------------------------
const fmt = (v, digits = 2, unit = "") => (v === null || v === undefined ? "–" : Number(v).toFixed(digits) + unit);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const pct = (v, digits = 1) => (v === null || v === undefined ? "–" : (100 * v).toFixed(digits) + " %");

function cell(row, html, title) {
  const td = document.createElement("td");
  td.innerHTML = html;
  if (title) td.title = title;
  row.appendChild(td);
}

function render(s) {
  $("state").textContent = s.state;
  $("state").className = "pill " + s.state;
  const cur = s.current || {};
  $("tokens-per-s").textContent = fmt(cur.tokens_per_s, 1);
  $("ms-per-token").textContent = fmt(cur.ms_per_token, 2);
  $("queue").textContent = s.queue.waiting + " / " + s.queue.limit;
  $("slots").textContent = (s.queue.slots_busy ?? 0) + " / " + (s.queue.slots ?? 1);
  const req = s.totals.requests;
  $("requests").textContent = Object.values(req).reduce((a, b) => a + b, 0);
  $("requests").parentElement.title = Object.entries(req).map(([k, v]) => k + " " + v).join(", ");
  $("rebuilds").textContent = s.totals.rebuilds;
  const replans = s.replans || { count: 0 };
  $("replans").textContent = replans.count;
  $("replans").parentElement.title = replans.last ? `last: ${replans.last.cause} (lost ${replans.last.lost.join(", ") || "none"}, `
    + `back ${replans.last.joined.join(", ") || "none"}) in ${replans.last.seconds} s, ${replans.last.replayed_tokens} tokens replayed` : "";
  $("sync-mode").textContent = s.sync;
  const tbody = $("devices").querySelector("tbody");
  tbody.replaceChildren();
  for (const d of s.devices || []) {
    const tr = document.createElement("tr");
    tr.dataset.device = d.name;
    cell(tr, `${esc(d.name)}<span class="endpoint">${d.role === "master" ? "master · " : ""}${esc(d.endpoint)}</span>`);
    cell(tr, d.alive ? '<span class="up">●</span>' : '<span class="down">●</span>', d.error || "");
    const share = d.share || 0;
    cell(tr, `<span class="share"><span class="bar" style="width:${Math.round(60 * share)}px"></span>${pct(share, 0)}</span>`,
         d.role === "stage" ? `pipeline stage: ${d.endpoint}`
                            : `${d.heads} heads, ${d.mlp_groups} MLP groups, ${d.vocab_groups} vocabulary groups`);
    cell(tr, fmt(d.compute_ms_per_token, 3));
    if (d.role !== "master" && d.sync_ms_per_token == null && d.sync_ms_p50 != null) {
      cell(tr, `<span class="hint">gather p50</span> ${fmt(d.sync_ms_p50, 2)}`,
           "UDP sync: the runtime times whole gathers, not each device per token");
    } else {
      cell(tr, d.role === "master" ? "–" : fmt(d.sync_ms_per_token, 3));
    }
    cell(tr, d.role === "master" ? "–" : pct(d.link_plr));
    cell(tr, d.role === "master" ? "–" : fmt(d.rtt_ms, 3));
    cell(tr, d.observed_plr == null ? "–" : pct(d.observed_plr, 2));
    cell(tr, d.chunks_recovered == null ? "–" : d.chunks_recovered + " / " + d.chunks_missing);
    tbody.appendChild(tr);
  }
  const loss = s.loss;
  const layers = $("loss-layers");
  layers.replaceChildren();
  if (loss && s.sync !== "reliable") {
    $("loss-summary").textContent = `${loss.partials_dropped} of ${loss.partials} partial sums lost chunks · ` +
      `${fmt(loss.groups_dropped, 1)} of ${loss.groups_offered_lossy} groups dropped · predicted rank of what was ` +
      `dropped: mean ${fmt(loss.dropped_rank_mean, 1)}, best ${loss.dropped_rank_min ?? "–"} (0 = most important)`;
    const byLayer = loss.dropped_by_layer || {};
    if (Object.keys(byLayer).length) {
      const legend = document.createElement("div");
      legend.className = "hint legend";
      legend.innerHTML = '<span class="key att"></span> attention heads <span class="key mlp"></span> MLP groups ' +
        "(groups × fraction of their partial sum lost, since the cluster started)";
      layers.appendChild(legend);
    }
    const max = Math.max(1e-9, ...Object.values(byLayer).map((v) => (v.attention || 0) + (v.mlp || 0)));
    for (const [layer, v] of Object.entries(byLayer)) {
      const row = document.createElement("div");
      row.className = "row";
      const a = 100 * (v.attention || 0) / max, m = 100 * (v.mlp || 0) / max;
      row.innerHTML = `<span>layer ${layer}</span><span class="bars" title="attention heads ${fmt(v.attention)}, MLP groups ${fmt(v.mlp)}">` +
        `<span class="att" style="width:${a}%"></span><span class="mlp" style="width:${m}%"></span></span>` +
        `<span>${fmt((v.attention || 0) + (v.mlp || 0), 1)}</span>`;
      layers.appendChild(row);
    }
  } else {
    $("loss-summary").textContent = "sync " + s.sync + ": partial sums travel reliably, nothing is dropped";
  }
  $("gaps").hidden = !(s.gaps || []).length;  // nothing the runtime lacks: no note
  const gaps = $("gaps").querySelector("ul");
  gaps.replaceChildren(...(s.gaps || []).map((g) => Object.assign(document.createElement("li"), { textContent: g })));
  const err = s.totals.last_error;
  $("last-error").hidden = !err;
  $("last-error").textContent = err ? "last error: " + err : "";
}

let watching = null;
async function watchCluster() {
  if (watching) watching.abort();
  const controller = new AbortController();
  watching = controller;
  for (;;) {
    try {
      const r = await fetch("/v1/halo/cluster/events", { headers: headers(), signal: controller.signal });
      if (r.status === 401) { $("state").textContent = "API key needed"; return; }
      for await (const data of sseData(r)) render(JSON.parse(data));
    } catch (e) {
      if (controller.signal.aborted) return;
    }
    $("state").textContent = "reconnecting";
    $("state").className = "pill down";
    await new Promise((ok) => setTimeout(ok, 2000));
  }
}

loadModel();
watchCluster();
