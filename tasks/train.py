from __future__ import annotations

import ray
from prefect import task

from engines.data.sft import sft_batch
from engines.training.updates import UpdateSpec
from tasks.common import TASK_DEFAULTS


@task(name="train", retries=0, **TASK_DEFAULTS)
def train(train_engine, batch_ref, loss_fn, update: UpdateSpec) -> dict[str, float]:
    """``update.epochs × update.mini_batches`` optimizer steps on ``batch_ref``. Never retried: a second
    attempt would change the weights twice."""
    return ray.get(train_engine.train_step.remote(batch_ref, loss_fn, update))


_sft_batch_remote = ray.remote(max_retries=1)(sft_batch)


@task(name="sft_train", retries=0, **TASK_DEFAULTS)
def sft_train(train_engine, tokenizer_path: str, prompts: list[str], targets: list[str], loss_fn) -> dict[str, float]:
    """Tokenize ``prompt ++ target`` on a Ray worker and take one supervised optimizer step on it."""
    batch_ref = _sft_batch_remote.remote(tokenizer_path, prompts, targets)
    return ray.get(train_engine.train_step.remote(batch_ref, loss_fn))
