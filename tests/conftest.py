"""Shared fixtures for tests that talk to a real tritonserver (see k3backend.tritonserver).

Nothing here skips: a missing tritonserver or perf_analyzer fails the test with the command
that fixes it (scripts/setup-env).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import interpret
from k3backend.tritonserver import TritonServer

# The models under test are tiny: one intra-op thread is several times faster than two fighting
# over a 2-core machine (and keeps results independent of the machine's core count).
torch.set_num_threads(1)

StartServer = Callable[..., TritonServer]
REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"


@dataclass
class ExternalServer:
    """A server started outside pytest on the project's model_repository (e.g. on a GPU machine):
    `K3_EXTERNAL_SERVER=http://host:8000,host:8001,http://host:8002/metrics`."""

    http_url: str
    grpc_url: str
    metrics_url: str


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """Factory: `triton_server(model_repository, models, extra_args=())` -> a started server.

    The returned `TritonServer` is ready (every model in `models` answers
    `/v2/models/<m>/ready` with 200) and has `.http_url`, `.grpc_url` (host:port, as
    tritonclient.grpc takes it), `.metrics_url`, `.log_path`, `.pid` and `.stop()`.

    Servers are shared: a second call with the same repository, models and extra_args returns
    the same running server, so several modules can use one slow-to-load repository. Pass
    `fresh=True` for a private server (for tests that kill or reload it). Every server started
    here is stopped at the end of the session; stop it earlier with `.stop()`.
    """
    servers: dict[tuple, TritonServer] = {}
    started: list[TritonServer] = []

    def start(
        model_repository: Path,
        models: Sequence[str],
        extra_args: Sequence[str] = (),
        *,
        fresh: bool = False,
        startup_timeout_s: float = 300.0,
    ) -> TritonServer:
        external = os.environ.get("K3_EXTERNAL_SERVER")
        if external and Path(model_repository).resolve() == REPOSITORY and not fresh and not extra_args:
            return ExternalServer(*external.split(","))
        key = (Path(model_repository).resolve(), tuple(models), tuple(extra_args))
        server = None if fresh else servers.get(key)
        if server is not None and server.is_running():
            return server
        work_dir = tmp_path_factory.mktemp("tritonserver")
        server = TritonServer(
            model_repository, work_dir, models=models, extra_args=extra_args,
            startup_timeout_s=startup_timeout_s,
        )
        started.append(server)
        server.start()
        if not fresh:
            servers[key] = server
        return server

    yield start
    for server in started:  # all shut down at once: one after the other took a minute
        server.begin_stop()
    for server in reversed(started):
        server.stop()


@pytest.fixture(scope="session")
def perf_analyzer() -> Path:
    """The perf_analyzer wrapper that scripts/setup-env puts in the virtualenv's bin/."""
    path = Path(sys.executable).parent / "perf_analyzer"
    if not os.access(path, os.X_OK):
        pytest.fail(f"perf_analyzer not found at {path}; run scripts/setup-env", pytrace=False)
    return path


_REPORTS = pytest.StashKey[list]()
_CHILDREN = pytest.StashKey[list]()


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`report(text)`: print `text` in the session's closing summary (not amid the progress dots)."""
    return lambda text: request.config.stash.setdefault(_REPORTS, []).append(text)


def _child(item: pytest.Item) -> interpret.Child | None:
    """The interpreter child (`CHECKS`) of the item's module, if it has one."""
    child = getattr(getattr(item, "module", None), "CHECKS", None)
    return child if isinstance(child, interpret.Child) else None


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules with interpreter children run last, and their children start now at low priority
    (`interpret.prestart`): the single-threaded checks (~7 CPU-minutes) then overlap the rest of the
    suite, which leaves a core idle while it waits on servers."""
    items.sort(key=lambda item: _child(item) is not None)  # stable: file order otherwise
    children = list(dict.fromkeys(c for c in map(_child, items) if c is not None))
    if children and not config.option.collectonly:
        config.stash[_CHILDREN] = children
        interpret.prestart(children)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for child in session.config.stash.get(_CHILDREN, []):
        child.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    texts = config.stash.get(_REPORTS, [])
    if texts:
        terminalreporter.write_sep("-", "reports")
        for text in texts:
            terminalreporter.write_line(text)
