"""The framework's floor for a session call (bench/python.py): FastAPI on uvicorn's httptools protocol and
uvloop, as the service runs, with one route that takes the service's own `SessionExecuteRequest` and
answers, as the service's route does, a `SessionExecuteResponse`: a real call's answer, given by the bench
in `METAAGENT_BENCH_FLOOR_ANSWER`. Nothing else: what a session call costs past this is the service's."""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from metaagent.sessions.models import SessionExecuteRequest, SessionExecuteResponse

ANSWER = SessionExecuteResponse.model_validate_json(os.environ["METAAGENT_BENCH_FLOOR_ANSWER"])

app = FastAPI()


@app.post("/sessions/{session_id}/execute")
async def execute(session_id: str, body: SessionExecuteRequest) -> JSONResponse:
    return JSONResponse(ANSWER.model_dump(mode="json"))
