"""The tiny model source: HF-format folder with safetensors, a digit-splitting tokenizer, seeded init."""

from __future__ import annotations

import pytest

from engines.models import TinyModelSpec, build_tiny_model, load_model, load_tokenizer, stop_token_ids


def test_tiny_model_folder_is_hf_format(tiny_model_dir):
    from pathlib import Path

    files = {p.name for p in Path(tiny_model_dir).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    model = load_model(tiny_model_dir)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 64


def test_tokenizer_splits_digits_and_round_trips(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode("12+30=42", add_special_tokens=False)
    assert len(ids) == 8  # one token per character: digits are split individually
    assert tok.decode(ids) == "12+30=42"
    assert tok.pad_token_id != tok.eos_token_id
    assert stop_token_ids(tok) == (tok.eos_token_id,)
    with pytest.raises(ValueError, match="single tokens"):
        stop_token_ids(tok, ["12"])


def test_same_seed_same_weights(tmp_path):
    import torch

    texts = ["1+1=2", "2+3=5"]
    spec = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    a = load_model(str(build_tiny_model(tmp_path / "a", texts, spec, seed=5)))
    b = load_model(str(build_tiny_model(tmp_path / "b", texts, spec, seed=5)))
    c = load_model(str(build_tiny_model(tmp_path / "c", texts, spec, seed=6)))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)
