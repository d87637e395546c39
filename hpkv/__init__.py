"""hpkv: tiered KV-cache offload engine for vLLM and SGLang.

Importing the package starts nothing (no threads, no mmap, no sockets): the
connector modules are imported by inference-engine processes that must stay cheap.
"""

__version__ = "0.1.0"
