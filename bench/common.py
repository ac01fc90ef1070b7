"""Shared pieces of the benchmarks: the two model sizes, the arithmetic prompts, result lines.

Every benchmark builds its models in a temporary folder from a fixed seed, so RollFlow and the
baseline it is compared with start from the same weights and tokenizer. Results are printed as
``<name> <value> goal <op><target> <met|missed>``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SIZES = {
    # configs/tiny.yaml's model
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    # ~26M parameters, the size at which the goals of issue 6 hold
    "bench": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=1408),
}
MAX_NEW_TOKENS = {"tiny": 8, "bench": 64}


def arithmetic_rows(num_train: int = 500, num_heldout: int = 32, max_operand: int = 30, seed: int = 0):
    """``configs/tiny.yaml``'s task: ``(train_rows, heldout_rows)``."""
    from engines.data.arithmetic import make_arithmetic_splits

    return make_arithmetic_splits(num_train=num_train, num_heldout=num_heldout, max_operand=max_operand,
                                  ops=("+",), seed=seed)


def quickstart_rows():
    """``configs/quickstart.yaml``'s task, drawn with seed 0: ``(train_rows, heldout_rows)``."""
    return arithmetic_rows(num_train=4000, num_heldout=200, max_operand=99)


def build_model(size: str, out_dir: str | os.PathLike, rows: list[dict], seed: int = 0,
                max_positions: int = 256) -> str:
    """A Qwen2 model of ``SIZES[size]`` (or a dict of TinyModelSpec fields) with a tokenizer trained on ``rows``."""
    from engines.models import TinyModelSpec, build_tiny_model

    shape = SIZES[size] if isinstance(size, str) else size
    spec = TinyModelSpec(**shape, max_position_embeddings=max_positions)
    return str(build_tiny_model(Path(out_dir), [r["prompt"] + r["answer"] for r in rows], spec, seed=seed))


def grpo_batch(model: str, rows: list[dict], max_new_tokens: int, prompts: int = 8, group: int = 8):
    """A GRPO train batch on ``model``: ``prompts`` x ``group`` HF samples (temperature 1, seed 0) of the first
    prompts of ``rows``, with uniform random rewards (seed 0)."""
    import torch

    from engines.batches import AdvantageSpec, advantage_batch
    from engines.inference.hf import HFInferenceEngine
    from engines.types import SamplingParams

    rollout = HFInferenceEngine(model, torch_threads=2)
    out = rollout.generate([r["prompt"] for r in rows[:prompts] for _ in range(group)],
                           SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=0))
    rewards = torch.rand(len(out.completions), generator=torch.Generator().manual_seed(0))
    group_ids = torch.arange(prompts).repeat_interleave(group)
    batch, _, _ = advantage_batch(out, rewards, group_ids, AdvantageSpec("grpo", rollout.tokenizer.pad_token_id))
    return batch


def scratch_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=f"rollflow-{prefix}-")


def median(values) -> float:
    return float(statistics.median(values))


def result_line(name: str, value: float, op: str, target: float) -> str:
    met = value <= target if op == "<=" else value >= target
    return f"{name} {value:#.3g} goal {op}{target:g} {'met' if met else 'missed'}"


def emit(payload: dict) -> None:
    """Last stdout line of a benchmark subprocess: its figures as JSON, read by ``run_all.py``."""
    print("RESULT " + json.dumps(payload), flush=True)


def read_result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError("benchmark printed no RESULT line:\n" + stdout[-4000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


def start_flow_services() -> None:
    """What a benchmark of the real flow needs in this process: quiet Prefect, transformers and tokenizers
    (unless set already), a local Ray cluster and a Prefect server."""
    for key, value in {"PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}.items():
        os.environ.setdefault(key, value)
    from flows.setup import ensure_ray, start_prefect_server

    ensure_ray()
    start_prefect_server()
