"""`sao report` rendered by a real browser: headless Chromium, driven over the DevTools protocol, loads the report
from disk and says whether every plot drew, whether anything was fetched from the network, and whether the console
logged an error; then the page's screenshot must be an image, not a blank.

Needs Chromium (Debian: `apt-get install chromium`, or the smaller `chromium-headless-shell`); skipped without it.
The README's picture (docs/images/report.png) is a real report, not this test's: see the README's Operations section.
"""

import base64
import io
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from components.eval.report import write_report
from tests.eval.test_report import log_run

pytestmark = pytest.mark.browser

WIDTH = 1400
CHECK_PLOTS = """JSON.stringify([...document.querySelectorAll('figure.plot')].map(f => {
  const svg = f.querySelector('svg.chart'), box = svg && svg.getBBox(), rect = svg && svg.getBoundingClientRect();
  return {metric: f.dataset.metric, nodata: !!f.querySelector('.nodata'),
          paths: svg ? svg.querySelectorAll('path').length : 0, bbox: box ? [box.width, box.height] : [0, 0], shown: rect ? [rect.width, rect.height] : [0, 0]};
}))"""
"""For each figure: its metrics, whether it says "No data", how many SVG paths it drew, the drawing's extent in SVG
units (getBBox: zero when nothing was laid out) and its size on the page in CSS pixels."""


def find_chromium() -> str | None:
    """The first Chromium on PATH (Debian's `chromium` or `chromium-headless-shell`, or another distribution's)."""
    return next(
        filter(None, map(shutil.which, ("chromium", "chromium-headless-shell", "chromium-browser", "google-chrome"))),
        None,
    )


class DevTools:
    """One page of a headless Chromium over the DevTools protocol: commands wait for their answer, events are kept."""

    def __init__(self, binary: str, profile: Path) -> None:
        self.process = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={WIDTH},900",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            self._connect(binary, profile)
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise

    def _connect(self, binary: str, profile: Path) -> None:
        from websockets.sync.client import connect

        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 30
        while not (port_file.exists() and len(port_file.read_text().splitlines()) == 2):
            assert self.process.poll() is None, f"{binary} exited with {self.process.returncode}"
            assert time.monotonic() < deadline, f"{binary} did not open its DevTools port in 30 s"
            time.sleep(0.1)
        port, path = port_file.read_text().splitlines()
        self.browser = connect(f"ws://127.0.0.1:{port}{path}", proxy=None, max_size=None, open_timeout=30)
        self.ids, self.events = 0, []
        target = self.call("Target.createTarget", url="about:blank", socket=self.browser)["targetId"]
        self.page = connect(f"ws://127.0.0.1:{port}/devtools/page/{target}", proxy=None, max_size=None, open_timeout=30)

    def call(self, method: str, socket=None, timeout: float = 30, **params) -> dict:
        socket = socket or self.page
        self.ids += 1
        socket.send(json.dumps({"id": self.ids, "method": method, "params": params}))
        while True:
            message = json.loads(socket.recv(timeout=timeout))
            if message.get("id") == self.ids:
                assert "error" not in message, f"{method}: {message['error']}"
                return message["result"]
            self.events.append(message)

    def wait_for(self, event: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == event for e in self.events):
            self.events.append(json.loads(self.page.recv(timeout=max(deadline - time.monotonic(), 0.01))))

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"]["value"]

    def close(self) -> None:
        from websockets.exceptions import ConnectionClosed

        self.page.close()
        try:
            self.call("Browser.close", socket=self.browser, timeout=10)
        except (ConnectionClosed, TimeoutError):  # it may drop the socket as it exits; waiting below is what counts
            pass
        self.browser.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def report(tmp_path):
    """The report of two finished training runs in a sqlite MLflow: SAO with a critic, and GRPO without one."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    experiment = client.create_experiment("sao", artifact_location=(tmp_path / "art").as_uri())
    runs = [
        log_run(client, experiment, "tiny-cpu/sao", steps=60, offset=0.1, idle=True),
        log_run(
            client,
            experiment,
            "tiny-cpu/grpo",
            steps=60,
            critic=False,
            idle=True,
            start_ms=1_700_000_900_000,
            seconds=313,
        ),
    ]
    return write_report(client, runs, tmp_path / "report.html")


def test_every_plot_draws_in_chromium_offline_and_without_console_errors(report, tmp_path):
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium (apt-get install chromium)")
    browser = DevTools(binary, tmp_path / "profile")
    try:
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.call(f"{domain}.enable")
        browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=900, deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", url=report.resolve().as_uri())
        browser.wait_for("Page.loadEventFired")
        plots = json.loads(browser.evaluate(CHECK_PLOTS))
        height = browser.evaluate("document.documentElement.scrollHeight")
        browser.call(
            "Emulation.setDeviceMetricsOverride", width=WIDTH, height=height, deviceScaleFactor=1, mobile=False
        )
        png = base64.b64decode(
            browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, timeout=60)["data"]
        )
    finally:
        browser.close()

    assert len(plots) == 8
    for plot in plots:
        assert not plot["nodata"], plot
        assert plot["paths"] > 20, plot  # axes, ticks, glyphs and one line per run: a drawn plot has many
        assert min(plot["bbox"]) > 100 and min(plot["shown"]) > 150, plot
    fetched = [e["params"]["request"]["url"] for e in browser.events if e.get("method") == "Network.requestWillBeSent"]
    assert fetched == [report.resolve().as_uri()], "the report must load nothing but itself"
    errors = [
        e["params"]
        for e in browser.events
        if e.get("method") == "Runtime.exceptionThrown"
        or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
        or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
    ]
    assert errors == []

    import numpy as np
    from PIL import Image

    (tmp_path / "report.png").write_bytes(png)
    image = Image.open(io.BytesIO(png))
    assert image.size == (WIDTH, height) and height > 1500
    pixels = np.asarray(image.convert("RGB"))
    assert pixels.std() > 10, "a blank page"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100, "too few colours for a page of plots"
