"""Start, probe and reliably stop a real SGLang 0.5.23 server on the CPU for tests and benchmarks.

SGLang runs from its own virtualenv (``.venv-sglang``, made by ``scripts/setup-sglang.sh``;
``HPKV_SGLANG_PYTHON`` overrides the interpreter), with the TEST-ONLY CPU shims of
``hpkv/testing/sglang_shims`` on its ``PYTHONPATH`` (a stub ``sgl_kernel`` and three
monkeypatches; see the README there). Process handling is :class:`VllmServer`'s: own
session, SIGTERM then SIGKILL to every descendant within a bound, ``atexit`` clean-up.

The defaults are what HiCache needs on the CPU (``layer_first`` host layout with the
``direct`` IO backend, torch-native attention, no overlap scheduling) and what fits a
2-core machine (one OpenMP thread, a 4096-token KV pool).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import requests

from hpkv.testing.vllm_server import VllmServer, VllmServerError

__all__ = ["SglangServer", "SglangServerError", "sglang_python", "SHIMS_DIR", "hpkv_backend_args"]

SHIMS_DIR = Path(__file__).resolve().parent / "sglang_shims"
REPO_ROOT = Path(__file__).resolve().parents[2]


class SglangServerError(VllmServerError):
    """The SGLang server failed to start, died, or answered with an error."""


def sglang_python() -> str | None:
    """The interpreter of the SGLang virtualenv, or None when it is not set up."""
    py = os.environ.get("HPKV_SGLANG_PYTHON") or str(REPO_ROOT / ".venv-sglang" / "bin" / "python")
    return py if os.access(py, os.X_OK) else None


def hpkv_backend_args(extra_config: Mapping[str, Any] | None = None) -> list[str]:
    """CT-HPKV's flag, as a user types it (hpkv's SGLang plugin expands it), plus an optional
    extra config merged into hpkv's (e.g. ``{"prefetch_threshold": 64}``)."""
    import json

    args = ["--enable-ct-hpkv"]
    if extra_config:
        args += ["--hicache-storage-backend-extra-config", json.dumps(dict(extra_config))]
    return args


class SglangServer(VllmServer):
    """A ``sglang.launch_server`` subprocess on a loopback port, serving ``/generate``."""

    #: SGLang's load-snapshot files, left by a killed scheduler (SGLang's own CI sweeps them).
    leaked_shm_prefixes = ("sglang_loads_",)
    #: SGLang names its ZMQ sockets after ``tempfile`` files it never removes; it compiles nothing
    #: here, so a temporary directory of its own costs no cache.
    scratch_variables = ("TMPDIR",)

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        page_size: int = 16,
        max_total_tokens: int = 4096,
        hicache: bool = True,
        omp_threads: int = 1,
        python: str | None = None,
        ready_timeout: float = 300.0,
        **kwargs: Any,
    ) -> None:
        py = python or sglang_python()
        if py is None:
            raise SglangServerError(
                "no SGLang virtualenv: run scripts/setup-sglang.sh (or set "
                "HPKV_SGLANG_PYTHON to an interpreter with sglang==0.5.23)"
            )
        super().__init__(
            model, extra_args=extra_args, env=env, python=py, ready_timeout=ready_timeout, **kwargs
        )
        self.page_size = page_size
        self.max_total_tokens = max_total_tokens
        self.hicache = hicache
        self.omp_threads = omp_threads

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--page-size",
            str(self.page_size),
        ]
        return cmd + self.machine_args() + self.extra_args

    def machine_args(self) -> list[str]:
        """What SGLang needs on this CPU-only, 2-core machine (and HiCache on the CPU)."""
        args = [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--disable-overlap-schedule",
            "--max-total-tokens",
            str(self.max_total_tokens),
            "--skip-server-warmup",
        ]
        if self.hicache:
            # What HiCache runs with on the CPU (research note §5); --enable-ct-hpkv keeps these.
            args += [
                "--hicache-io-backend",
                "direct",
                "--hicache-mem-layout",
                "layer_first",
                "--hicache-ratio",
                "2",
            ]
        return args

    def environment(self) -> dict[str, str]:
        e = super().environment()
        e.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        e.setdefault("OMP_NUM_THREADS", str(self.omp_threads))
        e.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
        e.update(self.extra_env)
        # The shims go first also when ``env`` (a copy of a test's environment) has a PYTHONPATH.
        e["PYTHONPATH"] = os.pathsep.join([str(SHIMS_DIR), *filter(None, [e.get("PYTHONPATH")])])
        return e

    def generate(
        self, prompt: str, max_new_tokens: int = 16, logprobs: bool = True, timeout: float = 300.0
    ) -> dict[str, Any]:
        """Greedy ``/generate``; the response JSON (``text``, ``meta_info``)."""
        body = {
            "text": prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "return_logprob": logprobs,
        }
        r = self._session.post(self.url + "/generate", json=body, timeout=timeout)
        if r.status_code != 200:
            raise SglangServerError(f"/generate returned HTTP {r.status_code}: {r.text[:500]}")
        out: dict[str, Any] = r.json()
        return out

    def flush_cache(self, timeout: float = 60.0) -> None:
        """``POST /flush_cache``: SGLang drops its device (L1) and host (L2) caches; hpkv keeps its tiers.

        SGLang refuses (HTTP 400) until its scheduler is idle, which it is a moment after the last
        response (and after its cache controller's queued transfers): retried within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            r = requests.post(self.url + "/flush_cache", timeout=timeout)
            if r.status_code == 200:
                return
            if r.status_code != 400 or time.monotonic() > deadline:
                raise SglangServerError(f"/flush_cache returned HTTP {r.status_code}: {r.text[:300]}")
            time.sleep(0.2)

    def __repr__(self) -> str:
        return f"SglangServer(pid={self.pid}, url={self.url}, model={self.model!r})"


def cached_tokens(response: Mapping[str, Any]) -> dict[str, int]:
    """Which tier served the prompt's cached prefix, from SGLang's own report."""
    meta = response.get("meta_info", {})
    d = meta.get("cached_tokens_details") or {}
    return {
        "device": int(d.get("device", 0)),
        "host": int(d.get("host", 0)),
        "storage": int(d.get("storage", 0)),
        "total": int(meta.get("cached_tokens", 0)),
    }
