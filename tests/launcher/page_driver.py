"""Drives headless Chromium on an agent's live page (GET /) for the tests.

    page_driver.py URL OUTDIR [SECONDS]

Opens URL in headless Chromium through the DevTools protocol (over
--remote-debugging-pipe: no port, nothing to race for) and, every 200 ms
until OUTDIR/quit exists or SECONDS (120) pass, writes what the page shows
to OUTDIR/dom.json (atomically): the elements the page marks for tests
(data-rank, data-node, #agent-state, #attempt, #banner, #history) as the
browser rendered them. When OUTDIR/shoot exists it writes a screenshot to
OUTDIR/page.png and removes OUTDIR/shoot. Exits 0 when told to quit, 2 when
Chromium cannot be started or answered nothing.
"""
import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

SNAPSHOT = r"""
(() => {
  const q = s => document.querySelector(s);
  const shown = e => !!e && !e.hidden && getComputedStyle(e).display !== 'none';
  const all = s => Array.from(document.querySelectorAll(s));
  const banner = q('#banner');
  return JSON.stringify({
    loaded: document.body.dataset.loaded || '',
    updates: Number(document.body.dataset.updates || 0),
    state: (q('#agent-state') || {}).textContent || '',
    attempt: (q('#attempt') || {}).textContent || '',
    banner: shown(banner) ? (banner.dataset.kind || 'shown') : '',
    banner_text: shown(banner) ? banner.textContent : '',
    ranks: all('[data-rank]').map(e => ({rank: Number(e.dataset.rank), state: e.dataset.state || ''})),
    nodes: all('[data-node]').map(e => ({node: Number(e.dataset.node), state: e.dataset.state || ''})),
    history: all('#history [data-event]').map(e => e.dataset.event),
    text: document.body.innerText.slice(0, 4000),
  });
})()
"""


class Browser:
    """Chromium with the DevTools protocol on fds 3 (to it) and 4 (from it)."""

    def __init__(self, profile):
        to_r, self.to_w = os.pipe()
        self.from_r, from_w = os.pipe()

        def fds():
            # dup2 of a descriptor onto itself keeps its close-on-exec flag.
            os.dup2(to_r, 3)
            os.dup2(from_w, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        chromium = shutil.which("chromium") or "/usr/bin/chromium"
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--remote-debugging-pipe", "--window-size=1280,900",
             "--user-data-dir=" + profile, "about:blank"],
            # close_fds would close 3 and 4 after preexec_fn made them.
            close_fds=False, preexec_fn=fds, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self.buf = b""
        self.next_id = 0
        self.session = None

    def call(self, method, params=None, timeout=20):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    if "error" in reply:
                        raise RuntimeError(method + ": " + json.dumps(reply["error"]))
                    return reply.get("result", {})
            ready, _, _ = select.select([self.from_r], [], [], 0.5)
            if ready:
                chunk = os.read(self.from_r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the protocol pipe")
                self.buf += chunk
        raise RuntimeError(method + ": no answer within %d s" % timeout)

    def open(self, url):
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        self.session = self.call("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]

    def evaluate(self, expression):
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        return r.get("result", {}).get("value")

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path + ".tmp", "wb") as f:
            f.write(base64.b64decode(data))
        os.replace(path + ".tmp", path)

    def close(self):
        self.proc.kill()
        self.proc.wait()


def main():
    url, out = sys.argv[1], sys.argv[2]
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 120.0
    profile = tempfile.mkdtemp(prefix="page_driver_")
    try:
        browser = Browser(profile)
        try:
            browser.open(url)
        except (RuntimeError, OSError) as e:
            print("page_driver: chromium did not open the page: %s" % e, file=sys.stderr)
            return 2
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not os.path.exists(os.path.join(out, "quit")):
            try:
                snap = browser.evaluate(SNAPSHOT)
            except RuntimeError as e:
                snap = json.dumps({"error": str(e)})
            if snap:
                with open(os.path.join(out, "dom.json.tmp"), "w") as f:
                    f.write(snap)
                os.replace(os.path.join(out, "dom.json.tmp"), os.path.join(out, "dom.json"))
            shoot = os.path.join(out, "shoot")
            if os.path.exists(shoot):
                browser.screenshot(os.path.join(out, "page.png"))
                os.remove(shoot)
            time.sleep(0.2)
        browser.close()
        return 0
    finally:
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
