"""Env-level async rollout against lockstep, on environments whose steps take 0-``max_step_ms`` ms.

``episodes`` Corridor episodes (groups of 4 sharing a seed) on one tiny policy (the HF rollout engine, in
this process, one thread): lockstep generates every live episode's turn in one call and then waits for
every environment step before the next turn; async runs each episode on its own thread and batches the
turns pending at each moment, so a slow step holds nobody else. Each step sleeps a time drawn from the
episode and the turn (the same in every runner). The two runners alternate ``repeats`` times; the
figures are medians. Both must sample exactly the serial runner's trajectories (one request seed each).

    python bench/agentic_rollout.py [episodes=32] [max_turns=6] [max_step_ms=50] [repeats=3]

Last line: ``agentic_async_speedup <lockstep s / async s> goal >=1.2``.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, median, result_line, scratch_dir  # noqa: E402


class SlowSteps:
    """An environment whose every step first sleeps 0-``max_s`` s, drawn from (episode, turn)."""

    def __init__(self, env, episode: int, max_s: float):
        self.env, self.episode, self.max_s, self.turn = env, episode, max_s, 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, text):
        time.sleep(random.Random(self.episode * 1000 + self.turn).random() * self.max_s)
        self.turn += 1
        return self.env.step(text)


def main(argv: list[str]) -> dict:
    from engines import environments
    from engines.agentic.chat import TurnRenderer
    from engines.agentic.rollout import EnginePolicy, EpisodeSpec, RolloutSettings, Runner
    from engines.agentic.warm_start import environment_texts
    from engines.inference.hf import HFInferenceEngine
    from engines.models import TinyModelSpec, build_tiny_model, load_tokenizer

    args = dict(a.split("=", 1) for a in argv)
    episodes, max_turns = int(args.get("episodes", 32)), int(args.get("max_turns", 6))
    max_s, repeats = float(args.get("max_step_ms", 50)) / 1000, int(args.get("repeats", 3))
    model = Path(scratch_dir("bench-agentic")) / "model"
    texts = environment_texts("Corridor-v0", {}, 200, seed=0, max_turns=max_turns)
    build_tiny_model(model, texts, TinyModelSpec(max_position_embeddings=256), seed=0)
    tokenizer, engine = load_tokenizer(str(model)), HFInferenceEngine(str(model), torch_threads=1)
    settings = RolloutSettings(max_turns=max_turns, max_tokens_per_turn=3, max_context=256)
    runner = Runner(EnginePolicy(engine, settings), TurnRenderer(tokenizer), settings,
                    lambda spec: SlowSteps(environments.make(spec.env_id), spec.index, max_s), environments.state_key)
    specs = [EpisodeSpec("Corridor-v0", 500 + i // 4, i // 4, i, sample_seed=i) for i in range(episodes)]

    def timed(mode):
        start = time.perf_counter()
        done = runner.run(specs, mode)
        return time.perf_counter() - start, done

    _, serial = timed("serial")
    seconds = {"lockstep": [], "async": []}
    same = True
    for _ in range(repeats):
        for mode in seconds:
            elapsed, done = timed(mode)
            seconds[mode].append(elapsed)
            same &= all(a.response_ids() == b.response_ids() for a, b in zip(serial, done))
    lockstep, asynchronous = median(seconds["lockstep"]), median(seconds["async"])
    turns = sum(len(e.turns) for e in serial)
    print(f"{episodes} episodes, {turns} turns, steps of 0-{max_s * 1000:.0f} ms: lockstep {lockstep:.2f} s, "
          f"async {asynchronous:.2f} s (medians of {repeats}); trajectories equal to the serial runner's: {same}")
    ratio = lockstep / asynchronous
    print(result_line("agentic_async_speedup", ratio, ">=", 1.2))
    payload = {"lockstep_s": lockstep, "async_s": asynchronous, "speedup": ratio, "same_trajectories": same,
               "turns": turns}
    emit(payload)
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
