"""The distillation teacher: top-k of the full-vocabulary distribution with its tail mass, sampled-token
and summed log-probs, and the tokenizer/vocabulary check between student and teacher."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from engines.data.sft import sft_batch
from engines.models import check_vocabularies, load_model
from engines.training.teacher import TeacherEngine, topk_with_tail
from engines.training.torch import ReferenceEngine


def _batch(model_dir: str):
    return sft_batch(model_dir, ["12+3=", "1+1=", "29+30="], ["15", "2 and 2", "59"])


def _full_logprobs(model_dir: str, batch, temperature: float) -> torch.Tensor:
    """The reference form: one padded forward, ``log softmax(logits / T)`` over the vocabulary, entry ``t``
    predicting token ``t`` (column 0 is not a prediction and left at 0). [B, L, V]"""
    model = load_model(model_dir, trainable=False)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    out = torch.zeros_like(logits)
    out[:, 1:] = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    return out


@pytest.fixture(scope="module")
def teacher(tiny_model_dir):
    return TeacherEngine(tiny_model_dir, micro_batch_size=2)


def test_topk_with_tail_hand_worked():
    log_probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]).log()
    ids, top, tail = topk_with_tail(log_probs, 2)
    assert ids.tolist() == [[0, 1], [3, 2]]  # the two most likely ids, most likely first
    assert torch.allclose(top, torch.tensor([[0.5, 0.3], [0.4, 0.3]]).log())
    # the rest: 0.15 + 0.05 = 0.2 and 0.1 + 0.2 = 0.3
    assert torch.allclose(tail, torch.tensor([0.2, 0.3]).log())
    ids, top, tail = topk_with_tail(log_probs, 4)  # k = V: no mass outside
    assert torch.isneginf(tail).all() and torch.allclose(top.exp().sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match=r"0 < k <= vocabulary size 4, got k=5"):
        topk_with_tail(log_probs, 5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_topk_logprobs_are_full_vocabulary_logprobs_at_the_teachers_top_ids(teacher, tiny_model_dir, temperature):
    batch = _batch(tiny_model_dir)
    out = teacher.topk_logprobs(batch, k=5, temperature=temperature)
    full = _full_logprobs(tiny_model_dir, batch, temperature)  # [B, L, V]
    mask = batch.loss_mask.bool()
    assert out["ids"].shape == (*batch.input_ids.shape, 5) and out["ids"].dtype == torch.int64
    assert out["logprobs"].dtype == torch.float32 and out["tail"].shape == batch.input_ids.shape
    expected_top, expected_ids = full[mask].topk(5, dim=-1)
    assert torch.equal(out["ids"][mask], expected_ids)
    assert (out["logprobs"][mask] - expected_top).abs().max() < 1e-5  # sorted, the full softmax's values
    assert (out["logprobs"][mask] - full[mask].gather(-1, out["ids"][mask])).abs().max() < 1e-5
    expected_tail = torch.log1p(-out["logprobs"][mask].exp().sum(-1))  # log(1 - Σ top-k p)
    assert (out["tail"][mask] - expected_tail).abs().max() < 1e-5
    for key in ("ids", "logprobs", "tail"):
        assert (out[key][~mask] == 0).all()  # only answer tokens are scored


def test_temperature_sharpens_the_teachers_distribution(teacher, tiny_model_dir):
    batch = _batch(tiny_model_dir)
    mask = batch.loss_mask.bool()
    warm, cold = (teacher.topk_logprobs(batch, k=3, temperature=t) for t in (1.0, 0.5))
    assert torch.equal(warm["ids"][mask], cold["ids"][mask])  # T > 0 keeps the order
    # dividing the logits by T < 1 moves mass to the top token and out of the tail
    assert (cold["logprobs"][mask][:, 0] > warm["logprobs"][mask][:, 0]).all()
    assert (cold["tail"][mask] < warm["tail"][mask]).all()


def test_topk_over_the_whole_vocabulary_leaves_no_tail(teacher, tiny_model_dir):
    batch = _batch(tiny_model_dir)
    vocab = teacher.vocab_size()
    out = teacher.topk_logprobs(batch, k=vocab, temperature=1.0)
    mask = batch.loss_mask.bool()
    assert torch.isneginf(out["tail"][mask]).all()
    assert (out["logprobs"][mask].exp().sum(-1) - 1).abs().max() < 1e-5
    assert torch.equal(out["ids"][mask].sort(-1).values, torch.arange(vocab).expand(int(mask.sum()), vocab))


def test_teacher_scores_like_a_reference_and_sums_answers(teacher, tiny_model_dir):
    batch = _batch(tiny_model_dir)
    logprobs = teacher.logprobs(batch)
    assert torch.equal(logprobs, ReferenceEngine(tiny_model_dir, micro_batch_size=2).logprobs(batch))
    full = _full_logprobs(tiny_model_dir, batch, 1.0)
    picked = full.gather(-1, batch.input_ids[..., None]).squeeze(-1)  # [B, L]
    assert ((logprobs - picked) * batch.loss_mask).abs().max() < 1e-5
    expected = (picked * batch.loss_mask).sum(-1)  # [B]: Σ over answer tokens
    assert (teacher.sequence_logprobs(batch) - expected).abs().max() < 1e-4
    assert teacher.vocab_size() == len(teacher.scorer.model.get_input_embeddings().weight)


def _with_vocab_size(model_dir: str, out, vocab_size: int) -> str:
    """A copy of ``model_dir`` whose config declares ``vocab_size`` rows (configs only are read)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_check_vocabularies(tiny_model_dir, tmp_path):
    from engines.models import TinyModelSpec, build_tiny_model, load_tokenizer

    size = len(load_tokenizer(tiny_model_dir))
    padded = _with_vocab_size(tiny_model_dir, tmp_path / "padded", size + 16)
    check_vocabularies(tiny_model_dir, padded)  # same tokenizer, 16 padding rows more: fine
    check_vocabularies(padded, tiny_model_dir)
    short = _with_vocab_size(tiny_model_dir, tmp_path / "short", size - 1)
    with pytest.raises(ValueError, match=rf"student {tiny_model_dir} vs teacher {short}: vocab sizes {size} vs "
                                         rf"{size - 1} differ beyond padding: the tokenizer has {size} tokens"):
        check_vocabularies(tiny_model_dir, short)
    other = str(build_tiny_model(tmp_path / "other", ["the quick brown fox jumps"] * 4,
                                 TinyModelSpec(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1,
                                               intermediate_size=32), seed=0))
    with pytest.raises(ValueError, match=rf"student {tiny_model_dir} vs teacher {other}: the teacher tokenizer "
                                         r"maps \d+ tokens differently \(e\.g\. .*\); distillation needs one tokenizer"):
        check_vocabularies(tiny_model_dir, other)


@pytest.mark.ray
def test_teacher_starts_as_an_actor(tiny_model_dir, ray_cluster, teacher):
    from engines.actors import start_engine, stop_engine

    handle = start_engine("teacher/torch", run_name="t-teacher", role="teacher", model_path=tiny_model_dir,
                          micro_batch_size=2)
    batch = _batch(tiny_model_dir)
    remote = ray_cluster.get(handle.topk_logprobs.remote(batch, 4, 0.7))
    local = teacher.topk_logprobs(batch, k=4, temperature=0.7)
    assert all(torch.equal(remote[key], local[key]) for key in ("ids", "logprobs", "tail"))
    stop_engine(handle)
