// Search for the site opened from file://, with no server and no network (mkdocs.yml loads this before
// the theme's scripts). Chromium refuses `new Worker(url)` on a file:// page, and the theme's search runs
// in a worker: here the worker's script runs instead in a hidden same-document iframe, and messages
// cross as events. Served over http(s), the real Worker is used and this does nothing. (Its name keeps
// Material's offline plugin from adding its own shim, which it would fetch from a CDN.)
(function () {
  "use strict";
  if (location.protocol !== "file:") return;

  class FrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.pending = [];
      this.frame = document.createElement("iframe");
      this.frame.hidden = true;
      document.body.appendChild(this.frame);  // about:blank: same origin as the page
      const scope = this.frame.contentWindow;
      scope.postMessage = (data) => {  // the worker's replies
        const event = new MessageEvent("message", { data: data });
        if (this.onmessage) this.onmessage(event);
        this.dispatchEvent(event);
      };
      const script = scope.document.createElement("script");
      script.src = new URL(url, location.href).href;
      script.onload = () => {
        this.ready = true;
        this.pending.splice(0).forEach((data) => this.postMessage(data));
      };
      scope.document.head.appendChild(script);
    }

    postMessage(data) {
      if (!this.ready) {
        this.pending.push(data);
        return;
      }
      const scope = this.frame.contentWindow;
      scope.dispatchEvent(new scope.MessageEvent("message", { data: data }));
    }

    terminate() {
      this.frame.remove();
    }
  }

  window.Worker = FrameWorker;
})();
