"""Shared pytest fixtures: the tiny test model and real vLLM servers.

``tiny_model`` generates (once, then reuses) the deterministic Qwen2 test model
in ``~/.cache/hpkv/models`` (``HPKV_MODEL_CACHE`` overrides), so reruns are quick.

``vllm_server`` is a factory: ``srv = vllm_server(extra_args=[...], env={...})``
starts a server on the tiny model (or ``model=...``) and waits until it is
ready. Every server a test started is stopped at teardown, also when the test
failed; on failure the tail of each server's log is printed, so it shows in the
"Captured stdout teardown" section of the report.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import pytest

from hpkv.testing.model import generate_model
from hpkv.testing.vllm_server import VllmServer

#: Seconds a vLLM server may take to become ready (≈ 90-130 s on 2 busy cores).
VLLM_READY_TIMEOUT = float(os.environ.get("HPKV_TEST_VLLM_READY_TIMEOUT", "420"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    """Keep each phase's report on the item (``item.rep_setup``, ``item.rep_call``) for fixtures."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def _test_failed(item: pytest.Item) -> bool:
    return any(getattr(getattr(item, f"rep_{when}", None), "failed", False) for when in ("setup", "call"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """scripts/test.sh runs the suite in two phases: on parallel workers every test but those
    marked ``alone`` (``HPKV_TEST_PHASE=parallel``), then those by themselves (``alone``).
    Without the variable, everything selected runs."""
    phase = os.environ.get("HPKV_TEST_PHASE")
    if phase not in ("parallel", "alone"):
        return
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for i in items:
        (keep if (i.get_closest_marker("alone") is not None) == (phase == "alone") else dropped).append(i)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Directory of the deterministic tiny Qwen2 model (generated on first use)."""
    return generate_model()


@pytest.fixture
def vllm_server(
    request: pytest.FixtureRequest, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., VllmServer]]:
    """Factory that starts ready vLLM servers and always stops them at teardown.

    ``vllm_server(extra_args=(), env=None, *, model=None, wait=True, **kwargs)``:
    ``kwargs`` go to :class:`VllmServer` (``max_model_len``, ``port``, ...).
    """
    servers: list[VllmServer] = []
    log_dir = tmp_path_factory.mktemp("vllm-logs")

    def start(
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        model: str | None = None,
        wait: bool = True,
        **kwargs: Any,
    ) -> VllmServer:
        kwargs.setdefault("log_path", log_dir / f"vllm-{len(servers)}.log")
        kwargs.setdefault("ready_timeout", VLLM_READY_TIMEOUT)
        srv = VllmServer(model or tiny_model, extra_args=extra_args, env=env, **kwargs)
        servers.append(srv)
        srv.start()
        if wait:
            srv.wait_ready()
        return srv

    yield start

    failed = _test_failed(request.node)
    errors: list[str] = []
    for srv in reversed(servers):
        try:
            srv.stop()
        except Exception as exc:  # noqa: BLE001 - stop the others, then report
            errors.append(f"{srv!r}: {exc}")
        if failed:
            print(f"\n----- vLLM server log tail ({srv.log_path}) -----\n{srv.log_tail(120)}")
    if errors:
        pytest.fail("could not stop vLLM servers: " + "; ".join(errors))


@pytest.fixture
def server():
    """A real ``hpkv serve`` with a private 64 MiB pool under /dev/shm, always stopped and removed."""
    from hpkv.testing.server import ServerProcess, private_env

    srv = ServerProcess(private_env(pool_size="64m")).start()
    try:
        yield srv
    finally:
        srv.cleanup()
