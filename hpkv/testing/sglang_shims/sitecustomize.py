"""TEST-ONLY patches that let SGLang 0.5.23's HiCache run on a CPU-only machine.

Put on ``PYTHONPATH`` only by ``hpkv.testing.sglang_server`` (see README.md here). Each
patch is applied right after SGLang imports the module it patches, in every SGLang process:

(a) ``pool_host.common._cuda_host_register`` → no-op (no NVIDIA driver to page-lock with);
(b) ``MHATokenToKVPoolHost(pin_memory=False)`` (pinned CPU memory needs CUDA);
(c) ``pool_host.mha.transfer_kv_direct``: a torch version of the ``direct`` IO backend's
    copy (``layer_first`` layout), which SGLang binds only on CUDA/HIP/XPU.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_COMMON = "sglang.srt.mem_cache.pool_host.common"
_MHA = "sglang.srt.mem_cache.pool_host.mha"


def _patch_common(mod: Any) -> None:
    mod._cuda_host_register = lambda *a, **k: None


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1, **_: Any) -> None:
    for s, d in zip(src_layers, dst_layers):
        si = src_indices.to(s.device)
        di = dst_indices.to(d.device)
        d.index_copy_(0, di, s.index_select(0, si).to(d.dtype))


def _patch_mha(mod: Any) -> None:
    cls = mod.MHATokenToKVPoolHost
    init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    mod.transfer_kv_direct = _transfer_kv_direct


_PATCHES = {_COMMON: _patch_common, _MHA: _patch_mha}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Any):
        self.inner, self.patch = inner, patch

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _Finder())
