// The kimi-mlx chat page: plain JavaScript, no build step, nothing loaded from the network. It talks to the server's
// /v1/status and /v1/chat/completions (streamed, with usage), keeps conversations in localStorage and the API key in
// localStorage ("kimi-mlx.key"). Model text is rendered by the small Markdown renderer below, which escapes HTML
// first and only makes links with http(s) and mailto targets.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = { convs: "kimi-mlx.conversations", current: "kimi-mlx.current", settings: "kimi-mlx.settings",
                key: "kimi-mlx.key" };
const NO_TOOL_RESULT = "(not run: the chat page runs no tools)";
const state = { status: null, convs: [], current: null, running: null, attachments: [],
                settings: { system: "", temperature: "", top_p: "", max_tokens: "", thinking: true, effort: "" } };

// ---- Markdown (escape first, then a small safe subset) ----
function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;")
          .replace(/'/g, "&#39;");
}
function safeUrl(url) {
  const u = url.replace(/&amp;/g, "&").trim();
  return /^(https?:|mailto:)/i.test(u) ? escapeHtml(u) : null;
}
function inline(text) {  // text is already escaped
  const codes = [];
  text = text.replace(/`([^`\n]+)`/g, (m, c) => { codes.push(c); return "\u0000" + (codes.length - 1) + "\u0000"; });
  text = text.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (m, label, url) => {
    const safe = safeUrl(url);
    return safe ? `<a href="${safe}" target="_blank" rel="noopener noreferrer">${label}</a>` : m;
  });
  text = text.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
  text = text.replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>").replace(/(^|\W)_([^_\n]+)_(?=\W|$)/g, "$1<em>$2</em>");
  return text.replace(/\u0000(\d+)\u0000/g, (m, i) => `<code>${codes[+i]}</code>`);
}
function renderMarkdown(src) {
  const lines = escapeHtml(src).split("\n");
  const out = [];
  let para = [], list = null, code = null;
  const flushPara = () => { if (para.length) out.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`); para = []; };
  const flushList = () => { if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`); list = null; };
  for (const line of lines) {
    if (code) {
      if (/^\s*```/.test(line)) { out.push(`<pre><code${code.lang}>${code.lines.join("\n")}</code></pre>`); code = null; }
      else code.lines.push(line);
      continue;
    }
    const fence = line.match(/^\s*```\s*([\w+-]*)/);
    if (fence) { flushPara(); flushList(); code = { lang: fence[1] ? ` class="language-${fence[1]}"` : "", lines: [] }; continue; }
    const head = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    if (head) { flushPara(); flushList(); const n = Math.min(head[1].length + 2, 6); out.push(`<h${n}>${inline(head[2])}</h${n}>`); }
    else if (item) {
      flushPara();
      const tag = /\d/.test(item[1]) ? "ol" : "ul";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push(item[2]);
    } else if (!line.trim()) { flushPara(); flushList(); }
    else { flushList(); para.push(line); }
  }
  if (code) out.push(`<pre><code${code.lang}>${code.lines.join("\n")}</code></pre>`);  // still streaming
  flushPara(); flushList();
  return out.join("");
}

// ---- Storage ----
function load(key, fallback) {
  try { const v = localStorage.getItem(key); return v === null ? fallback : JSON.parse(v); } catch (e) { return fallback; }
}
function saveConvs() {
  try {
    localStorage.setItem(STORE.convs, JSON.stringify(state.convs));
    localStorage.setItem(STORE.current, JSON.stringify(state.current));
  } catch (e) {  // the browser's quota (images take room): the conversations stay in this tab
    showBanner("could not save the conversations in this browser (" + e.name + "): export or delete some");
  }
}
function saveSettings() { localStorage.setItem(STORE.settings, JSON.stringify(state.settings)); }
function apiKey() { return localStorage.getItem(STORE.key) || ""; }
function conv() { return state.convs.find((c) => c.id === state.current) || null; }
function newConv(messages = [], title = "New chat") {
  const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 7), title, messages,
              created: new Date().toISOString() };
  state.convs.unshift(c);
  state.current = c.id;
  saveConvs();
  return c;
}

// ---- API ----
function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = "Bearer " + apiKey();
  return h;
}
async function errorText(resp) {
  let msg = `HTTP ${resp.status}`;
  try { const body = await resp.json(); if (body.error && body.error.message) msg += ": " + body.error.message; } catch (e) { /* not JSON */ }
  if (resp.status === 401) msg += apiKey() ? " — the API key was refused; enter the right one above." : " — this server needs an API key; enter it above.";
  return msg;
}
function showBanner(text) { $("banner").textContent = text; $("banner").hidden = !text; }
function needKey(text) { $("key-form").hidden = false; showBanner(text); $("api-key").focus(); }

async function refreshStatus() {
  let resp;
  try { resp = await fetch("/v1/status", { headers: headers() }); } catch (e) { showBanner("cannot reach the server: " + e); return; }
  if (resp.status === 401) { needKey(await errorText(resp)); return; }
  if (!resp.ok) { showBanner("status: " + await errorText(resp)); setTimeout(refreshStatus, 1000); return; }
  state.status = await resp.json();
  $("key-form").hidden = true;
  showBanner("");
  renderStatus();
}
function gb(bytes) { return (bytes / 1e9).toFixed(3) + " GB"; }
function renderStatus() {
  const s = state.status, st = s.stats, pc = st.prefix_cache;
  $("model-name").textContent = `${s.model} (${s.chat_format})`;
  const rows = [["Model", s.model], ["Chat format", s.chat_format + (s.k3 ? " (Kimi-K3)" : "")],
    ["Images", s.images ? "yes" : "no: " + s.no_images], ["Context", s.max_context + " tokens"],
    ["Weights", gb(s.weights_bytes)], ["Memory", `${gb(s.memory.active_bytes)} active, ${gb(s.memory.peak_bytes)} peak`],
    ["Prefix cache", pc ? `${pc.entries} entries, ${gb(pc.bytes)}` : "off"],
    ["Running", String(st.running)], ["Prefilling", String(st.prefilling)], ["Queued", String(st.queued)],
    ["Finished", String(st.finished)], ["Ranks", String(s.ranks)]];
  if (st.images_encoded !== null) rows.push(["Images encoded", String(st.images_encoded)]);
  const dl = $("status-list");
  dl.replaceChildren();
  for (const [k, v] of rows) {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k; dd.textContent = v; dd.dataset.key = k;
    dl.append(dt, dd);
  }
  const attach = $("attach-label");
  $("image-input").disabled = !s.images;
  attach.classList.toggle("disabled", !s.images);
  $("images-note").textContent = s.images ? "" : "This model is text-only: it takes no images.";
  $("thinking-set").disabled = !s.k3;
  $("thinking-note").textContent = s.k3 ? "" : "This model (Kimi Linear) has no thinking mode.";
  const effort = $("set-effort");
  if (effort.options.length === 1) for (const e of s.thinking_efforts) effort.add(new Option(e, e));
  effort.value = state.settings.effort;
}

function requestBody(messages) {
  const s = state.settings, body = { model: state.status ? state.status.model : undefined, stream: true,
    stream_options: { include_usage: true }, messages: [] };
  if (s.system.trim()) body.messages.push({ role: "system", content: s.system });
  for (const m of messages) {
    if (m.role === "user") {
      body.messages.push({ role: "user", content: m.images && m.images.length ?
        [{ type: "text", text: m.content }, ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))] : m.content });
    } else if (!m.error || m.content || (m.tool_calls && m.tool_calls.length)) {
      const a = { role: "assistant", content: m.content || "" };
      body.messages.push(a);
      if (m.tool_calls && m.tool_calls.length) {  // the page runs no tools: each call is answered with that fact
        a.tool_calls = m.tool_calls;
        for (const tc of m.tool_calls) body.messages.push({ role: "tool", tool_call_id: tc.id, content: NO_TOOL_RESULT });
      }
    }
  }
  if (s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.top_p !== "") body.top_p = Number(s.top_p);
  if (s.max_tokens !== "") body.max_tokens = Number(s.max_tokens);
  if (state.status && state.status.k3) {
    body.chat_template_kwargs = { thinking: !!s.thinking };
    if (s.thinking && s.effort) body.chat_template_kwargs.thinking_effort = s.effort;
  }
  return body;
}

// Stream one assistant reply into ``msg`` (a message of the current conversation).
async function generate(c, msg) {
  const controller = new AbortController();
  state.running = { controller, msg };
  setRunning(true);
  const history = c.messages.slice(0, c.messages.indexOf(msg));
  const t0 = performance.now();
  let first = null;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(requestBody(history)), signal: controller.signal });
    if (!resp.ok) {
      msg.error = await errorText(resp);
      if (resp.status === 401) needKey(msg.error);
      return;
    }
    const reader = resp.body.getReader(), decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const data = JSON.parse(line.slice(6));
          if (first === null && data.choices && data.choices.length) first = performance.now();
          applyChunk(msg, data);
        }
        renderMessage(c, msg);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else msg.error = "request failed: " + e.message;
  } finally {
    const t1 = performance.now();
    if (msg.usage) msg.stats = stats(msg.usage, t0, first, t1);
    state.running = null;
    setRunning(false);
    saveConvs();
    renderMessages();
    refreshStatus();
  }
}
function applyChunk(msg, data) {
  if (data.error) { msg.error = data.error.message || JSON.stringify(data.error); return; }
  if (data.usage) msg.usage = data.usage;
  for (const choice of data.choices || []) {
    const d = choice.delta || {};
    if (d.reasoning_content) msg.reasoning = (msg.reasoning || "") + d.reasoning_content;
    if (d.content) msg.content += d.content;
    for (const tc of d.tool_calls || []) {
      msg.tool_calls = msg.tool_calls || [];
      const known = msg.tool_calls[tc.index];
      if (!known) msg.tool_calls[tc.index] = { id: tc.id, type: "function",
        function: { name: tc.function.name || "", arguments: tc.function.arguments || "" } };
      else known.function.arguments += tc.function.arguments || "";
    }
    if (choice.finish_reason) msg.finish = choice.finish_reason;
  }
}
function stats(usage, t0, first, t1) {
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  const gen = usage.completion_tokens;
  const decode = first !== null && gen > 1 ? (gen - 1) / ((t1 - first) / 1000) : null;
  return { prompt: usage.prompt_tokens, cached, generated: gen,
           image_tokens: (usage.prompt_tokens_details || {}).image_tokens || 0,
           ttft_s: first !== null ? (first - t0) / 1000 : null, tok_s: decode };
}
function setRunning(on) {
  $("stop").hidden = !on;
  $("send").disabled = on;
  if (on) $("stop").focus(); else if (document.activeElement === $("stop") || document.activeElement === document.body) $("input").focus();
}

// ---- Actions ----
async function send() {
  const text = $("input").value;
  if (state.running || (!text.trim() && !state.attachments.length)) return;
  const c = conv() || newConv();
  const user = { role: "user", content: text };
  if (state.attachments.length) user.images = state.attachments.slice();
  if (c.messages.length === 0 && c.title === "New chat") c.title = text.trim().slice(0, 40) || "Images";
  const reply = { role: "assistant", content: "" };
  c.messages.push(user, reply);
  $("input").value = "";
  state.attachments = [];
  renderAttachments();
  renderAll();
  await generate(c, reply);
}
async function regenerate(c, index) {  // replace the assistant message at ``index`` and what follows it
  if (state.running) return;
  c.messages.splice(index);
  const reply = { role: "assistant", content: "" };
  c.messages.push(reply);
  renderMessages();
  await generate(c, reply);
}
function editMessage(c, index, node) {
  if (state.running) return;
  const m = c.messages[index];
  const box = document.createElement("textarea");
  box.className = "edit-box"; box.value = m.content; box.rows = 3;
  box.setAttribute("aria-label", "Edit message");
  const save = button("Save and regenerate", async () => { m.content = box.value; await regenerate(c, index + 1); });
  const cancel = button("Cancel", () => renderMessages());
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); save.click(); }
    if (e.key === "Escape") cancel.click();
  });
  const actions = document.createElement("div");
  actions.className = "actions"; actions.append(save, cancel);
  node.querySelector(".body").replaceWith(box);
  node.querySelector(".actions").replaceWith(actions);
  box.focus();
}
function branch(c, index) {  // a new conversation with the messages up to and including ``index``
  if (state.running) return;
  newConv(JSON.parse(JSON.stringify(c.messages.slice(0, index + 1))), c.title + " (branch)");
  renderAll();
}

// ---- Rendering ----
function button(label, onClick, cls) {
  const b = document.createElement("button");
  b.type = "button"; b.textContent = label;
  if (cls) b.className = cls;
  b.addEventListener("click", onClick);
  return b;
}
function renderAll() { renderConversations(); renderMessages(); }
function renderConversations() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of state.convs) {
    const li = document.createElement("li");
    if (c.id === state.current) li.className = "current";
    const open = button(c.title, () => { if (state.running) return; state.current = c.id; saveConvs(); renderAll(); }, "open");
    open.setAttribute("aria-current", c.id === state.current ? "true" : "false");
    const rename = button("Rename", () => {
      const input = document.createElement("input");
      input.value = c.title; input.setAttribute("aria-label", "Conversation title");
      input.addEventListener("keydown", (e) => {
        if (e.key === "Enter") { c.title = input.value.trim() || c.title; saveConvs(); renderConversations(); }
        if (e.key === "Escape") renderConversations();
      });
      open.replaceWith(input); input.focus(); input.select();
    }, "small");
    const del = button("Delete", () => {
      if (state.running || !confirm(`Delete "${c.title}"?`)) return;
      state.convs = state.convs.filter((x) => x !== c);
      if (state.current === c.id) state.current = state.convs.length ? state.convs[0].id : null;
      saveConvs(); renderAll();
    }, "small");
    const exp = button("Export", () => {
      const a = document.createElement("a");
      a.href = URL.createObjectURL(new Blob([JSON.stringify(c, null, 2)], { type: "application/json" }));
      a.download = (c.title.replace(/[^\w.-]+/g, "_") || "conversation") + ".json";
      a.click();
      setTimeout(() => URL.revokeObjectURL(a.href), 1000);
    }, "small");
    li.append(open, rename, del, exp);
    ul.append(li);
  }
}
function renderMessages() {
  const box = $("messages"), c = conv();
  box.replaceChildren();
  if (!c) return;
  c.messages.forEach((m, i) => box.append(messageNode(c, m, i)));
  box.scrollTop = box.scrollHeight;
}
function renderMessage(c, m) {
  const i = c.messages.indexOf(m), old = $("messages").children[i];
  if (old) old.replaceWith(messageNode(c, m, i));
  $("messages").scrollTop = $("messages").scrollHeight;
}
function messageNode(c, m, i) {
  const node = document.createElement("div");
  node.className = "msg " + m.role;
  node.dataset.index = i;
  const role = document.createElement("div");
  role.className = "role"; role.textContent = m.role === "user" ? "You" : "Assistant";
  node.append(role);
  if (m.reasoning) {
    const d = document.createElement("details"), s = document.createElement("summary"), body = document.createElement("div");
    d.className = "reasoning"; s.textContent = "Reasoning"; body.innerHTML = renderMarkdown(m.reasoning);
    d.append(s, body); node.append(d);
  }
  const body = document.createElement("div");
  body.className = "body";
  if (m.role === "user") body.textContent = m.content; else body.innerHTML = renderMarkdown(m.content);
  body.style.whiteSpace = m.role === "user" ? "pre-wrap" : "";
  node.append(body);
  for (const url of m.images || []) {
    const img = document.createElement("img"); img.className = "thumb"; img.src = url; img.alt = "attached image"; node.append(img);
  }
  for (const tc of m.tool_calls || []) {
    const t = document.createElement("div");
    t.className = "tool-call"; t.textContent = `call ${tc.function.name}(${tc.function.arguments})`;
    node.append(t);
  }
  if (m.stopped) node.append(note("stopped", "muted"));
  if (m.error) node.append(note(m.error, "error"));
  if (m.stats) node.append(note(statsText(m.stats), "stats"));
  const actions = document.createElement("div");
  actions.className = "actions";
  if (m.role === "user") actions.append(button("Edit", () => editMessage(c, i, node)));
  else actions.append(button("Regenerate", () => regenerate(c, i)));
  actions.append(button("Branch", () => branch(c, i)));
  if (state.running && state.running.msg === m) actions.hidden = true;
  node.append(actions);
  return node;
}
function note(text, cls) { const d = document.createElement("div"); d.className = cls; d.textContent = text; return d; }
function statsText(s) {
  const parts = [`prompt ${s.prompt} tok`, `cached ${s.cached}`, `generated ${s.generated}`];
  if (s.image_tokens) parts.push(`images ${s.image_tokens} tok`);
  if (s.ttft_s !== null) parts.push(`first token ${s.ttft_s.toFixed(2)} s`);
  if (s.tok_s !== null) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
  return parts.join(" · ");
}
function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.attachments.forEach((url, i) => {
    const img = document.createElement("img"); img.src = url; img.alt = `attachment ${i + 1}`;
    box.append(img, button("Remove", () => { state.attachments.splice(i, 1); renderAttachments(); }, "small"));
  });
}

// ---- Wiring ----
function bindSetting(id, key, kind) {
  const el = $(id);
  if (kind === "check") el.checked = !!state.settings[key]; else el.value = state.settings[key];
  el.addEventListener("change", () => { state.settings[key] = kind === "check" ? el.checked : el.value; saveSettings(); });
}
function togglePanel(buttonId, panelId, cls) {
  $(buttonId).addEventListener("click", () => {
    const p = $(panelId), open = cls ? !p.classList.contains(cls) : p.hidden;
    if (cls) p.classList.toggle(cls, open); else p.hidden = !open;
    $(buttonId).setAttribute("aria-expanded", String(open));
    if (open && panelId === "status") refreshStatus();
  });
}
function init() {
  state.convs = load(STORE.convs, []);
  state.current = load(STORE.current, null);
  Object.assign(state.settings, load(STORE.settings, {}));
  if (!conv()) state.current = state.convs.length ? state.convs[0].id : null;
  for (const [id, key, kind] of [["set-system", "system"], ["set-temperature", "temperature"], ["set-top-p", "top_p"],
    ["set-max-tokens", "max_tokens"], ["set-thinking", "thinking", "check"], ["set-effort", "effort"]]) bindSetting(id, key, kind);
  togglePanel("toggle-settings", "settings"); togglePanel("toggle-status", "status"); togglePanel("toggle-side", "side", "open");
  $("refresh-status").addEventListener("click", refreshStatus);
  $("new-chat").addEventListener("click", () => { if (!state.running) { newConv(); renderAll(); $("input").focus(); } });
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (state.running) state.running.controller.abort(); });
  $("attach-label").tabIndex = 0;
  $("attach-label").addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); $("image-input").click(); } });
  $("image-input").addEventListener("change", async (e) => {
    for (const f of e.target.files) state.attachments.push(await readDataUrl(f));
    e.target.value = "";
    renderAttachments();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem(STORE.key, $("api-key").value.trim());
    $("api-key").value = "";
    refreshStatus();
  });
  $("forget-key").addEventListener("click", () => { localStorage.removeItem(STORE.key); refreshStatus(); });
  renderAll();
  refreshStatus();
  $("input").focus();
}
function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result); r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}
init();
