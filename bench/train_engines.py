"""Sharded training and LoRA against the single-process torch engine, in one run, on the same model and batch.

    python bench/train_engines.py        # prints its figures; last line RESULT {json}

1. Train tokens/s: one GRPO ``train_step`` on the bench-size model (``bench.common.SIZES``; 8 prompts x 8,
   up to 64 new tokens, ``grpo_batch``) by the torch engine (one actor, 2 threads) and by FSDP2 with 2
   ranks (two actors, 1 thread each: the same 2 cores), from each engine's ``perf/train_compute_s``, the
   median over ``CALLS`` steps after a warm-up one. Both start from the same weights and see the same
   batch, so their losses agree (printed).
2. Weight-sync time, full vs LoRA (r=8 on every attention and MLP projection): ``tasks.sync.sync_weights``
   from a torch trainer to an HF rollout engine, each a Ray actor, after the first sync (which sends the
   base), the median over ``SYNCS``; and the bytes each sync sends. The full sync on one node goes through
   shared memory (one copy); it is also timed through Ray's object store (verified buckets), the path of
   an engine on another node, where the bytes sent count.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import arithmetic_rows, build_model, emit, grpo_batch, median, scratch_dir  # noqa: E402

CALLS = 3
SYNCS = 10
LORA = {"r": 8, "alpha": 16, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def train_rates(model: str, batch) -> dict:
    """Tokens/s of ``train_step`` on ``batch``: the torch engine, then FSDP2 with 2 ranks."""
    import ray

    from engines.actors import start_engine, stop_engine
    from engines.algorithms.objective import PolicyObjective
    from engines.rank_group import start_rank_group
    from engines.training.torch import OptimSpec
    from engines.training.updates import UpdateSpec

    tokens = float(batch.attention_mask.sum())
    batch_ref = ray.put(batch)
    common = dict(run_name="bench-train", model_path=model, optim=OptimSpec(lr=1e-5), micro_batch_size=16, reuse=False)
    engines = {"torch": lambda: start_engine("train/torch", role="torch", torch_threads=2, **common),
               "fsdp2": lambda: start_rank_group("train/fsdp2", role="fsdp2", world_size=2, torch_threads=1, **common)}
    out = {}
    for name, start in engines.items():
        engine = start()
        steps = [ray.get(engine.train_step.remote(batch_ref, PolicyObjective(), UpdateSpec())) for _ in range(CALLS + 1)]
        stop_engine(engine)
        seconds = [s["perf/train_compute_s"] for s in steps[1:]]
        out[name] = {"tokens_per_s": tokens / median(seconds), "step_s": median(seconds),
                     "first_loss": steps[0]["train/loss"]}
        print(f"{name:>6}: {out[name]['tokens_per_s']:7.0f} train tokens/s ({out[name]['step_s']:.3f} s a step of "
              f"{tokens:.0f} tokens), first-step loss {steps[0]['train/loss']:.6f}", flush=True)
    out["ratio"] = out["fsdp2"]["tokens_per_s"] / out["torch"]["tokens_per_s"]
    print(f"train tokens/s FSDP2 (2 ranks) / torch: {out['ratio']:.3f}", flush=True)
    return out


def sync_times(model: str) -> dict:
    """Seconds and bytes of a weight sync after the first: full weights, then a LoRA adapter."""
    import ray

    from engines.actors import start_engine, stop_engine
    from engines.training.torch import OptimSpec
    from tasks.sync import sync_weights

    out = {}
    for name, extra in (("full", {}), ("lora", {"lora": LORA})):
        common = dict(run_name="bench-sync", model_path=model, torch_threads=2)
        trainer = start_engine("train/torch", role="trainer", optim=OptimSpec(), reuse=False, **common, **extra)
        rollout = start_engine("rollout/hf", role="rollout", reuse=False, **common)
        adapter = bool(extra)
        sync_weights.fn(trainer, [rollout], 0, 64, adapter=adapter)  # the first sync: the base, once
        seconds = []
        for version in range(1, SYNCS + 1):
            started = time.perf_counter()
            sync_weights.fn(trainer, [rollout], version, 64, adapter=adapter)
            seconds.append(time.perf_counter() - started)
        if adapter:
            nbytes = ray.get(trainer.export_adapter.remote(SYNCS, 64 << 20)).nbytes
        else:
            nbytes = sum(bucket.data.nbytes for bucket in ray.get(trainer.export_weights.remote(64 << 20)))
            buckets = []  # the object-store path, which an engine on another node takes
            for version in range(SYNCS + 1, 2 * SYNCS + 1):
                started = time.perf_counter()
                ray.get(rollout.update_weights.remote(version, trainer.export_weights.remote(64 << 20)))
                buckets.append(time.perf_counter() - started)
            out["full_buckets"] = {"sync_s": median(buckets), "mbytes": nbytes / 2**20}
        stop_engine(trainer)
        stop_engine(rollout)
        out[name] = {"sync_s": median(seconds), "mbytes": nbytes / 2**20}
        print(f"{name:>6}: a sync {out[name]['sync_s'] * 1e3:.1f} ms, {out[name]['mbytes']:.2f} MiB sent"
              + (f"; through the object store {out['full_buckets']['sync_s'] * 1e3:.1f} ms" if not adapter else ""),
              flush=True)
    out["ratio"] = out["lora"]["sync_s"] / out["full"]["sync_s"]
    out["ratio_vs_buckets"] = out["lora"]["sync_s"] / out["full_buckets"]["sync_s"]
    print(f"weight-sync time LoRA / full: {out['ratio']:.3f} (shared memory), {out['ratio_vs_buckets']:.3f} "
          "(object-store buckets)", flush=True)
    return out


def main() -> None:
    import ray
    import torch

    from flows.setup import ensure_ray

    torch.set_num_threads(2)
    rows, _ = arithmetic_rows()
    model = build_model("bench", Path(scratch_dir("model-train")) / "model", rows)
    batch = grpo_batch(model, rows, max_new_tokens=64)
    ensure_ray()
    train = train_rates(model, batch)
    sync = sync_times(model)
    ray.shutdown()
    emit({"train": train, "sync": sync,
          "ratios": {"fsdp2_2_ranks_train_tokens_per_s": train["ratio"], "lora_sync_s": sync["ratio"]}})


if __name__ == "__main__":
    main()
