"""The shared outbound pool is fair by destination: hung requests to one host never stall the others.

The finding: ten requests to a silent allowed upstream took the whole pool (httpcore's default of ten
connections), so an unrelated request to another host timed out. Here a real service, a silent server
and ordinary servers, all on 127.0.0.1; the assertions are about who is answered, never about time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest

from metaagent.app import create_app
from tests.conftest import make_settings, running_upstream
from tests.fake_upstreams import OPENAI_KEY, SERPER_KEY, fake_openai
from tests.hostile_servers import SilentServer, silent_server
from tests.live_service import serving

pytestmark = pytest.mark.security

PER_HOST = 3
HUNG = PER_HOST + 3  # more requests to the silent host than its share
WAIT_S = 60  # how long the test waits for the service to have connected (a hang guard, not a threshold)


@contextmanager
def in_background(calls: list[Callable[[], httpx2.Response]]) -> Iterator[list[httpx2.Response | Exception]]:
    """Runs each call in a thread; joins them when the block ends."""
    answers: list[httpx2.Response | Exception] = []

    def run(call: Callable[[], httpx2.Response]) -> None:
        try:
            answers.append(call())
        except Exception as exc:  # a test thread's failure, reported by the assertions on `answers`
            answers.append(exc)

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    try:
        yield answers
    finally:
        for thread in threads:
            thread.join(timeout=120)


def wait_for_connections(silent: SilentServer, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while silent.accepted < count:
        assert time.monotonic() < deadline, f"only {silent.accepted} of {count} connections arrived"
        time.sleep(0.05)


def post(base: str, path: str, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(f"{base}{path}", json=body, timeout=120)


def service_settings(tmp_path: Path, **overrides: Any) -> Any:
    return make_settings(
        tmp_path,
        allow_http_hosts='["127.0.0.1"]',
        egress_connections_per_host=PER_HOST,
        egress_pool_wait_s=1,
        **overrides,
    )


def test_hung_requests_to_one_host_do_not_stall_a_request_to_another(tmp_path: Path, upstream: str) -> None:
    with silent_server() as silent, serving(create_app(service_settings(tmp_path))) as base:
        hung = [lambda: post(base, "/tools/http", {"url": f"{silent.url}/never", "timeout_s": 60})] * HUNG
        with in_background(hung) as answers:
            wait_for_connections(silent, PER_HOST)
            unrelated = post(base, "/tools/http", {"url": f"{upstream}/hello", "timeout_s": 60})
            assert unrelated.status_code == 200, unrelated.text
            assert unrelated.json()["body"] == "hello from upstream"
            # Past its share, the silent host's own requests wait at most the pool wait, then say why.
            busy = post(base, "/tools/http", {"url": f"{silent.url}/never", "timeout_s": 60})
            assert busy.status_code == 504
            assert "METAAGENT_EGRESS_CONNECTIONS_PER_HOST" in busy.json()["error"]
            deadline = time.monotonic() + WAIT_S
            while len(answers) < HUNG - PER_HOST:  # those past the share are refused while the rest hang
                assert time.monotonic() < deadline, answers
                time.sleep(0.05)
            assert silent.accepted == PER_HOST  # never more than the share of one destination
            refused = list(answers)
            silent.close_all()
    assert all(isinstance(a, httpx2.Response) and a.status_code == 504 for a in refused), refused
    assert len(answers) == HUNG
    assert all(isinstance(a, httpx2.Response) and a.status_code in (502, 504) for a in answers), answers


def test_hung_searches_do_not_stall_the_http_tool_or_embeddings(tmp_path: Path, upstream: str) -> None:
    with silent_server() as silent, fake_openai() as openai:
        settings = service_settings(
            tmp_path,
            serper_api_key=SERPER_KEY,
            serper_base_url=silent.url,
            openai_api_key=OPENAI_KEY,
            openai_base_url=openai.url,
            upstream_max_retries=0,
        )
        with serving(create_app(settings)) as base:
            hung = [lambda: post(base, "/tools/search", {"q": "hangs"})] * PER_HOST
            with in_background(hung):
                wait_for_connections(silent, PER_HOST)
                http = post(base, "/tools/http", {"url": f"{upstream}/hello"})
                embeddings = post(base, "/tools/embeddings", {"input": "still answered"})
                assert http.status_code == 200, http.text
                assert embeddings.status_code == 200, embeddings.text
                assert silent.accepted == PER_HOST
                silent.close_all()


def test_connections_to_many_hosts_are_bounded_by_the_total(tmp_path: Path) -> None:
    """With `total` below the sum of the shares, hung requests to several hosts hold at most `total`."""
    with (
        silent_server() as first,
        silent_server() as second,
        serving(create_app(service_settings(tmp_path, egress_max_connections=PER_HOST + 1))) as base,
    ):
        hung = [
            lambda url=server.url: post(base, "/tools/http", {"url": url, "timeout_s": 60})
            for server in (first, second)
            for _ in range(PER_HOST)
        ]
        with in_background(hung) as answers:
            deadline = time.monotonic() + WAIT_S
            while first.accepted + second.accepted < PER_HOST + 1 or len(answers) < PER_HOST - 1:
                assert time.monotonic() < deadline, (first.accepted, second.accepted, answers)
                time.sleep(0.05)
            assert first.accepted + second.accepted == PER_HOST + 1
            refused = [a for a in answers if isinstance(a, httpx2.Response)]
            assert refused
            assert all("METAAGENT_EGRESS_MAX_CONNECTIONS" in a.json()["error"] for a in refused)
            first.close_all()
            second.close_all()


def test_the_pool_share_of_a_destination_is_freed_when_its_answers_are_read(tmp_path: Path) -> None:
    with running_upstream() as other, serving(create_app(service_settings(tmp_path))) as base:
        for _ in range(PER_HOST * 3):  # more sequential requests than the share: each gives its slot back
            assert post(base, "/tools/http", {"url": f"{other}/bytes?n=10"}).status_code == 200
