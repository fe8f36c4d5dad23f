const params = new URLSearchParams(location.search);
let chat = params.get("chat") || sessionStorage.getItem("chatq-sandbox-chat") || ("c" + Math.random().toString(36).slice(2, 10));
sessionStorage.setItem("chatq-sandbox-chat", chat);
document.getElementById("chat").textContent = chat;
document.getElementById("newchat").onclick = (e) => { e.preventDefault(); sessionStorage.removeItem("chatq-sandbox-chat"); location.search = ""; };
const log = document.getElementById("log");
const STATUS = { accepted: "stored", queued: "queued", waiting: "waiting for you to finish typing", replying: "bot is writing", replied: "answered", failed: "failed", needs_review: "needs review", ignored: "ignored" };
async function refresh() {
  const r = await fetch(`/v1/sandbox/chats/${encodeURIComponent(chat)}/messages`);
  if (!r.ok) return;
  const { messages } = await r.json();
  log.replaceChildren(...messages.map(m => {
    const div = document.createElement("div");
    div.className = `msg ${m.from}`;
    div.textContent = m.text;
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = new Date(m.at).toLocaleTimeString() + (m.from === "buyer" ? " · " + (STATUS[m.status] || m.status) : " · bot");
    div.appendChild(meta);
    return div;
  }));
  const pending = messages.some(m => m.from === "buyer" && ["accepted", "queued", "waiting", "replying"].includes(m.status));
  document.getElementById("typing").textContent = pending ? "the bot will answer once you pause…" : "";
}
document.getElementById("send").onsubmit = async (e) => {
  e.preventDefault();
  const input = document.getElementById("text");
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  await fetch("/v1/sandbox/messages", { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ chat_id: chat, text }) });
  refresh();
};
refresh();
setInterval(refresh, 1000);
