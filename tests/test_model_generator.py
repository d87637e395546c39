"""The tiny test model: deterministic bytes, one token per letter, the asked shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpkv.testing.model import MARKER_FILE, ModelSpec, generate_model, is_complete


def _files(d: str | Path) -> dict[str, bytes]:
    root = Path(d)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_files(tmp_path: Path, tiny_model: str) -> None:
    a = generate_model(tmp_path / "a", seed=0)
    b = generate_model(tmp_path / "b", seed=0)
    fa, fb, fc = _files(a), _files(b), _files(tiny_model)
    assert set(fa) == {
        MARKER_FILE,
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between two generations"
        assert fa[name] == fc[name], f"{name} differs from the cached model"


def test_different_seed_gives_different_weights(tmp_path: Path, tiny_model: str) -> None:
    from safetensors.torch import load_file

    other = generate_model(tmp_path / "s1", seed=1)
    w0, w1 = load_file(Path(tiny_model) / "model.safetensors"), load_file(Path(other) / "model.safetensors")
    assert w0.keys() == w1.keys()
    for name in w0:
        assert w0[name].shape == w1[name].shape
        if name.endswith("norm.weight"):
            continue  # norms start at 1 whatever the seed
        assert not (w0[name] == w1[name]).all(), f"{name} is the same for seeds 0 and 1"
    # Only the weights depend on the seed.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (Path(tiny_model) / name).read_bytes() == (Path(other) / name).read_bytes()


def test_default_dir_depends_on_seed_and_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPKV_MODEL_CACHE", str(tmp_path))
    a = generate_model(
        seed=0, num_layers=1, hidden_size=64, num_attention_heads=2, num_kv_heads=1, intermediate_size=64
    )
    b = generate_model(
        seed=1, num_layers=1, hidden_size=64, num_attention_heads=2, num_kv_heads=1, intermediate_size=64
    )
    assert Path(a).parent == tmp_path and Path(a).name.startswith("qwen2-tiny-")
    assert a != b
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(a).name, Path(b).name]
    )  # no temp dirs left


def test_existing_model_is_reused_quickly(tiny_model: str) -> None:
    st = (Path(tiny_model) / "model.safetensors").stat()
    t = time.monotonic()
    assert generate_model() == tiny_model
    assert time.monotonic() - t < 0.5
    assert (Path(tiny_model) / "model.safetensors").stat().st_mtime_ns == st.st_mtime_ns


def test_incomplete_dir_is_replaced_foreign_dir_is_refused(tmp_path: Path) -> None:
    small = dict(num_layers=1, hidden_size=64, num_attention_heads=2, num_kv_heads=1, intermediate_size=64)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert is_complete(generate_model(empty, **small), ModelSpec(**small))

    # A writer that dies leaves only a temp dir beside the target, never a
    # marker-less target; a stale temp dir is cleaned up by the next writer.
    stale = tmp_path / ".crashed.tmp-abc"
    stale.mkdir()
    (stale / "config.json").write_text("{")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    crashed = generate_model(tmp_path / "crashed", **small)
    assert is_complete(crashed) and not stale.exists()

    # A directory without the marker is never taken as a complete model.
    half = tmp_path / "half"
    generate_model(half, **small)
    (half / MARKER_FILE).unlink()
    assert not is_complete(half)
    with pytest.raises(FileExistsError, match="not a complete generated model"):
        generate_model(half, **small)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a complete generated model"):
        generate_model(foreign, **small)
    assert (foreign / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "text, n_tokens",
    [("A A A A", 4), ("A B C", 3), ("A B C D", 4), (" ".join(["A"] * 1000), 1000)],
)
def test_one_token_per_letter(tiny_model: str, text: str, n_tokens: int) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)  # what vLLM loads
    raw = Tokenizer.from_file(os.path.join(tiny_model, "tokenizer.json"))
    ids = hf(text)["input_ids"]
    assert len(ids) == n_tokens  # and no BOS/EOS added
    assert raw.encode(text).ids == ids
    assert hf.decode(ids) == text  # lossless
    assert hf.unk_token_id not in ids


def test_tokenizer_is_lossless_and_has_special_tokens(tiny_model: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for text in ["Hello, world.", "x\n  y\tz", "ü 日本 ✓", "The answer is 42!"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    gen = json.loads((Path(tiny_model) / "generation_config.json").read_text())
    assert tok.eos_token == "</s>" and tok.eos_token_id == gen["eos_token_id"]
    assert tok.bos_token_id == gen["bos_token_id"]
    assert tok.pad_token_id == gen["pad_token_id"]


def test_config_shape(tiny_model: str) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model)
    assert cfg.model_type == "qwen2"
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (512, 8)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 2)
    assert cfg.hidden_size // cfg.num_attention_heads == 64 == cfg.head_dim
    assert cfg.max_position_embeddings >= 16384
    assert cfg.dtype == torch.bfloat16
    assert cfg.vocab_size >= len(AutoTokenizer.from_pretrained(tiny_model))
    # KV bytes per token: 2 (K, V) * layers * kv heads * head dim * 2 bytes = 4 KiB.
    assert 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 == 4096


def test_transformers_loads_every_weight(tiny_model: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tiny_model, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(torch.tensor([[69, 292, 292]])).logits
    assert logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(logits.float()).all()


def test_cli_prints_the_path(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpkv.testing.model",
            "--out",
            str(out),
            "--seed",
            "3",
            "--num-layers",
            "1",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "2",
            "--num-kv-heads",
            "1",
            "--intermediate-size",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert res.stdout.strip() == str(out)
    assert is_complete(out)


@pytest.mark.parametrize(
    ("kind", "other_layers", "every"),
    [
        ("gemma3", "sliding_attention", 4),
        ("qwen3_next", "linear_attention", 4),
        ("gpt_oss", "sliding_attention", 2),
    ],
)
def test_hybrid_kinds_load_in_transformers_with_every_weight(
    tmp_path: Path, kind: str, other_layers: str, every: int
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path = generate_model(tmp_path / kind, kind=kind, num_layers=4, full_attention_every=every)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.layer_types == ([other_layers] * (every - 1) + ["full_attention"]) * (4 // every)
    with torch.no_grad():
        logits = model(torch.tensor([[69, 292, 292]])).logits
    assert torch.isfinite(logits.float()).all()


def test_a_head_size_apart_from_the_width_is_written_and_unset_changes_no_digest(tmp_path: Path) -> None:
    from transformers import AutoConfig

    assert ModelSpec(kind="gemma3").digest() == ModelSpec(kind="gemma3", attention_head_dim=0).digest()
    assert ModelSpec(kind="gemma3").digest() != ModelSpec(kind="gemma3", attention_head_dim=128).digest()
    path = generate_model(tmp_path / "g", kind="gemma3", num_layers=2, attention_head_dim=128)
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (512, 8, 128)
    with pytest.raises(ValueError, match="qwen2"):
        ModelSpec(attention_head_dim=128).validate()


def test_qwen3_next_linear_heads_apart_from_the_attention_load_in_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    base = ModelSpec(kind="qwen3_next")
    assert base.digest() == ModelSpec(kind="qwen3_next", linear_key_heads=0, linear_head_dim=0).digest()
    assert base.digest() != ModelSpec(kind="qwen3_next", linear_head_dim=128).digest()
    path = generate_model(
        tmp_path / "q",
        kind="qwen3_next",
        num_layers=2,
        full_attention_every=2,
        attention_head_dim=256,
        linear_key_heads=4,
        linear_value_heads=8,
        linear_head_dim=32,
    )
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    c = model.config
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.head_dim) == (
        4,
        8,
        32,
        256,
    )
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[69, 292, 292]])).logits.float()).all()
    with pytest.raises(ValueError, match="multiple"):
        ModelSpec(kind="qwen3_next", linear_key_heads=3, linear_value_heads=8).validate()
    with pytest.raises(ValueError, match="qwen3_next"):
        ModelSpec(kind="gemma3", linear_head_dim=64).validate()
