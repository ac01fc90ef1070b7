"""The baselines of ``bench/post_training.py``: TRL's ``SFTTrainer`` and ``DPOTrainer`` on the same token rows.

    python bench/trl_post_training.py MODEL ROWS_JSON --task sft|dpo --steps N --batch B [--padding-free 0|1]
                                      [--precompute-ref 0|1]

Run in its own process so its threads and memory do not mix with RollFlow's. ``ROWS_JSON`` is what
``bench.post_training.write_rows`` wrote: the SFT rows as token ids with their completion masks, the
preference rows as prompt/chosen/rejected strings and the token ids RollFlow encoded them to. Each step
takes the next ``B`` rows (pairs) in file order (``_InOrder``), so both sides see the same batches.

Settings, both trainers: fp32, ``--threads`` torch threads, AdamW (transformers' default, fused) at a
constant LR, no warm-up, no weight decay, gradient-norm clip 1, no gradient checkpointing, one optimizer
step per batch (no accumulation), dropout off.

- SFT: the dataset holds ``input_ids`` and ``completion_mask`` (already tokenized: TRL skips its own
  tokenization), ``completion_only_loss=True`` (the loss on the assistant's tokens only),
  ``packing=False`` (rows are not regrouped across steps), ``max_length=None``; with ``--padding-free 1``
  ``padding_free=True`` (a step's rows concatenated into one sequence with restarting position ids, no
  padding; without a flash-attention kernel transformers attends over it with a dense block-diagonal
  mask), with 0 the rows padded to the batch's longest.
- DPO: ``loss_type="sigmoid"``, ``beta`` 0.1, the reference a frozen copy of the model; with
  ``--precompute-ref 1`` its summed log-probs are computed once for the dataset before training (inside
  the trainer's constructor, timed as ``setup_s``), with 0 by a reference forward in every step. TRL
  tokenizes the strings itself; the token ids are checked against RollFlow's before training.

A step's wall time runs from ``on_step_begin`` to ``on_step_end``: forward, loss, backward, clip and the
optimizer step (collating the batch happens before it). With ``--lockstep GO,DONE`` (two file descriptors
``bench.post_training.TRLPeer`` passes) each step first waits for a byte on GO and writes one to DONE when
it ends, so the driver runs its own steps in between. The loss of every step and its token count (the
rows' real tokens, prompts included) come back with the times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _in_order(trainer_class):
    """``trainer_class`` that feeds its rows in dataset order and records each training step's loss and tokens."""
    from torch.utils.data import SequentialSampler

    class _InOrder(trainer_class):
        recorded: list[tuple[float, int]]

        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def compute_loss(self, model, inputs, *args, **kwargs):
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                loss = out[0] if isinstance(out, tuple) else out
                mask = inputs.get("attention_mask")  # padding-free SFT has none: its one row is all tokens
                tokens = int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
                self.recorded.append((float(loss.detach()), tokens))
            return out

    return _InOrder


def _check_tokens(dataset, rows: list[dict]) -> None:
    """TRL's tokenization of the preference strings must give RollFlow's token ids, row for row."""
    for i, (mine, theirs) in enumerate(zip(rows, dataset)):
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            if list(theirs[key]) != mine[key]:
                raise SystemExit(f"row {i}: TRL's {key} {list(theirs[key])} differ from RollFlow's {mine[key]}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("rows", help="the JSON file bench.post_training.write_rows wrote")
    parser.add_argument("--task", choices=("sft", "dpo"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True, help="rows (SFT) or pairs (DPO) per step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--padding-free", type=int, default=1, help="SFT only")
    parser.add_argument("--precompute-ref", type=int, default=1, help="DPO only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lockstep", default="", help="GO,DONE: file descriptors to take steps in turn by")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from bench.common import emit

    rows = json.loads(Path(args.rows).read_text())[args.task][: args.steps * args.batch]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    common = dict(output_dir=str(Path(args.rows).parent / f"trl-{args.task}"), per_device_train_batch_size=args.batch,
                  gradient_accumulation_steps=1, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, max_grad_norm=1.0, max_steps=args.steps, use_cpu=True, bf16=False,
                  gradient_checkpointing=False, logging_steps=10**9, save_strategy="no", report_to="none",
                  seed=args.seed, disable_tqdm=True, dataloader_num_workers=0)
    if args.task == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer_class = _in_order(SFTTrainer)
        config = SFTConfig(**common, completion_only_loss=True, padding_free=bool(args.padding_free), packing=False, max_length=None)
        dataset = Dataset.from_list([{"input_ids": r["input_ids"], "completion_mask": r["completion_mask"]} for r in rows])
    else:
        from trl import DPOConfig, DPOTrainer

        trainer_class = _in_order(DPOTrainer)
        config = DPOConfig(**common, loss_type=["sigmoid"], beta=args.beta, max_length=None,
                           precompute_ref_log_probs=bool(args.precompute_ref))
        dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    times: list[float] = []
    go, done = (int(fd) for fd in args.lockstep.split(",")) if args.lockstep else (None, None)

    class Timer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            if go is not None:
                os.read(go, 1)
            self.start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            times.append(time.perf_counter() - self.start)
            if done is not None:
                os.write(done, b"d")

    started = time.perf_counter()
    trainer = trainer_class(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                            callbacks=[Timer()])
    setup_s = time.perf_counter() - started
    trainer.recorded = []
    if args.task == "dpo":
        _check_tokens(trainer.train_dataset, rows)
    trainer.train()
    result = {"step_times": times, "losses": [loss for loss, _ in trainer.recorded],
              "tokens": [tokens for _, tokens in trainer.recorded], "setup_s": setup_s}
    emit(result)
    return result


if __name__ == "__main__":
    main()
