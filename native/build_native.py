"""cffi builder for hpkv's native core (module ``hpkv._native``).

Every ``native/*.c`` is compiled into one extension. The declarations Python may
call are the ``native/*.cdef`` files (plain C declarations, one file per C
module), so each module's interface is written once, beside its C source.
"""
from __future__ import annotations

import glob
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

ffibuilder = FFI()
for cdef_path in sorted(glob.glob(os.path.join(HERE, "*.cdef"))):
    with open(cdef_path) as f:
        ffibuilder.cdef(f.read())

headers = sorted(os.path.basename(p) for p in glob.glob(os.path.join(HERE, "*.h")))
sources = sorted(glob.glob(os.path.join(HERE, "*.c")))

ffibuilder.set_source(
    "hpkv._native",
    "\n".join(f'#include "{h}"' for h in headers),
    sources=sources,
    include_dirs=[HERE],
    extra_compile_args=["-O3", "-std=gnu11", "-march=x86-64-v2", "-Wall", "-Wno-unused-function"]
    if os.uname().machine == "x86_64"
    else ["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
    libraries=["pthread", "dl"],
)

if __name__ == "__main__":
    raise SystemExit("build the native core with `pip install -e .` (or `bash scripts/setup.sh`): "
                     "it writes hpkv/_native.abi3.so without overwriting a loaded module in place")
