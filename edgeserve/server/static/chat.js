// The built-in chat page: conversations in localStorage, streamed replies rendered as sanitized Markdown,
// edit/regenerate, per-reply speed, and the model's loading state. No build step: plain ES module.
import hljs from "./vendor/highlight/core.min.js";
import bash from "./vendor/highlight/languages/bash.min.js";
import c from "./vendor/highlight/languages/c.min.js";
import cpp from "./vendor/highlight/languages/cpp.min.js";
import diff from "./vendor/highlight/languages/diff.min.js";
import dockerfile from "./vendor/highlight/languages/dockerfile.min.js";
import go from "./vendor/highlight/languages/go.min.js";
import ini from "./vendor/highlight/languages/ini.min.js";
import java from "./vendor/highlight/languages/java.min.js";
import javascript from "./vendor/highlight/languages/javascript.min.js";
import json from "./vendor/highlight/languages/json.min.js";
import markdown from "./vendor/highlight/languages/markdown.min.js";
import plaintext from "./vendor/highlight/languages/plaintext.min.js";
import python from "./vendor/highlight/languages/python.min.js";
import rust from "./vendor/highlight/languages/rust.min.js";
import shell from "./vendor/highlight/languages/shell.min.js";
import sql from "./vendor/highlight/languages/sql.min.js";
import typescript from "./vendor/highlight/languages/typescript.min.js";
import xml from "./vendor/highlight/languages/xml.min.js";
import yaml from "./vendor/highlight/languages/yaml.min.js";

const LANGUAGES = {bash, c, cpp, diff, dockerfile, go, ini, java, javascript, json, markdown, plaintext, python, rust,
                   shell, sql, typescript, xml, yaml};
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);

const $ = (id) => document.getElementById(id);
const CHATS_KEY = "edgeserve-chats", CURRENT_KEY = "edgeserve-current", SETTINGS_KEY = "edgeserve-settings";
const SETTINGS = {model: "model", system: "system", temperature: "temperature", top_p: "top_p",
                  max_tokens: "maxtokens", api_key: "apikey"};  // setting -> input id
// empty: the request leaves the field out and the server's default applies (as the Settings dialog says)
const DEFAULT_SETTINGS = {model: "", system: "", temperature: "", top_p: "", max_tokens: "", api_key: ""};
const TITLE_CHARS = 48;  // a new conversation is named by its first message, cut with an ellipsis
const PHONE = matchMedia("(max-width: 760px)");
const TINY_MODEL = "smollm2-135m", RECOMMENDED_MODEL = "qwen2.5-1.5b";  // see edgeserve/first_run.py

let chats = readJSON(CHATS_KEY, {});        // id -> {id, title, created, updated, messages: [{role, content, meta}]}
let currentId = localStorage.getItem(CURRENT_KEY);
if (!chats[currentId]) currentId = null;    // null: a new chat, stored once it has a message
let settings = {...DEFAULT_SETTINGS, ...readJSON(SETTINGS_KEY, {})};
if (!settings.v) {  // the first version of this page stored its prefilled 0.7 and 1024 as if the user chose them
  if (settings.temperature === "0.7") settings.temperature = "";
  if (settings.max_tokens === "1024") settings.max_tokens = "";
  settings.v = 2;
}
let stream = null;                           // the reply being generated: {chat, msg, el, controller, ...}

// ---- storage ----------------------------------------------------------------------------------------------

function readJSON(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v && typeof v === "object" ? v : fallback;
  } catch {
    return fallback;
  }
}

function saveChats() {
  try {
    localStorage.setItem(CHATS_KEY, JSON.stringify(chats));
    if (currentId) localStorage.setItem(CURRENT_KEY, currentId); else localStorage.removeItem(CURRENT_KEY);
  } catch (e) {
    notice("could not save the conversation in this browser: " + e.message);
  }
}

function saveSettings() {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

// ---- markdown ---------------------------------------------------------------------------------------------

const escapeHtml = (s) => s.replace(/[&<>"']/g, (ch) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;",
                                                          "'": "&#39;"}[ch]));
// Raw HTML in a reply is shown as text, never parsed; DOMPurify below is the second line of defence.
marked.use({gfm: true, renderer: {html: (token) => escapeHtml(token.text)}});
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer"); }
});
const PURIFY = {FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "iframe"],
                FORBID_ATTR: ["style"]};

/** Render `text` as sanitized Markdown into `el`: highlighted code blocks, each with a copy button. */
function renderMarkdown(el, text) {
  el.innerHTML = DOMPurify.sanitize(marked.parse(text), PURIFY);
  for (const code of el.querySelectorAll("pre > code")) {
    const lang = ((code.className.match(/language-([\w+#-]+)/) || [])[1] || "").toLowerCase();
    if (lang && hljs.getLanguage(lang)) {
      code.innerHTML = hljs.highlight(code.textContent, {language: lang, ignoreIllegals: true}).value;
    } else if (!lang) {
      code.innerHTML = hljs.highlightAuto(code.textContent).value;
    }
    code.classList.add("hljs");
    const pre = code.parentElement, box = document.createElement("div"), head = document.createElement("div");
    const label = document.createElement("span"), copy = document.createElement("button");
    box.className = "code"; head.className = "code-head";
    label.textContent = lang || "text";
    copy.type = "button"; copy.className = "copy"; copy.textContent = "Copy";
    head.append(label, copy);
    pre.replaceWith(box);
    box.append(head, pre);
  }
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const ta = document.createElement("textarea");  // plain-http LAN pages have no clipboard API
  ta.value = text; ta.setAttribute("readonly", ""); ta.className = "sr-only";
  document.body.append(ta); ta.select(); document.execCommand("copy"); ta.remove();
}

function flash(button, text) {
  const old = button.textContent;
  button.textContent = text;
  setTimeout(() => { button.textContent = old; }, 1500);
}

// ---- conversation list ------------------------------------------------------------------------------------

const currentChat = () => (currentId ? chats[currentId] : null);

function renderChatList() {
  const ul = $("chats");
  ul.innerHTML = "";
  for (const chat of Object.values(chats).sort((a, b) => b.updated - a.updated)) {
    const li = document.createElement("li");
    li.dataset.id = chat.id;
    if (chat.id === currentId) li.setAttribute("aria-current", "true");
    const open = button(chat.title, "open", () => switchTo(chat.id));
    open.title = chat.title;
    li.append(open, button("\u270E", "icon rename", () => startRename(li, chat), "rename " + chat.title),
              button("\u00D7", "icon delete", () => deleteChat(chat), "delete " + chat.title));
    ul.append(li);
  }
}

function button(text, className, onClick, label) {
  const b = document.createElement("button");
  b.type = "button"; b.className = className; b.textContent = text;
  if (label) b.setAttribute("aria-label", label);
  b.addEventListener("click", onClick);
  return b;
}

function startRename(li, chat) {
  const input = document.createElement("input");
  input.value = chat.title;
  input.setAttribute("aria-label", "conversation name");
  li.replaceChildren(input);
  input.focus(); input.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) { chat.title = input.value.trim(); saveChats(); }
    renderChatList(); renderTitle();
  };
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") { ev.preventDefault(); finish(true); }
    if (ev.key === "Escape") { ev.preventDefault(); finish(false); }
  });
  input.addEventListener("blur", () => finish(true));
}

function deleteChat(chat) {
  if (!confirm(`Delete the conversation "${chat.title}"?`)) return;
  if (stream && stream.chat === chat) stream.controller.abort();
  delete chats[chat.id];
  if (currentId === chat.id) currentId = null;
  saveChats(); renderAll();
}

function switchTo(id) {
  currentId = id;
  saveChats(); renderAll(); closeSidebar();
  $("input").focus();
}

function renderTitle() {
  const chat = currentChat();
  $("chat-title").textContent = chat ? chat.title : "New chat";
  document.title = (chat ? chat.title + " \u00b7 " : "") + "edgeserve chat";
}

// ---- messages ---------------------------------------------------------------------------------------------

function renderAll() {
  renderChatList(); renderTitle(); renderMessages();
}

function renderMessages() {
  const log = $("log"), chat = currentChat();
  log.querySelectorAll(".turn").forEach((t) => t.remove());
  $("empty").hidden = Boolean(chat && chat.messages.length);
  renderEmpty();
  if (!chat) return;
  chat.messages.forEach((m, i) => log.append(renderTurn(chat, m, i)));
  log.scrollTop = log.scrollHeight;
}

function renderTurn(chat, m, i) {
  const turn = document.createElement("div"), msg = document.createElement("div");
  turn.className = "turn " + m.role;
  turn.dataset.index = i;
  msg.className = "msg " + m.role;
  const last = i === chat.messages.length - 1;
  const busy = Boolean(stream);
  const actions = document.createElement("div");
  actions.className = "actions";
  if (m.role === "user") {
    msg.textContent = m.content;
    for (const url of m.images || []) msg.append(imageThumb(url, "attached"));
    if (!busy) actions.append(button("Edit", "edit", () => startEdit(turn, chat, i)));
    turn.append(msg, actions);
    return turn;
  }
  if (m.meta && m.meta.error) msg.classList.add("error");
  if (stream && stream.msg === m) {
    stream.el = msg;
    paintStream();
  } else {
    renderMarkdown(msg, m.content);
    if (m.meta && m.meta.error) {
      const err = document.createElement("div");
      err.className = "error-text"; err.textContent = "error: " + m.meta.error;
      msg.append(err);
    }
  }
  const foot = metaLine(m);  // stats and actions share one line under the reply
  turn.append(msg, foot);
  if (!(stream && stream.msg === m)) {
    actions.append(button("Copy", "copy-reply", (ev) => copyText(m.content).then(() => flash(ev.target, "Copied"))));
    if (last && !busy) actions.append(button("Regenerate", "regenerate", () => regenerate(chat)));
    if (last && !busy && m.versions && m.versions.length > 1) actions.append(versionSwitch(chat, m));
    foot.append(actions);
  }
  return turn;
}

function metaLine(m) {
  const div = document.createElement("div");
  div.className = "meta";
  const s = m.meta || {};
  const add = (text, cls) => { const span = document.createElement("span"); span.textContent = text;
                               if (cls) span.className = cls; div.append(span); };
  if (s.model) add(s.model);
  if (s.tokens) add(`${s.approx ? "~" : ""}${s.tokens} tokens`, "tokens");
  if (s.tps) add(`${s.tps.toFixed(1)} tok/s`, "tps");
  if (s.ttft != null) add(`first token ${s.ttft.toFixed(2)} s`, "ttft");
  if (s.loadSeconds) add(`model loaded in ${s.loadSeconds.toFixed(1)} s`, "load");
  if (s.finish === "length") add("hit max tokens", "length");
  if (s.stopped) add("stopped", "stopped");
  return div;
}

function startEdit(turn, chat, i) {
  const box = document.createElement("div"), ta = document.createElement("textarea"), row = document.createElement("div");
  box.className = "edit-box";
  ta.value = chat.messages[i].content;
  ta.setAttribute("aria-label", "edit message");
  const submit = () => {
    const text = ta.value.trim();
    const images = chat.messages[i].images;  // an edit keeps the message's images
    if ((!text && !images) || stream) return;
    chat.messages.splice(i);
    chat.messages.push(images ? {role: "user", content: text, images} : {role: "user", content: text});
    generate(chat);
  };
  row.append(button("Cancel", "cancel", () => renderMessages()), button("Send", "save", submit));
  row.lastChild.classList.add("primary");
  ta.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); submit(); }
    if (ev.key === "Escape") { ev.preventDefault(); renderMessages(); }
  });
  box.append(ta, row);
  turn.replaceChildren(box);
  ta.focus();
}

/** A new reply to the last user message; the replies before it stay, switchable with versionSwitch (one that
 * failed or was stopped before any text is dropped). */
function regenerate(chat) {
  if (stream) return;
  let versions = [];
  while (chat.messages.length && chat.messages[chat.messages.length - 1].role === "assistant") {
    const old = chat.messages.pop();
    versions = (old.versions || [{content: old.content, meta: old.meta}]).filter((v) => v.content);
  }
  if (chat.messages.length) generate(chat, versions);
}

/** "‹ 2/3 ›": show another version of reply `m` (its content and stats), kept in the chat. */
function versionSwitch(chat, m) {
  const box = document.createElement("span"), label = document.createElement("span");
  box.className = "versions";
  label.className = "version";
  label.textContent = `${m.version + 1}/${m.versions.length}`;
  const go = (step) => () => {
    const i = m.version + step;
    if (i < 0 || i >= m.versions.length || stream) return;
    m.version = i;
    m.content = m.versions[i].content;
    m.meta = m.versions[i].meta;
    saveChats(); renderMessages();
  };
  const prev = button("\u2039", "prev-version", go(-1), "previous reply");
  const next = button("\u203A", "next-version", go(1), "next reply");
  prev.disabled = m.version === 0;
  next.disabled = m.version === m.versions.length - 1;
  box.append(prev, label, next);
  return box;
}

// ---- generation -------------------------------------------------------------------------------------------

function headers() {
  const h = {"Content-Type": "application/json"};
  if (settings.api_key.trim()) h["Authorization"] = "Bearer " + settings.api_key.trim();
  return h;
}

function requestBody(chat, model) {
  const messages = [];
  if (settings.system.trim()) messages.push({role: "system", content: settings.system.trim()});
  for (const m of chat.messages) {
    if (m.role === "assistant" && m.meta && m.meta.error && !m.content) continue;
    const images = (m.images || []).map((url) => ({type: "image_url", image_url: {url}}));
    messages.push({role: m.role, content: images.length ? [{type: "text", text: m.content}, ...images] : m.content});
  }
  const body = {model, messages, stream: true, stream_options: {include_usage: true}};
  const num = (v, parse) => (String(v).trim() === "" || Number.isNaN(parse(v)) ? undefined : parse(v));
  body.temperature = num(settings.temperature, parseFloat);
  body.top_p = num(settings.top_p, parseFloat);
  body.max_tokens = num(settings.max_tokens, (v) => parseInt(v, 10));
  return body;
}

/** A conversation's name from its first message: at most TITLE_CHARS characters, an ellipsis where it was cut. */
function titleOf(text) {
  const t = text.replace(/\s+/g, " ").trim();
  return t.length <= TITLE_CHARS ? t : t.slice(0, TITLE_CHARS - 1).trimEnd() + "\u2026";
}

// ---- attached images ----------------------------------------------------------------------------------------

let pending = [];  // data URLs of the images attached to the next message

function imageThumb(url, cls) {
  const img = document.createElement("img");
  img.src = url; img.className = cls; img.alt = "attached image";
  return img;
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren(...pending.map((url, i) => {
    const item = document.createElement("span");
    item.className = "attachment";
    item.append(imageThumb(url, "thumb"), button("\u2715", "remove-image", () => {
      pending.splice(i, 1); renderAttachments();
    }, "remove the image"));
    return item;
  }));
  box.classList.toggle("hidden", !pending.length);
}

function attachFiles(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.onload = () => { pending.push(reader.result); renderAttachments(); };
    reader.onerror = () => notice("could not read " + file.name);
    reader.readAsDataURL(file);
  }
}

function send(text) {
  let chat = currentChat();
  if (!chat) {
    const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 6);
    chat = {id, title: titleOf(text || "image"), created: Date.now(), updated: Date.now(), messages: []};
    chats[id] = chat;
    currentId = id;
  }
  const user = {role: "user", content: text};
  if (pending.length) { user.images = pending; pending = []; renderAttachments(); }
  chat.messages.push(user);
  generate(chat);
}

/** Stream a reply to the chat's last user message into a new assistant message, with its timings; `versions`:
 * earlier replies to the same message, kept beside it. */
async function generate(chat, versions = []) {
  const model = $("model").value;
  const body = JSON.stringify(requestBody(chat, model));
  const msg = {role: "assistant", content: "", meta: {model}};
  if (versions.length) { msg.versions = versions; msg.version = versions.length; }
  chat.messages.push(msg);
  chat.updated = Date.now();
  const controller = new AbortController();
  stream = {chat, msg, el: null, controller, start: performance.now(), first: null, chunks: 0, usage: null,
            loading: null, timer: null, lastSave: 0};
  setBusy(true);
  saveChats(); renderAll();
  stream.timer = setInterval(pollWhileWaiting, 500);
  pollWhileWaiting();
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), signal: controller.signal,
                                                     body});
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message || err.error : r.status + " " + r.statusText);
    }
    await readStream(r.body.getReader(), msg);
  } catch (e) {
    if (e.name === "AbortError") msg.meta.stopped = true;
    else msg.meta.error = e.message;
  } finally {
    finishStream();
  }
}

async function readStream(reader, msg) {
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, cut).trim();
      buf = buf.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || chunk.error);
      if (chunk.usage) stream.usage = chunk.usage;
      for (const ch of chunk.choices || []) {
        if (ch.finish_reason) msg.meta.finish = ch.finish_reason;
        if (ch.delta && ch.delta.content) {
          if (stream.first === null) stream.first = performance.now();
          stream.chunks += 1;
          msg.content += ch.delta.content;
          schedulePaint();
        }
      }
    }
  }
}

let paintQueued = false;
function schedulePaint() {
  if (paintQueued) return;
  paintQueued = true;
  requestAnimationFrame(() => { paintQueued = false; if (stream) paintStream(); });
  if (stream && performance.now() - stream.lastSave > 1000) { stream.lastSave = performance.now(); saveChats(); }
}

/** Draw the reply being generated: its Markdown so far, or the waiting / loading-model status. */
function paintStream() {
  const el = stream.el;
  if (!el || !el.isConnected) return;
  const log = $("log"), atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  if (stream.msg.content) {
    renderMarkdown(el, stream.msg.content);
  } else {
    const secs = ((performance.now() - stream.start) / 1000).toFixed(0);
    const status = document.createElement("div");
    status.className = "status";
    status.textContent = stream.loading
      ? `loading model ${stream.loading.model}\u2026 ${Math.round(stream.loading.seconds)} s`
      : `waiting for the model\u2026 ${secs} s`;
    el.replaceChildren(status);
  }
  if (atBottom) log.scrollTop = log.scrollHeight;
}

/** While no token has arrived, ask /api/ps (or /health) whether the model is loading and for how long. */
async function pollWhileWaiting() {
  const s = stream;
  if (!s || s.first !== null) return;
  const model = s.msg.meta.model;
  try {
    let loading = null;
    const r = await fetch("/api/ps", {headers: headers()});
    if (r.ok) {
      const models = (await r.json()).models || [];
      labelModels(models);
      const entry = models.find((m) => m.name === model);
      if (entry && entry.status === "loading") loading = {model, seconds: entry.loading_seconds || 0};
    } else {
      const h = await (await fetch("/health")).json();
      if (h.models && h.models[model] === "loading") loading = {model, seconds: (performance.now() - s.start) / 1000};
    }
    if (stream !== s || s.first !== null) return;
    if (loading) s.sawLoading = true;
    s.loading = loading;
  } catch { /* the status line just keeps counting */ }
  if (stream === s) paintStream();
}

function finishStream() {
  const s = stream, m = s.msg, end = performance.now();
  clearInterval(s.timer);
  if (s.first !== null) {
    m.meta.ttft = (s.first - s.start) / 1000;
    const tokens = s.usage ? s.usage.completion_tokens : s.chunks;
    m.meta.tokens = tokens;
    m.meta.approx = !s.usage;
    if (tokens > 1 && end > s.first) m.meta.tps = (tokens - 1) / ((end - s.first) / 1000);
  }
  if (m.versions) {  // this reply becomes the newest version (one without text is dropped at the next regenerate)
    m.versions.push({content: m.content, meta: m.meta});
    m.version = m.versions.length - 1;
  }
  s.chat.updated = Date.now();
  stream = null;
  setBusy(false);
  saveChats(); renderAll();
  refreshModels().then((ps) => {
    const entry = s.sawLoading && ps.find((e) => e.name === m.meta.model);
    if (entry && entry.load_seconds) { m.meta.loadSeconds = entry.load_seconds; saveChats(); if (!stream) renderMessages(); }
  });
}

function setBusy(busy) {
  $("send").classList.toggle("hidden", busy);
  $("stop").classList.toggle("hidden", !busy);
}

// ---- models and settings ----------------------------------------------------------------------------------

let modelStates = {};  // model id -> its state from /api/ps (absent: not loaded)

/** Label each model in the list with its state from /api/ps's `models`. */
function labelModels(models) {
  modelStates = Object.fromEntries(models.map((m) => [m.name, m.status]));
  for (const opt of $("model").options) {
    opt.textContent = `${opt.value} \u00b7 ${modelStates[opt.value] || "not loaded"}`;
  }
  renderEmpty();
}

/** The first screen of a new chat: the model, its state, what the tiny default model is for, example prompts. */
function renderEmpty() {
  const model = $("model").value, state = modelStates[model] || "not loaded";
  $("empty-model").textContent = model || "no model";
  $("empty-state").textContent = !model ? "" : state === "not loaded" ? "not loaded: it loads with your first message"
    : state;
  $("empty-state").dataset.state = state;
  const tiny = model === TINY_MODEL;
  $("empty-note").hidden = !tiny;
  if (tiny) {
    const code = (text) => { const c = document.createElement("code"); c.textContent = text; return c; };
    $("empty-note").replaceChildren(
      `${TINY_MODEL} is a 135M model for trying edgeserve out: its answers are often nonsense. For real use: `,
      code(`edgeserve pull ${RECOMMENDED_MODEL}`), ", then ", code(`edgeserve serve -m ${RECOMMENDED_MODEL}`), ".");
  }
}

/** Fill the model list from /v1/models, each labelled with its state from /api/ps; returns /api/ps's models. */
async function refreshModels() {
  let models = [];
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.error ? body.error.message : r.status + " " + r.statusText);
    const ids = body.data.map((m) => m.id);
    const ps = await fetch("/api/ps", {headers: headers()}).then((x) => (x.ok ? x.json() : {models: []}))
      .catch(() => ({models: []}));
    models = ps.models || [];
    const select = $("model"), chosen = select.value || settings.model;
    select.replaceChildren(...ids.map((id) => {
      const opt = document.createElement("option");
      opt.value = id;
      return opt;
    }));
    if (ids.includes(chosen)) select.value = chosen;
    labelModels(models);
    clearNotice();
    showModelDefaults();
  } catch (e) {
    notice("could not list models: " + e.message + (/key/i.test(e.message) ? " (set it in Settings)" : ""));
  }
  return models;
}

/** Show the chosen model's recommended temperature / top_p (its file's, from /api/show) as the settings'
 * placeholders: what the server uses when the field is left empty. */
let defaultsShownFor = null;
async function showModelDefaults() {
  const model = $("model").value;
  if (model === defaultsShownFor) return;
  defaultsShownFor = model;
  let params = "";
  if (model) {
    params = await fetch("/api/show", {method: "POST", headers: headers(),
                                       body: JSON.stringify({model})})
      .then((r) => (r.ok ? r.json() : {})).then((b) => b.parameters || "").catch(() => "");
  }
  for (const [name, id] of [["temperature", "temperature"], ["top_p", "top_p"]]) {
    const m = params.match(new RegExp("^" + name + " (\\S+)$", "m"));
    $(id).placeholder = m ? `model's: ${m[1]}` : "default";
  }
}

function loadSettingsIntoForm() {
  for (const [key, id] of Object.entries(SETTINGS)) if (key !== "model") $(id).value = settings[key];
}

function readSettingsFromForm() {
  for (const [key, id] of Object.entries(SETTINGS)) settings[key] = $(id).value;
  saveSettings();
}

let noticeTimer = null;
/** Show `text` above the conversation; for `seconds` only when given (else until the next good model list). */
function notice(text, seconds) {
  $("notice").textContent = text; $("notice").hidden = false;
  clearTimeout(noticeTimer);
  if (seconds) noticeTimer = setTimeout(clearNotice, seconds * 1000);
}
function clearNotice() { $("notice").hidden = true; }

// ---- export -----------------------------------------------------------------------------------------------

function download(name, type, text) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([text], {type}));
  a.download = name;
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function exportChat(format) {
  const chat = currentChat();
  $("menu").open = false;
  if (!chat) { notice("nothing to export yet", 4); return; }
  const slug = chat.title.replace(/[^\w-]+/g, "-").replace(/^-+|-+$/g, "").slice(0, 40) || "chat";
  if (format === "json") {
    download(slug + ".json", "application/json",
             JSON.stringify({...chat, system: settings.system || undefined}, null, 2));
  } else {
    const parts = [`# ${chat.title}\n`];
    if (settings.system.trim()) parts.push(`**System**\n\n${settings.system.trim()}\n`);
    for (const m of chat.messages) parts.push(`**${m.role === "user" ? "User" : "Assistant"}**\n\n${m.content}\n`);
    download(slug + ".md", "text/markdown", parts.join("\n"));
  }
}

// ---- sidebar on phones ------------------------------------------------------------------------------------

function openSidebar() {
  $("sidebar").classList.add("open"); $("scrim").hidden = false;
  $("toggle-sidebar").setAttribute("aria-expanded", "true");
  $("new-chat").focus();
}

function closeSidebar() {
  if (!$("sidebar").classList.contains("open")) return;
  $("sidebar").classList.remove("open"); $("scrim").hidden = true;
  $("toggle-sidebar").setAttribute("aria-expanded", "false");
}

// ---- wiring -----------------------------------------------------------------------------------------------

function autosize() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = Math.min(input.scrollHeight + 2, 192) + "px";
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if ((!text && !pending.length) || stream) return;
  $("input").value = "";
  autosize();
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $("form").requestSubmit(); }
  if (ev.key === "Escape" && stream) stream.controller.abort();
});
$("input").addEventListener("input", autosize);
$("stop").addEventListener("click", () => { if (stream) stream.controller.abort(); });
$("attach").addEventListener("click", () => $("file").click());
$("file").addEventListener("change", (ev) => { attachFiles(ev.target.files); ev.target.value = ""; });
$("new-chat").addEventListener("click", () => switchTo(null));
$("new-chat-top").addEventListener("click", () => switchTo(null));
$("log").addEventListener("click", (ev) => {
  const copy = ev.target.closest(".code .copy");
  if (copy) copyText(copy.closest(".code").querySelector("code").textContent).then(() => flash(copy, "Copied"));
});
$("model").addEventListener("change", () => {
  settings.model = $("model").value; saveSettings(); renderEmpty(); showModelDefaults();
});
$("examples").addEventListener("click", (ev) => {
  const example = ev.target.closest(".example");
  if (example && !stream) send(example.textContent.trim());
});
/** The message box's hint: the keys on a wide screen, one word on a phone (where the longer one is clipped). */
function placeholder() {
  $("input").placeholder = PHONE.matches ? "Message" : "Message (Enter sends, Shift+Enter new line)";
}
PHONE.addEventListener("change", placeholder);
placeholder();
const openSettings = () => { $("menu").open = false; closeSidebar(); loadSettingsIntoForm(); $("settings").showModal(); };
$("open-settings").addEventListener("click", openSettings);
$("settings-from-menu").addEventListener("click", openSettings);
$("settings").addEventListener("close", () => {
  const keyChanged = $("apikey").value !== settings.api_key;
  readSettingsFromForm();
  if (keyChanged) refreshModels();
});
$("export-json").addEventListener("click", () => exportChat("json"));
$("export-md").addEventListener("click", () => exportChat("md"));
$("toggle-sidebar").addEventListener("click", openSidebar);
$("close-sidebar").addEventListener("click", closeSidebar);
$("scrim").addEventListener("click", closeSidebar);
document.addEventListener("keydown", (ev) => { if (ev.key === "Escape") { closeSidebar(); $("menu").open = false; } });
document.addEventListener("click", (ev) => { if (!$("menu").contains(ev.target)) $("menu").open = false; });
window.addEventListener("storage", (ev) => {  // another tab changed the chats
  if (ev.key === CHATS_KEY && !stream) { chats = readJSON(CHATS_KEY, {}); if (!chats[currentId]) currentId = null; renderAll(); }
});
setInterval(() => { if (!stream && document.visibilityState === "visible") refreshModels(); }, 15000);

const legacyKey = localStorage.getItem("edgeserve-key");  // the key field of the first version of this page
if (legacyKey && !settings.api_key) { settings.api_key = legacyKey; saveSettings(); }
loadSettingsIntoForm();
renderAll();
refreshModels();
$("input").focus();
