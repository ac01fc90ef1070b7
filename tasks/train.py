from __future__ import annotations

import ray
from prefect import task

from engines.training.updates import UpdateSpec
from tasks.common import TASK_DEFAULTS


@task(name="train", retries=0, **TASK_DEFAULTS)
def train(train_engine, batch_ref, loss_fn, update: UpdateSpec) -> dict[str, float]:
    """``update.epochs × update.mini_batches`` optimizer steps on ``batch_ref``. Never retried: a second
    attempt would change the weights twice."""
    return ray.get(train_engine.train_step.remote(batch_ref, loss_fn, update))
