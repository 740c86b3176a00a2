"""A hostile upstream cannot exhaust the service's memory: the bombs of the finding against a real
`metaagent serve` process, whose peak resident memory (`VmHWM`) is read from /proc.

The finding: a 64 KB gzip Serper answer inflating to 60 MB of `{}` objects took the service from 88 to
1,577 MiB; an embeddings answer with a 10-million-number vector added about 600 MiB. The bound below is
generous (a tenth of the first), and is about memory, never time.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tests.fake_upstreams import OPENAI_KEY, SERPER_KEY, FakeUpstream, Scripted, fake_openai, fake_serper
from tests.service_process import ServiceProcess, service_process

pytestmark = [pytest.mark.security, pytest.mark.slow]

BOUND_KIB = 160 * 1024  # the most the peak may rise above the resident memory before the bomb


@pytest.fixture
def upstreams() -> Iterator[tuple[FakeUpstream, FakeUpstream]]:
    with fake_serper() as serper, fake_openai() as openai:
        yield serper, openai


@pytest.fixture
def service(tmp_path: Path, upstreams: tuple[FakeUpstream, FakeUpstream]) -> Iterator[ServiceProcess]:
    serper, openai = upstreams
    with service_process(
        tmp_path,
        ALLOW_HTTP_HOSTS='["127.0.0.1"]',
        SERPER_API_KEY=SERPER_KEY,
        METAAGENT_SERPER_BASE_URL=serper.url,
        OPENAI_API_KEY=OPENAI_KEY,
        OPENAI_BASE_URL=openai.url,
        METAAGENT_UPSTREAM_MAX_RETRIES="0",
    ) as running:
        yield running


def baseline(service: ServiceProcess) -> int:
    """Resident memory once every code path of the tools has run once (imports, pools, TLS contexts)."""
    assert httpx2.post(f"{service.base}/tools/search", json={"q": "warm up"}, timeout=60).status_code == 200
    assert httpx2.post(f"{service.base}/tools/embeddings", json={"input": "warm up"}, timeout=60).status_code == 200
    return max(service.memory_kib("VmRSS"), service.memory_kib("VmHWM"))


def test_a_gzip_bomb_of_empty_objects_from_serper_leaves_memory_bounded(
    service: ServiceProcess, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    serper, _ = upstreams
    before = baseline(service)
    bomb = gzip.compress(b'{"organic": [' + b"{}," * 20_000_000 + b"{}]}", 9)
    assert len(bomb) < 128 * 1024  # about 60 MB once inflated
    serper.script(Scripted(200, bomb, {"Content-Encoding": "gzip"}))
    answers: list[httpx2.Response] = []
    bombed = threading.Thread(
        target=lambda: answers.append(httpx2.post(f"{service.base}/tools/search", json={"q": "x"}, timeout=120))
    )
    bombed.start()
    health = httpx2.get(f"{service.base}/health", timeout=120)  # others are served meanwhile
    bombed.join(timeout=120)
    assert health.status_code == 200
    assert answers[0].status_code == 502
    assert "bytes (decoded)" in answers[0].json()["error"]
    assert service.memory_kib("VmHWM") - before < BOUND_KIB


def test_a_ten_million_number_vector_leaves_memory_bounded(
    service: ServiceProcess, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    _, openai = upstreams
    before = baseline(service)
    vector = b",".join([b"0.125"] * 10_000_000)
    body = gzip.compress(b'{"data": [{"index": 0, "embedding": [' + vector + b']}], "model": "m"}', 9)
    openai.script(Scripted(200, body, {"Content-Encoding": "gzip"}))
    response = httpx2.post(f"{service.base}/tools/embeddings", json={"input": "x"}, timeout=120)
    assert response.status_code == 502
    assert "bytes (decoded)" in response.json()["error"]
    assert service.memory_kib("VmHWM") - before < BOUND_KIB


def test_an_answer_of_many_values_within_the_size_cap_is_refused_before_it_is_parsed(
    service: ServiceProcess, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    serper, _ = upstreams
    before = baseline(service)
    dense = b'{"organic": [' + b"{}," * 1_300_000 + b"{}]}"  # just under the 4 MiB cap: 1.3 million objects
    serper.script(Scripted(200, gzip.compress(dense), {"Content-Encoding": "gzip"}))
    response = httpx2.post(f"{service.base}/tools/search", json={"q": "x"}, timeout=120)
    assert response.status_code == 502
    assert "JSON values" in response.json()["error"]
    assert service.memory_kib("VmHWM") - before < BOUND_KIB
