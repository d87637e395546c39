# The native core is compiled by cffi at install time (pip install . / pip install -e .);
# hpkv._ringcall, the rings' single-descriptor calls as a CPython type, beside it.
import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class build_ext_replacing(build_ext):
    """Unlink an in-place extension before writing the new one.

    Overwriting a loaded .so in place (same inode) crashes every process that
    runs it, e.g. an hpkv server while `pip install -e .` rebuilds.
    """

    def copy_file(self, infile, outfile, *args, **kwargs):
        if os.path.exists(outfile) and outfile.endswith(".so"):
            os.unlink(outfile)
        return super().copy_file(infile, outfile, *args, **kwargs)


ringcall = Extension(
    "hpkv._ringcall",
    sources=["native/python/ringcall.c"],
    include_dirs=["native"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall"]
    + (["-march=x86-64-v2"] if platform.machine() == "x86_64" else []),
)

setup(cffi_modules=["native/build_native.py:ffibuilder"], ext_modules=[ringcall],
      cmdclass={"build_ext": build_ext_replacing})
