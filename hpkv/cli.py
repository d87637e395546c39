"""The ``hpkv`` command line.

Verbs are thin: each parses its flags and calls into the layer that does the work.
Benchmarks live in :mod:`hpkv.bench`, one module per ``hpkv bench NAME``, each
with ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from hpkv import __version__

# hpkv bench NAME -> module. Modules must be cheap to import (heavy imports inside run()).
BENCHES = {
    "ring": ("hpkv.bench.ring", "ring round-trip latency and throughput vs. semaphores, pipes, mp.Queue"),
    "copy": ("hpkv.bench.copy", "save/load throughput through a transfer worker vs. memcpy; lookup latency"),
    "io": ("hpkv.bench.io", "KV file write/read throughput through the IO workers vs. raw O_DIRECT"),
    "pool": ("hpkv.bench.pool", "cost of making pool memory exist vs. mapping it (start-up cost)"),
    "startup": ("hpkv.bench.startup", "vLLM's start-up time with and without hpkv (default 8 GiB pool)"),
    "kernels": ("hpkv.bench.kernels", "native block copy and CRC32C throughput vs. a single-thread memcpy"),
    "scale": ("hpkv.bench.scale", "server memory per stored block, scan rate, lookup latency vs. N"),
    "ttft": ("hpkv.bench.ttft", "the CT-HPKV four-tier TTFT experiment against real vLLM"),
    "window": (
        "hpkv.bench.window",
        "bytes a sliding-window hybrid stores and loads per prompt vs. a full-attention model of its size",
    ),
    "remote": (
        "hpkv.bench.remote",
        "Mooncake Store floors in network namespaces: batch put/get GB/s, p50/p99, exists latency, CPU-s/GB",
    ),
    "peers": (
        "hpkv.bench.peers",
        "hpkv side by side with vLLM alone and LMCache: CT-HPKV's phases and many users",
    ),
    "admit": (
        "hpkv.bench.admit",
        "HPKV_STORAGE_ADMIT and HPKV_DRAM_EVICTION policies on a many-users workload: hits, bytes written",
    ),
}


def _config_markdown(page: str) -> int:
    """``hpkv config --markdown [PAGE]``: print the key table, or rewrite it inside PAGE."""
    from hpkv.config import ConfigError, markdown_table, with_markdown_table

    if page == "-":
        print(markdown_table(), end="")
        return 0
    try:
        with open(page, encoding="utf-8") as f:
            text = with_markdown_table(f.read())
    except (OSError, ConfigError) as exc:
        print(f"hpkv: cannot update {page}: {exc}", file=sys.stderr)
        return 1
    with open(page, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"hpkv: {page}: key table written")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from hpkv.common.checks import check_runtime
    from hpkv.config import ConfigError, describe, dumps_json, load_config

    if args.markdown is not None:
        return _config_markdown(args.markdown)
    try:
        cfg = load_config()
    except ConfigError as exc:
        print(f"hpkv: configuration error: {exc}", file=sys.stderr)
        return 1
    for w in cfg.warnings:
        print(f"hpkv: warning: {w}", file=sys.stderr)
    print(dumps_json(cfg) if args.json else describe(cfg))
    if args.check:
        from hpkv.engine.remote import check_config as check_remote

        try:
            for w in check_runtime(cfg):
                print(f"hpkv: warning: {w}", file=sys.stderr)
            check_remote(cfg)  # HPKV_REMOTE_*: the keys it needs, and Mooncake's API
        except ConfigError as exc:
            print(f"hpkv: check failed: {exc}", file=sys.stderr)
            return 1
    return 0


def _load_config_or_exit():
    from hpkv.config import ConfigError, load_config

    try:
        return load_config()
    except ConfigError as exc:
        print(f"hpkv: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _cmd_serve(args: argparse.Namespace) -> int:
    from hpkv.config import ConfigError, load_config
    from hpkv.engine.serve import ReadyPipe, detach, serve

    if args.detach:
        detach()
    ready = ReadyPipe(args.ready_fd)
    try:
        cfg = load_config()
    except ConfigError as exc:
        print(f"hpkv: configuration error: {exc}", file=sys.stderr)
        ready.send(f"error configuration error: {exc}")
        return 1
    return serve(cfg, auto=args.auto, log_level=args.log_level, ready=ready)


def _cmd_status(args: argparse.Namespace) -> int:
    from hpkv.monitor.status import print_status

    return print_status(_load_config_or_exit(), as_json=args.json)


def _cmd_stop(args: argparse.Namespace) -> int:
    from hpkv.client.control import stop_server

    return stop_server(_load_config_or_exit(), timeout=args.timeout)


MAX_STOP_TIMEOUT_S = 2 * 86400.0  # HPKV_STOP_DRAIN_TIMEOUT's maximum (a day) and then some


def _stop_timeout(text: str) -> float:
    """``hpkv stop --timeout``: a finite number of seconds, 0 < t <= MAX_STOP_TIMEOUT_S."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= MAX_STOP_TIMEOUT_S:  # also nan and inf
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds in (0, {MAX_STOP_TIMEOUT_S:g}]; "
            "leave it out to wait HPKV_STOP_DRAIN_TIMEOUT + 30 s"
        )
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 3600.0:  # also nan and inf
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 3600]")
    return value


def _cmd_doctor(args: argparse.Namespace) -> int:
    from hpkv.doctor import main as doctor

    return doctor(as_json=args.json, timeout=args.timeout)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _cmd_bench(args: argparse.Namespace) -> int:
    # A bench killed with SIGTERM unwinds like Ctrl-C: its finally blocks stop the vLLM and
    # hpkv servers it started (the default action would leave them running).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    module = importlib.import_module(BENCHES[args.bench][0])
    return int(module.run(args) or 0)


# ------------------------------------------------------------------ operator verbs
# hpkv evict / prefetch / pin / unpin: one control call each (hpkv.engine.calls.OperatorCalls).

_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(text: str) -> float:
    """``--older-than``: ``90``, ``90s``, ``10m``, ``2h``, ``1d`` → seconds (>= 0)."""
    t = text.strip().lower()
    unit = _DURATION_UNITS.get(t[-1:])
    try:
        value = float(t[:-1] if unit else t) * (unit or 1.0)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1e9:  # also nan and inf
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90s, 10m, 2h or 1d")
    return value


def _size(text: str) -> int:
    from hpkv.config import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 512m or 2g") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _read_keys_file(path: str) -> list[bytes]:
    """One hpkv key in hex per line (blank lines and # comments skipped); a bad line is named."""
    from hpkv.protocol.keys import KEY_BYTES

    keys = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            t = line.split("#", 1)[0].strip()
            if not t:
                continue
            try:
                k = bytes.fromhex(t)
            except ValueError:
                k = b""
            if len(k) != KEY_BYTES:
                raise ValueError(f"{path}:{n}: {t[:64]!r} is not a key of {2 * KEY_BYTES} hex digits")
            keys.append(k)
    if not keys:
        raise ValueError(f"{path}: no keys in it")
    return keys


def _skipped(sk: dict) -> str:
    shown = [f"{n} {why.replace('_', ' ')}" for why, n in sk.items() if n]
    return f"; skipped {', '.join(shown)}" if shown else ""


def _format_operator(op: str, r: dict) -> str:
    from hpkv.config import format_size

    ns = r["namespace"]
    who = f"namespace {ns['id']} {ns['fingerprint'][:12]} {ns['name']!r}"
    if op == "evict":
        verb = "would drop" if r["dry_run"] else "dropped"
        lines = [f"hpkv evict: {who}{' (dry run: nothing dropped)' if r['dry_run'] else ''}"]
        for tier in ("dram", "storage"):
            t = r.get(tier)
            if t is not None:
                files = f", {t['files']} file(s)" if tier == "storage" else ""
                what = f"{t['blocks']} block(s), {format_size(t['bytes'])}{files}"
                lines.append(f"  {tier:8} {verb} {what}{_skipped(t['skipped'])}")
        return "\n".join(lines)
    if op == "prefetch":
        out = (
            f"hpkv prefetch: {who}: loaded {r['blocks']} block(s), {format_size(r['bytes'])} into DRAM "
            f"in {r['seconds']:.3f}s (budget {format_size(r['budget_bytes'])}, pool free "
            f"{format_size(r['free_bytes'])})"
        )
        if r["failed"]:
            out += f"; {r['failed']} failed (files gone or unreadable: see server.log)"
        if r["still_reading"]:
            out += f"; {r['still_reading']} still being read at the timeout (they land in DRAM later)"
        if r["degraded"]:
            out += "; storage is degraded: nothing was read"
        return out
    if "prompt" in r:
        p = r["prompt"]
        who += f", a prompt of {p['tokens']} tokens: {p['blocks']} full block(s) of {p['block_size']}"
    if op == "pin":
        out = (
            f"hpkv pin: {who}: pinned {r['pinned']} block(s), {format_size(r['bytes'])}; operator pins "
            f"now {format_size(r['namespace_pinned_bytes'])} in this namespace, "
            f"{format_size(r['operator_pinned_bytes'])} of {format_size(r['cap_bytes'])} "
            "(HPKV_OPERATOR_PIN_MAX) in all"
        )
        if r["not_in_dram"]:
            out += f"; {r['not_in_dram']} key(s) not in DRAM, not pinned (`hpkv prefetch` first)"
        return out
    return (
        f"hpkv unpin: {who}: unpinned {r['unpinned']} block(s), {format_size(r['bytes'])}; operator pins "
        f"now {format_size(r['operator_pinned_bytes'])} in all"
    )


def _cmd_operator(args: argparse.Namespace) -> int:
    import json

    from hpkv.client.control import operator_call
    from hpkv.protocol.errors import HpkvError

    cfg = _load_config_or_exit()
    op = args.verb
    kw: dict = {"namespace": args.namespace}
    prompt: dict = {}
    timeout = args.timeout
    if op == "evict":
        kw |= {"tier": args.tier, "older_than_s": args.older_than, "dry_run": args.dry_run}
    elif op == "prefetch":
        kw |= {"max_bytes": args.max_bytes, "newest": args.newest, "timeout_s": args.timeout}
        timeout = args.timeout + 30.0  # the server answers within its bound
    elif not args.namespace and (args.all or args.keys_file):
        print(f"hpkv {op}: --namespace is needed with --all and --keys-file", file=sys.stderr)
        return 2
    elif args.all:
        kw["all"] = True
    else:
        try:
            if args.keys_file:
                kw["keys"] = [k.hex() for k in _read_keys_file(args.keys_file)]
            else:
                prompt = _prompt_keys(cfg, args)
                kw["namespace"], kw["keys"] = prompt.pop("fingerprint"), prompt.pop("keys")
        except (OSError, ValueError) as exc:
            print(f"hpkv {op}: {exc}", file=sys.stderr)
            return 2
    try:
        if "keys" in kw:  # a control line holds at most 1 MiB: calls of 20000 keys
            from hpkv.engine.calls import MAX_OPERATOR_KEYS

            keys, replies = kw.pop("keys"), []
            for i in range(0, len(keys), MAX_OPERATOR_KEYS):
                replies.append(operator_call(cfg, op, timeout, keys=keys[i : i + MAX_OPERATOR_KEYS], **kw))
            reply = _merge_replies(replies)
        else:
            reply = operator_call(cfg, op, timeout, **kw)
    except HpkvError as exc:
        print(f"hpkv {op}: {exc}", file=sys.stderr)
        return 1
    reply.pop("ok", None)
    if prompt:
        reply["prompt"] = prompt
    print(json.dumps(reply, indent=2) if args.json else _format_operator(op, reply))
    return 0


def _prompt_namespace(cfg, args: argparse.Namespace) -> dict:
    """The namespace a prompt's keys are made for, from the running server's catalog: the one
    ``--namespace`` names (id, name or fingerprint prefix, as the server matches them), else the
    one vLLM serves ``--model`` in (its name starts with the model directory's name)."""
    from hpkv.monitor.status import read_snapshot

    known = (read_snapshot(cfg) or {}).get("namespaces", [])
    listed = ", ".join(f"{n['id']} {n['fingerprint'][:12]} {n['name']!r}" for n in known) or "none"
    sel = args.namespace
    if sel:
        from hpkv.protocol.keys import namespaces_named

        sel = sel.strip()
        entries = [(n["id"], n["fingerprint"], n["name"]) for n in known]
        found = [known[i] for i in namespaces_named(sel, entries)]
        what = f"--namespace {sel!r}"
    elif args.model:
        base = os.path.basename(args.model.rstrip("/"))
        found = [n for n in known if n["name"].startswith(base + " ")]
        what = f"a namespace of the model {base!r} (named '{base} tp… bs…')"
    else:
        raise ValueError("give --namespace, or --model to find the namespace vLLM serves it in")
    if len(found) != 1:
        many = f"{len(found)} match: give --namespace" if found else "none matches"
        raise ValueError(f"{what}: {many} (namespaces on this server: {listed}; `hpkv status` lists them)")
    return found[0]


def _prompt_keys(cfg, args: argparse.Namespace) -> dict:
    """``--text``/``--text-file``/``--tokens``/``--tokens-file``: the prompt's token ids, then
    the keys of its full blocks as vLLM hashes them, in the namespace they belong to."""
    from hpkv.client.prompt_keys import parse_token_ids, prompt_keys, prompt_token_ids

    if args.tokens is not None:
        ids = parse_token_ids(args.tokens, "--tokens")
    elif args.tokens_file:
        with open(args.tokens_file, encoding="utf-8") as f:
            ids = parse_token_ids(f.read(), args.tokens_file)
    else:
        if not args.model:
            raise ValueError("--text needs --model: the model directory whose tokenizer vLLM uses")
        if args.text is not None:
            text = args.text
        else:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        ids = prompt_token_ids(args.model, text)
    ns = _prompt_namespace(cfg, args)
    block_size = args.block_size or int(ns.get("block_tokens") or 0)
    if block_size < 1:
        raise ValueError(
            f"namespace {ns['id']} {ns['name']!r} does not record its block size: pass --block-size "
            "(vLLM's --block-size)"
        )
    keys = prompt_keys(ns["fingerprint"], ids, block_size, args.hash_algo)
    if not keys:
        raise ValueError(
            f"the prompt is {len(ids)} token(s), less than one full block of {block_size}: nothing to "
            f"{args.verb}"
        )
    return {
        "fingerprint": ns["fingerprint"],
        "keys": [k.hex() for k in keys],
        "tokens": len(ids),
        "blocks": len(keys),
        "block_size": block_size,
    }


def _merge_replies(replies: list[dict]) -> dict:
    """pin/unpin sent in several calls: counts added, the totals of the last one."""
    out = dict(replies[-1])
    for key in ("pinned", "unpinned", "bytes", "not_in_dram"):
        if key in out:
            out[key] = sum(r[key] for r in replies)
    if "not_in_dram_keys" in out:
        out["not_in_dram_keys"] = [k for r in replies for k in r["not_in_dram_keys"]][:10]
    return out


def _add_operator_verbs(verbs: argparse._SubParsersAction) -> None:
    ns_help = "the namespace: its id, a fingerprint prefix or its name, as `hpkv status` shows them"

    def common(p: argparse.ArgumentParser, timeout: float = 120.0, ns_required: bool = True) -> None:
        p.add_argument(
            "--namespace",
            required=ns_required,
            help=ns_help if ns_required else ns_help + " (with --model: the one vLLM serves it in)",
        )
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument(
            "--timeout", type=_positive_seconds, default=timeout, help=f"seconds (default {timeout:g})"
        )
        p.set_defaults(func=_cmd_operator)

    p = verbs.add_parser(
        "evict", help="drop a namespace's blocks from DRAM and/or storage (not pinned or in use)"
    )
    common(p)
    p.add_argument(
        "--older-than", type=_duration, default=None, help="only blocks not used for this long (10m, 2h, 1d)"
    )
    p.add_argument(
        "--tier", choices=["dram", "storage", "all"], default="dram", help="where to drop them (default dram)"
    )
    p.add_argument("--dry-run", action="store_true", help="say what would be dropped, drop nothing")

    p = verbs.add_parser("prefetch", help="read a namespace's storage blocks into DRAM, newest first")
    common(p, timeout=30.0)
    p.add_argument(
        "--max-bytes", type=_size, default=None, help="at most this much (default: what is free in the pool)"
    )
    p.add_argument(
        "--newest", type=_positive_int, default=None, help="at most the N most recently used blocks"
    )

    for verb, what in (("pin", "keep blocks in DRAM until unpinned"), ("unpin", "release operator pins")):
        p = verbs.add_parser(verb, help=f"{what} (HPKV_OPERATOR_PIN_MAX)")
        common(p, ns_required=False)
        which = p.add_mutually_exclusive_group(required=True)
        which.add_argument("--keys-file", metavar="FILE", help="hpkv keys in hex, one per line")
        which.add_argument(
            "--all", action="store_true", help="all the namespace's DRAM blocks (unpin: all its pins)"
        )
        which.add_argument(
            "--text",
            help="a prompt's full blocks, the prompt tokenized by --model's tokenizer as vLLM's "
            "completions endpoint does (special tokens added)",
        )
        which.add_argument("--text-file", metavar="FILE", help="--text read from a file (as it is)")
        which.add_argument("--tokens", metavar="IDS", help="a prompt's token ids: 1,2,3 or '1 2 3'")
        which.add_argument("--tokens-file", metavar="FILE", help="--tokens read from a file")
        p.add_argument(
            "--model",
            help="with --text: the model directory (or cached Hugging Face name) vLLM serves; without "
            "--namespace, also picks the namespace vLLM serves it in",
        )
        p.add_argument(
            "--block-size",
            type=_positive_int,
            default=None,
            help="tokens per block (default: the namespace's, as the engine declared it)",
        )
        p.add_argument(
            "--hash-algo",
            default="sha256",
            choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
            help="the engine's --prefix-caching-hash-algo (default sha256, vLLM's); with xxhash or an "
            "engine that set PYTHONHASHSEED, run this with the engine's PYTHONHASHSEED",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpkv", description="hpkv: tiered KV-cache offload engine for vLLM and SGLang"
    )
    parser.add_argument("--version", action="version", version=f"hpkv {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True

    p = verbs.add_parser("config", help="print every configuration key, its value and its source")
    p.add_argument("--json", action="store_true", help="print one JSON object {KEY: {value, source}}")
    p.add_argument(
        "--check",
        action="store_true",
        help="also check the machine (pool on tmpfs, storage writable, pool fits)",
    )
    p.add_argument(
        "--markdown",
        nargs="?",
        const="-",
        metavar="PAGE",
        help="print every key's default and meaning as a markdown table (the documentation's), "
        "or rewrite that table between its markers in PAGE (docs/configuration.md)",
    )
    p.set_defaults(func=_cmd_config)

    p = verbs.add_parser("serve", help="run the hpkv server in the foreground")
    p.add_argument(
        "--auto",
        action="store_true",
        help="auto-spawned mode: exit after HPKV_SERVER_IDLE_EXIT seconds without clients",
    )
    p.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="overrides HPKV_LOG_LEVEL",
    )
    # Used by the auto-spawn (hpkv.client.spawn.spawn_server), not meant for people.
    p.add_argument("--detach", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_serve)

    p = verbs.add_parser("status", help="show the running server's pool, namespaces and workers")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_status)

    p = verbs.add_parser("stop", help="ask the running server to write pending spills and shut down")
    p.add_argument(
        "--timeout",
        type=_stop_timeout,
        default=None,
        help="seconds to wait for it to exit (default: HPKV_STOP_DRAIN_TIMEOUT + 30)",
    )
    p.set_defaults(func=_cmd_stop)

    p = verbs.add_parser(
        "doctor",
        help="check this machine and configuration before the engine starts; exit 1 if something blocks",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of {check, level, message, value}")
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=10.0,
        help="seconds each check may take before it is reported as not answering (a hung mount); default 10",
    )
    p.set_defaults(func=_cmd_doctor)

    _add_operator_verbs(verbs)

    p = verbs.add_parser("bench", help="benchmarks that print ratios measured in one run")
    benches = p.add_subparsers(dest="bench", metavar="NAME")
    benches.required = True
    for name, (module, help_text) in BENCHES.items():
        bp = benches.add_parser(name, help=help_text)
        bp.add_argument("--json", action="store_true", help="print one JSON object")
        try:
            importlib.import_module(module).add_arguments(bp)
        except ModuleNotFoundError:
            bp.set_defaults(unavailable=True)
        bp.set_defaults(func=_cmd_bench)
    _add_pack_verbs(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "unavailable", False):
        print(f"hpkv: 'bench {args.bench}' is not available in this build", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `hpkv status | head`: the reader left; say nothing more (Python would print a
        # traceback, and another one when it flushes stdout at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


# ------------------------------------------------------------------ hpkv export / import
def _resolve_namespace(text: str, storage: str | None, known: list[dict]) -> str:
    """A namespace as the user names it: its fingerprint, a unique prefix of one (``hpkv status``
    shows 12 digits), or the name a running server gives it."""
    names = sorted({n["fingerprint"] for n in known if n.get("name") == text})
    if len(names) == 1:
        return names[0]
    if names:
        raise SystemExit(
            f"hpkv: the server has {len(names)} namespaces named {text!r}: give one of {', '.join(names)}"
        )
    fps = {n["fingerprint"] for n in known}
    if storage and os.path.isdir(storage):
        fps |= {e for e in os.listdir(storage) if len(e) == 32}
    hits = sorted(fp for fp in fps if fp.startswith(text.lower()))
    if len(hits) == 1:
        return hits[0]
    if len(text) == 32:
        return text.lower()
    what = "matches no namespace" if not hits else f"matches {len(hits)} namespaces"
    raise SystemExit(f"hpkv: --namespace {text!r} {what} (give its fingerprint; `hpkv status` lists them)")


def _model_of(directory: str, cfg) -> dict:
    from hpkv.protocol.model_identity import ModelIdentityError, model_identity

    try:
        ident = model_identity(directory, model_id=cfg["HPKV_MODEL_ID"])
    except ModelIdentityError as exc:
        raise SystemExit(f"hpkv: {exc}") from None
    return {"path": os.path.abspath(directory), "identity": ident}


def _print_json(obj: object) -> None:
    import json

    print(json.dumps(obj, indent=2))


def _cmd_export(args: argparse.Namespace) -> int:
    from hpkv.engine.storage.pack import NamespaceInfo, PackError, export_pack
    from hpkv.monitor.status import read_snapshot, server_pid
    from hpkv.protocol.stats import StatsVersionError

    cfg = _load_config_or_exit()
    storage = cfg.storage_path
    if not storage:
        print(
            "hpkv: HPKV_KV_STORAGE_PATH is empty: the storage tier is off, nothing to export", file=sys.stderr
        )
        return 1
    try:
        snap = read_snapshot(cfg) or {}
    except StatsVersionError as exc:  # the files are enough: the pack's manifest comes from them
        print(f"hpkv: warning: {exc}", file=sys.stderr)
        snap = {}
    known = snap.get("namespaces", [])
    fp = _resolve_namespace(args.namespace, storage, known)
    info = next((n for n in known if n["fingerprint"] == fp), None)
    ns = (
        NamespaceInfo(fp, info["world_size"], info["shard_bytes"], info["name"], info["block_tokens"])
        if info
        else None
    )
    model = _model_of(args.model, cfg) if args.model else None
    try:
        report = export_pack(storage, fp, args.out, ns, model, overwrite=args.force, name=args.name or "")
    except (PackError, OSError) as exc:
        print(f"hpkv: export failed: {exc}", file=sys.stderr)
        return 1
    pid = server_pid(cfg)
    pending = int(snap.get("storage", {}).get("spills_pending", 0)) if snap else 0
    note = (
        f"server {pid} runs: blocks only in its DRAM pool ({pending} spill(s) pending now) are not in the pack"
        if pid is not None
        else ""
    )
    if args.json:
        _print_json({**report.as_json(), "server_pid": pid, "note": note})
        return 0
    n = report.namespace
    print(
        f"hpkv: exported {report.blocks} block(s) ({report.files} file(s), {report.bytes} bytes) of namespace "
        f"{n.fingerprint} ({n.name or 'unnamed'}, world {n.world_size}, {n.shard_bytes} B/shard) to {report.path}"
    )
    skipped = report.skipped_incomplete + report.skipped_corrupt + report.skipped_other
    if skipped:
        print(
            f"hpkv: left out {report.skipped_incomplete} incomplete, {report.skipped_corrupt} corrupt and "
            f"{report.skipped_other} other block(s): " + "; ".join(report.problems),
            file=sys.stderr,
        )
    if note:
        print(f"hpkv: {note}", file=sys.stderr)
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from hpkv.engine.storage.pack import PackError, import_pack
    from hpkv.monitor.status import server_pid

    cfg = _load_config_or_exit()
    storage = cfg.storage_path
    if not storage and not args.dry_run:
        print(
            "hpkv: HPKV_KV_STORAGE_PATH is empty: the storage tier is off, nowhere to import", file=sys.stderr
        )
        return 1
    expect_ns = args.namespace.lower() if args.namespace else None
    expect_model = _model_of(args.expect_model, cfg)["identity"] if args.expect_model else None
    try:
        report = import_pack(
            args.pack,
            storage or "",
            expect_namespace=expect_ns,
            expect_model=expect_model,
            fsync=bool(cfg["HPKV_STORAGE_FSYNC"]),
            dry_run=args.dry_run,
        )
    except (PackError, OSError) as exc:
        if args.json:
            _print_json({"pack": args.pack, "ok": False, "error": str(exc)})
        print(f"hpkv: import refused, nothing written: {exc}", file=sys.stderr)
        return 1
    pid = server_pid(cfg)
    if args.json:
        _print_json({**report.as_json(), "ok": True, "server_pid": pid})
        return 0
    n = report.namespace
    if report.dry_run:
        print(
            f"hpkv: {report.pack} verified: {report.blocks} block(s) of namespace {n.fingerprint} "
            f"({n.name or 'unnamed'}, world {n.world_size}); nothing written (--dry-run)"
        )
        return 0
    print(
        f"hpkv: imported {report.blocks} block(s) of namespace {n.fingerprint} ({n.name or 'unnamed'}): "
        f"{report.files_written} file(s) written ({report.bytes_written} bytes), {report.files_present} "
        + (
            f"already there; journaled in {report.journal}"
            if report.journal
            else "already there; not journaled: the namespace holds files no journal lists, so a "
            "server's attach scans its tree (and finds these); a running server finds them by a lookup's stat"
        )
    )
    if pid is not None and report.journal:
        print(
            f"hpkv: server {pid} finds them within HPKV_STORAGE_JOURNAL_POLL "
            f"({cfg['HPKV_STORAGE_JOURNAL_POLL']:g} s) if it serves this namespace, else when an engine attaches it"
        )
    return 0


def _add_pack_verbs(verbs) -> None:
    p = verbs.add_parser("export", help="write a namespace's KV files into one checksummed pack file")
    p.add_argument(
        "--namespace", required=True, help="fingerprint, a unique prefix of it, or the name a server shows"
    )
    p.add_argument("out", metavar="OUT.pack", help="the pack to write (refused if it exists, unless --force)")
    p.add_argument(
        "--model", metavar="DIR", help="record this model's identity, for `hpkv import --expect-model`"
    )
    p.add_argument("--name", help="the namespace name to record when no running server names it")
    p.add_argument("--force", action="store_true", help="replace OUT.pack if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_export)

    p = verbs.add_parser("import", help="verify a pack, then write its blocks into the storage directory")
    p.add_argument("pack", metavar="PACK", help="a pack written by `hpkv export`")
    p.add_argument(
        "--namespace",
        help="refuse the pack unless it holds this namespace (its fingerprint, or 8+ leading digits)",
    )
    p.add_argument(
        "--expect-model", metavar="DIR", help="refuse the pack unless it records this model's identity"
    )
    p.add_argument("--dry-run", action="store_true", help="verify the whole pack, write nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_import)


if __name__ == "__main__":
    sys.exit(main())
