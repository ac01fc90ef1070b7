"""The baseline: Hugging Face TRL's ``GRPOTrainer`` on the same model, prompts and reward.

Run in its own process (``python bench/trl_grpo.py MODEL STEPS MAX_NEW_TOKENS ...``) so its threads and
memory do not mix with RollFlow's. Settings mirror RollFlow's GRPO: beta 0 (no reference model),
group-std advantage scaling, token-mean loss, constant LR, one optimizer step per generation batch,
fp32, 2 torch threads. Gradient checkpointing is off (TRL's default is on; off is faster at these sizes).
Each step's wall time is taken from ``on_step_begin`` to ``on_step_end``: generation, reward, loss,
backward and the optimizer step. With ``--eval-every`` the held-out accuracy (greedy) is measured
every so many steps, outside the timed steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def math_reward(prompts, completions, answer, **_) -> list[float]:
    from engines.rewards import get_reward

    return list(get_reward("math")(prompts, completions, answer=answer))


def heldout_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Greedy accuracy on ``rows`` with RollFlow's HF engine loop (the same evaluation both sides)."""
    import torch

    from engines.inference.hf import HFInferenceEngine
    from engines.types import SamplingParams

    engine = HFInferenceEngine.from_model(model, tokenizer)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = engine.generate([r["prompt"] for r in rows], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                                       stop_token_ids=(tokenizer.eos_token_id,)))
    model.train(was_training)
    rewards = math_reward([r["prompt"] for r in rows], out.completions, [r["answer"] for r in rows])
    return sum(r >= 1.0 for r in rewards) / len(rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", default="tiny", help="tiny | quickstart: which arithmetic split")
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.0, help="stop once held-out accuracy reaches this")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.common import arithmetic_rows, emit, quickstart_rows

    train_rows, heldout = arithmetic_rows() if args.data == "tiny" else quickstart_rows()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rows = args.prompts_per_step * args.group_size
    config = GRPOConfig(
        output_dir=str(Path(args.model).parent / "trl-out"), per_device_train_batch_size=rows,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, beta=0.0, max_steps=args.steps, use_cpu=True, bf16=False,
        gradient_checkpointing=False, logging_steps=10**9, save_strategy="no", report_to="none", seed=args.seed,
        temperature=1.0, disable_tqdm=True, dataloader_num_workers=0,
    )
    times, evals = [], []
    clock = {"train": 0.0}

    class Timer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            elapsed = time.perf_counter() - self.start
            times.append(elapsed)
            clock["train"] += elapsed
            if args.eval_every and state.global_step % args.eval_every == 0:
                accuracy = heldout_accuracy(kw["model"], tokenizer, heldout, args.max_new_tokens)
                evals.append({"step": state.global_step, "accuracy": accuracy, "train_s": clock["train"]})
                if args.target and accuracy >= args.target:
                    control.should_training_stop = True

    started = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    setup_s = time.perf_counter() - started
    if args.eval_every:
        evals.append({"step": 0, "accuracy": heldout_accuracy(model, tokenizer, heldout, args.max_new_tokens), "train_s": 0.0})
    trainer.train()
    result = {"step_times": times, "setup_s": setup_s, "evals": evals}
    emit(result)
    return result


if __name__ == "__main__":
    main()
