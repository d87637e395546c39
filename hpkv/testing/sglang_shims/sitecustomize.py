"""TEST-ONLY patches that let SGLang 0.5.23's HiCache run on a CPU-only machine.

Put on ``PYTHONPATH`` only by ``hpkv.testing.sglang_server`` (see README.md here). Each
patch is applied right after SGLang imports the module it patches, in every SGLang process:

(a) ``pool_host.common._cuda_host_register`` → no-op (no NVIDIA driver to page-lock with);
(b) ``MHATokenToKVPoolHost(pin_memory=False)`` (pinned CPU memory needs CUDA);
(c) ``pool_host.mha.transfer_kv_direct``: a torch version of the ``direct`` IO backend's
    copy (``layer_first`` layout), which SGLang binds only on CUDA/HIP/XPU;
(d) ``TorchNativeAttnBackend`` attends with attention sinks (GPT-OSS passes ``sinks=``, which
    it does not accept) and reads a sliding-window layer of a hybrid SWA pool at the SWA
    pool's own indices (it indexes that pool with full-pool indices): SGLang runs GPT-OSS
    only with its CUDA/AMX backends, and the CPU has neither.
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


def _attend(self: Any, q: Any, layer: Any, batch: Any, sinks: Any, decode: bool) -> Any:
    """Causal (and sliding-window) attention of ``q`` over the request's cached KV, one request
    at a time in float32, with a per-head sink logit in the softmax when ``sinks`` is given."""
    import torch

    pool = self.token_to_kv_pool
    lid = layer.layer_id
    k_cache, v_cache = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
    swa = self.use_sliding_window_kv_pool and pool.layers_mapping[lid][1]
    window = layer.sliding_window_size
    window = window if window is not None and window > -1 else None
    heads, dim, vdim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    q = q.reshape(-1, heads, dim)
    out = q.new_empty((q.shape[0], heads, vdim))
    seq_lens = [int(x) for x in batch.seq_lens.tolist()]
    q_lens = [1] * len(seq_lens) if decode else [int(x) for x in batch.extend_seq_lens.tolist()]
    start = 0
    for i, (kv_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        idx = self.req_to_token_pool.req_to_token[batch.req_pool_indices[i], :kv_len].long()
        if swa:
            idx = pool.translate_loc_from_full_to_swa(idx).long()
        k, v = k_cache[idx].float(), v_cache[idx].float()
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        qi = q[start : start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * layer.scaling
        qpos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
        kpos = torch.arange(kv_len).unsqueeze(0)
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos >= qpos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(heads, 1, 1).expand(heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        start += q_len
    return out.reshape(-1, heads * vdim)


def _patch_torch_native(mod: Any) -> None:
    cls = mod.TorchNativeAttnBackend

    def wrap(name: str, decode: bool) -> None:
        original = getattr(cls, name)

        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kw):
            if sinks is None and not self.use_sliding_window_kv_pool:
                return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kw)
            if save_kv_cache and k is not None and v is not None:
                loc = mod.KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
            return _attend(self, q, layer, forward_batch, sinks, decode)

        setattr(cls, name, forward)

    wrap("forward_extend", False)
    wrap("forward_decode", True)


_PATCHES = {
    _COMMON: _patch_common,
    _MHA: _patch_mha,
    "sglang.srt.layers.attention.torch_native_backend": _patch_torch_native,
}


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
