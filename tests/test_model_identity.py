"""The model's identity in the namespace: its content, not its path (hpkv.protocol.model_identity)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpkv.config import ConfigError, load_config
from hpkv.protocol import model_identity as mi
from hpkv.protocol.keys import namespace_fingerprint
from hpkv.protocol.model_identity import ModelIdentityError, content_digest, model_identity

TENSORS = {"embed": 3000, "q_proj": 20000, "norm": 64, "mlp": 40000}  # name -> bytes


def write_safetensors(path: Path, seed: int) -> dict[str, tuple[int, int]]:
    """A safetensors file of :data:`TENSORS` whose bytes depend on ``seed``; its data offsets."""
    offsets, at = {}, 0
    for name, n in TENSORS.items():
        offsets[name] = (at, at + n)
        at += n
    header = {k: {"dtype": "U8", "shape": [e - b], "data_offsets": [b, e]} for k, (b, e) in offsets.items()}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data = bytes((i * 7 + seed) % 251 for i in range(at))
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return {k: (8 + len(raw) + b, 8 + len(raw) + e) for k, (b, e) in offsets.items()}


@pytest.fixture(autouse=True)
def fresh_cache():
    mi._cache.clear()
    yield
    mi._cache.clear()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "a" / "tiny"
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2}')
    (d / "generation_config.json").write_text('{"eos_token_id": 2}')
    (d / "tokenizer.json").write_text('{"model": {"vocab": {"A": 0}}}')
    write_safetensors(d / "model.safetensors", seed=0)
    return d


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def ident(path: Path) -> dict:
    mi._cache.clear()
    return model_identity(str(path))


def test_the_same_model_at_another_path_has_the_same_identity(model, tmp_path):
    copy = tmp_path / "b" / "elsewhere"
    shutil.copytree(model, copy, copy_function=shutil.copy)  # new mtimes, new inodes
    assert ident(copy) == ident(model)
    assert set(ident(model)) == {"model_content"}
    assert str(model) not in json.dumps(ident(model))


def test_touching_the_files_changes_nothing(model):
    before = ident(model)
    for p in model.iterdir():
        os.utime(p, (1e9, 1e9))
    assert ident(model) == before


def test_a_weight_byte_changed_inside_a_sampled_chunk_is_another_identity(model):
    before = ident(model)
    q_begin, _ = write_safetensors(model / "model.safetensors", seed=0)["q_proj"]
    flip_byte(model / "model.safetensors", q_begin + 100)
    assert ident(model) != before


def test_a_fine_tune_with_the_same_header_and_sizes_is_another_identity(model):
    before = ident(model)
    size = (model / "model.safetensors").stat().st_size
    write_safetensors(model / "model.safetensors", seed=1)  # same tensors, other bytes
    assert (model / "model.safetensors").stat().st_size == size
    assert ident(model) != before


def test_a_byte_changed_between_the_samples_goes_unseen(model):
    """The residual risk that HPKV_MODEL_ID covers: the middle of a large tensor is not read."""
    before = ident(model)
    begin, end = write_safetensors(model / "model.safetensors", seed=0)["mlp"]
    assert end - begin > 2 * mi.TENSOR_SAMPLE + 2
    flip_byte(model / "model.safetensors", (begin + end) // 2)
    assert ident(model) == before


def test_a_different_config_is_another_identity(model):
    before = ident(model)
    (model / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 3}')
    assert ident(model) != before


def test_a_changed_tokenizer_is_another_identity(model):
    before = ident(model)
    (model / "tokenizer.json").write_text('{"model": {"vocab": {"B": 0}}}')
    assert ident(model) != before


def test_files_that_do_not_make_the_kv_are_left_out(model):
    before = ident(model)
    (model / "README.md").write_text("# tiny")
    (model / ".gitattributes").write_text("*.safetensors filter=lfs")
    (model / "original").mkdir()
    (model / "original" / "consolidated.pth").write_bytes(b"x" * 100)
    (model / "pytorch_model.bin").write_bytes(b"other format")
    (model / "pytorch_model.bin.index.json").write_text("{}")
    assert ident(model) == before


def test_bin_weights_are_sampled_when_there_are_no_safetensors(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text("{}")
    data = bytearray(os.urandom(4 << 20))
    (d / "pytorch_model.bin").write_bytes(data)
    before = ident(d)
    data[len(data) - 10] ^= 0xFF  # in the last MiB
    (d / "pytorch_model.bin").write_bytes(data)
    assert ident(d) != before


def test_a_single_weight_file_is_identified_by_its_content_not_its_name(tmp_path):
    a, b = tmp_path / "model-a.gguf", tmp_path / "copy.gguf"
    a.write_bytes(os.urandom(100_000))
    shutil.copy(a, b)
    assert ident(a) == ident(b)


def test_hpkv_model_id_replaces_the_derived_identity(model):
    assert model_identity(str(model), model_id="qwen2.5-7b-ft@3") == {"model_id": "qwen2.5-7b-ft@3"}
    cfg = load_config(env={"HOME": "/nonexistent-home", "HPKV_MODEL_ID": "  qwen2.5-7b-ft@3 "})
    assert cfg["HPKV_MODEL_ID"] == "qwen2.5-7b-ft@3"
    assert load_config(env={"HOME": "/nonexistent-home"})["HPKV_MODEL_ID"] is None
    # the rest of the namespace still applies
    same = {"model_id": "m", "dtype": "bfloat16"}
    assert namespace_fingerprint(same) != namespace_fingerprint({**same, "dtype": "float16"})


@pytest.mark.parametrize(
    "value,reason", [("bad\nid", "unprintable character '\\n'"), ("x" * 257, "257 characters, more than 256")]
)
def test_a_bad_hpkv_model_id_is_refused_naming_the_value(value, reason):
    with pytest.raises(ConfigError) as err:
        load_config(env={"HOME": "/nonexistent-home", "HPKV_MODEL_ID": value})
    msg = str(err.value)
    assert "HPKV_MODEL_ID" in msg and repr(value) in msg and reason in msg and "printable text" in msg


def test_a_hub_name_without_a_local_snapshot_is_its_name_and_revision(tmp_path):
    hub = model_identity("Org/Tiny", revision="main", commit="a" * 40, cache_dir=str(tmp_path))
    assert hub == {"model": "Org/Tiny", "revision": "a" * 40}
    assert model_identity("Org/Tiny", revision="v1", cache_dir=str(tmp_path)) == {
        "model": "Org/Tiny",
        "revision": "v1",
    }


def test_a_hub_name_with_a_cached_snapshot_is_its_content(model, tmp_path):
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hf"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--Org--Tiny"
    shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert model_identity("Org/Tiny", cache_dir=str(cache)) == ident(model)
    assert model_identity("Org/Tiny", commit=commit, cache_dir=str(cache)) == ident(model)


def test_a_missing_file_is_part_of_the_identity_not_an_error(model):
    before = ident(model)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(model / "gone.json")  # a dangling link
    missing = ident(model)
    assert missing != before and missing == ident(model)


def test_an_unreadable_weight_file_is_part_of_the_identity_not_an_error(model, monkeypatch):
    before = ident(model)
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if str(path).endswith(".safetensors"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    assert ident(model) != before


def test_an_unlistable_model_directory_says_to_set_hpkv_model_id(model, monkeypatch):
    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "listdir", refuse)
    with pytest.raises(ModelIdentityError, match="cannot list the model directory.*HPKV_MODEL_ID"):
        model_identity(str(model))


def test_the_digest_is_computed_once_per_process_until_a_file_changes(model, monkeypatch):
    calls = []
    real = mi._weight_sample_digest
    monkeypatch.setattr(mi, "_weight_sample_digest", lambda *a: calls.append(a) or real(*a))
    first = content_digest(str(model))
    assert content_digest(str(model)) == first and len(calls) == 1
    os.utime(model / "model.safetensors", (1e9, 1e9))
    assert content_digest(str(model)) == first and len(calls) == 2


def test_vllm_names_the_model_by_its_content_and_its_load_options(model, tmp_path):
    from hpkv.connectors.vllm.layout import vllm_model_identity

    def vllm_config(path: Path, quantization=None) -> SimpleNamespace:
        mc = SimpleNamespace(
            model=str(path), revision=None, quantization=quantization, hf_overrides={}, hf_config=None
        )
        return SimpleNamespace(model_config=mc, load_config=SimpleNamespace(download_dir=None))

    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    ours = vllm_model_identity(vllm_config(model))
    assert ours == vllm_model_identity(vllm_config(copy))
    assert ours["model_content"] == ident(model)["model_content"]
    assert vllm_model_identity(vllm_config(model, "fp8")) != ours
    assert vllm_model_identity(vllm_config(model), "my-model") == {
        "model_id": "my-model",
        "quantization": "None",
        "hf_overrides": {},
    }


def test_sglang_names_the_model_by_its_content_behind_its_served_name(model, tmp_path):
    pytest.importorskip("sglang")
    from hpkv.connectors.sglang.storage import model_spec

    pool = SimpleNamespace(storage_format_tag="nhd")
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    ours = model_spec(f"{model}-nhd", pool)
    assert ours == model_spec(f"{copy}-nhd", pool) == {**ident(model), "model_name_suffix": "-nhd"}
    assert model_spec(str(model), SimpleNamespace()) == {**ident(model), "model_name_suffix": ""}
    assert model_spec("served-name", SimpleNamespace()) == {
        "model": "served-name",
        "revision": None,
        "model_name_suffix": "",
    }
    assert model_spec(f"{model}-nhd", pool, "my-model") == {
        "model_id": "my-model",
        "model_name_suffix": "-nhd",
    }
