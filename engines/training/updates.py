"""PPO's inner loop, shared by the training backends: one rollout batch becomes ``epochs × mini_batches``
optimizer steps (Schulman et al. 2017, arXiv:1707.06347, Algorithm 1: "optimize surrogate L wrt θ, with K
epochs and minibatch size M ≤ NT"; verl's ``ppo_epochs`` / ``ppo_mini_batch_size``, TRL's ``num_iterations``).

The batch's old log-probabilities stay those of the rollout for the whole loop, so from the second
optimizer step on the importance ratio leaves 1 and the clip ranges, dual-clip, GSPO's sequence clip
and TOPR's truncation act. Each epoch visits the rows in an order shuffled from ``UpdateSpec.seed``
(the flow derives it from the run seed and the step, so a resumed run shuffles as an uninterrupted one
does). With ``keep_groups`` the shuffle moves whole groups (rows with one ``group_ids`` value): a group
estimator's advantages are centred within each group, and each mini-batch then keeps that baseline
and one shared prompt per group for packing.

``optimizer_step`` is one step over one (mini-)batch: micro-batches with gradient accumulation, the
gradient-norm clip, the optimizer and the LR schedule (which therefore counts optimizer steps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from engines.types import TrainBatch


@dataclass(frozen=True)
class UpdateSpec:
    """How ``train_step`` turns one rollout batch into optimizer steps."""

    mini_batches: int = 1  # optimizer steps per epoch; at most one per group (or row), see mini_batch_rows
    epochs: int = 1  # passes over the rollout batch
    keep_groups: bool = True  # mini-batches hold whole groups (needs batch.group_ids); False: rows may split
    seed: int = 0  # seeds the row order of every epoch

    def __post_init__(self) -> None:
        if self.mini_batches < 1 or self.epochs < 1:
            raise ValueError(f"mini_batches and epochs must be >= 1, got {self.mini_batches} and {self.epochs}")


def mini_batch_rows(num_rows: int, group_ids: torch.Tensor | None, spec: UpdateSpec,
                    generator: torch.Generator) -> list[torch.Tensor | None]:
    """Row indices of each mini-batch of one epoch; ``[None]`` (the whole batch, in order) for one mini-batch.

    The units shuffled are groups (``keep_groups`` and ``group_ids`` [B] given) or rows; a random
    permutation of the units (from ``generator``) is cut into ``min(spec.mini_batches, units)`` parts
    whose sizes differ by at most one unit, and each part lists its rows unit by unit."""
    if spec.mini_batches == 1:
        return [None]
    if spec.keep_groups and group_ids is not None:
        _, units = torch.unique(group_ids.cpu(), return_inverse=True)  # [B] unit of each row (indices stay on CPU)
    else:
        units = torch.arange(num_rows)
    num_units = int(units.max()) + 1
    order = torch.randperm(num_units, generator=generator)  # [U] units in visiting order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_units)  # [U] position of each unit in the order
    rows = torch.argsort(rank[units] * num_rows + torch.arange(num_rows))  # [B] rows unit by unit
    parts = torch.tensor_split(torch.arange(num_units), min(spec.mini_batches, num_units))
    rows_per_unit = torch.bincount(rank[units], minlength=num_units)  # [U] rows of the k-th visited unit
    sizes = [int(rows_per_unit[part].sum()) for part in parts]
    return list(torch.split(rows, sizes))


def combine(metrics: list[dict[str, float]], weights: Iterable[float] | None = None) -> dict[str, float]:
    """Weighted mean of each key over ``metrics`` (equal weights by default); keys ending in ``_max`` take
    the maximum and ``_min`` the minimum. A key missing from an entry is averaged over the others."""
    weights = [1.0] * len(metrics) if weights is None else list(weights)
    out: dict[str, float] = {}
    total: dict[str, float] = {}
    for entry, weight in zip(metrics, weights):
        for key, value in entry.items():
            if key.endswith("_max"):
                out[key] = max(out.get(key, value), value)
            elif key.endswith("_min"):
                out[key] = min(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0.0) + weight * value
                total[key] = total.get(key, 0.0) + weight
    return {k: v / total[k] if k in total and total[k] else v for k, v in out.items()}


class DriftMeter:
    """How far the trainer's log-probs are from the rollout engine's on the tokens it sampled, before the
    first optimizer step after a weight sync, when both hold the same weights: ``sync/logprob_drift_max``
    and ``sync/logprob_drift_mean`` of ``|log π_train(y_t) − log π_rollout(y_t)|`` over the model's tokens.
    Float rounding (~1e-6 in fp32) after a right sync; a stale or half-loaded weight shows far above it.
    It costs no forward pass: the logprobs are the first step's own."""

    def __init__(self) -> None:
        self.max, self.sum, self.tokens = 0.0, 0.0, 0.0

    def add(self, inputs: dict[str, torch.Tensor], micro: TrainBatch) -> None:
        rollout = micro.tensors.get("rollout_logprobs")
        if "logprobs" not in inputs or rollout is None:
            return  # a critic, or a batch without sampled tokens (SFT)
        mask = micro.loss_mask
        gap = (inputs["logprobs"].detach().float() - rollout.float()).abs() * mask
        self.max = max(self.max, float(gap.max()))
        self.sum, self.tokens = self.sum + float(gap.sum()), self.tokens + float(mask.sum())

    def metrics(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        return {"sync/logprob_drift_max": self.max, "sync/logprob_drift_mean": self.sum / self.tokens}


SUMMED = frozenset({"train/loss", "actor/pg_loss"})
"""Metrics a micro-batch reports for the whole (mini-)batch already scaled by its weight: summed, not averaged."""


def optimizer_step(batch: TrainBatch, loss_fn: Callable, *, forward: Callable[[TrainBatch], dict],
                   parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                   scheduler, micro_batch_size: int, grad_clip: float, measure_drift: bool = False,
                   rank: int = 0, world_size: int = 1, backward: Callable[[torch.Tensor], None] | None = None,
                   step: Callable[[], float] | None = None) -> dict[str, float]:
    """One optimizer step over ``batch`` in micro-batches of ``micro_batch_size`` rows.

    Rows the objective shows to have no gradient (``loss_fn.rows_with_gradient``: zero-advantage rows)
    are not computed; the loss and the gradient stay those of the whole batch, since each micro-batch
    carries its share of it (``loss_fn.micro_weight``), and the other metrics (clip fraction, entropy, …)
    are means over the rows computed. With ``measure_drift`` (the first step after a weight sync) also
    ``sync/logprob_drift_*`` of the rows computed (``DriftMeter``).

    A sharded engine's ranks each pass the whole ``batch``, their ``rank`` and ``world_size``: rank r computes
    micro-batches r, r + world_size, …, so the gradient of the batch is the sum of the ranks' (their
    ``backward`` must sum, not average, across ranks), and a rank with one micro-batch fewer runs a
    zero-weight one so the collectives of every forward and backward stay in step. The metrics of every
    rank are gathered, so each returns those of the whole batch. ``backward(loss)`` defaults to
    ``loss.backward()``; ``step()`` (clip, optimizer, LR schedule; returns the gradient norm before the clip)
    to ``clip_grad_norm_`` over ``parameters`` then ``optimizer`` and ``scheduler``."""
    optimizer.zero_grad(set_to_none=True)
    rows = getattr(loss_fn, "rows_with_gradient", lambda _: None)(batch)
    computed = batch if rows is None else batch.select(rows)
    micros = list(computed.micro_batches(micro_batch_size))
    mine = micros[rank::world_size]
    padding = -(-len(micros) // world_size) - len(mine)  # 0 or 1: this rank's zero-weight micro-batch
    sums: dict[str, float] = {}
    entries, weights = [], []
    drift = DriftMeter() if measure_drift else None
    lr = scheduler.get_last_lr()[0]
    for i, micro in enumerate(mine + micros[:padding]):
        weight = loss_fn.micro_weight(micro, batch) if i < len(mine) else 0.0  # skipped rows add 0
        inputs = forward(micro)
        loss, metrics = loss_fn(**inputs, batch=micro)
        (backward or torch.Tensor.backward)(loss * weight)
        if i == len(mine):
            break  # the padding micro-batch counts in no metric
        if drift is not None:
            drift.add(inputs, micro)
        metrics["train/loss"] = float(loss.detach())
        for key in SUMMED & metrics.keys():
            sums[key] = sums.get(key, 0.0) + weight * metrics.pop(key)
        entries.append(metrics)
        weights.append(weight)
    if world_size > 1:
        entries, weights, sums, drift = _gather_step(entries, weights, sums, drift)
    totals = {**combine(entries, weights), **sums}
    totals["train/skipped_rows"] = float(len(batch) - len(computed))
    if drift is not None:
        totals.update(drift.metrics())
    if step is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
        optimizer.step()
        scheduler.step()
    else:
        grad_norm = step()
    totals["train/lr"] = lr
    totals["train/grad_norm"] = float(grad_norm)
    return totals


def _gather_step(entries: list[dict], weights: list[float], sums: dict[str, float], drift: DriftMeter | None):
    """Every rank's micro-batch metrics, weights, summed metrics and drift, combined on each rank."""
    from engines.training.distributed import gather_objects

    gathered = gather_objects((entries, weights, sums, drift and (drift.max, drift.sum, drift.tokens)))
    entries = [entry for rank_entries, *_ in gathered for entry in rank_entries]
    weights = [weight for _, rank_weights, *_ in gathered for weight in rank_weights]
    total_sums: dict[str, float] = {}
    for _, _, rank_sums, _ in gathered:
        for key, value in rank_sums.items():
            total_sums[key] = total_sums.get(key, 0.0) + value
    if drift is not None:
        drift = DriftMeter()
        for *_, (top, total, tokens) in gathered:
            drift.max, drift.sum, drift.tokens = max(drift.max, top), drift.sum + total, drift.tokens + tokens
    return entries, weights, total_sums, drift


def run_updates(batch: TrainBatch, loss_fn: Callable, spec: UpdateSpec, **step_kwargs) -> dict[str, float]:
    """``spec.epochs`` passes over ``batch`` of ``spec.mini_batches`` optimizer steps each
    (``optimizer_step``'s keyword arguments in ``step_kwargs``); returns the steps' metrics combined
    (``combine``: means, ``*_max``/``*_min`` extremes) plus ``train/optimizer_steps``, ``train/tokens``
    and ``perf/train_compute_s``. ``train/skipped_rows`` is per pass over the batch."""
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(spec.seed)
    steps = []
    for _ in range(spec.epochs):
        for rows in mini_batch_rows(len(batch), batch.group_ids, spec, generator):
            steps.append(optimizer_step(batch if rows is None else batch.select(rows), loss_fn,
                                        measure_drift=not steps, **step_kwargs))
    totals = combine(steps)
    totals["train/skipped_rows"] = sum(s["train/skipped_rows"] for s in steps) / spec.epochs
    totals["train/optimizer_steps"] = float(len(steps))
    totals["train/tokens"] = float(batch.attention_mask.sum())
    totals["perf/train_compute_s"] = time.perf_counter() - start
    return totals
