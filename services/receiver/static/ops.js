const $ = (id) => document.getElementById(id);
let token = sessionStorage.getItem("chatq-admin-token");
let openId = null;
async function api(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: { ...(opts.headers || {}), authorization: `Bearer ${token}`, "content-type": "application/json" } });
  const body = await r.json().catch(() => ({}));
  if (r.status === 401) { sessionStorage.removeItem("chatq-admin-token"); token = null; show(); }
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}
const age = (s) => s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
function card(label, value) { const d = document.createElement("div"); d.className = "card"; d.innerHTML = `<span></span><b></b>`; d.firstChild.textContent = label; d.lastChild.textContent = value; return d; }
let filterAccounts = new Map(), allAccounts = [];
async function load() {
  const chosen = $("account-filter").value;
  // The chosen account filters everything the page shows: numbers, needs a person, held chats.
  const only = chosen ? `account=${encodeURIComponent(chosen)}` : "";
  const s = await api("/v1/stats" + (only ? `?${only}` : ""));
  const day = s.last_24h;
  // The four numbers, named as in the README, the dashboard and the alerts.
  $("stats").replaceChildren(
    card("Backlog", s.backlog_total),
    card("Receipt-to-reply p50 / p95 (24 h)", day.receipt_to_reply_p50_seconds == null ? "–" : `${age(day.receipt_to_reply_p50_seconds)} / ${age(day.receipt_to_reply_p95_seconds)}`),
    card("Failed share (24 h)", `${(day.failed_share * 100).toFixed(1)} %`),
    card("Retries (24 h)", day.retries),
    card("Oldest unfinished", age(s.oldest_unfinished_age_seconds)),
    card("Waiting for a person: failed / needs review", `${s.backlog.failed.count} / ${s.backlog.needs_review.count}`),
  );
  // A paused account: its replies wait (none is lost) until the platform accepts it again.
  $("accounts").replaceChildren(...s.paused_accounts.map((a) => {
    const p = document.createElement("p");
    p.className = "paused";
    p.textContent = `${a.platform} account ${a.account_id} is paused (${a.state.replaceAll("_", " ")}) since ${new Date(a.since).toLocaleString()}: ${a.reason}`;
    return p;
  }));
  if (!chosen) {
    // The filter lists every account of the deployment (the busiest first): /v1/stats has
    // the busiest only, so the table's are read too, again when stats knows of more.
    if (filterAccounts.size < s.accounts_total) allAccounts = (await api("/v1/accounts?removed=true")).accounts;
    filterAccounts = new Map([...s.accounts, ...allAccounts].map((a) => [`${a.platform}:${a.account_id}`, a]));
    $("account-filter").replaceChildren(new Option("All accounts", ""), ...[...filterAccounts].map(([key, a]) => new Option(`${key}${a.name ? ` (${a.name})` : ""}`, key)));
  }
  $("account-rows").replaceChildren(...s.accounts.map(accountRow));
  const { operations } = await api(`/v1/operations?status=failed,needs_review&limit=200${only ? `&${only}` : ""}`);
  $("rows").replaceChildren(...operations.map(row));
  const { chats } = await api(`/v1/chats?held=true${only ? `&${only}` : ""}`);
  $("held").replaceChildren(...chats.map(heldRow));
}
function accountRow(a) {
  const tr = document.createElement("tr");
  tr.dataset.account = `${a.platform}:${a.account_id}`;
  const p50 = a.receipt_to_reply_p50_seconds;
  for (const text of [`${a.platform}:${a.account_id}`, a.name || "", a.state.replaceAll("_", " "), a.backlog, p50 == null ? "–" : age(p50), `${(a.failed_share * 100).toFixed(1)} %`, a.retries]) {
    const td = document.createElement("td"); td.textContent = text; tr.appendChild(td);
  }
  return tr;
}
function heldRow(c) {
  const tr = document.createElement("tr");
  tr.dataset.chat = c.chat;
  for (const text of [c.chat, new Date(c.held_until).toLocaleString(), c.waiting_messages]) {
    const td = document.createElement("td"); td.textContent = text; tr.appendChild(td);
  }
  const td = document.createElement("td");
  const b = document.createElement("button"); b.textContent = "Resume"; b.className = "primary";
  b.onclick = async () => {
    if (!confirm(`Hand ${c.chat} back to the bot now?`)) return;
    try { await api(`/v1/chats/${encodeURIComponent(c.chat)}/resume`, { method: "POST" }); $("flash").textContent = `${c.chat} is the bot's again`; }
    catch (e) { $("flash").textContent = `resume failed: ${e.message}`; }
    await load();
  };
  td.appendChild(b); tr.appendChild(td);
  return tr;
}
function row(op) {
  const tr = document.createElement("tr");
  tr.dataset.id = op.id;
  const cells = [age(op.age_seconds), op.status.replace("_", " "), `${op.platform} ${op.chat.chat_id}`, op.message.text, op.status_text];
  for (const [i, text] of cells.entries()) { const td = document.createElement("td"); td.textContent = text; if (i === 1) td.className = `status-${op.status}`; tr.appendChild(td); }
  const actions = document.createElement("td");
  const mk = (label, cls, fn) => { const b = document.createElement("button"); b.textContent = label; if (cls) b.className = cls; b.onclick = fn; actions.appendChild(b); };
  if (op.status === "needs_review") mk("Re-send…", "primary", () => resend(op.id));
  else mk("Retry", "primary", () => retry(op.id, false));
  mk("Replied manually", "", () => resolve(op.id, "replied_manually"));
  mk("Dismiss", "", () => resolve(op.id, "dismissed"));
  mk("Timeline", "", () => detail(op.id));
  tr.appendChild(actions);
  return tr;
}
function who() {
  const by = prompt("Your name (recorded with the decision)", localStorage.getItem("chatq-owner") || "");
  if (by) localStorage.setItem("chatq-owner", by);
  return by;
}
async function retry(id, resend) {
  const by = who();
  if (!by) return;
  try {
    await api(`/v1/operations/${id}/retry${resend ? "?resend=true" : ""}`, { method: "POST", body: JSON.stringify({ by }) });
    $("flash").textContent = `${resend ? "re-send confirmed" : "retry"}: ${id} is back in the queue`;
  } catch (e) { $("flash").textContent = `retry failed: ${e.message}`; }
  await load(); detail(id);
}
async function resend(id) {
  // The reply may already be in the chat: sending again is a person's decision, after a look.
  if (!confirm("The reply to this message may already be in the chat.\n\nCheck the chat first. Send a reply again?")) return;
  await retry(id, true);
}
async function resolve(id, resolution) {
  const owner = who();
  if (!owner) return;
  const note = prompt("Note (optional)") || "";
  try { await api(`/v1/operations/${id}/resolve`, { method: "POST", body: JSON.stringify({ resolution, owner, note }) }); $("flash").textContent = `resolved ${id}`; }
  catch (e) { $("flash").textContent = `resolve failed: ${e.message}`; }
  await load(); detail(id);
}
async function detail(id) {
  openId = id;
  const op = await api(`/v1/operations/${id}`);
  const d = $("detail");
  d.hidden = false;
  d.replaceChildren();
  const h = document.createElement("h3"); h.textContent = `Operation ${op.id}`; d.appendChild(h);
  const st = document.createElement("p"); st.id = "detail-status"; st.dataset.status = op.status; st.textContent = `${op.status}: ${op.status_text}`; d.appendChild(st);
  const ul = document.createElement("ul");
  for (const ev of op.timeline) { const li = document.createElement("li"); li.dataset.kind = ev.kind; li.textContent = `${new Date(ev.at).toLocaleString()} — ${ev.event}` + (ev.by ? ` (by ${ev.by})` : "") + (ev.for ? ` (for ${ev.for})` : ""); ul.appendChild(li); }
  d.appendChild(ul);
}
function show() {
  $("login").hidden = !!token; $("app").hidden = !token;
  if (token) load().catch(e => $("flash").textContent = e.message);
}
$("account-filter").onchange = () => load().catch(e => $("flash").textContent = e.message);
$("login").onsubmit = (e) => { e.preventDefault(); token = $("token").value; sessionStorage.setItem("chatq-admin-token", token); show(); };
show();
setInterval(() => { if (token) { load().catch(() => {}); if (openId) detail(openId).catch(() => {}); } }, 2000);
