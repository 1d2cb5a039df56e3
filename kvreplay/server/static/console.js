// kvreplay console: a chat over /v1/chat/completions (streamed) and a live KV map polled from
// /v1/kv/state (engine/kv_map.py draws each state). Talks to its own origin only. Opened from a
// `bench serve --kv-map` file it replays the states embedded in #kv-states instead.
"use strict";
(() => {
  const ZONES = {
    sinks: "sinks", protected: "protected", window: "hot window", heavy: "heavy hitters",
    hot: "hot middle", cold: "cold", dropped: "dropped (key index)", evicted: "evicted",
    replaying: "replaying", pending: "no K/V yet",
  };
  const TIERS = [["hot", "--z-hot"], ["cold", "--z-cold"], ["index", "--z-dropped"]];
  const LIVE_SPAN_S = 120;  // the usage chart's span while live
  const $ = (id) => document.getElementById(id);
  const query = new URLSearchParams(location.search);
  const pollMs = Math.max(50, Number(query.get("poll")) || 250);
  const embedded = $("kv-states");
  let key = sessionStorage.getItem("kvreplay-api-key") || "";
  let states = [];   // oldest first
  let shown = -1;    // index of the state drawn (snapshot mode: the scrubber's)
  let pollTimer = null;

  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const el = (tag, attrs = {}, text = "") => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text) node.textContent = text;
    return node;
  };
  const authHeaders = (extra = {}) => (key ? { ...extra, Authorization: "Bearer " + key } : extra);
  const fmt = (x, digits = 1) => (Number.isFinite(x) ? x.toFixed(digits) : "-");
  const pct = (x) => (Number.isFinite(x) ? (100 * x).toFixed(1) + "%" : "-");

  // ------------------------------------------------------------------ API key
  function askKey(message) {
    $("key-error").textContent = message;
    $("key-dialog").hidden = false;
    $("key-input").focus();
  }
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    key = $("key-input").value.trim();
    sessionStorage.setItem("kvreplay-api-key", key);
    $("key-dialog").hidden = true;
    poll();
  });

  // ------------------------------------------------------------------ live state
  async function poll() {
    clearTimeout(pollTimer);
    try {
      const response = await fetch("/v1/kv/state", { headers: authHeaders(), cache: "no-store" });
      if (response.status === 401) {
        $("status").textContent = "needs the API key";
        askKey(key ? "That key was refused." : "");
        return;  // polling resumes once a key is given
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const state = await response.json();
      states.push(state);
      while (states.length > 2 && state.time - states[0].time > LIVE_SPAN_S) states.shift();
      shown = states.length - 1;
      $("status").textContent = "live, step " + state.step;
      draw();
    } catch (error) {
      $("status").textContent = "offline (" + error.message + ")";
    }
    pollTimer = setTimeout(poll, pollMs);
  }

  // ------------------------------------------------------------------ drawing
  function draw() {
    const state = states[shown];
    if (!state) return;
    const p = state.policy;
    $("policy").textContent = `policy ${p.name}, trim ${p.trim}` +
      (p.resident_ratio != null ? `, resident ratio ${p.resident_ratio}` : "") +
      `, ${state.pool.num_blocks} blocks of ${state.pool.block_size} tokens`;
    drawCounters(state);
    drawUsage(state);
    drawRequests(state);
  }

  // The state about `seconds` before states[shown] (the oldest one there is when fewer).
  function before(seconds) {
    const now = states[shown];
    let i = shown;
    while (i > 0 && now.time - states[i - 1].time <= seconds) i--;
    return states[i];
  }

  function perMinute(then, now, read) {
    const dt = now.time - then.time;
    return dt > 0 ? (60 * (read(now) - read(then))) / dt : NaN;
  }

  function drawCounters(state) {
    const minute = before(60), recent = before(5);
    const t = (s) => s.totals || {}, c = (s) => s.counters || {};
    const sparse = c(state).sparse_candidate_blocks ? c(state).sparse_selected_blocks / c(state).sparse_candidate_blocks : NaN;
    const decodeDt = state.time - recent.time;
    const rows = [
      ["running / waiting", `${state.num_running} / ${state.num_waiting}`],
      ["pool used", pct(state.usage.used)],
      ["replays / min", fmt(perMinute(minute, state, (s) => t(s).replays || 0))],
      ["replayed tokens / min", fmt(perMinute(minute, state, (s) => t(s).replayed_tokens || 0), 0)],
      ["pauses", String(c(state).pauses || 0)],
      ["prefix hit rate", pct((t(state).prefix_hit_tokens || 0) / (t(state).prompt_tokens || NaN))],
      ["sparse hit rate", pct(sparse)],
      ["decode tokens / s", fmt(decodeDt > 0 ? (c(state).generation_tokens - c(recent).generation_tokens) / decodeDt : NaN)],
    ];
    const list = $("counters");
    list.replaceChildren(...rows.map(([name, value]) => {
      const box = el("div", { "data-counter": name });
      box.append(el("dt", {}, name), el("dd", {}, value));
      return box;
    }));
  }

  function drawUsage(state) {
    const canvas = $("usage");
    const width = canvas.clientWidth || canvas.width, height = canvas.height;
    canvas.width = width;
    const g = canvas.getContext("2d");
    g.clearRect(0, 0, width, height);
    const last = embedded ? states[states.length - 1].time : state.time;
    const first = embedded ? states[0].time : last - LIVE_SPAN_S;
    const span = Math.max(last - first, 1e-9);
    const x = (s) => ((s.time - first) / span) * (width - 2) + 1;
    const y = (fraction) => height - 1 - fraction * (height - 2);
    let base = states.map(() => 0);
    for (const [tier, colour] of TIERS) {  // stacked areas: hot, cold, key index
      const top = states.map((s, i) => base[i] + (s.usage[tier] || 0));
      g.beginPath();
      states.forEach((s, i) => g.lineTo(x(s), y(top[i])));
      for (let i = states.length - 1; i >= 0; i--) g.lineTo(x(states[i]), y(base[i]));
      g.closePath();
      g.fillStyle = css(colour);
      g.fill();
      base = top;
    }
    g.setLineDash([5, 4]);
    for (const [name, colour] of [["low", "#2f8f46"], ["admit", "#e0a100"], ["high", "#d9534f"]]) {
      const level = y(state.watermarks[name]);
      g.strokeStyle = colour;
      g.beginPath(); g.moveTo(0, level); g.lineTo(width, level); g.stroke();
      g.fillStyle = colour;
      g.fillText(name, 4, level - 3);
    }
    g.setLineDash([]);
    if (embedded) {  // the scrubber's time
      g.strokeStyle = "#222";
      g.beginPath(); g.moveTo(x(state), 0); g.lineTo(x(state), height); g.stroke();
    }
  }

  function drawRequests(state) {
    const box = $("requests");
    if (!state.sequences.length) {
      box.replaceChildren(el("p", { class: "empty" }, "No request is running."));
      return;
    }
    box.replaceChildren(...state.sequences.map((seq) => {
      const row = el("div", { class: "req", "data-request": seq.request_id, "data-seq": seq.seq_id });
      const label = el("div", { class: "req-label" });
      label.append(el("span", {}, `${seq.request_id}${seq.branch ? " #" + seq.branch : ""}`),
                   el("span", {}, seq.status),
                   el("span", {}, `${seq.num_computed_tokens} / ${seq.num_tokens} tokens`),
                   el("span", {}, `replays ${seq.stats.replays}, dropped ${seq.stats.dropped_tokens}`));
      if (seq.replaying) label.append(el("span", { class: "badge" }, "replaying"));
      const bar = el("div", { class: "bar" });
      let position = 0;
      for (const [zone, count] of seq.runs) {
        const title = `${ZONES[zone] || zone}: tokens ${position}-${position + count - 1}`;
        const run = el("span", { class: "z-" + zone, "data-zone": zone, title });
        run.style.flexGrow = String(count);
        bar.append(run);
        position += count;
      }
      row.append(label, bar);
      return row;
    }));
  }

  function drawLegends() {
    const swatch = (cls, text) => {
      const item = el("span");
      item.append(el("span", { class: "swatch " + cls }), text);
      return item;
    };
    $("zone-legend").replaceChildren(...Object.entries(ZONES).map(([z, text]) => swatch("z-" + z, text)));
    $("usage-legend").replaceChildren(swatch("z-hot", "hot"), swatch("z-cold", "cold"),
      swatch("z-dropped", "key index"), el("span", {}, "dashed: low / admit / high watermarks"));
  }

  // ------------------------------------------------------------------ chat
  let conversation = [];
  $("new-chat").addEventListener("click", () => { conversation = []; $("messages").replaceChildren(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("chat-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text) return;
    $("prompt").value = "";
    $("send").disabled = true;
    conversation.push({ role: "user", content: text });
    $("messages").append(el("div", { class: "msg user" }, text));
    const answer = el("div", { class: "msg assistant" });
    $("messages").append(answer);
    try {
      const reply = await streamChat(answer);
      conversation.push({ role: "assistant", content: reply });
    } catch (error) {
      answer.className = "msg error";
      answer.textContent = error.message;
      conversation.pop();
    } finally {
      $("send").disabled = false;
    }
  });

  async function streamChat(answer) {
    const system = $("system").value.trim();
    const body = {
      messages: (system ? [{ role: "system", content: system }] : []).concat(conversation),
      temperature: Number($("temperature").value), max_tokens: Math.max(1, Math.round(Number($("max-tokens").value))),
      stream: true, stream_options: { include_usage: true },
    };
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders({ "Content-Type": "application/json" }), body: JSON.stringify(body),
    });
    if (response.status === 401) askKey("The server refused the key.");
    if (!response.ok) {
      const detail = await response.json().catch(() => ({}));
      throw new Error(`HTTP ${response.status}: ${(detail.error && detail.error.message) || response.statusText}`);
    }
    const text = el("span", { class: "answer" });
    answer.append(text);
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "", reply = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          for (const choice of chunk.choices || []) {
            reply += (choice.delta && choice.delta.content) || "";
            text.textContent = reply;
          }
          if (chunk.usage) answer.append(usageLine(chunk.usage));
        }
      }
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    return reply;
  }

  function usageLine(usage) {
    const line = el("div", { class: "usage" });
    const kv = usage.kv || {};
    for (const [name, value] of Object.entries(kv)) {
      if (value) line.append(el("span", { "data-kv": name }, `${name} ${Number.isInteger(value) ? value : value.toFixed(3)}`));
    }
    if (!line.childNodes.length) line.append(el("span", {}, "usage.kv: all zero"));
    return line;
  }

  // ------------------------------------------------------------------ start
  drawLegends();
  if (embedded) {  // a recorded run (bench serve --kv-map): scrub through its states
    const recording = JSON.parse(embedded.textContent);
    document.body.classList.add("snapshot");
    document.title = recording.title;
    states = recording.states;
    shown = states.length - 1;
    const scrub = $("scrub");
    $("scrub-row").hidden = false;
    scrub.max = String(Math.max(0, states.length - 1));
    scrub.value = String(shown);
    const show = () => {
      shown = Number(scrub.value);
      const s = states[shown];
      $("scrub-label").textContent = s ? `t = ${fmt(s.time - states[0].time, 2)} s, step ${s.step}` : "";
      draw();
    };
    scrub.addEventListener("input", show);
    $("status").textContent = `recorded: ${states.length} states`;
    show();
  } else {
    poll();
  }
})();
