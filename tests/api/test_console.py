"""The web console over HTTP: who may sign in and what each viewer sees. A tenant sees only its own runs
(another tenant's run answers 404, like a missing one); an admin key sees every tenant's; without a
sign-in every page sends the browser to the form, and the key never travels in a URL or a readable
cookie."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.api.console.routes import COOKIE
from loraplex.config import ServerConfig
from loraplex.runtime.assembly import Runtime
from loraplex.runtime.control.keys import ConsoleLogins, KeyReadLimits, create_key, revoke_key
from tests.api.test_http import _fb_body, _retrieve
from tests.fakes import FakeEngine

STEPS = 3


@dataclass
class Console:
    http: TestClient
    service: Runtime
    keys: dict[str, str]  # alice, bob, ops (admin)
    run: str  # alice's run, trained STEPS steps

    def sign_in(self, who: str) -> dict[str, str]:
        """The Cookie header of a fresh sign-in of `who`."""
        response = self.http.post("/console/login", data={"key": self.keys[who]}, follow_redirects=False)
        assert response.status_code == 303, response.text
        token = response.cookies[COOKIE]
        self.http.cookies.clear()  # each request names its viewer explicitly
        return {"Cookie": f"{COOKIE}={token}"}

    def get(self, path: str, who: dict[str, str] | None = None):
        return self.http.get(path, headers=who or {}, follow_redirects=False)


@contextmanager
def serving_console(data_dir: Path) -> Iterator[tuple[TestClient, Runtime, dict[str, str]]]:
    """A keyed server over the fake engine with keys for alice, bob and the admin ops, by name."""
    service = Runtime.open(FakeEngine(), ServerConfig(data_dir=data_dir, long_poll_s=2.0, auth="keys"))
    keys = {
        "alice": create_key(service.store, "alice"),
        "bob": create_key(service.store, "bob"),
        "ops": create_key(service.store, "ops", admin=True),
    }
    with TestClient(create_app(service)) as http:
        yield http, service, keys


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    with serving_console(tmp_path_factory.mktemp("console")) as (http, service, keys):
        run = _train(http, {"X-API-Key": keys["alice"]}, STEPS)
        yield Console(http, service, keys, run)


def _train(http: TestClient, key: dict[str, str], steps: int) -> str:
    session = http.post("/api/v1/create_session", json={}, headers=key).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": "fake/bigram", "lora_config": {"rank": 4}}
    run = http.post("/api/v1/create_model", json=body, headers=key).json()["model_id"]
    seq = 1
    for _ in range(steps):
        fb = http.post("/api/v1/forward_backward", content=_fb_body(run, seq), headers=key).json()
        step = {"model_id": run, "seq_id": seq + 1, "adam_params": {"learning_rate": 0.01}}
        opt = http.post("/api/v1/optim_step", json=step, headers=key).json()
        for future in (fb, opt):
            assert "error" not in _retrieve(http, future["request_id"], key)
        seq += 2
    return run


def _loss_points(html: str) -> int:
    match = re.search(r'data-kind="forward_backward" data-metric="loss:sum" data-points="(\d+)"', html)
    assert match is not None, "no loss chart"
    return int(match.group(1))


@pytest.mark.parametrize("page", ["runs", "samplers", "requests", "server"])
def test_without_a_sign_in_every_page_sends_the_browser_to_the_form(console: Console, page: str) -> None:
    page = f"/console/{page}"
    response = console.get(page)
    assert response.status_code == 303 and response.headers["location"] == "/console/login"
    assert console.get(f"{page}?fragment=1").status_code == 401  # the live refresh says so instead


def test_a_run_page_without_a_sign_in_shows_nothing_of_the_run(console: Console) -> None:
    response = console.get(f"/console/runs/{console.run}")
    assert response.status_code == 303 and console.run not in response.text


def test_an_unknown_key_is_refused_at_the_form_and_gets_no_cookie(console: Console) -> None:
    response = console.http.post("/console/login", data={"key": "tml-not-a-key"}, follow_redirects=False)
    assert response.status_code == 401
    assert "unknown or revoked API key" in response.text
    assert COOKIE not in response.cookies


def test_the_sign_in_cookie_is_http_only_same_site_strict_and_is_not_the_key(console: Console) -> None:
    key = console.keys["alice"]
    response = console.http.post("/console/login", data={"key": key}, follow_redirects=False)
    console.http.cookies.clear()
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert key not in cookie and key not in response.headers["location"]
    assert response.headers["location"] == "/console/runs"


def test_a_tenant_sees_its_run_and_a_loss_chart_with_one_point_per_step(console: Console) -> None:
    alice = console.sign_in("alice")
    runs = console.get("/console/runs", alice)
    assert runs.status_code == 200 and console.run in runs.text
    page = console.get(f"/console/runs/{console.run}", alice)
    assert page.status_code == 200
    assert _loss_points(page.text) == STEPS
    # loss:sum, train/tokens, grad_norm, learning_rate
    assert page.text.count('<circle class="point series-0"') == 4 * STEPS
    assert _loss_points(console.get(f"/console/runs/{console.run}?fragment=1", alice).text) == STEPS


def test_another_tenant_neither_lists_the_run_nor_opens_it_by_its_url(console: Console) -> None:
    bob = console.sign_in("bob")
    assert console.run not in console.get("/console/runs", bob).text
    page = console.get(f"/console/runs/{console.run}", bob)
    assert page.status_code == 404
    assert "data-points" not in page.text and "alice" not in page.text
    assert console.get(f"/console/runs/{console.run}?fragment=1", bob).status_code == 404
    assert "alice" not in console.get("/console/requests", bob).text


def test_a_missing_run_and_another_tenants_run_answer_alike(console: Console) -> None:
    bob = console.sign_in("bob")
    missing = console.get("/console/runs/nobody:train:0", bob)
    foreign = console.get(f"/console/runs/{console.run}", bob)
    assert missing.status_code == foreign.status_code == 404
    assert missing.text.replace("nobody:train:0", "ID") == foreign.text.replace(console.run, "ID")


def test_an_admin_key_sees_every_tenants_runs_and_requests(console: Console) -> None:
    ops = console.sign_in("ops")
    runs = console.get("/console/runs", ops).text
    assert console.run in runs and "admin: every tenant" in runs
    assert _loss_points(console.get(f"/console/runs/{console.run}", ops).text) == STEPS
    assert "OptimStep" in console.get("/console/requests", ops).text


def test_an_admin_key_is_its_own_tenants_key_through_the_api(console: Console) -> None:
    listed = console.http.get("/api/v1/training_runs", headers={"X-API-Key": console.keys["ops"]}).json()
    assert listed["training_runs"] == []


def test_the_requests_page_shows_status_and_latency(console: Console) -> None:
    html = console.get("/console/requests", console.sign_in("alice")).text
    assert html.count("<td>ForwardBackward</td>") == STEPS and "complete" in html
    assert re.search(r'<td class="num">\d+ ms</td>', html)


def test_the_server_page_shows_slots_queues_and_passes(console: Console) -> None:
    html = console.get("/console/server", console.sign_in("bob")).text
    assert "Adapter slots" in html and "forward_backward" in html and "Last pass" in html


def test_signing_out_ends_the_sign_in(console: Console) -> None:
    alice = console.sign_in("alice")
    console.http.post("/console/logout", headers=alice, follow_redirects=False)
    assert console.get("/console/runs", alice).status_code == 303


def test_revoking_the_key_ends_its_console_sign_in(tmp_path: Path) -> None:
    service = Runtime.open(FakeEngine(), ServerConfig(data_dir=tmp_path, auth="keys"))
    service.logins = ConsoleLogins(service.store, "keys", limits=KeyReadLimits(known_s=0.0))
    key = create_key(service.store, "carol")
    with TestClient(create_app(service)) as http:
        assert http.post("/console/login", data={"key": key}, follow_redirects=False).status_code == 303
        assert http.get("/console/runs", follow_redirects=False).status_code == 200
        (info,) = [k for k in service.store.list_keys() if k.tenant == "carol"]
        revoke_key(service.store, info.key_id)
        time.sleep(0.01)
        assert http.get("/console/runs", follow_redirects=False).status_code == 303


def test_pages_forbid_inline_script_framing_and_referrers(console: Console) -> None:
    headers = console.get("/console/runs", console.sign_in("alice")).headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["referrer-policy"] == "no-referrer" and headers["cache-control"] == "no-store"


def test_a_checkpoint_offers_its_path_to_copy_its_files_to_download_and_its_save(console: Console) -> None:
    key = {"X-API-Key": console.keys["alice"]}
    body = {"model_id": console.run, "seq_id": 2 * STEPS + 1, "path": "console-ckpt"}
    future = console.http.post("/api/v1/save_weights", json=body, headers=key).json()
    path = _retrieve(console.http, future["request_id"], key)["path"]
    html = console.get(f"/console/runs/{console.run}", console.sign_in("alice")).text
    assert f'data-copy="{path}"' in html
    assert re.search(r"<td>save checkpoint</td>\s*<td><code>" + re.escape(path), html)  # its long work
    links = re.findall(r'href="(/api/v1/downloads/[^"]+)"', html)
    assert links, "no download links"
    download = console.http.get(links[0])
    assert download.status_code == 200 and len(download.content) > 0
