// loraplex console: refreshes the live part of a page (<main data-refresh-ms>) from the server every few
// seconds, except while the viewer is filling in a form there (ticked runs, filters: a refresh would
// undo them), and makes "copy" buttons copy their tinker:// path. No framework, no build step.
"use strict";

(function () {
  const live = document.querySelector("main[data-refresh-ms]");

  function editing() {
    const focused = document.activeElement;
    return live.dataset.editing === "true" || (focused !== null && live.contains(focused) && focused.closest("form") !== null);
  }

  async function refresh() {
    if (document.hidden || editing()) return;
    const url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    let response;
    try {
      response = await fetch(url, { credentials: "same-origin", headers: { Accept: "text/html" } });
    } catch (error) {
      live.dataset.stale = "true"; // the server is away; try again next time
      return;
    }
    if (response.status === 401) {
      window.location.assign("/console/login");
      return;
    }
    if (response.ok || response.status === 404) {
      const html = await response.text();
      if (editing()) return; // the viewer started on a form while this was on its way
      live.innerHTML = html;
      delete live.dataset.stale;
      live.dataset.refreshedAt = String(Date.now());
    }
  }

  if (live) {
    window.setInterval(refresh, Number(live.dataset.refreshMs) || 3000);
    // A changed field holds the refresh until the page is left (the form's GET loads a new one).
    live.addEventListener("change", function (event) {
      if (event.target.closest("form")) live.dataset.editing = "true";
    });
  }

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text);
    }
    // Plain http to a remote host: the Clipboard API is not offered; select a hidden field instead.
    const field = document.createElement("textarea");
    field.value = text;
    field.setAttribute("readonly", "");
    field.className = "offscreen";
    document.body.appendChild(field);
    field.select();
    const copied = document.execCommand("copy");
    field.remove();
    return copied ? Promise.resolve() : Promise.reject(new Error("copy refused"));
  }

  // Delegated, so buttons in refreshed content work too.
  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-copy]");
    if (!button) return;
    copyText(button.dataset.copy).then(
      function () { button.textContent = "copied"; },
      function () { button.textContent = "select and copy"; }
    );
    window.setTimeout(function () { button.textContent = "copy"; }, 1500);
  });
})();
