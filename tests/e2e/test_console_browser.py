"""The web console in a real browser: headless Debian chromium, driven through its chromedriver by
Selenium, against a real `loraplex serve --auth keys` that an official-SDK client trained.

The browser signs in with the trainer's key, finds the run on the runs page, opens it and sees a loss
chart with exactly one point per step, which grows by itself when the client trains on; with another
tenant's key the run is neither listed nor opened by its URL; an admin key lists it. Ticking two runs on
the runs page and submitting shows both runs' curves on one chart per metric. A screenshot of each
page is taken; with LORAPLEX_SCREENSHOTS=docs/console they are the README's pictures (that is how they
were made). CI installs chromium and chromium-driver (.ci/run); without them the test skips, except
under CI, where it fails.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from tinker import types

from tests.e2e.conftest import REPO, Server
from tests.e2e.sdk import LR, base_model, client, create_key, sft_datum, sft_steps

STEPS = 5
_WAIT_S = 30.0

_CHROMIUM, _DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if _CHROMIUM is None or _DRIVER is None:
    _MISSING = "needs Debian's chromium and chromium-driver, which .ci/run installs"
    if os.environ.get("CI"):
        pytest.fail(_MISSING, pytrace=False)
    pytest.skip(_MISSING, allow_module_level=True)

LOSS_CHART = 'figure[data-kind="forward_backward"][data-metric="loss:sum"]'


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = _CHROMIUM  # type: ignore[assignment]
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=ChromeService(executable_path=_DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def screenshot(browser: webdriver.Chrome, tmp_path: Path) -> Callable[[str], Path]:
    """screenshot(name): the whole page as a PNG, in tmp_path or under $LORAPLEX_SCREENSHOTS."""
    target = os.environ.get("LORAPLEX_SCREENSHOTS")
    directory = REPO / target if target else tmp_path / "screenshots"
    directory.mkdir(parents=True, exist_ok=True)

    def take(name: str) -> Path:
        size = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 2400), "scale": 1}
        shot = browser.execute_cdp_cmd(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
        )
        path = directory / f"{name}.png"
        path.write_bytes(base64.b64decode(shot["data"]))
        assert path.stat().st_size > 10_000, f"{name}.png looks blank"
        return path

    return take


def _sign_in(browser: webdriver.Chrome, server: Server, key: str) -> None:
    browser.delete_all_cookies()
    browser.get(f"{server.base_url}/console")  # not signed in: the form
    assert browser.current_url.endswith("/console/login")
    browser.find_element(By.ID, "key").send_keys(key)
    browser.find_element(By.CSS_SELECTOR, "form.login button").click()
    WebDriverWait(browser, _WAIT_S).until(lambda b: b.current_url.endswith("/console/runs"))
    assert key not in browser.current_url


def _click_link(browser: webdriver.Chrome, text: str) -> None:
    """Click the link showing `text`, again if a refresh replaced it between finding and clicking."""

    def click(b: webdriver.Chrome) -> bool:
        b.find_element(By.LINK_TEXT, text).click()
        return True

    WebDriverWait(browser, _WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(click)


def _run_links(browser: webdriver.Chrome) -> list[str]:
    return browser.execute_script(  # one script: a refresh may replace the table between WebDriver calls
        "return [...document.querySelectorAll('table.runs a.run')].map(a => a.textContent.trim());"
    )


def _loss_points(browser: webdriver.Chrome) -> int:
    """The points the loss chart draws (0 while it is not there yet); the figure says how many it has."""
    # Read in one script: the live refresh may replace the chart between two WebDriver calls.
    found = browser.execute_script(
        "const chart = document.querySelector(arguments[0]);"
        "return chart ? [chart.querySelectorAll('circle.point').length, chart.dataset.points] : null;",
        LOSS_CHART,
    )
    if found is None:
        return 0
    circles, declared = found
    assert circles == int(declared or -1)
    return circles


def _wait_for_points(browser: webdriver.Chrome, count: int) -> None:
    """Until the page's own refresh shows `count` loss points (no reload: the live update)."""
    WebDriverWait(browser, _WAIT_S, poll_frequency=0.2).until(lambda b: _loss_points(b) >= count)
    assert _loss_points(browser) == count


def test_a_tenant_follows_its_run_in_the_console_and_another_tenant_cannot_see_it(
    start_server: Callable[..., Server], browser: webdriver.Chrome, screenshot: Callable[[str], Path]
) -> None:
    server = start_server("--auth", "keys")
    alice_key = create_key(server.data_dir, "alice")
    bob_key = create_key(server.data_dir, "bob")
    ops_key = create_key(server.data_dir, "ops", admin=True)

    alice = client(server, alice_key)
    run = alice.create_lora_training_client(base_model=base_model(server), rank=8, seed=1).result()
    sft_steps(run, STEPS)
    saved = run.save_state("console-demo").result().path
    weights = run.save_weights_for_sampler("console-sampler").result().path
    sampler = alice.create_sampling_client(model_path=weights).result()
    sampler.sample(
        types.ModelInput.from_ints([3, 17, 9]), 1, types.SamplingParams(max_tokens=4, seed=1)
    ).result()
    run_id = run.model_id

    browser.get(f"{server.base_url}/console/login")
    screenshot("login")
    _sign_in(browser, server, alice_key)
    WebDriverWait(browser, _WAIT_S).until(lambda b: run_id in _run_links(b))
    screenshot("runs")

    _click_link(browser, run_id)
    _wait_for_points(browser, STEPS)  # one point per forward_backward, no more
    assert browser.find_element(By.CSS_SELECTOR, f'button.copy[data-copy="{saved}"]').is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, 'td.files a[href^="/api/v1/downloads/"]')
    run.forward_backward([sft_datum()], "cross_entropy").result()  # the client trains on...
    run.optim_step(types.AdamParams(learning_rate=LR)).result()
    _wait_for_points(browser, STEPS + 1)  # ...and the open page follows by itself
    screenshot("run")

    shows = {"samplers": weights, "requests": "ForwardBackward", "server": "Adapter slots"}
    for page, text in shows.items():
        _click_link(browser, page.capitalize())
        WebDriverWait(browser, _WAIT_S).until(lambda b, page=page: b.current_url.endswith(f"/console/{page}"))
        assert text in browser.find_element(By.TAG_NAME, "main").text
        screenshot(page)

    _sign_in(browser, server, bob_key)
    assert run_id not in _run_links(browser)
    browser.get(f"{server.base_url}/console/runs/{run_id}")  # the run's URL, straight
    assert browser.find_element(By.TAG_NAME, "h1").text == "Not found"
    assert not browser.find_elements(By.CSS_SELECTOR, LOSS_CHART)
    assert "alice" not in browser.page_source
    screenshot("refused")

    _sign_in(browser, server, ops_key)
    WebDriverWait(browser, _WAIT_S).until(lambda b: run_id in _run_links(b))
    owner = browser.find_element(By.CSS_SELECTOR, f'tr[data-run-id="{run_id}"] td.owner').text
    assert owner == "alice"


def _tick(browser: webdriver.Chrome, run_id: str) -> None:
    """Tick the run's box on the runs page, again if a refresh replaced it between finding and clicking."""

    def tick(b: webdriver.Chrome) -> bool:
        box = b.find_element(By.CSS_SELECTOR, f'input[name="run"][value="{run_id}"]')
        if not box.is_selected():
            box.click()
        return box.is_selected()

    WebDriverWait(browser, _WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(tick)


def test_ticking_two_runs_and_submitting_overlays_their_loss_curves_on_one_chart(
    start_server: Callable[..., Server], browser: webdriver.Chrome, screenshot: Callable[[str], Path]
) -> None:
    server = start_server("--auth", "keys")
    key = create_key(server.data_dir, "alice")
    alice = client(server, key)
    first = alice.create_lora_training_client(base_model=base_model(server), rank=8, seed=1).result()
    second = alice.create_lora_training_client(base_model=base_model(server), rank=8, seed=2).result()
    losses = {
        first.model_id: sft_steps(first, STEPS),
        second.model_id: sft_steps(second, STEPS, sft_datum([40, 2, 33, 19, 6, 27, 11, 4])),
    }
    assert losses[first.model_id] != losses[second.model_id]

    _sign_in(browser, server, key)
    WebDriverWait(browser, _WAIT_S).until(lambda b: set(losses) <= set(_run_links(b)))
    for run_id in losses:
        _tick(browser, run_id)
    browser.find_element(By.CSS_SELECTOR, "form.compare button[type=submit]").click()
    WebDriverWait(browser, _WAIT_S).until(lambda b: "/console/compare?" in b.current_url)
    assert all(f"run={run_id.replace(':', '%3A')}" in browser.current_url for run_id in losses)

    chart = browser.find_element(By.CSS_SELECTOR, LOSS_CHART)
    curves = chart.find_elements(By.CSS_SELECTOR, "svg polyline.line")
    shown = [c.get_attribute("data-run") for c in curves]  # in the runs list's order, newest first
    assert sorted(shown) == sorted(losses)
    heights = [[float(xy.split(",")[1]) for xy in c.get_attribute("points").split()] for c in curves]
    assert [len(h) for h in heights] == [STEPS, STEPS] and heights[0] != heights[1]
    legend = [li.text for li in chart.find_elements(By.CSS_SELECTOR, "ul.legend li")]
    assert legend == shown
    assert curves[0].value_of_css_property("stroke") != curves[1].value_of_css_property("stroke")
    screenshot("compare")
