# The native core is compiled by cffi at install time (pip install . / pip install -e .).
import os

from setuptools import setup
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


setup(cffi_modules=["native/build_native.py:ffibuilder"], cmdclass={"build_ext": build_ext_replacing})
