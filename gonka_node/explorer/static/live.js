// Live updates: the server sends an `update` event whenever its index changes; the page then fetches
// its own <main> again (already escaped HTML from the same server) and swaps it in. Without
// EventSource, or when the stream drops, it polls every 5 s instead.
"use strict";
(function () {
  const main = document.getElementById("main");
  if (!main || !main.dataset.live) return;
  let busy = false;
  async function refresh() {
    if (busy) return;
    busy = true;
    try {
      const response = await fetch(main.dataset.live, { cache: "no-store" });
      if (response.ok) main.innerHTML = await response.text();
    } catch (err) {
      // offline for a moment: the next event or poll tries again
    } finally {
      busy = false;
    }
  }
  function status(data) {
    const el = document.getElementById("status");
    if (el && data.block !== null) el.textContent = el.textContent.replace(/block \S+/, "block " + data.block);
  }
  function listen() {
    const source = new EventSource("/api/stream");
    source.addEventListener("update", function (event) {
      const data = JSON.parse(event.data);
      status(data);
      if (String(data.version) === main.dataset.version) return;  // rendered at this version already
      main.dataset.version = String(data.version);
      refresh();
    });
    source.onerror = function () {
      source.close();
      setTimeout(listen, 5000);
      refresh();
    };
  }
  if (window.EventSource) listen(); else setInterval(refresh, 5000);
})();
