"""The dashboard rendered in headless Chromium against a live status server (30 synthetic steps,
held-out evaluations every 7 versions).

Needs /usr/bin/chromium (scripts/install-browser.sh). The screenshot is decoded with a tiny PNG
reader below (no Pillow dependency) to check the charts' regions actually hold drawn pixels.
Set ASYNCRL_DASHBOARD_SCREENSHOT=path to keep a copy of the screenshot (docs/dashboard.png).
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asyncrl.api.status_report import (
    AdmissionReport,
    EngineReport,
    EvalRecord,
    RecoveryReport,
    ReplayReport,
    StalenessReport,
    StallReport,
    StepMetrics,
    StepRecord,
    TrainerReport,
)
from asyncrl.infra.health import Health
from asyncrl.trainer.report.status_api import StatusServer, create_app
from tests.support.paths import REPO
from tests.support.polling import poll

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
TOKEN = "dash-token"

pytestmark = pytest.mark.browser


@pytest.fixture(autouse=True)
def _chromium_installed() -> None:
    """scripts/test.sh installs Chromium; a missing browser is a broken setup, not a reason to skip."""
    assert CHROMIUM.exists(), "no /usr/bin/chromium: run scripts/install-browser.sh"


def evaluation(version: int, pass_at_1: float, k: int = 1, pass_at_k: float | None = None) -> EvalRecord:
    return EvalRecord(policy_version=version, reward_mean=round(pass_at_1 * 0.9 + 0.05, 4), pass_at_1=pass_at_1,
                      pass_at_k=pass_at_k, k=k, prompts=64, samples=64 * k, on_version=0.97,
                      response_length=11.5, seconds=41.0, engine_id="engine-0", time=1_700_000_000.0 + 30 * version)


def synthetic_report(steps: int = 30) -> TrainerReport:
    """A plausible run: reward climbing with noise, staleness growing up to eta=2, two engines,
    held-out pass@1 measured on versions 0, 7, 14, ... up to the last multiple of 7 below `steps`."""
    rnd = random.Random(0)
    t0 = 1_700_000_000.0
    evaluations = [evaluation(v, round(0.05 + 0.012 * v, 4)) for v in range(0, steps, 7)]
    history = [
        StepRecord(
            step=s,
            policy_version=s,
            reward_mean=round(0.04 + 0.25 * s / steps + rnd.uniform(-0.05, 0.05), 4),
            staleness_mean=round(min(2.0, s / 10) * rnd.uniform(0.5, 1.0), 3),
            staleness_max=min(2, 1 + s // 12),
            loss=rnd.uniform(-0.1, 0.1),
            clip_fraction=rnd.uniform(0.0, 0.05),
            tokens=2048,
            step_seconds=26 + rnd.uniform(-2, 2),
            proximal_seconds=3.1,
            weight_sync_seconds=0.8,
            time=t0 + 26 * s,
        )
        for s in range(1, steps + 1)
    ]
    return TrainerReport(
        job="local-arithmetic",
        phase="Training",
        step=steps,
        policy_version=steps,
        max_steps=40,
        groups_trained=8 * steps,
        tokens_trained=2048 * steps,
        reward_history=[h.reward_mean for h in history],
        staleness=StalenessReport(limit=2, dropped=3, histogram={"0": 20000, "1": 30000, "2": 11440}),
        dead_lettered=1,
        zero_signal_groups=7,
        dynamic_sampling_starved_steps=1,
        admission=AdmissionReport(accepted=248, running=6, capacity=2),
        recovery=RecoveryReport(dead_lettered=1, drift_lost=1, leases_returned=3, reward_failures=6,
                                recovered_entries=2, reclaimed_entries=5, trainer_restarts=1, engine_restarts=2,
                                engine_resyncs=3, ghost_groups_dropped=4),
        last_checkpoint="/runs/local/checkpoints/step-30",
        rollout=[
            EngineReport(url="http://127.0.0.1:30001", weight_version=steps, ready=True),
            EngineReport(url="http://127.0.0.1:30002", weight_version=steps - 1, ready=False),
        ],
        history=history,
        started_at=t0,
        updated_at=t0 + 26 * steps,
        evaluations=evaluations,
        last_step=StepMetrics.model_validate({
            **history[-1].model_dump(), "staleness_mean": 1.3, "staleness_max": 2, "tokens_per_second": 78.8,
            "step_seconds": 26.4, "clip_fraction": 0.023, "clip_fraction_low": 0.008, "clip_fraction_high": 0.015,
            "bapo_clip_low": 0.65, "bapo_clip_high": 1.35, "vcpo_lr_scale": 0.82, "tb_beta": 0.012,
            "importance_weight_max": 1.8, "importance_weight_min": 0.42, "importance_weight_mean": 0.998,
            "zero_signal_fraction": 0.25, "updates": 2,
            "replay": ReplayReport(trajectories=300, prompts=20, bytes=2 * 1048576, capacity=16384,
                                   replayed_groups=9)}),
    )


class Box:
    def __init__(self, report: TrainerReport) -> None:
        self.report = report

    def __call__(self) -> TrainerReport:
        return self.report


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit, non-interlaced RGB/RGBA PNG (what Chromium writes) into RGB rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = bpp = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
    raw, stride = zlib.decompress(idat), width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + b) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
        prev = line
    return width, height, rows


def ink(png: bytes, is_ink) -> tuple[int, int]:
    """(matching pixels, total pixels) of a screenshot."""
    width, height, rows = read_png(png)
    hits = sum(1 for row in rows for x in range(width) if is_ink(row[3 * x], row[3 * x + 1], row[3 * x + 2]))
    return hits, width * height


def bluish(r: int, g: int, b: int) -> bool:
    return b > 150 and b - r > 60


def orangish(r: int, g: int, b: int) -> bool:
    return r > 180 and r - b > 80 and g < 200


def greenish(r: int, g: int, b: int) -> bool:
    return g > 120 and g - r > 60 and g - b > 20  # --eval #059669, not the violet reward or cyan pass@k


def not_white(r: int, g: int, b: int) -> bool:
    return min(r, g, b) < 240  # the shaded area is orange at 12% opacity: (252, 235, 226)


@pytest.fixture
def box() -> Box:
    return Box(synthetic_report())


@pytest.fixture
def board() -> Health:
    """The server's own Health board (the process-wide one may hold another test's outage)."""
    return Health()


@pytest.fixture
async def live(box: Box, board: Health) -> AsyncIterator[str]:
    server = StatusServer(create_app(box, token=TOKEN, health=board))
    url = await server.start()
    yield url
    await server.stop()


async def sign_in(page, live: str) -> None:
    """What a person does: open the page (the login form, 401), type the token, submit."""
    resp = await page.goto(f"{live}/?refresh=0.5")
    assert resp.status == 401
    await page.fill("input[name=token]", TOKEN)
    await page.click("button[type=submit]")
    await page.wait_for_url("**/?refresh=0.5")


@pytest.fixture
async def page():
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 800})
            yield await context.new_page()
        finally:
            await browser.close()


async def test_dashboard_draws_reward_and_staleness_charts(live: str, page, box: Box, tmp_path: Path) -> None:
    await sign_in(page, live)
    await page.wait_for_selector("body[data-loaded=true]", timeout=20_000)

    # the big numbers
    assert (await page.text_content("#phase")) == "Training"
    assert not await page.locator("#degraded").is_visible()  # healthy: no banner
    assert (await page.text_content("#k-step")) == "30 / 40"
    assert (await page.text_content("#k-version")) == "v30"
    assert box.report.last_step is not None
    assert (await page.text_content("#k-reward")) == f"{box.report.last_step.reward_mean:.3f}"
    assert (await page.text_content("#k-stale")) == "1.30 / 2"
    assert (await page.text_content("#k-tps")) == "78.8"
    assert "ready" in (await page.text_content("#engines")) and "not ready" in (await page.text_content("#engines"))
    recovery = [[(await c.text_content()) for c in await row.locator("td").all()]
                for row in await page.locator("#recovery tr").all()]
    assert recovery == [["admission accepted / running / free", "248 / 6 / 2"], ["stale groups dropped", "3"],
                        ["dead_lettered", "1"], ["drift_lost", "1"], ["drift_found", "0"], ["leases_returned", "3"],
                        ["reward_failures", "6"], ["episode_failures", "0"], ["generation_failures", "0"],
                        ["engine_requeues", "0"], ["recovered_entries", "2"],
                        ["reclaimed_entries", "5"],
                        ["fenced_engines", "0"],
                        ["trainer_restarts", "1"], ["engine_restarts", "2"], ["engine_resyncs", "3"],
                        ["ghost_groups_dropped", "4"]]

    details = dict([[(await c.text_content()) for c in await row.locator("td").all()]
                    for row in await page.locator("#details tr").all()])
    assert details["zero-signal groups skipped / starved steps"] == "7 / 1"
    assert details["replay buffer"] == "300 / 16384 trajectories, 2.0 MiB, 9 groups replayed"
    # the last step's card: every figure of the step's record that has a value, by its name
    last_step = dict([[(await c.text_content()) for c in await row.locator("td").all()]
                      for row in await page.locator("#last-step tr").all()])
    assert (last_step["zero_signal_fraction"], last_step["clip_fraction_low"]) == ("0.2500", "0.008000")
    assert (last_step["bapo_clip_low"], last_step["bapo_clip_high"], last_step["vcpo_lr_scale"]) == \
        ("0.6500", "1.350", "0.8200")
    assert (last_step["tb_beta"], last_step["updates"], last_step["replay.trajectories"]) == ("0.01200", "2", "300")
    assert "tb_log_z_mean" not in last_step  # (no value: not shown)
    assert await page.locator("#last-step tr[data-figure=behav_ess] td").first.get_attribute("title") == \
        "Effective sample size of w as a fraction, (sum w)^2 / (n sum w^2): 1 = no reweighting."

    # the charts: one line point per step, with real on-screen size
    reward = page.locator("#reward-chart path.series.reward")
    d = await reward.get_attribute("d")
    assert d.count("M") + d.count("L") == 30
    assert await page.locator("#reward-chart circle").count() == 30
    for selector in ("#reward-chart path.series.reward", "#staleness-chart path.staleness-mean",
                     "#staleness-chart path.staleness-max"):
        # (polled: the page redraws its charts every refresh, and a chart being redrawn has no box)
        bbox = await poll(page.locator(selector).bounding_box, timeout=10, what=f"{selector} drawn")
        assert bbox is not None and bbox["width"] > 300 and bbox["height"] > 40, (selector, bbox)
    assert "η = 2" in (await page.text_content("#staleness-chart"))
    assert await page.locator("#staleness-histogram rect.bar").count() == 3

    # the screenshot's chart regions are not blank, and carry the series' colours
    shot = tmp_path / "dashboard.png"
    await page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    reward_png = await page.locator("#reward-chart").screenshot()
    stale_png = await page.locator("#staleness-chart").screenshot()
    blue, total = ink(reward_png, bluish)
    assert blue > 0.01 * total, (blue, total)
    orange, total = ink(stale_png, orangish)
    assert orange > 0.01 * total, (orange, total)
    drawn, total = ink(stale_png, not_white)
    assert drawn > 0.05 * total, (drawn, total)  # the mean's shaded area
    if os.environ.get("ASYNCRL_DASHBOARD_SCREENSHOT"):
        await page.screenshot(path=os.environ["ASYNCRL_DASHBOARD_SCREENSHOT"], full_page=True)

    # the held-out evaluations: their own chart, one point per evaluated version (0, 7, 14, 21, 28)
    assert await page.locator("#eval-none").is_hidden()
    assert await page.locator("#eval-chart circle.eval-pass1").count() == 5
    assert await page.locator("#eval-chart circle.eval-reward").count() == 5
    assert await page.locator("#eval-chart circle.eval-passk").count() == 0  # k = 1: no pass@k
    assert await page.locator("#eval-legend-k").is_hidden()
    assert "policy version" in (await page.text_content("#eval-chart"))
    bbox = await poll(page.locator("#eval-chart path.series.eval-pass1").bounding_box, timeout=10,
                      what="#eval-chart pass@1 drawn")  # (polled: redrawn every refresh, as above)
    assert bbox is not None and bbox["width"] > 300 and bbox["height"] > 20, bbox
    green, total = ink(await page.locator("#eval-chart").screenshot(), greenish)
    assert green > 0.002 * total, (green, total)
    newest = box.report.evaluations[-1]
    assert newest.policy_version == 28
    assert (await page.text_content("#eval-newest")) == f"pass@1 {newest.pass_at_1:.2f}@v28"
    latest = await page.text_content("#eval-latest")
    assert "v28" in latest and f"{newest.pass_at_1:.3f}" in latest and f"{newest.reward_mean:.3f}" in latest
    assert "64 × 1" in latest and "97%" in latest

    # polling picks up the trainer's next report (and its new evaluation)
    box.report = synthetic_report(31).model_copy(update={"phase": "Succeeded"})
    box.report.evaluations.append(evaluation(31, 0.61))
    await page.wait_for_function("document.body.dataset.step === '31'", timeout=20_000)
    assert (await page.text_content("#phase")) == "Succeeded"
    d = await page.locator("#reward-chart path.series.reward").get_attribute("d")
    assert d.count("M") + d.count("L") == 31
    d = await page.locator("#eval-chart path.series.eval-pass1").get_attribute("d")
    assert d.count("M") + d.count("L") == 6
    assert (await page.text_content("#eval-newest")) == "pass@1 0.61@v31"


async def test_dashboard_draws_pass_at_k_and_one_point_per_version(live: str, page, box: Box) -> None:
    """samplesPerPrompt k > 1: a pass@k series and legend entry; a version evaluated twice (a
    restarted trainer asks again) is one point, its newest result; the newest is the highest version,
    whatever order the results arrived in."""
    box.report = synthetic_report().model_copy(update={"evaluations": [
        evaluation(0, 0.10, k=4, pass_at_k=0.25), evaluation(20, 0.30, k=4, pass_at_k=0.55),
        evaluation(10, 0.15, k=4, pass_at_k=0.35), evaluation(10, 0.20, k=4, pass_at_k=0.40)]})
    await sign_in(page, live)
    await page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
    assert await page.locator("#eval-chart circle.eval-pass1").count() == 3
    assert await page.locator("#eval-chart circle.eval-passk").count() == 3
    assert await page.locator("#eval-legend-k").is_visible()
    assert (await page.text_content("#eval-legend-k")) == "pass@4"
    assert (await page.text_content("#eval-newest")) == "pass@1 0.30@v20"
    latest = await page.text_content("#eval-latest")
    assert "pass@4" in latest and "0.550" in latest and "64 × 4" in latest
    # the pass@1 points climb left to right: v0 0.10, v10 0.20 (the newer of its two), v20 0.30
    ys = [float(await c.get_attribute("cy")) for c in await page.locator("#eval-chart circle.eval-pass1").all()]
    xs = [float(await c.get_attribute("cx")) for c in await page.locator("#eval-chart circle.eval-pass1").all()]
    assert xs == sorted(xs) and ys == sorted(ys, reverse=True)  # SVG y grows downwards
    assert abs((ys[0] - ys[1]) - (ys[1] - ys[2])) < 0.5  # 0.10 -> 0.20 -> 0.30: equal steps, not 0.15


def mixture_report(steps: int = 30) -> TrainerReport:
    """The synthetic run trained on two sources: 'easy' improving, 'hard' regressing."""
    base = synthetic_report(steps)
    history = [h.model_copy(update={"reward_by_source": {"easy": 0.3 + 0.02 * h.step, "hard": 0.5 - 0.01 * h.step}})
               for h in base.history]
    last = base.last_step.model_copy(update={"reward_by_source": history[-1].reward_by_source,  # type: ignore[union-attr]
                                             "groups_by_source": {"easy": 6, "hard": 2}})
    newest = base.evaluations[-1].model_copy(update={"pass_at_1_by_source": {"easy": 0.625, "hard": 0.125},
                                                     "reward_by_source": {"easy": 0.7, "hard": 0.2}})
    return base.model_copy(update={"history": history, "last_step": last, "groups_by_source": {"easy": 180, "hard": 60},
                                   "evaluations": [*base.evaluations[:-1], newest]})


async def test_dashboard_shows_each_mixture_source(live: str, page, box: Box) -> None:
    """A mixture (spec.datasets): a reward series per source, and groups trained per source with
    their share; a job with one dataset has no per-source row at all."""
    await sign_in(page, live)
    await page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
    assert await page.locator("#sources").is_hidden()
    box.report = mixture_report()
    await page.wait_for_selector("#sources:not([hidden])", timeout=20_000)
    assert await page.locator("#source-chart circle.source-easy").count() == 30
    assert await page.locator("#source-chart circle.source-hard").count() == 30
    easy = [float(await c.get_attribute("cy")) for c in await page.locator("#source-chart circle.source-easy").all()]
    hard = [float(await c.get_attribute("cy")) for c in await page.locator("#source-chart circle.source-hard").all()]
    assert easy == sorted(easy, reverse=True) and hard == sorted(hard)  # (SVG y grows downwards)
    rows = {await r.get_attribute("data-source"): await r.inner_text()
            for r in await page.locator("#source-table tr").all()}
    assert set(rows) == {"easy", "hard"}
    assert "180" in rows["easy"] and "75.0%" in rows["easy"] and "0.900" in rows["easy"]
    assert "60" in rows["hard"] and "25.0%" in rows["hard"] and "0.200" in rows["hard"]
    assert "easy" in (await page.text_content("#source-legend"))
    latest = await page.text_content("#eval-latest")  # (spec.evaluation.datasets: each source's pass@1)
    assert "pass@1 · easy0.625 (reward 0.700)" in latest and "pass@1 · hard0.125 (reward 0.200)" in latest


async def test_dashboard_without_evaluations_says_so(live: str, page, box: Box) -> None:
    """A job without spec.evaluation (or before its first result): no empty chart frame, a sentence."""
    box.report = synthetic_report().model_copy(update={"evaluations": []})
    await sign_in(page, live)
    await page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
    assert await page.locator("#eval-chart").is_hidden()
    assert await page.locator("#eval-none").is_visible()
    assert "no evaluation yet" in (await page.text_content("#eval-none"))
    assert "no evaluation yet" in (await page.text_content("#eval-latest"))
    assert (await page.text_content("#eval-newest")) == ""
    # the first result arrives: the chart appears without a reload
    box.report = synthetic_report().model_copy(update={"evaluations": [evaluation(0, 0.05)]})
    await page.wait_for_function("document.body.dataset.evaluations === '1'", timeout=20_000)
    assert await page.locator("#eval-chart").is_visible()
    assert await page.locator("#eval-none").is_hidden()
    assert await page.locator("#eval-chart circle.eval-pass1").count() == 1
    assert (await page.text_content("#eval-newest")) == "pass@1 0.05@v0"


async def test_dashboard_shows_a_degraded_banner_while_an_outage_lasts(live: str, page, board: Health) -> None:
    """The banner appears (on screen, amber, with the reason and what is unreachable) while the
    trainer's board lists an outage, and goes away once it recovers, without a reload."""
    await sign_in(page, live)
    await page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
    banner = page.locator("#degraded")
    assert not await banner.is_visible()

    board.failing("redis", "j-redis.ns.svc:6379/0", "ConnectionError: Connection refused", 180.0)
    await page.wait_for_selector("#degraded", state="visible", timeout=20_000)
    assert (await page.text_content("#degraded-reason")) == "RedisUnavailable"
    text = await banner.text_content()
    assert "Degraded" in text and "j-redis.ns.svc:6379/0" in text and "Connection refused" in text
    assert "training waits since" in text
    box = await banner.bounding_box()
    assert box is not None and box["width"] > 600 and box["height"] > 20, box
    amber, total = ink(await banner.screenshot(), lambda r, g, b: r > 230 and 180 < g < 250 and b < 215)
    assert amber > 0.3 * total, (amber, total)  # the banner's background, not a blank strip
    assert (await page.text_content("#phase")) == "Training"  # the rest of the page still renders

    board.recovered("redis", "j-redis.ns.svc:6379/0")
    await page.wait_for_selector("#degraded", state="hidden", timeout=20_000)
    await page.wait_for_function("document.body.dataset.degraded === undefined", timeout=20_000)


async def test_dashboard_shows_a_stalled_banner_with_the_cause_while_it_lasts(live: str, page, box: Box) -> None:
    """The report's `stalled` shows as a banner with the cause, how long, the count and the last
    error; a step clears it, without a reload."""
    await sign_in(page, live)
    await page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
    assert not await page.locator("#stalled").is_visible()
    healthy = box.report
    box.report = healthy.model_copy(update={"phase": "Waiting", "stalled": StallReport(
        reason="RewardFailures", count=12, seconds=75.0, since=1_700_000_000.0, dropped={"reward_failures": 12},
        last_error="prompt p3: RuntimeError: verifier down",
        message="12 groups dropped because their reward could not be computed (last error: prompt p3: "
                "RuntimeError: verifier down)")})
    await page.wait_for_selector("#stalled", state="visible", timeout=20_000)
    assert (await page.text_content("#stalled-reason")) == "RewardFailures"
    text = await page.text_content("#stalled-text")
    assert text == ("no group accepted for training for 75.0 s: 12 groups dropped because their reward could not be "
                    "computed (last error: prompt p3: RuntimeError: verifier down)")
    box_ = await page.locator("#stalled").bounding_box()
    assert box_ is not None and box_["width"] > 600 and box_["height"] > 20, box_
    box.report = healthy
    await page.wait_for_selector("#stalled", state="hidden", timeout=20_000)
    await page.wait_for_function("document.body.dataset.stalled === undefined", timeout=20_000)


async def test_dashboard_without_token_is_refused_and_says_how(live: str, page) -> None:
    resp = await page.goto(f"{live}/")
    assert resp.status == 401
    assert "status-auth" in (await page.text_content("body"))  # where the token is
    await page.fill("input[name=token]", "a guess")
    await page.click("button[type=submit]")
    assert "not this job's status token" in (await page.text_content("body"))
    assert not await page.locator("#phase").count()


async def test_dashboard_with_empty_report_shows_waiting(page, tmp_path: Path) -> None:
    server = StatusServer(create_app(lambda: TrainerReport(job="fresh")))
    url = await server.start()
    try:
        await page.goto(f"{url}/")
        await page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
        assert (await page.text_content("#phase")) == "Starting"
        assert "waiting for the first step" in (await page.text_content("#reward-chart"))
        assert "no rollout engines" in (await page.text_content("#engines"))
        assert (await page.text_content("#k-reward")) == "–"
        assert await page.locator("#eval-chart").is_hidden()
        assert "no evaluation yet" in (await page.text_content("#eval-none"))
    finally:
        await server.stop()


def test_install_script_is_idempotent_once_chromium_exists() -> None:
    import subprocess

    script = REPO / "scripts" / "install-browser.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert "already installed" in out.stdout
    assert shutil.which("chromium") or CHROMIUM.exists()
