"""Screenshots of what a person sees in the Prefect UI, taken in headless Chromium.

Starts a Prefect server (its own PREFECT_HOME and FRENZY_HOME in a temporary folder), syncs the
local CPU pool, saves a `GPUCluster` block, creates the `frenzy-submit` deployment, runs one
submission of examples/tiny-job.yaml, and saves PNGs of the run's artifacts, each artifact, the
run form, the work pools page and the two block editors into docs/ (ui-*.png). Prints each file
and the URL it shows.

    python scripts/ui_screenshots.py [--port 4391] [--out docs] [--width 1400]

Needs Debian's `chromium` package (`apt-get install chromium`), driven over its DevTools
protocol. Takes 2-6 minutes on 2 busy cores (server start with migrations, one tiny training
run, ~10 s per page).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Seconds a page gets after navigation before the capture: the UI fetches the run, its artifacts
# and the deployment schema after the first paint; 8 s drew every page here fully on 2 busy
# cores (3 s left some artifact cards empty).
SETTLE_S = 8.0

DRIVER = r"""
import json, os, sys
from prefect import get_client
from prefect.utilities.callables import parameter_schema

from blocks.cluster import GPUCluster
from blocks.settings import FrenzySettings
from deployments.pools import sync_pools, CONTROL_POOL
from frenzy_cli.run import load_job
from frenzy_flows import submit_training
from scheduler.discover import cluster_or_local

topology = cluster_or_local(None)
sync_pools(topology)
GPUCluster.from_cluster(topology).save("local-cpu", overwrite=True)
FrenzySettings.register_type_and_schema()
with get_client(sync_client=True) as client:
    flow_id = client.create_flow_from_name("frenzy-submit")
    dep_id = client.create_deployment(
        flow_id=flow_id, name="frenzy-submit", work_pool_name=CONTROL_POOL,
        entrypoint="frenzy_flows/flow.py:submit_training",
        parameter_openapi_schema=parameter_schema(submit_training).model_dump(),
        enforce_parameter_schema=True, description="Submit an LLM training job without choosing GPUs.")
dry = submit_training(load_job(sys.argv[1]), cluster=GPUCluster.load("local-cpu"), dry_run=True, return_state=True)
result = submit_training(load_job(sys.argv[1]))
print("FRENZY_UI " + json.dumps({"flow_run_id": result.flow_run_id, "deployment_id": str(dep_id),
                                 "dry_run_id": str(dry.state_details.flow_run_id),
                                 "cluster_block_id": str(GPUCluster.load("local-cpu")._block_document_id)}))
"""


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _post(url: str, body: dict) -> object:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


class Browser:
    """Headless Chromium driven over the DevTools protocol (Prefect's own `websockets` client).

    Plain ``chromium --headless --screenshot`` caught the UI mid fade-in (every page dimmed);
    over the protocol the page is loaded, given ``SETTLE_S`` to draw, optionally scrolled to a
    label, then captured."""

    def __init__(self, width: int, port: int = 9333):
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if not chromium:
            raise SystemExit("chromium not found: apt-get install chromium")
        self.width, self.port = width, port
        self.profile = tempfile.mkdtemp(prefix="frenzy-chromium-")
        self.proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                      f"--user-data-dir={self.profile}", f"--remote-debugging-port={port}",
                                      f"--window-size={width},1000", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                tabs = _get(f"http://127.0.0.1:{port}/json")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise SystemExit("chromium did not open its DevTools port")
                time.sleep(0.2)
        from websockets.sync.client import connect

        self.ws = connect(next(t["webSocketDebuggerUrl"] for t in tabs if t["type"] == "page"), max_size=None)
        self.n = 0

    def call(self, method: str, **params) -> dict:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def _on_text(self, text: str, action: str) -> None:
        """``action`` ('click()' or 'scrollIntoView()') on the innermost first element whose text is ``text``."""
        t = json.dumps(text)
        found = self.call("Runtime.evaluate", returnByValue=True, expression=(
            "(() => { const m = Array.from(document.querySelectorAll('body *')).filter(e => e.textContent.trim() === "
            + t + " && !Array.from(e.children).some(c => c.textContent.trim() === " + t + "));"
            " if (!m.length) return false; m[0]." + action + "; return true; })()"))
        if not found.get("result", {}).get("value"):
            raise SystemExit(f"no element with the text {text!r} on the page")

    def shoot(self, url: str, out: Path, height: int, click: str | None = None, scroll_to: str | None = None) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=height, deviceScaleFactor=1,
                  mobile=False)
        self.call("Page.navigate", url=url)
        time.sleep(SETTLE_S)
        if click:           # a tab, e.g. a run's "Artifacts"
            self._on_text(click, "click()")
            time.sleep(SETTLE_S / 2)
        if scroll_to:       # a label further down, e.g. the form's "cluster (Optional)"
            self._on_text(scroll_to, "scrollIntoView()")
            time.sleep(1.0)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        out.write_bytes(base64.b64decode(data))
        print(f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}  <- {url}"
              + (f" (at '{scroll_to}')" if scroll_to else ""))

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=4391)
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--job", default=str(ROOT / "examples" / "tiny-job.yaml"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix="frenzy-ui-"))
    base = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "FRENZY_HOME": str(tmp / "frenzy"),
           "PREFECT_API_URL": f"{base}/api", "PREFECT_UI_API_URL": f"{base}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(ROOT)}
    (tmp / "prefect").mkdir()
    log = open(tmp / "server.log", "w")
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                               "--port", str(args.port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                _get(f"{base}/api/health")
                break
            except Exception:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"server did not start: {(tmp / 'server.log').read_text()[-2000:]}")
                time.sleep(1)
        proc = subprocess.run([sys.executable, "-c", DRIVER, args.job], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("FRENZY_UI ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"submission failed:\n{proc.stderr[-3000:]}")
        ids = json.loads(line.split(" ", 1)[1])
        run_id, dep_id = ids["flow_run_id"], ids["deployment_id"]
        arts = _post(f"{base}/api/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
        by_key = {a["key"]: a["id"] for a in arts if a.get("key")}
        browser = Browser(args.width)
        try:
            browser.shoot(f"{base}/runs/flow-run/{run_id}", out / "ui-run-artifacts.png", 1100, click="Artifacts",
                          scroll_to="Artifacts")
            for key, name, h in (("frenzy-plans", "ui-artifact-plans.png", 800),
                                 ("frenzy-summary", "ui-artifact-summary.png", 1500),
                                 ("frenzy-memory", "ui-artifact-memory.png", 1100)):
                if key in by_key:
                    browser.shoot(f"{base}/artifacts/artifact/{by_key[key]}", out / name, h)
            form = f"{base}/deployments/deployment/{dep_id}/run"
            browser.shoot(form, out / "ui-run-form.png", 1600)
            browser.shoot(form, out / "ui-run-form-cluster.png", 1100, scroll_to="cluster (Optional)")
            dry = _post(f"{base}/api/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [ids["dry_run_id"]]}}})
            if dry:
                browser.shoot(f"{base}/artifacts/artifact/{dry[0]['id']}", out / "ui-artifact-dry-run.png", 700)
            browser.shoot(f"{base}/work-pools", out / "ui-work-pools.png", 900)
            # the block editors: the saved GPUCluster (its pool entries) and a new FrenzySettings
            browser.shoot(f"{base}/blocks/block/{ids['cluster_block_id']}/edit", out / "ui-block-gpu-cluster.png", 1400)
            browser.shoot(f"{base}/blocks/catalog/frenzy-settings/create", out / "ui-block-settings.png", 1400)
        finally:
            browser.close()
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
