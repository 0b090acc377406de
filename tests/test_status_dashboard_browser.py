"""The dashboard renders its charts in headless Chromium (Debian's, driven by Playwright)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from PIL import Image

from asyncrl.trainer.status_api import StatusServer, create_app
from status_fixtures import synthetic_report

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def _ink_fraction(png: bytes) -> float:
    """Fraction of pixels that differ clearly from the image's most common (background) colour."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    background = max(img.getcolors(img.width * img.height), key=lambda c: c[0])[1]
    ink = sum(count for count, colour in img.getcolors(img.width * img.height)
              if sum(abs(a - b) for a, b in zip(colour, background)) > 60)
    return ink / (img.width * img.height)


def test_dashboard_draws_reward_and_staleness_charts(tmp_path: Path):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "run scripts/install-browser.sh"
    server = StatusServer(create_app(synthetic_report, token="tok"))
    url = server.start_in_thread()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/?token=tok")
            # the page polls /status with the bearer token and draws one polyline/path per series
            page.wait_for_function(
                "document.querySelectorAll('#reward-chart path, #reward-chart polyline').length > 0"
                " && document.querySelectorAll('#staleness-chart path, #staleness-chart polyline').length > 0",
                timeout=20_000)
            assert "30" in page.inner_text("body")  # the step number is shown
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            for chart in ("#reward-chart", "#staleness-chart", "#staleness-histogram"):
                box = page.locator(chart).bounding_box()
                assert box and box["width"] > 200 and box["height"] > 100, chart
                assert _ink_fraction(page.locator(chart).screenshot()) > 0.01, f"{chart} is blank"
            browser.close()
        assert shot.stat().st_size > 10_000
    finally:
        server.stop_thread()
