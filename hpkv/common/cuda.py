"""What every room may ask of the CUDA driver loaded by native/cuda_copy.c: whether it is usable,
and the error type naming a failed call. Importing this loads nothing; the driver is opened
(dlopen) at the first call."""

from __future__ import annotations

from hpkv.common.native import ffi, lib


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``code`` is the CUresult."""

    def __init__(self, what: str, code: int):
        name = ffi.string(lib.hpkv_cuda_error_name(code)).decode()
        super().__init__(f"{what} failed: {name} ({code})")
        self.code = code


class CudaUnavailable(RuntimeError):
    """No usable CUDA driver on this machine (the message says why)."""


def cuda_unavailable_reason() -> str:
    """'' when libcuda loads and cuInit succeeds, else why not (e.g. 'no libcuda ...')."""
    return str(ffi.string(lib.hpkv_cuda_available()).decode())
