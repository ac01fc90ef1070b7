"""The vLLM rollout engine against the HF one, in one run, on the same models, prompts, group and lengths.

    python bench/rollout_engines.py        # prints its figures; last line RESULT {json}

1. Rollout tokens/s at the tiny and bench sizes (``bench.common.SIZES``; head_dim 32 and 64, both shapes
   vLLM's CPU attention takes): each engine as a Ray actor (vLLM in its own venv), 8 prompts x 8 (a GRPO
   batch), temperature 1, up to ``ROLLOUT_MAX_NEW_TOKENS`` tokens. Generated tokens are counted from
   ``response_lengths`` and timed by the engine's ``compute_seconds``; the first call warms up and is left
   out, the figure is the median over ``CALLS`` calls. A call of one new token per row gives each engine's
   fixed cost per call, and ``(call - that) / (longest row - 1)`` its cost per decoding step.
2. GRPO s/iter of the real flow (Prefect + Ray + MLflow, ``configs/tiny.yaml`` on the size's model, as in
   ``perf.py grpo_iter_vs_trl``) with ``rollout.engine=hf`` and ``vllm``: the median over steps after the
   first. Each flow runs in a process of its own.

The engines run one at a time: the HF actor is stopped before the vLLM one starts.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import MAX_NEW_TOKENS, SIZES, arithmetic_rows, build_model, emit, median, scratch_dir  # noqa: E402
from bench.perf import _flow, _overhead  # noqa: E402

ENGINES = ("hf", "vllm")
PROMPTS, GROUP = 8, 8
ROLLOUT_MAX_NEW_TOKENS = 128
CALLS = 3  # timed calls per engine and size, after one warm-up call
FLOW_STEPS = {"tiny": 12, "bench": 8}


def _rollout_rates(kind: str, model: str, prompts: list[str]) -> dict:
    """Tokens/s of engine ``kind`` over ``CALLS`` calls after a warm-up one, and its cost per call and step."""
    import ray

    from engines.actors import start_engine, stop_engine
    from engines.types import SamplingParams

    engine = start_engine(f"rollout/{kind}", run_name="bench-rollout", role=kind, reuse=False, model_path=model,
                          torch_threads=2)
    call = lambda seed, tokens: ray.get(engine.generate.remote(  # noqa: E731
        prompts, SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=seed)))
    started = time.perf_counter()
    call(100, ROLLOUT_MAX_NEW_TOKENS)  # warm-up (and, for vLLM, the wait for its load)
    first_call_s = time.perf_counter() - started
    calls = []
    for seed in range(CALLS):
        started = time.perf_counter()
        out = call(seed, ROLLOUT_MAX_NEW_TOKENS)
        wall = time.perf_counter() - started
        lengths = out.response_lengths
        calls.append({"tokens": int(lengths.sum()), "longest": int(lengths.max()), "compute_s": out.compute_seconds,
                      "wall_s": wall})
    one_token_s = median(call(200 + seed, 1).compute_seconds for seed in range(CALLS))
    stop_engine(engine)
    rates = [c["tokens"] / c["compute_s"] for c in calls]
    step_s = median((c["compute_s"] - one_token_s) / max(c["longest"] - 1, 1) for c in calls)
    return {"tokens_per_s": median(rates), "wall_tokens_per_s": median(c["tokens"] / c["wall_s"] for c in calls),
            "tokens": [c["tokens"] for c in calls], "one_token_call_s": one_token_s, "decode_step_s": step_s,
            "first_call_s": first_call_s}


def rollout_throughput(models: dict[str, str], prompts: list[str]) -> dict:
    import ray

    from flows.setup import ensure_ray

    ensure_ray()
    out = {}
    for size, model in models.items():
        out[size] = {kind: _rollout_rates(kind, model, prompts) for kind in ENGINES}
        out[size]["ratio"] = out[size]["vllm"]["tokens_per_s"] / out[size]["hf"]["tokens_per_s"]
        for kind in ENGINES:
            r = out[size][kind]
            print(f"{size:>6} {kind:>4}: {r['tokens_per_s']:7.0f} tokens/s (through Ray {r['wall_tokens_per_s']:.0f}), "
                  f"tokens per call {r['tokens']}, a 1-token call {r['one_token_call_s'] * 1e3:.1f} ms, "
                  f"a decoding step {r['decode_step_s'] * 1e3:.2f} ms, first call {r['first_call_s']:.1f} s", flush=True)
        print(f"{size:>6}: rollout tokens/s vLLM/HF {out[size]['ratio']:.3f}", flush=True)
    ray.shutdown()
    return out


def iteration_times(models: dict[str, str]) -> dict:
    out = {}
    for size, model in models.items():
        out[size] = {}
        for kind in ENGINES:
            flow = _flow("configs/tiny.yaml", ["model.source=hf", f"model.path={model}", f"rollout.engine={kind}",
                                               f"rollout.max_new_tokens={MAX_NEW_TOKENS[size]}",
                                               "train.micro_batch_size=64", f"train.steps={FLOW_STEPS[size]}",
                                               "eval.every=0", "train.optim.lr=1e-4"])
            history = flow["history"]
            ours, steps = _overhead(history), sorted(history["time/step"])[1:]
            generate = median(history["perf/generate_compute_s"][s] for s in steps)
            out[size][kind] = {"step_s": ours["step_s"], "generate_compute_s": generate,
                               "overhead_share": ours["overhead_share"], "wall_s": flow["wall_s"]}
            print(f"{size:>6} {kind:>4}: {ours['step_s']:.3f} s/iter (generation {generate:.3f} s), "
                  f"flow wall {flow['wall_s']:.0f} s", flush=True)
        out[size]["ratio"] = out[size]["vllm"]["step_s"] / out[size]["hf"]["step_s"]
        print(f"{size:>6}: GRPO s/iter vLLM/HF {out[size]['ratio']:.3f}", flush=True)
    return out


def main() -> None:
    import torch

    torch.set_num_threads(2)
    rows, _ = arithmetic_rows()
    models = {size: build_model(size, Path(scratch_dir(f"model-{size}")) / "model", rows) for size in SIZES}
    prompts = [r["prompt"] for r in rows[:PROMPTS] for _ in range(GROUP)]
    rollout = rollout_throughput(models, prompts)
    flows = iteration_times(models)
    emit({"rollout": rollout, "grpo_iter": flows,
          "ratios": {size: {"rollout_tokens_per_s": rollout[size]["ratio"], "grpo_s_per_iter": flows[size]["ratio"]}
                     for size in SIZES}})


if __name__ == "__main__":
    main()
