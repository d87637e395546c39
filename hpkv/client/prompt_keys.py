"""A prompt's hpkv keys, as a vLLM engine makes them (``hpkv pin --text`` / ``--tokens``).

A vLLM engine's block of ``block_size`` tokens is named by its *block hash*: vLLM's
``hash_block_tokens`` chained from the first block (``NONE_HASH``) over the token ids, with the
engine's ``--prefix-caching-hash-algo`` (sha256 by default); hpkv's key of the block is that hash
keyed by the namespace's fingerprint (:func:`hpkv.protocol.keys.block_keys`). Only full blocks
have hashes. The hashes are computed here with vLLM's own functions (vLLM must be installed where
``hpkv pin`` runs), so they are the engine's exactly, for prompts without LoRA adapters,
multi-modal inputs or a ``cache_salt`` (those add extra keys to the hashes). A non-cryptographic
algorithm (xxhash) or an engine started with ``PYTHONHASHSEED`` derives ``NONE_HASH`` from that
seed: run ``hpkv pin`` with the engine's ``PYTHONHASHSEED``.

Text is tokenized as vLLM's completions endpoint tokenizes a prompt: the model directory's own
tokenizer (``transformers.AutoTokenizer``), special tokens added (``add_special_tokens=True``,
the endpoint's default: a BOS where the tokenizer adds one). A chat request's prompt is the chat
template's text, rendered without adding special tokens again: pin it with ``--tokens``.

Imported only by the CLI: it never runs inside an engine or the server.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hpkv.protocol.keys import block_keys

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


class PromptKeysError(ValueError):
    """A prompt cannot be turned into keys (no tokenizer, no vLLM, bad token ids)."""


def prompt_token_ids(model: str, text: str) -> list[int]:
    """``text`` tokenized by ``model``'s tokenizer as vLLM's completions endpoint does it.
    ``model``: a model directory, or a Hugging Face name already in the local cache."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise PromptKeysError(f"tokenizing a prompt needs transformers ({exc}); or pass --tokens") from None
    local = os.path.isdir(model)
    if not local and (os.path.exists(model) or model.startswith(("/", ".", "~"))):
        raise PromptKeysError(f"--model {model!r}: no such model directory")
    try:
        tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:  # by case, in transformers
        where = "the directory" if local else "the local Hugging Face cache (nothing is downloaded)"
        raise PromptKeysError(
            f"--model {model!r}: no tokenizer could be loaded from {where}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; pass --tokens instead"
        ) from None
    return list(tok(text, add_special_tokens=True)["input_ids"])


def parse_token_ids(text: str, where: str = "--tokens") -> list[int]:
    """``1,2,3`` or ``1 2 3`` (or a JSON list) → token ids; a bad one is named."""
    t = text.strip()
    if t.startswith("[") and t.endswith("]"):
        t = t[1:-1]
    out = []
    for i, part in enumerate(t.replace(",", " ").split()):
        if not part.isdigit():
            raise PromptKeysError(f"{where}: token {i + 1} {part[:32]!r} is not a token id (an integer >= 0)")
        out.append(int(part))
    if not out:
        raise PromptKeysError(f"{where}: no token ids in it")
    return out


def vllm_block_hashes(token_ids: Sequence[int], block_size: int, hash_algo: str = "sha256") -> list[bytes]:
    """vLLM's block hashes of the full blocks of ``token_ids`` (a prompt without extra keys)."""
    if block_size < 1:
        raise PromptKeysError(f"block size {block_size} must be >= 1")
    if hash_algo not in HASH_ALGOS:
        raise PromptKeysError(f"--hash-algo {hash_algo!r} is not one of {', '.join(HASH_ALGOS)}")
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as kvu
    except ImportError as exc:
        raise PromptKeysError(f"computing vLLM's block hashes needs vLLM installed here ({exc})") from None
    fn = get_hash_fn_by_name(hash_algo)
    kvu.init_none_hash(fn)  # NONE_HASH as the engine derives it (PYTHONHASHSEED, else the default)
    out: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = kvu.hash_block_tokens(fn, parent, token_ids[start : start + block_size], None)
        out.append(bytes(parent))
    return out


def prompt_keys(
    fingerprint: str, token_ids: Sequence[int], block_size: int, hash_algo: str = "sha256"
) -> list[bytes]:
    """hpkv's keys of the prompt's full blocks in the namespace ``fingerprint`` (group 0: a model
    with one KV cache group)."""
    return block_keys(fingerprint, vllm_block_hashes(token_ids, block_size, hash_algo))
