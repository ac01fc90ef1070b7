"""Step time of generate + score with scoring overlapped with generation vs scoring after it.

A deliberately slow reward: ``judge``, an LLM grading every completion on its own inference engine
actor (a judge model larger than the policy, as in practice). The step's prompts (the QA domain) are
generated in ``chunks`` calls on the real rollout engine actor; with async scoring each chunk is graded
while the next chunk generates, without it grading starts when the whole batch is done. Both modes run
the same chunks with the same seeds, alternating, on a local Ray; the figure is the median over ``steps``.
(The ``code`` reward is not used here: the untrained tiny policy writes no runnable code, so its
sandbox would never start.)

    python bench/async_scoring.py [steps=5] [chunks=4] [prompts=8] [group=8] [max_new_tokens=32]

Last line: ``async_scoring_step_ratio <async/sync>`` (below 1: overlap saves time).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time


def main(argv: list[str]) -> None:
    import ray

    from configs.schema import RolloutConfig
    from engines.actors import run_actor_names, start_engine
    from engines.data.prompts import load_prompt_rows
    from engines.models import TinyModelSpec, build_tiny_model
    from engines.scoring import ScoreSpec
    from engines.types import SamplingParams
    from tasks.score import Chunk, generate_and_score

    args = dict(a.split("=", 1) for a in argv)
    timeout_s = RolloutConfig().timeout_s  # the run's default wait for a generation call
    steps, n_chunks = int(args.get("steps", 5)), int(args.get("chunks", 4))
    prompts, group, max_new = int(args.get("prompts", 8)), int(args.get("group", 8)), int(args.get("max_new_tokens", 32))
    rows = load_prompt_rows("configs/data/qa/train.jsonl")
    root = tempfile.mkdtemp(prefix="rollflow-bench-")
    texts = [r["prompt"] + r["answer"] for r in rows]
    build_tiny_model(f"{root}/policy", texts, TinyModelSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                                            intermediate_size=512, vocab_size=512), seed=0)
    build_tiny_model(f"{root}/judge", texts, TinyModelSpec(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
                                                           intermediate_size=1024, vocab_size=512), seed=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rollflow")
    rollout = start_engine("rollout/hf", run_name="bench-async", role="rollout", model_path=f"{root}/policy",
                           torch_threads=1)
    judge = start_engine("rollout/hf", run_name="bench-async", role="judge", model_path=f"{root}/judge", torch_threads=1)
    ray.get(judge.__ray_ready__.remote())  # its name is listed once it exists
    [judge_name] = run_actor_names("bench-async", "judge")
    workers = [start_engine("reward/worker", run_name="bench-async", role="reward-0", max_concurrency=8)]
    spec = ScoreSpec("judge", {"engine_actor": judge_name, "max_new_tokens": 8}, "qa", chunk_size=group,
                     concurrency=4, timeout_s=120)

    def chunks_for(step: int) -> list[Chunk]:
        chosen = [rows[(step * prompts + i) % len(rows)] for i in range(prompts)]
        per = max(1, prompts // n_chunks)
        out = []
        for k in range(0, prompts, per):
            part = chosen[k:k + per]
            out.append(Chunk([r["prompt"] for r in part for _ in range(group)],
                             {"answer": [r["answer"] for r in part for _ in range(group)]},
                             SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=1000 * step + k), spec))
        return out

    generate_and_score.fn([rollout], workers, chunks_for(0), True, timeout_s=timeout_s)  # warm-up: model load, first sandbox
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(1, steps + 1):
        for overlap in (False, True):
            start = time.perf_counter()
            scored = generate_and_score.fn([rollout], workers, chunks_for(step), overlap, timeout_s=timeout_s)
            times[overlap].append(time.perf_counter() - start)
        gen = sum(s["generate_s"] for s in scored.stats)
        score = sum(s["score_s"] for s in scored.stats)
        print(f"step {step}: sync {times[False][-1]:.2f}s  async {times[True][-1]:.2f}s  "
              f"(generate compute {gen:.2f}s, score compute {score:.2f}s)", flush=True)
    sync, overlapped = statistics.median(times[False]), statistics.median(times[True])
    print(f"{prompts} prompts x {group}, <= {max_new} new tokens, {n_chunks} chunks, judge reward; median of {steps}")
    print(f"scoring after generation  {sync:.2f} s/step")
    print(f"scoring overlapped        {overlapped:.2f} s/step")
    print(f"async_scoring_step_ratio {overlapped / sync:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
