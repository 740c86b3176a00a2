"""The Python runner's look at sys.modules when its gate locks: only the modules imported after the ready
line, found by the order a dict keeps, must be looked at again (runner.py's `imported_since_ready`).

Pure logic, on the runner's own function taken from its file (the runner itself imports numpy and scipy
at its top, which the host need not have). That every module a library imported before the ready line is
dropped, so that `import ctypes` reaches the gate, is shown end to end under both runtimes in
tests/sandbox/test_python_gate.py (`import_ctypes`).
"""

from __future__ import annotations

import ast
import types
from collections.abc import Callable

from metaagent.languages.python.image import PYTHON_RUNNER_DIR

SOURCE = (PYTHON_RUNNER_DIR / "runner.py").read_text()


def imported_since_ready(modules: dict[str, object], last_at_ready: str) -> Callable[[], list[str]]:
    """The runner's function, bound to `modules` as its sys.modules and `last_at_ready` as its marker."""
    tree = ast.parse(SOURCE)
    (found,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "imported_since_ready"]
    runner_sys = types.SimpleNamespace(modules=modules)
    namespace: dict[str, object] = {"sys": runner_sys, "LAST_MODULE_AT_READY": last_at_ready}
    exec(compile(ast.Module(body=[found], type_ignores=[]), "runner.py", "exec"), namespace)  # noqa: S102
    function: Callable[[], list[str]] = namespace["imported_since_ready"]  # type: ignore[assignment]
    return function


def test_nothing_imported_since_the_ready_line_leaves_nothing_to_look_at() -> None:
    modules = {"os": 1, "numpy": 2, "scipy": 3}
    assert imported_since_ready(modules, "scipy")() == []


def test_every_module_imported_since_the_ready_line_is_looked_at_and_none_before() -> None:
    modules: dict[str, object] = {"os": 1, "numpy": 2, "scipy": 3}
    since = imported_since_ready(modules, "scipy")
    modules["asyncio.events"] = 4
    modules["_ctypes"] = 5
    assert sorted(since()) == ["_ctypes", "asyncio.events"]


def test_a_module_dropped_and_imported_again_since_the_ready_line_is_looked_at() -> None:
    modules: dict[str, object] = {"ctypes": 1, "numpy": 2, "scipy": 3}
    since = imported_since_ready(modules, "scipy")
    del modules["ctypes"]
    modules["ctypes"] = 4  # a dict puts a key inserted again at its end
    assert since() == ["ctypes"]


def test_without_its_marker_every_module_is_looked_at() -> None:
    modules: dict[str, object] = {"os": 1, "numpy": 2, "ctypes": 3}
    assert sorted(imported_since_ready(modules, "gone")()) == ["ctypes", "numpy", "os"]
