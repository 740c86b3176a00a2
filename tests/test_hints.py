@pytest.fixture
def live_service(tmp_path: Path) -> Iterator[str]:
    with serving(create_app(make_settings(tmp_path))) as url:
        yield url


def text_of(result: types.CallToolResult) -> str:
    (block,) = result.content
    assert isinstance(block, types.TextContent)
    return block.text


def test_every_action_has_a_route_form_and_a_tool_form_that_names_no_route() -> None:
    for action in hints.ACTIONS.values():
        assert ROUTE.match(action.for_face(hints.Face.ROUTES))
        tool_form = action.for_face(hints.Face.TOOLS, session_id="ses_1", path="a.txt")
        assert tool_form.startswith("call ")
        assert not ROUTE.search(tool_form), tool_form


def test_a_hint_names_the_route_by_default_and_the_tool_while_speaking_tools() -> None:
    assert hints.hint(hints.CREATE_SESSION) == "POST /sessions"
    assert hints.hint(hints.LIST_FILES, session_id="ses_1") == "GET /sessions/ses_1/files"
    with hints.speaking(hints.Face.TOOLS):
        assert hints.hint(hints.CREATE_SESSION) == "call session_create"
        assert hints.hint(hints.LIST_FILES, session_id="ses_1") == "call session_files with session_id ses_1"
        assert hints.hint(hints.CLOSE_SESSION) == "call session_close"
        assert hints.hint(hints.RUN_IN_SESSION) == "call code_interpreter with session_id"
        assert hints.hint(hints.READ_FILE, session_id="ses_1", path="a.txt") == (
            "call session_read_file with session_id ses_1 and path a.txt"
        )
    assert hints.hint(hints.CLOSE_SESSION) == "DELETE /sessions/{id}"


async def test_an_unknown_session_over_mcp_is_a_tool_error_that_names_session_create_and_no_route(
    live_service: str,
) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with Client(f"{live_service}/mcp") as client:
            run = await client.call_tool("code_interpreter", {"code": "1", "session_id": UNKNOWN})
            close = await client.call_tool("session_close", {"session_id": UNKNOWN})
    for result in (run, close):
        assert result.is_error is True
        assert text_of(result) == f"No session {UNKNOWN!r}; to create one, call session_create"


async def test_an_unknown_session_at_post_tools_by_name_names_session_create_and_no_route(
    service: ServiceFactory,
) -> None:
    async with service() as client:
        run = await client.post("/tools/code_interpreter", json={"code": "1", "session_id": UNKNOWN})
        close = await client.post("/tools/session_close", json={"session_id": UNKNOWN})
    for response in (run, close):
        assert response.status_code == 404
        assert response.json() == {"error": f"No session {UNKNOWN!r}; to create one, call session_create"}


async def test_an_unknown_session_on_the_resource_routes_and_the_older_tool_path_names_the_route(
    service: ServiceFactory,
) -> None:
    async with service() as client:
        execute = await client.post(f"/sessions/{UNKNOWN}/execute", json={"code": "1"})
        record = await client.get(f"/sessions/{UNKNOWN}")
        older = await client.post("/tools/code-interpreter", json={"code": "1", "session_id": UNKNOWN})
    for response in (execute, record, older):
        assert response.status_code == 404
        assert response.json() == {"error": f"No session {UNKNOWN!r}; to create one, POST /sessions"}


async def test_an_unknown_session_in_a_streamed_call_by_name_names_the_tool(service: ServiceFactory) -> None:
    """A streamed call runs in the response's own task, after the route handler returned."""
    async with service() as client:
        response = await client.post(
            "/tools/code_interpreter",
            json={"code": "1", "session_id": UNKNOWN},
            headers={"Accept": "text/event-stream"},
        )
    assert response.status_code == 404
    assert response.json()["error"].endswith("call session_create")