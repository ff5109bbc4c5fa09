// llmgw-poller operator's page: refresh without a reload, and draw each endpoint's load.
//
// Every 2 s: read /v1/view (the JSON `poller status --json` prints) to extend each
// endpoint's running/waiting history, then fetch this same page (same query string) and
// swap its <main>, already rendered and escaped by the server. Nothing here writes HTML
// from data: text goes through the DOM, the picture is built with createElementNS. The
// history lives only in this tab (nothing new is stored in Redis).
"use strict";

(function () {
  const REFRESH_MS = 2000;
  const WINDOW_MS = 5 * 60 * 1000;
  const MIN_SPAN_MS = 60 * 1000;
  const SVG = "http://www.w3.org/2000/svg";
  const W = 120;
  const H = 26;
  const samples = new Map(); // endpoint id -> [{t, r, w}] (r/w null = no stats)
  const live = document.getElementById("live");
  let timer = null;

  function record(view) {
    const now = view.now_ms;
    const seen = new Set();
    for (const e of view.endpoints) {
      seen.add(e.id);
      let points = samples.get(e.id);
      if (!points) {
        points = [];
        samples.set(e.id, points);
      }
      const s = e.stats;
      points.push({ t: now, r: s ? s.running : null, w: s ? s.waiting : null });
      while (points.length && points[0].t < now - WINDOW_MS) points.shift();
    }
    for (const id of samples.keys()) if (!seen.has(id)) samples.delete(id);
    return now;
  }

  function line(points, field, max, start, span, cls) {
    const el = document.createElementNS(SVG, "polyline");
    const coords = [];
    for (const p of points) {
      if (p[field] === null) continue;
      const x = ((p.t - start) / span) * W;
      const y = H - 1 - (p[field] / max) * (H - 2);
      coords.push(x.toFixed(1) + "," + y.toFixed(1));
    }
    el.setAttribute("points", coords.join(" "));
    el.setAttribute("class", cls);
    return el;
  }

  function draw(now) {
    for (const cell of document.querySelectorAll("td.load")) {
      const points = samples.get(cell.dataset.id) || [];
      // The x axis spans what this tab has seen: at least a minute, at most WINDOW_MS.
      const seen = points.length ? now - points[0].t : 0;
      const span = Math.min(WINDOW_MS, Math.max(MIN_SPAN_MS, seen));
      const start = now - span;
      let max = 1;
      for (const p of points) max = Math.max(max, p.r || 0, p.w || 0);
      const svg = document.createElementNS(SVG, "svg");
      svg.setAttribute("viewBox", "0 0 " + W + " " + H);
      svg.setAttribute("width", String(W));
      svg.setAttribute("height", String(H));
      svg.setAttribute("class", "spark");
      const title = document.createElementNS(SVG, "title");
      const last = points.length ? points[points.length - 1] : null;
      title.textContent = last && last.r !== null
        ? "running " + last.r + ", waiting " + last.w + " (peak " + max + " over the last " +
          Math.round(span / 1000) + " s this page saw)"
        : "no stats seen yet";
      svg.appendChild(title);
      svg.appendChild(line(points, "w", max, start, span, "wait"));
      svg.appendChild(line(points, "r", max, start, span, "run"));
      cell.replaceChildren(svg);
    }
  }

  async function refresh() {
    let now = null;
    try {
      const viewReply = await fetch("/v1/view", { cache: "no-store" });
      if (viewReply.ok) now = record(await viewReply.json());
      const pageReply = await fetch(location.pathname + location.search, { cache: "no-store" });
      const doc = new DOMParser().parseFromString(await pageReply.text(), "text/html");
      const fresh = doc.getElementById("page");
      const current = document.getElementById("page");
      // A filter the operator is choosing right now keeps its open menu and focus.
      const form = document.getElementById("filters");
      const keep = form && form.contains(document.activeElement) ? form : null;
      if (fresh && current) current.replaceWith(document.adoptNode(fresh));
      const swapped = document.getElementById("filters");
      if (keep && swapped && swapped !== keep) swapped.replaceWith(keep);
      if (now === null) {
        const main = document.getElementById("page");
        now = main && main.dataset.nowMs ? Number(main.dataset.nowMs) : Date.now();
      }
      draw(now);
      live.textContent = "live: refreshed " + new Date().toLocaleTimeString() + ", every 2 s";
      live.className = pageReply.ok ? "ok" : "bad";
    } catch (err) {
      live.textContent = "cannot reach this poller (" + err + "); retrying every 2 s";
      live.className = "bad";
    }
  }

  async function loop() {
    await refresh();
    timer = setTimeout(loop, REFRESH_MS);
  }

  // Filters and sorting change the query string in place, so the histories survive and
  // the link in the address bar stays shareable.
  function go(url) {
    window.history.pushState(null, "", url);
    clearTimeout(timer);
    loop();
  }

  document.addEventListener("click", (event) => {
    const a = event.target.closest("a.sort, #filters a");
    if (!a || event.button !== 0 || event.metaKey || event.ctrlKey) return;
    event.preventDefault();
    go(a.getAttribute("href"));
  });
  document.addEventListener("change", (event) => {
    const form = event.target.closest("#filters");
    if (form) form.requestSubmit();
  });
  document.addEventListener("submit", (event) => {
    const form = event.target.closest("#filters");
    if (!form) return;
    event.preventDefault();
    const params = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v) params.append(k, String(v));
    const q = params.toString();
    go(q ? "?" + q : location.pathname);
  });
  window.addEventListener("popstate", () => {
    clearTimeout(timer);
    loop();
  });

  live.textContent = "live: refreshing every 2 s";
  loop();
})();
