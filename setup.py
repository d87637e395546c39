# The native core is compiled by cffi at install time (pip install . / pip install -e .).
from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
