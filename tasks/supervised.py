"""Tasks of the supervised stages (``flows/supervised.py``): encode the rows, score them once with the
reference or teacher (cached under the run directory), train a step, evaluate. Rows, caches and batches
stay in the Ray object store; the tasks return refs and small summaries."""

from __future__ import annotations

import io

import ray
import torch
from prefect import task

from engines import checkpoint_store as store
from engines.data.supervised import answer_rows, stage_batch
from engines.models import load_tokenizer
from tasks.common import TASK_DEFAULTS

CACHE_ROWS = 64  # rows per scoring call of the reference or teacher


def _encode(kind: str, tokenizer_path: str, rows: list[dict], max_length: int):
    """``(encoded rows, (how many, Rejected))``."""
    from engines.data.chat import encode_preferences, encode_sft

    options = {"loss_on": "completion"} if kind == "sft_completion" else {}
    encode = encode_preferences if kind == "dpo" else encode_sft
    encoded, rejected = encode(load_tokenizer(tokenizer_path), rows, max_length=max_length, **options)
    return encoded, (len(encoded), rejected)


_encode_remote = ray.remote(max_retries=1, num_returns=2)(_encode)


@task(name="encode_rows", retries=0, **TASK_DEFAULTS)
def encode_rows(kind: str, tokenizer_path: str, rows: list[dict], max_length: int):
    """Tokenize ``rows`` on a Ray worker (``engines.data.chat``); returns ``(encoded_ref, kept, rejected)``:
    the encoded rows stay in the object store, ``rejected`` reports the rows left out."""
    encoded_ref, summary_ref = _encode_remote.remote(kind, tokenizer_path, ray.put(rows), max_length)
    kept, rejected = ray.get(summary_ref)
    return encoded_ref, kept, rejected


def _score_reference(reference, encoded: list, pad_token_id: int) -> list[tuple[float, float]]:
    """``(chosen, rejected)`` summed log-probs of every pair under ``reference``, ``CACHE_ROWS`` pairs a call."""
    sums = []
    for start in range(0, len(encoded), CACHE_ROWS):
        batch = stage_batch("dpo", encoded, list(range(start, min(start + CACHE_ROWS, len(encoded)))), pad_token_id)
        per_row = (ray.get(reference.logprobs.remote(batch)) * batch.loss_mask).sum(-1)  # [2P]
        sums += [(float(c), float(r)) for c, r in zip(per_row[0::2], per_row[1::2])]
    return sums


def _score_teacher(teacher, encoded: list, pad_token_id: int, top_k: int, temperature: float) -> list[dict]:
    """The teacher's top-k tokens at each row's answer tokens with their full-vocabulary log-probs:
    ``{"ids", "logprobs"}`` [n, k] (k at most the vocabulary; ``top_k`` 0: the whole vocabulary)."""
    tokens = ray.get(teacher.vocab_size.remote())
    k = min(top_k, tokens) if top_k else tokens  # a top-k over the whole vocabulary is the full distribution
    rows = []
    for start in range(0, len(encoded), CACHE_ROWS):
        batch = stage_batch("sft", encoded, list(range(start, min(start + CACHE_ROWS, len(encoded)))), pad_token_id)
        scored = ray.get(teacher.topk_logprobs.remote(batch, k, temperature))
        rows += [{"ids": ids, "logprobs": lps}
                 for ids, lps in zip(answer_rows(scored["ids"], batch), answer_rows(scored["logprobs"], batch))]
    return rows


def _cached(uri: str, manifest: dict, compute, *args):
    """The rows of the cache at ``uri`` (``rows.pt`` and ``manifest.json``, written last); computed with
    ``compute(*args)`` and written first when missing."""
    found = store.read_json(store.join(uri, "manifest.json"))
    if found is not None:
        fs, path = store.filesystem(store.join(uri, "rows.pt"))
        with fs.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=True)
    rows = compute(*args)
    buffer = io.BytesIO()
    torch.save(rows, buffer)
    store.write_bytes(store.join(uri, "rows.pt"), buffer.getvalue())
    store.write_json(store.join(uri, "manifest.json"), {**manifest, "rows": len(rows)})
    return rows


_cached_remote = ray.remote(max_retries=0)(_cached)


@task(name="score_reference", retries=0, **TASK_DEFAULTS)
def score_reference(reference, encoded_ref, pad_token_id: int, uri: str, manifest: dict):
    """The reference's summed log-probs of every pair, from the cache at ``uri`` or computed and cached
    there; returns a ref to them."""
    return _ready(_cached_remote.remote(uri, manifest, _score_reference, reference, encoded_ref, pad_token_id))


@task(name="score_teacher", retries=0, **TASK_DEFAULTS)
def score_teacher(teacher, encoded_ref, pad_token_id: int, top_k: int, temperature: float, uri: str, manifest: dict):
    """The teacher's top-k log-probs at every answer token, from the cache at ``uri`` or computed and cached
    there; returns a ref to them."""
    return _ready(_cached_remote.remote(uri, manifest, _score_teacher, teacher, encoded_ref, pad_token_id, top_k,
                                        temperature))


def _ready(ref):
    """``ref`` once its value exists, without fetching it here: the scorer may then stop. (A failed scoring
    raises where the first batch uses it.)"""
    ray.wait([ref], fetch_local=False)
    return ref


_batch_remote = ray.remote(max_retries=1)(stage_batch)


@task(name="supervised_train", retries=0, **TASK_DEFAULTS)
def supervised_train(trainer, kind: str, encoded_ref, cache_ref, indices: list[int], pad_token_id: int,
                     objective) -> dict[str, float]:
    """One optimizer step of ``objective`` on rows ``indices`` (batch built on a Ray worker). Never retried:
    a second attempt would step twice."""
    batch_ref = _batch_remote.remote(kind, encoded_ref, indices, pad_token_id, cache_ref)
    return ray.get(trainer.train_step.remote(batch_ref, objective))


@task(name="supervised_eval", retries=1, **TASK_DEFAULTS)
def supervised_eval(trainer, kind: str, encoded_ref, cache_ref, count: int, pad_token_id: int,
                    objective) -> dict[str, float]:
    """``objective``'s metrics over the ``count`` held-out rows, without a gradient."""
    batch_ref = _batch_remote.remote(kind, encoded_ref, list(range(count)), pad_token_id, cache_ref)
    return ray.get(trainer.evaluate.remote(batch_ref, objective))
