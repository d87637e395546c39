"""hpkv's vLLM plugin accepts CT-HPKV's ``--disable-log-requests``, which vLLM 0.32 no longer knows.

The parser rule is tested on plain argparse parsers (milliseconds); one test parses with vLLM's
own server parser, as ``python -m vllm.entrypoints.openai.api_server`` builds it (vLLM loads
the plugin while it builds it). ``tests/test_wheel.py`` runs the whole command line with
``vllm serve``.
"""

from __future__ import annotations

import argparse
import logging

import pytest

from hpkv.connectors.vllm.plugin import DISABLE_LOG_REQUESTS, add_disable_log_requests

ACCEPTED = "hpkv: --disable-log-requests (in CT-HPKV's command line) is accepted and changes nothing"


def vllm_like_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False)
    return p


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_disable_log_requests_is_vllms_default_with_one_warning() -> None:
    p = vllm_like_parser()
    add_disable_log_requests(p)
    add_disable_log_requests(p)  # idempotent
    rec = Recorder()
    logging.getLogger("vllm.hpkv").addHandler(rec)  # vLLM's own logging may not propagate
    try:
        ns = p.parse_args([DISABLE_LOG_REQUESTS])
    finally:
        logging.getLogger("vllm.hpkv").removeHandler(rec)
    assert vars(ns) == {"enable_log_requests": False}  # nothing added to vLLM's namespace
    assert [line for line in rec.lines if ACCEPTED in line] == rec.lines and len(rec.lines) == 1
    assert DISABLE_LOG_REQUESTS not in p.format_help()


def test_a_parser_with_its_own_disable_log_requests_keeps_it() -> None:
    p = vllm_like_parser()
    p.add_argument(DISABLE_LOG_REQUESTS, action="store_true")
    add_disable_log_requests(p)
    assert p.parse_args([DISABLE_LOG_REQUESTS]).disable_log_requests is True


def test_other_parsers_are_left_alone() -> None:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_disable_log_requests(p)
    assert DISABLE_LOG_REQUESTS not in p._option_string_actions


def test_vllms_server_parser_accepts_disable_log_requests() -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())  # loads vLLM's general plugins, hpkv's too
    args = parser.parse_args(["--model", "m", DISABLE_LOG_REQUESTS])
    assert args.enable_log_requests is False
    assert not hasattr(args, "disable_log_requests")
