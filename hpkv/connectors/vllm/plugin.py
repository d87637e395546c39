"""vLLM plugin (entry point ``vllm.general_plugins``): CT-HPKV's vLLM command line as published.

* registers ``HpkvConnectorV1`` by name, so
  ``--kv-transfer-config '{"kv_connector":"HpkvConnectorV1","kv_role":"kv_both"}'`` works
  without a module path;
* accepts ``--disable-log-requests``, which both of CT-HPKV's command lines pass and vLLM 0.32
  no longer knows (it replaced the flag with ``--enable-log-requests``, off by default): the
  flag is read as what it asks for, vLLM's default now, with one warning saying so.

vLLM loads general plugins in its front-end process from ``AsyncEngineArgs.add_cli_args``,
i.e. while it builds the server's argument parser and before it parses the command line
(``vllm serve`` and ``python -m vllm.entrypoints.openai.api_server`` alike), but gives
plugins no handle on that parser. So the flag is added where the parse starts: vLLM's
``FlexibleArgumentParser.parse_known_args`` adds it to a parser that has vLLM's
``--enable-log-requests`` and no ``--disable-log-requests`` of its own (a vLLM that knows the
flag again keeps its own), hidden from ``--help`` and leaving the parsed namespace untouched.

vLLM may load plugins several times per process, so everything here is idempotent.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("vllm.hpkv")

CONNECTOR_NAME = "HpkvConnectorV1"
DISABLE_LOG_REQUESTS = "--disable-log-requests"
_ENABLE_LOG_REQUESTS = "--enable-log-requests"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "hpkv.connectors.vllm.connector", CONNECTOR_NAME
        )
    accept_disable_log_requests()


class _VllmDefaultNow(argparse.Action):
    """``--disable-log-requests``: asks for what vLLM does by default now; sets nothing."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        # A warning, as vLLM's own parser says "argument ... is deprecated": vLLM configures its
        # logging only after the parse, so an INFO line here would not be shown.
        log.warning(
            "hpkv: %s (in CT-HPKV's command line) is accepted and changes nothing: vLLM does not "
            "log requests by default now (it replaced the flag with %s)",
            DISABLE_LOG_REQUESTS,
            _ENABLE_LOG_REQUESTS,
        )


def add_disable_log_requests(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the ``--disable-log-requests`` of older vLLMs if it is a vLLM server's
    parser (it has ``--enable-log-requests``) and lacks the flag."""
    known = parser._option_string_actions
    if _ENABLE_LOG_REQUESTS in known and DISABLE_LOG_REQUESTS not in known:
        parser.add_argument(DISABLE_LOG_REQUESTS, action=_VllmDefaultNow)


def accept_disable_log_requests() -> None:
    """Make vLLM's argument parsers accept ``--disable-log-requests`` (see the module's docstring)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if getattr(FlexibleArgumentParser, "_hpkv_accepts_disable_log_requests", False):
        return
    original: Callable[..., Any] = FlexibleArgumentParser.parse_known_args

    def parse_known_args(self: FlexibleArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        add_disable_log_requests(self)
        return original(self, args, namespace)

    FlexibleArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    FlexibleArgumentParser._hpkv_accepts_disable_log_requests = True  # type: ignore[attr-defined]
