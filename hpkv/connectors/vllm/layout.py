"""The namespace both roles derive from vLLM's config, and the description of a KV cache
that the transfer worker copies from (CPU backend: one shared-memory allocation)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from hpkv.common.layout import pages_span
from hpkv.connectors.vllm.groups import FULL, GroupNeed, group_needs
from hpkv.protocol.keys import namespace_fingerprint
from hpkv.protocol.model_identity import ModelIdentityError, model_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class Layout:
    """What both roles derive from the engine config: the namespace and the shard size.

    ``num_layers``: the KV cache regions a block spans. vLLM's KV cache groups overlay the
    same regions (layer ``j`` of every group shares one) and draw their blocks from one pool,
    so a block id names one group's pages in every region: a copy needs no group.
    ``groups``: what a hit needs from each KV cache group (:mod:`.groups`), in vLLM's order."""

    fingerprint: str
    name: str
    world_size: int
    block_size: int
    num_layers: int
    page_bytes: int
    groups: tuple[GroupNeed, ...] = (FULL,)

    @property
    def shard_bytes(self) -> int:
        return self.num_layers * self.page_bytes


def _cpu_isa(vllm_config: VllmConfig) -> str:
    """The CPU attention kernel's page format tag (the bytes of a page depend on it)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        mc = vllm_config.model_config
        dtype = cast(torch.dtype, mc.dtype)  # a torch.dtype once vLLM resolved the model config
        return str(
            _get_attn_isa(
                dtype,
                vllm_config.cache_config.block_size,
                mc.get_head_size(),
                vllm_config.cache_config.cache_dtype,
            )
        )
    except Exception as exc:  # noqa: BLE001 - the tag only needs to be stable and distinct
        return f"unknown:{type(exc).__name__}"


def _page_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, device: str) -> str:
    """What the bytes of one pool page mean. The CPU backend keeps its historical tag (existing
    namespaces stay valid). On other devices the in-page order (NHC or HNC) of vLLM's resolved
    ``KVCacheLayout``: LBNHC and BLNHC pages are the same bytes, so a restart that changes only
    the block/layer nesting keeps its hits, while NHC and HNC never mix."""
    if device == "cpu":
        return "per-layer-blocks"
    from hpkv.connectors.vllm.cuda_layout import page_order_of

    name = getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
    return f"pages-{page_order_of(name)}"


def vllm_model_identity(vllm_config: VllmConfig, model_id: str | None = None) -> dict[str, Any]:
    """The model's entries of the namespace (:mod:`hpkv.protocol.model_identity`): ``model_id``
    (``HPKV_MODEL_ID``) if set, else the content of the directory (or hub snapshot) vLLM loaded,
    plus the engine options that change the weights as loaded."""
    mc = vllm_config.model_config
    try:
        ident = model_identity(
            str(mc.model),
            model_id=model_id,
            revision=mc.revision,
            commit=getattr(getattr(mc, "hf_config", None), "_commit_hash", None),
            cache_dir=getattr(getattr(vllm_config, "load_config", None), "download_dir", None),
        )
    except ModelIdentityError as exc:
        raise NotImplementedError(str(exc)) from None
    return {
        **ident,
        "quantization": str(getattr(mc, "quantization", None)),
        "hf_overrides": _overrides(getattr(mc, "hf_overrides", None)),
    }


def _overrides(value: Any) -> Any:
    """``--hf-overrides`` as the namespace records it: a dict as it is, a function by its name
    (its repr holds an address, different in every process)."""
    if value is None or isinstance(value, dict):
        return value or {}
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"


def derive_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, model_id: str | None = None
) -> Layout:
    """The namespace of this engine's KV; NotImplementedError for set-ups hpkv cannot serve.
    ``model_id`` (``HPKV_MODEL_ID``) names the model instead of its files' content."""
    import vllm

    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    mc = vllm_config.model_config
    if pc.pipeline_parallel_size != 1:
        raise NotImplementedError(
            "hpkv supports tensor parallelism; pipeline parallelism is not supported yet"
        )
    if kv_cache_config is None:
        raise NotImplementedError("this vLLM gives connectors no KV cache config (vLLM >= 0.30 needed)")
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise NotImplementedError("this model has no KV cache (attention-free): nothing for hpkv to keep")
    device = str(vllm_config.device_config.device_type)
    needs = group_needs(kv_cache_config, cc.block_size)
    if any(n.state for n in needs) and device != "cpu":
        raise NotImplementedError(
            f"hpkv keeps SSM/linear-attention state on the CPU backend only so far, not on {device}: "
            "vLLM serves the model without hpkv (remove --kv-transfer-config to silence this)"
        )
    if len(groups) > 1 and device != "cpu":
        raise NotImplementedError(
            f"hpkv serves models with {len(groups)} KV cache groups (hybrid attention) on the CPU "
            f"backend only so far, not on {device}"
        )
    unit = getattr(cc, "prefix_match_unit", None)
    if len(groups) > 1 and unit not in (None, cc.block_size):
        # request.block_hashes then come every `unit` tokens, not one per block
        raise NotImplementedError(f"--prefix-match-unit {unit} differs from the block size {cc.block_size}")
    pages = {int(g.kv_cache_spec.page_size_bytes) for g in groups}
    if len(pages) != 1:
        raise NotImplementedError(f"KV cache groups with different page sizes {sorted(pages)}")
    page_bytes = pages.pop()
    num_layers = max(len(g.layer_names) for g in groups)  # groups overlay the same regions
    spec_dict = {
        **vllm_model_identity(vllm_config, model_id),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": cc.block_size,
        "layers": num_layers,
        "page_bytes": page_bytes,
        "tp": pc.tensor_parallel_size,
        "pp": pc.pipeline_parallel_size,
        "layout": _page_format(vllm_config, kv_cache_config, device),
        "device": device,
        "isa": _cpu_isa(vllm_config) if device == "cpu" else "",
        "engine": "vllm",
        "engine_version": vllm.__version__,
        "torch": torch.__version__.split("+")[0],
        "hash_algo": str(cc.prefix_caching_hash_algo),
    }
    if needs != (FULL,):  # a single full-attention group keeps the namespace it always had
        spec_dict["groups"] = [n.tag for n in needs]
    name = f"{os.path.basename(str(mc.model).rstrip('/'))} tp{pc.tensor_parallel_size} bs{cc.block_size}"
    return Layout(
        namespace_fingerprint(spec_dict),
        name,
        pc.tensor_parallel_size,
        cc.block_size,
        num_layers,
        page_bytes,
        needs,
    )


def describe_kv(
    layout: Layout, kv_caches: dict[str, torch.Tensor], path: str, base: int, size: int
) -> dict[str, Any]:
    """The ``register_device`` arguments for KV cache tensors that lie in the shared-memory
    allocation ``path`` (``size`` bytes mapped at address ``base``); ValueError if the layout
    is not one hpkv copies (each block of a layer one contiguous page, one stride for all)."""
    seen: dict[int, torch.Tensor] = {}
    for t in kv_caches.values():
        seen.setdefault(t.data_ptr(), t)
    layers = sorted(seen.values(), key=lambda t: t.data_ptr())
    if len(layers) != layout.num_layers:
        raise ValueError(f"{len(layers)} KV cache tensors, the namespace expects {layout.num_layers}")
    bases, strides, block_counts = [], set(), set()
    for t in layers:
        elem = t.element_size()
        per_kernel_block = t[0].numel() * elem
        k = layout.page_bytes // per_kernel_block  # kernel blocks per vLLM block
        if (
            t.stride(0) * elem == layout.page_bytes
            and per_kernel_block < layout.page_bytes
            and t[0].is_contiguous()
        ):
            # A padded page: an SSM/linear-attention layer's state (vLLM's int8 view of its
            # conv + SSM state, padded to the attention page so that the groups share blocks).
            # The copy takes the whole page, padding included.
            k = 1
        elif (
            k * per_kernel_block != layout.page_bytes
            or t.stride(0) * elem != per_kernel_block
            or not t[0].is_contiguous()
        ):
            raise ValueError(
                f"unsupported KV cache tensor layout: shape {tuple(t.shape)}, strides "
                f"{t.stride()}, page {layout.page_bytes} bytes"
            )
        bases.append((0, t.data_ptr() - base))
        strides.add(k * t.stride(0) * elem)  # per_kernel_block, or a padded page
        block_counts.add(t.shape[0] // k)
    if len(strides) != 1:
        raise ValueError(f"KV cache layers have different block strides {sorted(strides)}")
    if len(block_counts) != 1:
        raise ValueError(f"KV cache layers have different block counts {sorted(block_counts)}")
    stride, num_blocks = strides.pop(), block_counts.pop()
    _check_pages_in_bounds([off for _, off in bases], layers, size, num_blocks, stride, layout.page_bytes)
    return dict(
        regions=[{"path": path, "size": size}],
        layer_bases=bases,
        block_stride=stride,
        page_bytes=layout.page_bytes,
        num_blocks=num_blocks,
    )


def _check_pages_in_bounds(
    offsets: list[int], layers: list[torch.Tensor], size: int, num_blocks: int, stride: int, page: int
) -> None:
    """Every page a copy takes, whole (a padded state page's padding past its tensor's last
    element included), lies in the ``size``-byte allocation and before the next layer's first
    page; ValueError naming the sizes otherwise (the server would refuse only the first kind, and
    the second would copy another layer's bytes)."""
    span = pages_span(num_blocks, stride, page)
    ends = [*offsets[1:], size]
    for off, end, t in zip(offsets, ends, layers, strict=True):
        if off < 0 or off + span > end:
            what = "the shared-memory allocation's end" if end == size else "the next layer's first page"
            raise ValueError(
                f"KV cache tensor of shape {tuple(t.shape)} at byte {off}: its {num_blocks} pages of "
                f"{page} bytes (stride {stride}) end at byte {off + span}, past {what} at byte {end} "
                f"({size}-byte allocation)"
            )
