"""Loads the compiled native core (``hpkv._native``, and ``hpkv._ringcall``, the
rings' single-descriptor calls) with an actionable error."""

from __future__ import annotations

EXPECTED_ABI = 2

try:
    import hpkv._ringcall as ringcall
    from hpkv._native import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "hpkv's native core (hpkv._native, hpkv._ringcall) is not built or cannot be loaded "
        f"({exc}). Build it with `pip install -e .` from the source tree "
        "(or `bash scripts/setup.sh`, which also does the rest of the set-up); "
        "it needs gcc and the Python headers."
    ) from exc

if lib.hpkv_native_abi() != EXPECTED_ABI:  # pragma: no cover
    raise ImportError(
        f"hpkv._native has ABI {lib.hpkv_native_abi()}, this Python code expects "
        f"{EXPECTED_ABI}: the compiled core is stale; rebuild with `pip install -e .`."
    )

__all__ = ["ffi", "lib", "ringcall"]
