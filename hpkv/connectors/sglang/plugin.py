"""``--enable-ct-hpkv`` for SGLang's own command line (CT-HPKV's flag), through SGLang's plugins.

SGLang 0.5.23 loads every ``sglang.srt.plugins`` entry point (hpkv's pyproject declares
``hpkv = "hpkv.connectors.sglang.plugin:register"``) in each of its processes before it
parses arguments (``python -m sglang.launch_server`` and ``sglang serve`` alike), and
applies the hooks they register. hpkv registers four for its command line:

* ``prepare_server_args`` reads CT-HPKV's published order, the flag between ``--model-path``
  and its value (``sglang serve --model-path --enable-ct-hpkv /path/to/model …``), as
  ``--model-path /path/to/model --enable-ct-hpkv`` (argparse would take the flag for
  ``--model-path``'s missing value); see :func:`published_order`. ``sglang serve`` looks at
  the model path before it loads plugins, to choose between its LLM and diffusion servers,
  so ``ServeBackendRegistry.auto_detect`` gets the same reading;
* ``ServerArgs.add_cli_args`` gains ``--enable-ct-hpkv``;
* ``ServerArgs.from_cli_args`` turns the flag into HiCache's arguments:
  ``--enable-hierarchical-cache``, ``--hicache-storage-backend dynamic`` and an extra config
  naming :class:`~hpkv.connectors.sglang.storage.HpkvHiCacheStorage` (merged into any extra
  config the user gave; the user's keys win), with ``prefetch_threshold`` =
  ``VLLM_HPKV_TOKEN_THRESHOLD`` unless the user set one.

and three on SGLang's radix cache (``UnifiedRadixCache``) for KV events (``--kv-events-config``):
``write_backup_storage`` (the pages a node backs up to hpkv, remembered), ``take_events``
(hpkv's tier changes of those pages published with SGLang's own events) and ``reset``
(announced again after SGLang's ``AllBlocksCleared``); see :mod:`hpkv.connectors.sglang.events`.

``SGLANG_PLUGINS`` (a comma-separated allow-list) must name ``hpkv`` if it is set. Nothing
here imports SGLang at module level: SGLang's hook registry does the patching.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from hpkv.connectors.sglang import BACKEND_EXTRA_CONFIG

log = logging.getLogger("sglang.hpkv")

FLAG = "--enable-ct-hpkv"
_MODULE = "sglang.srt.server_args"
_TARGET = f"{_MODULE}.ServerArgs"
_MODEL_PATH = ("--model-path", "--model")
_RADIX = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the four hooks (cheap, idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_MODULE}.prepare_server_args", _prepare_server_args, HookType.AROUND)
    HookRegistry.register(
        "sglang.cli.serve_backends.ServeBackendRegistry.auto_detect", _auto_detect, HookType.AROUND
    )
    HookRegistry.register(f"{_TARGET}.add_cli_args", _add_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_TARGET}.from_cli_args", _from_cli_args, HookType.AROUND)
    # KV events of hpkv's tiers (--kv-events-config): hpkv.connectors.sglang.events
    HookRegistry.register(f"{_RADIX}.write_backup_storage", _write_backup_storage, HookType.AROUND)
    HookRegistry.register(f"{_RADIX}.take_events", _take_events, HookType.AROUND)
    HookRegistry.register(f"{_RADIX}.reset", _reset, HookType.AROUND)


def published_order(argv: list[str]) -> list[str]:
    """``argv`` with CT-HPKV's ``--model-path --enable-ct-hpkv MODEL`` read as
    ``--model-path MODEL --enable-ct-hpkv`` (also after ``--model``); anything else unchanged.

    Only that exact shape is rewritten: the flag right after ``--model-path``, followed by a
    value that is not an option."""
    out = list(argv)
    for i in range(len(out) - 2):
        if out[i] in _MODEL_PATH and out[i + 1] == FLAG and not out[i + 2].startswith("-"):
            out[i + 1], out[i + 2] = out[i + 2], FLAG
            break
    return out


def _prepare_server_args(original: Callable[..., Any], argv: list[str], *a: Any, **k: Any) -> Any:
    ordered = published_order(argv)
    out = original(ordered, *a, **k)
    if ordered != list(argv):  # logged after the parse: SGLang sets up its logging there
        log.info("hpkv: read CT-HPKV's '--model-path %s MODEL' as '--model-path MODEL %s'", FLAG, FLAG)
    return out


def _auto_detect(original: Callable[..., Any], registry: Any, request: Any, *a: Any, **k: Any) -> Any:
    if request.model_path == FLAG:  # `sglang serve --model-path --enable-ct-hpkv MODEL`
        from sglang.cli.utils import try_get_model_path

        argv = published_order(list(request.argv))
        request = dataclasses.replace(request, argv=tuple(argv), model_path=try_get_model_path(argv))
    return original(registry, request, *a, **k)


def _add_cli_args(original: Callable[..., Any], parser: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
    out = original(parser, *a, **k)
    if not any(FLAG in act.option_strings for act in parser._actions):
        parser.add_argument(
            FLAG,
            action="store_true",
            default=False,
            help="hpkv (CT-HPKV) as HiCache's storage tier: turns on the hierarchical "
            "cache with hpkv's storage backend (hpkv's DRAM pool, then its KV files)",
        )
    return out


def _from_cli_args(
    original: Callable[..., Any], cls: Any, args: argparse.Namespace, *a: Any, **k: Any
) -> Any:
    if getattr(args, "enable_ct_hpkv", False):
        apply_ct_hpkv(args)
    return original(cls, args, *a, **k)


def _load_extra_config(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    if text.startswith("@"):
        path = text[1:]
        if not path.endswith(".json"):
            raise ValueError(
                f"{FLAG}: --hicache-storage-backend-extra-config {text!r}: hpkv can merge its "
                f"settings only into a JSON string or @file.json; put them in that file "
                f"yourself (see hpkv's docs/sglang.md) or pass JSON"
            )
        with open(path, encoding="utf-8") as f:
            text = f.read()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{FLAG}: --hicache-storage-backend-extra-config is not valid JSON ({exc}): {text[:200]!r}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{FLAG}: --hicache-storage-backend-extra-config must be a JSON object, not "
            f"{type(value).__name__}"
        )
    return value


def hicache_settings(
    storage_backend: str | None, extra_config: str | None, token_threshold: int | None
) -> tuple[str, str]:
    """(``--hicache-storage-backend``, ``--hicache-storage-backend-extra-config``) for hpkv;
    ``token_threshold`` None (``auto``) leaves SGLang's own prefetch threshold."""
    if storage_backend not in (None, "", "dynamic"):
        raise ValueError(
            f"{FLAG} uses hpkv as HiCache's storage backend, but --hicache-storage-backend "
            f"is {storage_backend!r}: drop one of the two"
        )
    user = _load_extra_config(extra_config)
    merged: dict[str, Any] = {**BACKEND_EXTRA_CONFIG, **user}
    if merged.get("module_path") != BACKEND_EXTRA_CONFIG["module_path"] and "module_path" in user:
        log.warning(
            "hpkv: %s with a storage extra config naming module %r: that backend is used",
            FLAG,
            merged.get("module_path"),
        )
    if token_threshold is not None:
        merged.setdefault("prefetch_threshold", token_threshold)
    return "dynamic", json.dumps(merged, sort_keys=True)


def apply_ct_hpkv(args: argparse.Namespace) -> None:
    """Rewrite parsed SGLang arguments so ``--enable-ct-hpkv`` means hpkv as HiCache's L3."""
    from hpkv.config import load_config

    threshold: int | None = load_config()["VLLM_HPKV_TOKEN_THRESHOLD"]
    backend, extra = hicache_settings(
        getattr(args, "hicache_storage_backend", None),
        getattr(args, "hicache_storage_backend_extra_config", None),
        threshold,
    )
    args.enable_hierarchical_cache = True
    args.hicache_storage_backend = backend
    args.hicache_storage_backend_extra_config = extra
    log.info(
        "hpkv: %s: --enable-hierarchical-cache --hicache-storage-backend %s "
        "--hicache-storage-backend-extra-config '%s'",
        FLAG,
        backend,
        extra,
    )


# ---------------------------------------------------------------------------- KV events
def _hpkv_backend(cache: Any) -> Any:
    """hpkv's storage backend of SGLang's radix ``cache``; None when another (or none) serves it."""
    backend = getattr(getattr(cache, "cache_controller", None), "storage_backend", None)
    return backend if hasattr(backend, "hpkv_events") else None


def _write_backup_storage(
    original: Callable[..., Any], cache: Any, node_id: Any, *args: Any, **kw: Any
) -> Any:
    out = original(cache, node_id, *args, **kw)
    if (backend := _hpkv_backend(cache)) is not None:
        backend.hpkv_events_remember(cache, node_id)
    return out


def _take_events(original: Callable[..., Any], cache: Any, *args: Any, **kw: Any) -> Any:
    events = original(cache, *args, **kw)
    if (backend := _hpkv_backend(cache)) is not None:
        events = list(events) + backend.hpkv_events_take(cache)
    return events


def _reset(original: Callable[..., Any], cache: Any, *args: Any, **kw: Any) -> Any:
    out = original(cache, *args, **kw)
    if (backend := _hpkv_backend(cache)) is not None:
        backend.hpkv_events_reset(cache)
    return out
