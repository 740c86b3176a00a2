"""The HTTP side of sessions against a real service and engine: a file path as written is decoded once."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest

from tests.sandbox.conftest import Service

pytestmark = [pytest.mark.docker]


@pytest.fixture
def session_id(sandbox_service: Service) -> Iterator[str]:
    created = httpx2.post(f"{sandbox_service.base_url}/sessions", timeout=120)
    assert created.status_code == 201, created.text
    sid: str = created.json()["session_id"]
    yield sid
    httpx2.delete(f"{sandbox_service.base_url}/sessions/{sid}", timeout=120)


def test_a_file_path_under_a_percent_encoded_session_id_is_decoded_once(
    sandbox_service: Service, session_id: str
) -> None:
    base = sandbox_service.base_url
    encoded_id = session_id.replace("_", "%5F")
    written = httpx2.put(f"{base}/sessions/{encoded_id}/files/%2541", content=b"once", timeout=60)
    assert written.status_code == 201, written.text
    assert written.json()["path"] == "%41"
    listed = httpx2.get(f"{base}/sessions/{encoded_id}/files", timeout=60).json()["files"]
    assert [f["path"] for f in listed] == ["%41"]
    assert httpx2.get(f"{base}/sessions/{encoded_id}/files/%2541", timeout=60).content == b"once"
    assert httpx2.get(f"{base}/sessions/{session_id}/files/A", timeout=60).status_code == 404
    # The prefix itself may be written percent-encoded too: the path after it is still decoded once.
    assert httpx2.get(f"{base}/%73essions/{session_id}/%66iles/%2541", timeout=60).content == b"once"
    deleted = httpx2.delete(f"{base}/sessions/{encoded_id}/files/%2541", timeout=60)
    assert deleted.json() == {"path": "%41", "deleted": True}
