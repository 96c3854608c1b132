// pgfence status page: updates the live part of the page in place, and
// counts lease expiries down between updates. The page reads without it.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) {
    return;
  }
  var every = Number(live.getAttribute("data-refresh")) || 1000;
  var status = document.getElementById("live-status");
  var offset = 0; // database clock minus this browser's clock

  function human(ms) {
    var s = ms / 1000;
    if (ms < 1000) return Math.floor(ms) + "ms";
    if (s < 10) return s.toFixed(1) + "s";
    if (s < 60) return Math.floor(s) + "s";
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    if (s < 3600) return Math.floor(s / 60) + "m" + pad(Math.floor(s) % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h" + pad(Math.floor(s / 60) % 60) + "m";
    return Math.floor(s / 86400) + "d" + pad(Math.floor(s / 3600) % 24) + "h";
  }

  function syncClock() {
    var stamp = document.getElementById("stamp");
    if (stamp) {
      offset = Number(stamp.getAttribute("data-now")) - Date.now();
    }
  }

  function tick() {
    var now = Date.now() + offset;
    var els = live.querySelectorAll(".countdown");
    for (var i = 0; i < els.length; i++) {
      var left = Number(els[i].getAttribute("data-deadline")) - now;
      if (left > 0) {
        els[i].textContent = human(left);
      } else {
        els[i].textContent = "expired";
        els[i].classList.add("gone");
      }
    }
  }

  function swap(html) {
    // Keep the keyboard focus and the open details across the update:
    // elements that can take either have ids that stay the same.
    var focused = document.activeElement && live.contains(document.activeElement) ? document.activeElement.id : "";
    var open = [];
    var ds = live.querySelectorAll("details[open][id]");
    for (var i = 0; i < ds.length; i++) open.push(ds[i].id);
    live.innerHTML = html;
    for (var j = 0; j < open.length; j++) {
      var d = document.getElementById(open[j]);
      if (d) d.open = true;
    }
    if (focused) {
      var f = document.getElementById(focused);
      if (f) f.focus();
    }
  }

  function refresh() {
    var url = new URL(window.location.href);
    url.searchParams.set("partial", "1");
    // A request the network holds (no answer, no error) is given up, so
    // that the page says it is not updating.
    var signal = window.AbortSignal && AbortSignal.timeout ? AbortSignal.timeout(Math.max(20000, 3 * every)) : undefined;
    fetch(url.toString(), { cache: "no-store", credentials: "same-origin", signal: signal })
      .then(function (res) {
        if (!res.ok) throw new Error("HTTP " + res.status);
        return res.text();
      })
      .then(function (html) {
        swap(html);
        syncClock();
        tick();
        if (status) status.textContent = "Live: updates every " + human(every) + ".";
      })
      .catch(function (err) {
        if (status) status.textContent = "Not updating (" + err.message + "); retrying.";
      })
      .then(function () {
        window.setTimeout(refresh, every);
      });
  }

  syncClock();
  tick();
  window.setInterval(tick, 250);
  window.setTimeout(refresh, every);
})();
