"""TEST-ONLY stub of ``sgl_kernel`` (no CPU build on PyPI): ``from sgl_kernel import f`` succeeds,
calling ``f`` raises; submodules are absent, so SGLang's own ``ImportError`` fallbacks apply.

See ``hpkv/testing/sglang_shims/README.md``. Never installed; put on ``PYTHONPATH`` by
``hpkv.testing.sglang_server`` only.
"""
from __future__ import annotations

import sys
import types
from typing import Any

__version__ = "0.0.0+hpkv-test-stub"


def _missing(name: str):
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} is a test stub (hpkv/testing/sglang_shims): "
                                  f"this SGLang code path needs the real CPU/CUDA kernels")
    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(f"{self.__name__}.{name}")


sys.modules[__name__].__class__ = _StubModule
