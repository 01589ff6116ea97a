"""End to end in a real browser: JupyterLab serves the tour notebook, headless Chromium (Debian's
package, driven by Playwright) runs it, changes one widget of the app and sees the block map
change. The screenshot lands in out/browser/tour.png."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def ensure_chromium():
    """Debian's chromium package; installed here when missing (Playwright's own download is not used)."""
    if CHROMIUM.exists():
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "update"], check=False, capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "chromium"], check=False, capture_output=True, timeout=600)
    if not CHROMIUM.exists():
        pytest.fail("the browser test needs Debian's chromium at /usr/bin/chromium: apt-get install -y chromium")


def disable_news():
    """JupyterLab's news prompt covers the notebook; switch it off for this environment."""
    settings = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings"
    settings.mkdir(parents=True, exist_ok=True)
    path = settings / "overrides.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("@jupyterlab/apputils-extension:notification", {})["fetchNews"] = "false"
    path.write_text(json.dumps(data))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    ensure_chromium()
    disable_news()
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / "01_tour.ipynb", root / "01_tour.ipynb")
    port, token = free_port(), "workbench-test"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JUPYTERLAB_SETTINGS_DIR=str(root / ".settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(root / ".workspaces"), MPLBACKEND="module://matplotlib_inline.backend_inline")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--allow-root"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        server.terminate()
        pytest.fail("JupyterLab did not start within 60 s")
    yield base, token
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


def test_tour_runs_in_jupyterlab_and_the_app_redraws(lab):
    from playwright.sync_api import sync_playwright

    base, token = lab
    shots = ROOT / "out" / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(f"{base}/lab/tree/01_tour.ipynb?token={token}")
        page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=90_000)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_text("Run All Cells", exact=True).click()
        # the app's block map is the last widget image; its Stats/Block map follow every change
        app_image = page.locator(".jp-OutputArea .widget-tab .widget-image").first
        app_image.wait_for(timeout=240_000)
        page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=240_000)
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count() == 0 \
            or page.locator("text=Traceback").count() == 0
        assert page.locator("text=PASS window_with_globals").count() >= 1
        before = app_image.get_attribute("src")
        status = page.locator("text=redrawn in").last
        first_status = status.inner_text()
        # change one widget: the query length
        lq = page.locator(".widget-inline-hbox", has=page.locator("label", has_text="Lq")).locator("input").first
        lq.fill("600")
        lq.press("Tab")  # the text box commits its value when it loses focus
        # each redraw displays a new image element: query it afresh
        page.wait_for_function(
            "(old) => { const img = document.querySelector('.jp-OutputArea .widget-tab .widget-image');"
            " return img !== null && img.getAttribute('src') !== old; }", arg=before, timeout=60_000)
        page.wait_for_timeout(500)
        app_image.scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "tour.png"))
        assert app_image.get_attribute("src") != before
        assert page.locator("text=redrawn in").last.inner_text() != first_status
        browser.close()
