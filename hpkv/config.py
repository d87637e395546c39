"""hpkv configuration, as CT-HPKV documents it.

Every setting is a *key* declared once in :data:`KEYS`. Its value is looked up in
this order, the first hit wins:

1. the ini file: ``HPKV_CONFIG_FILE_PATH`` if set in the environment, else
   ``~/.config/hpkv/config.ini``. Bare ``KEY=VALUE`` lines (CT-HPKV's form) and a
   ``[hpkv]`` section both work; ``#`` and ``;`` start comments;
2. the environment;
3. the key's default.

Bad values raise :class:`ConfigError`, which names the key, the value, where it
came from (``file:line`` or ``environment``) and the accepted form. Loading has no
side effects; :func:`check_runtime` does the file-system checks (and creates the
storage and pool directories).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

CONFIG_FILE_ENV = "HPKV_CONFIG_FILE_PATH"
DEFAULT_CONFIG_FILE = "~/.config/hpkv/config.ini"
INI_SECTION = "hpkv"
# Internal: the configuration a process resolved, handed to a process it starts (JSON, see
# Config.to_env). Not a user setting; it wins over the file and the environment.
RESOLVED_ENV = "HPKV_RESOLVED_CONFIG"


class ConfigError(ValueError):
    """A configuration value is invalid, or the machine does not fit it."""


@dataclass(frozen=True)
class Source:
    """Where a value came from: ``file`` (with path and line), ``env`` or ``default``."""

    kind: str
    path: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        if self.kind == "file":
            return f"{self.path}:{self.line}"
        return "environment" if self.kind == "env" else "default"


# --------------------------------------------------------------------------- parsers
# Each parser takes the raw string and returns the typed value, or raises
# ValueError; the caller turns that into a ConfigError with key, value and source.

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
SIZE_FORM = (
    "a byte count with an optional binary unit k, m, g, t (also kb, kib, ...; "
    "case-insensitive), e.g. 4096, 512m, 8g, 16G, 1.5GiB"
)


def parse_size(text: str) -> int:
    """``'512m'`` → 536870912. Units are binary (k = 1024); fractions round down."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    number, unit, suffix = m.groups()
    if suffix.lower() == "ib" and not unit:
        raise ValueError(f"'ib' needs a unit: {text!r}")
    try:
        value = Decimal(number) * (1024 ** _SIZE_UNITS[unit.lower()])
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(str(exc)) from None
    return int(value)


def format_size(n: int) -> str:
    """Human-readable binary size, e.g. ``8.0 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
BOOL_FORM = "1/0, true/false, yes/no or on/off"


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


_VAR_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_path(text: str, env: Mapping[str, str] | None = None) -> str:
    """Expand ``$VAR``, ``${VAR}`` and a leading ``~`` from ``env``; unset variables are an error."""
    env = os.environ if env is None else env

    def var(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ValueError(f"environment variable ${name} in the path is not set")
        return env[name]

    expanded = _VAR_RE.sub(var, text.strip())
    if expanded == "~" or expanded.startswith("~/"):
        home = env.get("HOME") or os.path.expanduser("~")
        expanded = home + expanded[1:]
    return os.path.abspath(expanded)


def parse_path(text: str, env: Mapping[str, str] | None = None) -> str:
    if not text.strip():
        raise ValueError("empty path")
    return expand_path(text, env)


def parse_optional_path(text: str, env: Mapping[str, str] | None = None) -> str | None:
    """An empty value means "disabled" (e.g. no storage tier)."""
    return expand_path(text, env) if text.strip() else None


def parse_auto_size(text: str) -> int | None:
    """``auto`` → None (hpkv decides), else a size."""
    return None if text.strip().lower() == "auto" else parse_size(text)


def parse_auto_bool(text: str) -> bool | None:
    """``auto`` → None (hpkv decides), else a boolean."""
    return None if text.strip().lower() == "auto" else parse_bool(text)


def parse_threshold(text: str) -> int | None:
    """``auto`` → None (hpkv measures), else an integer >= 0."""
    if text.strip().lower() == "auto":
        return None
    return _int_parser(minimum=0)(text)


def parse_admit(text: str) -> int:
    """HPKV_STORAGE_ADMIT: ``always`` → 0, ``reuse:N`` → N (hits from DRAM before the write)."""
    value = text.strip().lower()
    if value == "always":
        return 0
    kind, _, n = value.partition(":")
    if kind != "reuse" or not n.strip().isdigit() or not 1 <= int(n) <= 1000:
        raise ValueError(f"{text!r} is not 'always' or 'reuse:N' with N from 1 to 1000")
    return int(n)


def _int_parser(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip(), 10)
        if minimum is not None and value < minimum:
            raise ValueError(f"{value} < {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{value} > {maximum}")
        return value

    return parse


def _float_parser(minimum: float = 0.0, maximum: float = 1e9) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text.strip())
        # nan and inf too: a deadline of inf seconds ends in an OverflowError somewhere.
        if not minimum <= value <= maximum:
            raise ValueError(f"{value} is outside {minimum:g}..{maximum:g}")
        return value

    return parse


def _choice_parser(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    return parse


TIER_NAMES = ("files", "remote")  # the tiers below the DRAM pool HPKV_TIER_ORDER orders


def parse_tier_order(text: str) -> tuple[str, ...]:
    """``files,remote`` or ``remote,files``: each tier below the pool named once, in order."""
    names = tuple(n.strip().lower() for n in text.split(","))
    if sorted(names) != sorted(TIER_NAMES):
        raise ValueError(
            f"{text!r} is not a tier order: name each of {', '.join(TIER_NAMES)} once, "
            "comma-separated (files,remote or remote,files)"
        )
    return names


MAX_GID = 0xFFFFFFFE  # (gid_t)-1 means "no change" to chown


def parse_percent(text: str) -> float:
    """``'5%'`` or ``'5'`` → 5.0 (percent, 0..100)."""
    t = text.strip().removesuffix("%").strip()
    value = float(t)
    if not 0.0 <= value <= 100.0:
        raise ValueError(f"{value} is outside 0..100")
    return value


def parse_pool_share(text: str) -> int | float:
    """``'25%'`` → 25.0 (a float: percent of HPKV_KV_MEM_POOL_SIZE), ``'2g'`` → bytes (an int)."""
    t = text.strip()
    if t.endswith("%"):
        return parse_percent(t)
    return parse_size(t)


def _min_size(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = parse_size(text)
        if value < minimum:
            raise ValueError(f"{value} bytes is below the minimum of {format_size(minimum)}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{value} bytes is above the maximum of {format_size(maximum)}")
        return value

    return parse


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Pool offsets stay below 2**40: a reserve answer carries the slot's generation above them
# (hpkv.protocol.wire.SLOT_GEN_SHIFT).
MAX_POOL_BYTES = 1 << 40


def parse_group(text: str) -> int | None:
    """A group name or numeric gid → gid; empty → None (no group allowed)."""
    t = text.strip()
    if not t:
        return None
    import grp

    if t.isdigit():
        gid = int(t)
        if gid > MAX_GID:
            raise ValueError(f"gid {gid} is outside 0..{MAX_GID}")
        try:  # the server chowns its socket to it: a gid no group has is a typo
            grp.getgrgid(gid)
        except KeyError:
            raise ValueError(f"no group has gid {gid} on this machine (see getent group)") from None
        return gid
    try:
        return grp.getgrnam(t).gr_gid
    except KeyError:
        raise ValueError(f"no group named {t!r} on this machine") from None


def parse_log_level(text: str) -> str:
    t = text.strip().upper()
    if t not in _LOG_LEVELS:
        raise ValueError(f"unknown log level {text!r}")
    return t


MAX_MODEL_ID = 256


def parse_model_id(text: str) -> str | None:
    """``HPKV_MODEL_ID``: empty → None (hpkv derives the identity), else printable, at most 256 characters."""
    t = text.strip()
    if not t:
        return None
    if len(t) > MAX_MODEL_ID:
        raise ValueError(f"{len(t)} characters, more than {MAX_MODEL_ID}")
    bad = [c for c in t if not c.isprintable()]
    if bad:
        raise ValueError(f"it holds the unprintable character {bad[0]!r}")
    return t


def parse_host(text: str) -> str:
    t = text.strip()
    if not t or any(c.isspace() for c in t):
        raise ValueError(f"not a host: {text!r}")
    return t


# --------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class Key:
    name: str
    default: str
    parse: Callable[..., Any]  # (text) -> value; path keys also take the environment
    form: str  # the accepted form, for error messages
    help: str  # what it does, in markdown: the "meaning" column of docs/configuration.md

    @property
    def is_path(self) -> bool:
        return self.parse in (parse_path, parse_optional_path)


KEYS: dict[str, Key] = {
    k.name: k
    for k in (
        Key(
            "HPKV_KV_STORAGE_PATH",
            "~/.cache/hpkv/storage",
            parse_optional_path,
            "a directory path (~ and $VARS expand); empty disables the storage tier",
            "KV file directory; empty disables the storage tier",
        ),
        Key(
            "HPKV_KV_MEM_POOL_SIZE",
            "8g",
            _min_size(1 << 20, MAX_POOL_BYTES),
            SIZE_FORM + ", at least 1m, at most 1t",
            "DRAM pool size (at most 1t: a reserved slot's value carries its generation above the offset)",
        ),
        Key(
            "HPKV_DRAM_EVICTION",
            "lru",
            _choice_parser("lru", "s3fifo"),
            "lru or s3fifo",
            "which DRAM block the pool evicts when it is full: `lru`, the least recently used; "
            "`s3fifo`, S3-FIFO: a new block waits in a small probation queue (10 % of the pool) and "
            "is evicted from there unless it was hit meanwhile, so one-shot prompts do not push the "
            "reused prefixes out (see docs/benchmarks.md for when it pays)",
        ),
        Key(
            "HPKV_SHARE_MEM_FILE_PATH",
            "/dev/shm/hpkv",
            parse_path,
            "a directory path on tmpfs or ramfs (~ and $VARS expand)",
            "directory of the pool file; must be tmpfs or ramfs",
        ),
        Key(
            "VLLM_HPKV_TOKEN_THRESHOLD",
            "1204",
            parse_threshold,
            "an integer >= 0, or auto",
            "load a hit only if it is at least this many tokens; `auto`: load the prefix of a hit whose"
            " load (at each tier's rate measured in this engine) beats recomputing it (at the engine's "
            "measured prefill rate), so a storage tier slower than prefill is skipped while DRAM still "
            "loads",
        ),
        Key("VLLM_ENABLE_HPKV", "1", parse_bool, BOOL_FORM, "0 turns the connector into a no-op"),
        Key(
            "HPKV_ASYNC_STORAGE_LOADS",
            "1",
            parse_bool,
            BOOL_FORM,
            "a hit that needs storage loads in the background while vLLM steps its other requests "
            "(vLLM's async KV load). 0: the step waits for the disk read",
        ),
        Key(
            "HPKV_ASYNC_DRAM_LOADS",
            "auto",
            parse_auto_bool,
            "auto, or " + BOOL_FORM,
            "vLLM on the CPU: a hit that DRAM holds whole loads in the background while vLLM steps its "
            "other requests (vLLM's async KV load), instead of in the step, where every running request "
            "waits for its copy (448 MiB, 40-100 ms here, for an 8192-token hit of Qwen2.5-7B's KV "
            "shape). `auto`: in the background while other requests are running, in the step when "
            "none is (nobody waits, and the hit saves the step an async load takes to be reported); "
            "1: always in the background; 0: always in the step. Unless 0, a request can choose with "
            '`"kv_transfer_params": {"hpkv_async_dram_load": true}` (or false)',
        ),
        Key(
            "HPKV_MODEL_ID",
            "",
            parse_model_id,
            f"printable text of at most {MAX_MODEL_ID} characters; empty = derived from the model's files",
            "the model's name in the namespace, instead of the one hpkv derives from the model's "
            "content (its config, tokenizer and weight index in full, its weights' names, sizes and "
            "sampled bytes; see [below](#the-model-in-the-namespace)): engines with the same "
            "value and the same KV layout share blocks. Set it to share a model whose copies differ in "
            "files that do not change the KV, or to tell apart weights that differ only where hpkv "
            "does not sample; empty: derived",
        ),
        Key(
            "HPKV_NUM_TRANSFER_WORKERS",
            "1",
            _int_parser(minimum=1, maximum=64),
            "an integer 1..64",
            "transfer worker processes per device",
        ),
        Key(
            "HPKV_CUDA_BLOCK_OUTERMOST",
            "1",
            parse_bool,
            BOOL_FORM,
            "on CUDA, ask vLLM for the BLNHC KV cache layout (a block of all layers is one copy); 0 "
            "keeps vLLM's choice",
        ),
        Key(
            "HPKV_NUM_IO_WORKERS",
            "2",
            _int_parser(minimum=1, maximum=64),
            "an integer 1..64",
            "IO worker processes (each checks one promoted file while it reads the next)",
        ),
        Key(
            "HPKV_SERVER_IDLE_EXIT",
            "600",
            _float_parser(minimum=0.0),
            "a number of seconds >= 0 (0 = never)",
            "an auto-spawned server exits after this many idle seconds (0 = never)",
        ),
        Key(
            "HPKV_STOP_DRAIN_TIMEOUT",
            "60",
            _float_parser(minimum=0.0, maximum=86400.0),
            "a number of seconds 0..86400",
            "at a stop, pending write-through spills are written for at most this many seconds "
            "(0..86400); new reserves are answered pool-full meanwhile",
        ),
        Key(
            "HPKV_STORAGE_FSYNC",
            "0",
            parse_bool,
            BOOL_FORM,
            "fsync KV files before they are renamed into place",
        ),
        Key(
            "HPKV_KV_STORAGE_SIZE",
            "0",
            parse_size,
            SIZE_FORM + "; 0 = no limit",
            "capacity of the storage directory, all namespaces and all servers sharing it together "
            "(0 = no limit): one evictor deletes the least recently used blocks above it (see [shared "
            "storage](shared-storage.md))",
        ),
        Key(
            "HPKV_STORAGE_EVICTOR",
            "auto",
            _choice_parser("auto", "always", "never"),
            "auto, always or never",
            "who keeps the storage directory under `HPKV_KV_STORAGE_SIZE` when several servers share it"
            " (see [shared storage](shared-storage.md)): `auto`: the servers elect one through a lease "
            "file in the directory; `always`: this server evicts (give exactly one server this); "
            "`never`: this server never deletes for capacity",
        ),
        Key(
            "HPKV_STORAGE_EVICTOR_LEASE",
            "15",
            _float_parser(minimum=1.0, maximum=3600.0),
            "a number of seconds 1..3600",
            "the evictor's lease: renewed by its holder while it runs, taken over by another server "
            "when it is expired by half of this (the holder died or hangs)",
        ),
        Key(
            "HPKV_STORAGE_READ_GRACE",
            "60",
            _float_parser(minimum=0.0),
            "a number of seconds >= 0",
            "a KV file any server read within this many seconds is never evicted for capacity (the "
            "reader leaves the file's access time; the evictor checks it before deleting)",
        ),
        Key(
            "HPKV_STORAGE_JOURNAL_POLL",
            "1",
            _float_parser(minimum=0.05, maximum=60.0),
            "a number of seconds 0.05..60",
            "how often a server appends to its journals and reads the other servers' journals: a file"
            " another server writes is found within this (plus the NFS attribute cache for a new server)",
        ),
        Key(
            "HPKV_PROMOTE_PART_SIZE",
            "16m",
            parse_size,
            SIZE_FORM + "; 0 = one part",
            "a storage hit is read in up to 8 parts of at least this size (of one rank's shards), each "
            "copied into vLLM's KV cache or SGLang's host pool while the next is read (0 = one part; "
            "vLLM on the CPU, and SGLang; vLLM on CUDA reads in one part)",
        ),
        Key(
            "HPKV_STORAGE_LOOKUP_WAIT_MS",
            "5",
            _float_parser(0.0, 60_000.0),
            "milliseconds, e.g. 5",
            "a lookup that needs the storage file system (a key nobody knows: another server may "
            "have written it; a storage hit not checked for 2 s) waits at most this long for its "
            "stats, which run off the request loop; what is not confirmed by then is a miss for "
            "that lookup. A stat here takes 2-6 us on ext4, ~0.1-1 ms on NFS; a hung mount costs a "
            "lookup this bound, never more, and DRAM hits never wait",
        ),
        Key(
            "HPKV_STORAGE_LOOKUP_RETRY_MS",
            "1000",
            _float_parser(0.0, 60_000.0),
            "milliseconds, e.g. 1000; 0 = never",
            "vLLM: a request whose lookup ended at HPKV_STORAGE_LOOKUP_WAIT_MS with its next block "
            "still being checked on storage is not scheduled yet and asks again on the next steps "
            "(the other requests keep running), for at most this long; then what is not confirmed "
            "is recomputed. A stat that hangs for 1 s marks storage degraded, which ends the wait",
        ),
        Key(
            "HPKV_STORAGE_READ_BOUNCE",
            "auto",
            parse_auto_bool,
            "auto, or " + BOOL_FORM,
            "promote reads go through a private buffer (auto: on virtio disks, where O_DIRECT into "
            "shared memory reads at half speed)",
        ),
        Key(
            "HPKV_STORAGE_READ_INFLIGHT",
            "auto",
            parse_auto_size,
            "auto, or " + SIZE_FORM + "; 0 = no limit",
            "promote reads go to several IO workers at once only while the files being read add up to "
            "at most this size (auto: 4m on virtio disks, where two 4 MiB reads at once ran slower than"
            " one; elsewhere no limit)",
        ),
        Key(
            "HPKV_STORAGE_ADMIT",
            "always",
            parse_admit,
            "always, or reuse:N (N from 1 to 1000)",
            "which saved blocks the write-through puts on storage: always (CT-HPKV: every block, as "
            "it is saved), or reuse:N: a block is written once it was hit from DRAM N times, so a "
            "prompt seen once costs no storage write; a block evicted from DRAM before its N-th hit "
            "is dropped, not written",
        ),
        Key(
            "HPKV_STORAGE_MIN_FREE",
            "5%",
            parse_percent,
            "a percentage 0..100, e.g. 5%",
            "spilling pauses below this much free space",
        ),
        Key(
            "HPKV_REMOTE_BACKEND",
            "",
            _choice_parser("", "mooncake"),
            "empty (off) or mooncake",
            "a remote tier below the pool shared by several nodes: `mooncake` (Mooncake Store, the "
            "`mooncake` extra; needs HPKV_REMOTE_MASTER, HPKV_REMOTE_METADATA, "
            "HPKV_REMOTE_LOCAL_HOSTNAME). With HPKV_KV_STORAGE_PATH set too it is the tier below the "
            "files (DRAM, then files, then the store; HPKV_TIER_ORDER reverses it); alone, the only tier "
            "below the pool. Mooncake listens on every interface of the node: see the README's Mooncake "
            "section",
        ),
        Key(
            "HPKV_REMOTE_MASTER",
            "",
            str.strip,
            "host:port of mooncake_master's RPC",
            "the Mooncake master (its `--rpc_address`:`--rpc_port`)",
        ),
        Key(
            "HPKV_REMOTE_METADATA",
            "",
            str.strip,
            "a URL, e.g. http://10.0.0.1:8080/metadata",
            "Mooncake's metadata server (the master's `--enable_http_metadata_server`, or etcd)",
        ),
        Key(
            "HPKV_REMOTE_LOCAL_HOSTNAME",
            "",
            str.strip,
            "this node's address as the other nodes reach it",
            "the address of this node's Mooncake client (also its MC_TCP_BIND_ADDRESS); never guessed",
        ),
        Key(
            "HPKV_REMOTE_PROTOCOL",
            "tcp",
            _choice_parser("tcp", "rdma"),
            "tcp or rdma",
            "Mooncake's transport",
        ),
        Key(
            "HPKV_REMOTE_DEVICES",
            "",
            str.strip,
            "RDMA device names, comma-separated",
            "the RDMA devices Mooncake uses (rdma only)",
        ),
        Key(
            "HPKV_REMOTE_SEGMENT_SIZE",
            "0",
            parse_size,
            "a size, e.g. 4g (0 = contribute nothing)",
            "memory this node's remote worker contributes to the store. Objects in it are lost when "
            "the worker restarts; 0 makes it a pure client of segments held elsewhere",
        ),
        Key(
            "HPKV_REMOTE_LOOKUP_WAIT_MS",
            "5",
            _float_parser(0.0, 60_000.0),
            "milliseconds, e.g. 5",
            "a lookup whose next key is unknown here asks the remote store (off the request loop) and "
            "waits at most this long; what is not confirmed by then is a miss for that lookup",
        ),
        Key(
            "HPKV_REMOTE_DOWN_AFTER",
            "3",
            _int_parser(minimum=1, maximum=1000),
            "a count, e.g. 3",
            "consecutive store failures that mark the remote tier down (one master timeout does at "
            "once); while down, lookups do not ask it, blocks are not published (counted as dropped) "
            "and remote hits are recomputed",
        ),
        Key(
            "HPKV_REMOTE_PROBE_S",
            "2",
            _float_parser(0.1, 3600.0),
            "seconds, e.g. 2",
            "while the remote tier is down, one cheap probe (an exists of one key) every this many "
            "seconds; the first that the store answers marks it up again",
        ),
        Key(
            "HPKV_REMOTE_WRITE_POLICY",
            "commit",
            _choice_parser("commit", "evict"),
            "commit or evict",
            "when a block is published to the remote store: `commit`, as soon as it is committed "
            "(write-through); `evict`, when the DRAM pool evicts it (its slots wait for the put, the "
            "allocation takes the next victim; at most a quarter of the pool waits at once: beyond that, "
            "or while the store is down, the victim is evicted unpublished, counted as dropped and logged "
            "once). A block the store holds already is not published again",
        ),
        Key(
            "HPKV_TIER_ORDER",
            "files,remote",
            parse_tier_order,
            "files,remote or remote,files",
            "the order of the tiers below the DRAM pool (DRAM is always first): a lookup asks them in "
            "this order and a block held by both is read from the first. A tier that is off "
            "(HPKV_KV_STORAGE_PATH empty, HPKV_REMOTE_BACKEND empty) is left out",
        ),
        Key(
            "HPKV_METRICS_PORT",
            "0",
            _int_parser(minimum=0, maximum=65535),
            "a TCP port 0..65535 (0 = off)",
            "port of the Prometheus endpoint (0 = off)",
        ),
        Key(
            "HPKV_METRICS_HOST",
            "127.0.0.1",
            parse_host,
            "a host name or address",
            "address the Prometheus endpoint binds to",
        ),
        Key(
            "HPKV_ALLOW_GROUP",
            "",
            parse_group,
            "a group name or gid; empty = only the server's own uid",
            "an existing group (name or gid) whose members may also connect to the server's socket; "
            "empty: only the user who runs the server (see [the security model](security.md))",
        ),
        Key(
            "HPKV_LEASE_S",
            "600",
            _float_parser(minimum=0.0),
            "a number of seconds >= 0 (0 = no lease)",
            "a pin or reservation not released within this many seconds is released by the server (a "
            "save made for a released reservation afterwards is refused, nothing written; pins wait for"
            " the loads already queued) (0 = no lease)",
        ),
        Key(
            "HPKV_OPERATOR_PIN_MAX",
            "25%",
            parse_pool_share,
            SIZE_FORM + ", or a percentage of HPKV_KV_MEM_POOL_SIZE, e.g. 25%",
            "DRAM an operator may pin with `hpkv pin` (all namespaces together); a pin beyond it is "
            "refused. Operator pins have no lease: they hold until `hpkv unpin` or the server's restart",
        ),
        Key(
            "HPKV_MAX_CONTROL_CONNECTIONS",
            "512",
            _int_parser(minimum=1, maximum=65536),
            "an integer 1..65536",
            "control connections the server keeps open at once (lowered to fit `ulimit -n`); more are "
            "refused (the client raises `HpkvUnavailable` and recomputes) and logged",
        ),
        Key(
            "HPKV_LOG_MAX_BYTES",
            "64m",
            _min_size(64 * 1024),
            SIZE_FORM + ", at least 64k",
            "`server.log` is renamed `server.log.1` (the last 3 kept) past this size; a spawned "
            "server's output and its workers follow the new file",
        ),
        Key(
            "HPKV_WORKER_HANG_S",
            "30",
            _float_parser(0.0, 3600.0),
            "a number of seconds, 0..3600 (0 = no hang detection)",
            "a transfer or IO worker whose job loop has not turned for this many seconds (a job taken "
            "and not finished, or the process stopped) is shown `hung` in `hpkv status`/`hpkv-top`, "
            "killed, its jobs answered as failures, and restarted (0 = no detection)",
        ),
        Key(
            "HPKV_LOG_LEVEL",
            "INFO",
            parse_log_level,
            "one of " + ", ".join(_LOG_LEVELS),
            "server and worker log level",
        ),
    )
}


# --------------------------------------------------------------------------- the documented table
# docs/configuration.md holds this table between the two markers; tests/test_docs.py fails when
# it differs, so a key's default and meaning are written once, above.
CONFIG_FILE_HELP = "the ini file (environment only)"
DOC_TABLE_BEGIN = "<!-- BEGIN generated by `hpkv config --markdown docs/configuration.md` -->"
DOC_TABLE_END = "<!-- END generated -->"


def markdown_table() -> str:
    """Every key with its default and meaning, as a markdown table (the config file's key first)."""
    rows = [(CONFIG_FILE_ENV, DEFAULT_CONFIG_FILE, CONFIG_FILE_HELP)]
    rows += [(k.name, k.default or "(empty)", k.help) for k in KEYS.values()]
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| {name} | {default} | {meaning} |" for name, default, meaning in rows]
    return "\n".join(lines) + "\n"


def with_markdown_table(page: str) -> str:
    """``page`` with the text between :data:`DOC_TABLE_BEGIN` and :data:`DOC_TABLE_END` replaced
    by :func:`markdown_table`."""
    begin, end = page.find(DOC_TABLE_BEGIN), page.find(DOC_TABLE_END)
    if begin < 0 or end < begin:
        raise ConfigError(f"the page has no {DOC_TABLE_BEGIN!r} ... {DOC_TABLE_END!r} markers")
    head = page[: begin + len(DOC_TABLE_BEGIN)]
    return f"{head}\n{markdown_table()}{page[end:]}"


# --------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class Setting:
    key: str
    value: Any
    raw: str
    source: Source


@dataclass
class Config:
    """The effective configuration: one :class:`Setting` per key."""

    settings: dict[str, Setting]
    config_file: str
    config_file_found: bool
    warnings: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.settings[key].value

    def source(self, key: str) -> Source:
        return self.settings[key].source

    # Typed shortcuts for the keys every layer uses.
    @property
    def pool_dir(self) -> str:
        return self["HPKV_SHARE_MEM_FILE_PATH"]

    @property
    def pool_size(self) -> int:
        return self["HPKV_KV_MEM_POOL_SIZE"]

    @property
    def storage_path(self) -> str | None:
        return self["HPKV_KV_STORAGE_PATH"]

    def as_json(self) -> dict[str, dict[str, Any]]:
        return {
            name: {"value": s.value, "source": str(s.source), "raw": s.raw}
            for name, s in self.settings.items()
        }

    def to_env(self) -> dict[str, str]:
        """This configuration, handed to a process we start: every key's raw value with its
        source. The child resolves exactly this (a default stays a default, a file value keeps
        its ``file:line``) and reads neither the ini file nor the other variables again."""
        settings = {
            name: {"raw": s.raw, "source": [s.source.kind, s.source.path, s.source.line]}
            for name, s in self.settings.items()
        }
        return {
            RESOLVED_ENV: json.dumps(
                {"config_file": self.config_file, "found": self.config_file_found, "settings": settings}
            )
        }


def _strip_inline_comment(value: str) -> str:
    # A comment inside a value needs whitespace before it, so paths like
    # /data/run#1 keep their '#'.
    m = re.search(r"\s[#;]", value)
    return value[: m.start()] if m else value


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def read_ini(path: str) -> tuple[dict[str, tuple[str, int]], list[str]]:
    """Parse the ini file: ``{KEY: (raw value, line number)}`` and warnings.

    Lines before any section header, and lines in ``[hpkv]``, are read; other
    sections are ignored with a warning. ``export KEY=VALUE`` is accepted too, so a
    shell-style env file works.
    """
    values: dict[str, tuple[str, int]] = {}
    warnings: list[str] = []
    section: str | None = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text or text[0] in "#;":
                continue
            if text.startswith("[") and text.endswith("]"):
                section = text[1:-1].strip()
                if section.lower() != INI_SECTION:
                    warnings.append(
                        f"{path}:{lineno}: section [{section}] is ignored "
                        f"(hpkv reads bare KEY=VALUE lines and the [{INI_SECTION}] section)"
                    )
                continue
            if section is not None and section.lower() != INI_SECTION:
                continue
            if text.startswith("export "):
                text = text[len("export ") :].lstrip()
            if "=" not in text and ":" not in text:
                raise ConfigError(f"{path}:{lineno}: cannot parse {text!r}: expected KEY=VALUE")
            sep = "=" if "=" in text else ":"
            name, _, raw = text.partition(sep)
            name = name.strip().upper()
            raw = _unquote(_strip_inline_comment(raw).strip())
            if name in values:
                warnings.append(
                    f"{path}:{lineno}: {name} is set again (line {values[name][1]} is overridden)"
                )
            values[name] = (raw, lineno)
    for name in values:
        if name in KEYS or name == CONFIG_FILE_ENV:
            continue
        if name.startswith(("HPKV_", "VLLM_HPKV", "VLLM_ENABLE_HPKV")):
            near = difflib.get_close_matches(name, list(KEYS), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else ""
            warnings.append(f"{path}:{values[name][1]}: unknown key {name}{hint}")
        else:
            warnings.append(f"{path}:{values[name][1]}: {name} is not an hpkv key and is ignored")
    return values, warnings


def config_file_path(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    try:
        return expand_path(env.get(CONFIG_FILE_ENV) or DEFAULT_CONFIG_FILE, env)
    except ValueError as exc:
        raise ConfigError(
            f"{CONFIG_FILE_ENV}={env.get(CONFIG_FILE_ENV)!r} (from environment): {exc}"
        ) from None


def _parse_setting(key: Key, raw: str, source: Source, env: Mapping[str, str]) -> Setting:
    try:
        value = key.parse(raw, env) if key.is_path else key.parse(raw)
    except ValueError as exc:
        raise ConfigError(
            f"{key.name}={raw!r} (from {source}) is invalid: {exc}. Expected {key.form}."
        ) from None
    return Setting(key.name, value, raw, source)


def _handed_over(text: str, env: Mapping[str, str]) -> Config:
    """The configuration a parent process resolved (:meth:`Config.to_env`)."""
    try:
        data = json.loads(text)
        given = {name: (str(s["raw"]), Source(*s["source"])) for name, s in data["settings"].items()}
        config_file, found = str(data["config_file"]), bool(data["found"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{RESOLVED_ENV} is not a configuration hpkv handed over ({exc}); unset it"
        ) from None
    settings = {}
    for key in KEYS.values():
        raw, source = given.get(key.name, (key.default, Source("default")))
        settings[key.name] = _parse_setting(key, raw, source, env)
    return Config(settings, config_file, found)


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """Resolve every key: ini file, then environment, then default (or what a parent handed over)."""
    env = os.environ if env is None else env
    if env.get(RESOLVED_ENV):
        return _handed_over(env[RESOLVED_ENV], env)
    path = config_file_path(env)
    file_values: dict[str, tuple[str, int]] = {}
    warnings: list[str] = []
    found = os.path.isfile(path)
    if found:
        try:
            file_values, warnings = read_ini(path)
        except OSError as exc:
            raise ConfigError(
                f"cannot read the hpkv config file {path} ({exc.strerror}); "
                f"fix its permissions or point {CONFIG_FILE_ENV} elsewhere"
            ) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"the hpkv config file {path} is not UTF-8 text ({exc})") from None
    elif CONFIG_FILE_ENV in env:
        raise ConfigError(
            f"{CONFIG_FILE_ENV}={env[CONFIG_FILE_ENV]!r} (from environment): "
            f"no such file {path}; create it or unset {CONFIG_FILE_ENV}"
        )

    settings: dict[str, Setting] = {}
    for key in KEYS.values():
        if key.name in file_values:
            raw, line = file_values[key.name]
            source = Source("file", path, line)
        elif key.name in env:
            raw, source = env[key.name], Source("env")
        else:
            raw, source = key.default, Source("default")
        settings[key.name] = _parse_setting(key, raw, source, env)
    return Config(settings, path, found, warnings)


def describe(cfg: Config) -> str:
    """The table ``hpkv config`` prints."""
    rows = [("KEY", "VALUE", "SOURCE")]
    for name, s in cfg.settings.items():
        value = s.value
        if name in ("HPKV_KV_MEM_POOL_SIZE", "HPKV_KV_STORAGE_SIZE") and value:
            shown = f"{s.raw} ({format_size(value)})"
        elif value is None:
            shown = "(disabled)"
        else:
            shown = str(value)
        rows.append((name, shown, str(s.source)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
    lines.append("")
    lines.append(f"config file: {cfg.config_file}" + ("" if cfg.config_file_found else " (not found)"))
    return "\n".join(lines)


def dumps_json(cfg: Config) -> str:
    return json.dumps(cfg.as_json(), indent=2, sort_keys=False)
