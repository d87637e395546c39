"""Test and benchmark helpers: a deterministic tiny model and a managed vLLM server.

* :func:`generate_model` (``hpkv.testing.model``): writes a seeded Qwen2 model
  with random weights and a one-token-per-letter tokenizer, no network needed.
* :class:`VllmServer` (``hpkv.testing.vllm_server``): starts a real vLLM OpenAI
  server on a loopback port and stops it with all its child processes.

Exports resolve lazily, so importing ``hpkv.testing.model`` needs neither
``requests`` nor ``psutil``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["generate_model", "VllmServer", "VllmServerError"]


def __getattr__(name: str) -> Any:
    if name == "generate_model":
        from hpkv.testing.model import generate_model

        return generate_model
    if name in ("VllmServer", "VllmServerError"):
        from hpkv.testing import vllm_server

        return getattr(vllm_server, name)
    raise AttributeError(f"module 'hpkv.testing' has no attribute {name!r}")
