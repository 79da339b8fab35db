// Lethe dashboard: refresh unfinished requests in place (no full reload), verify certificates on demand, and count
// the requests ticked for a bulk action.
// Polls /dashboard/api/requests for the rows still active; on the request page, a change of status re-fetches the
// page body (report, certificate, timeline) from /dashboard/requests/<id>/live. A body marked data-follow (the
// per-person erasure) is fetched again from its URL while it says it is still following (data-following="true").
(function () {
  "use strict";
  const interval = Number(document.body.dataset.pollMs || 1000);

  function activeIds() {
    const ids = new Set();
    document.querySelectorAll('[data-request-id][data-active="true"]').forEach((el) => ids.add(el.dataset.requestId));
    return Array.from(ids);
  }

  function setField(root, name, fn) {
    root.querySelectorAll('[data-field="' + name + '"]').forEach(fn);
  }

  async function reloadBody(url) {
    const target = document.getElementById("live");
    if (!target) return;
    const response = await fetch(url, { credentials: "same-origin" });
    if (response.ok) target.innerHTML = await response.text();
  }

  function update(item) {
    document.querySelectorAll('[data-request-id="' + item.id + '"]').forEach((el) => {
      const before = el.dataset.status;
      el.dataset.status = item.status;
      el.dataset.active = item.active ? "true" : "false";
      el.classList.toggle("overdue", item.overdue);
      setField(el, "status", (s) => { s.textContent = item.status; s.className = "badge status-" + item.status; });
      setField(el, "progress", (p) => { p.value = item.progress; p.hidden = !item.active; });
      setField(el, "message", (m) => { m.textContent = item.message; });
      setField(el, "time_left", (t) => { t.textContent = item.time_left; t.classList.toggle("flag-overdue", item.overdue); });
      if (before !== item.status && el.dataset.live) reloadBody(el.dataset.live);
    });
  }

  async function poll() {
    const ids = activeIds();
    if (ids.length) {
      try {
        const response = await fetch("/dashboard/api/requests?ids=" + encodeURIComponent(ids.join(",")), {
          credentials: "same-origin", headers: { accept: "application/json" },
        });
        if (response.status === 401) { window.location.assign("/dashboard/login"); return; }
        if (response.ok) (await response.json()).items.forEach(update);
      } catch (err) { /* the next poll tries again */ }
    }
    window.setTimeout(poll, interval);
  }

  function follow(box) {
    let last = "";
    async function tick() {
      if (box.dataset.active !== "true") return;
      try {
        const response = await fetch(box.dataset.follow, { credentials: "same-origin" });
        if (response.status === 401) { window.location.assign("/dashboard/login"); return; }
        if (response.ok) {
          const html = await response.text();
          if (html !== last) { box.innerHTML = html; last = html; }  // unchanged: leave the page as it is
          const state = box.querySelector("[data-following]");
          box.dataset.active = state && state.dataset.following === "true" ? "true" : "false";
        }
      } catch (err) { /* the next poll tries again */ }
      window.setTimeout(tick, interval);
    }
    window.setTimeout(tick, interval);
  }

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("[data-verify]");
    if (!button) return;
    const out = document.getElementById(button.dataset.target);
    button.disabled = true;
    out.textContent = "verifying…";
    try {
      const response = await fetch(button.dataset.verify, { credentials: "same-origin" });
      const body = await response.json();
      out.className = "verify " + (body.valid ? "valid" : "invalid");
      out.textContent = response.ok ? body.message + "\n(checked " + body.checked_at + ")" : body.error;
    } catch (err) {
      out.className = "verify invalid";
      out.textContent = "could not reach the service";
    } finally {
      button.disabled = false;
    }
  });

  // the list's bulk form: "tick every request on this page", and how many are ticked
  function ticked() {
    const boxes = Array.from(document.querySelectorAll('input[type=checkbox][name=ids][form=bulk]'));
    const count = document.getElementById("bulk-count");
    if (count) count.textContent = String(boxes.filter((b) => b.checked).length);
    const all = document.getElementById("pick-all");
    if (all) all.checked = boxes.length > 0 && boxes.every((b) => b.checked);
  }
  document.addEventListener("change", (event) => {
    const target = event.target;
    if (target.id === "pick-all") {
      document.querySelectorAll('input[type=checkbox][name=ids][form=bulk]').forEach((b) => { b.checked = target.checked; });
    }
    if (target.id === "pick-all" || (target.name === "ids" && target.getAttribute("form") === "bulk")) {
      ticked();
      const mode = document.getElementById("bulk-ticked");
      if (mode) mode.checked = true;  // ticking a request means acting on the ticked ones
    }
  });
  ticked();

  window.setTimeout(poll, interval);
  document.querySelectorAll("[data-follow]").forEach(follow);
})();
