"""SFT and DPO train tokens/s: RollFlow's torch engine against TRL's SFTTrainer and DPOTrainer, in one run.

    python bench/post_training.py [vocab=N]       # prints its figures; last line RESULT {json}

Both sides start from the same model (``SHAPE``, built offline from seed 0) and train on the same token
rows in the same batches: ``engines.data.synthetic``'s letter-reversal task (``sft_task``,
``preference_task``), encoded by ``engines.data.chat`` in the plain turn format, the loss on the
assistant's answer and its end-of-turn token. fp32, 2 torch threads, AdamW at a constant LR, gradient-norm
clip 1, no gradient checkpointing, one optimizer step per batch. RollFlow's engine runs in this process
(no Ray); TRL runs in its own (``bench/trl_post_training.py``, whose docstring lists its settings).

- SFT, ``SFT_ROWS`` rows a step: ``TorchTrainEngine.train_step(batch, SFTObjective())``, the batch one
  micro-batch whose sequences the engine packs without padding. TRL with ``padding_free=True`` and with
  ``False`` (padded rows).
- DPO, ``DPO_PAIRS`` pairs a step, sigmoid loss, beta 0.1: the reference's summed log-probs once over all
  the run's pairs (``ReferenceEngine.sequence_logprobs``, timed apart), then
  ``train_step(batch, DPOObjective())``; the engine packs a pair's two rows around one copy of their
  prompt. TRL with ``precompute_ref_log_probs=True`` (the same one reference pass, in its constructor) and
  with ``False`` (a reference forward in every step, TRL's default).

``vocab=N`` pads the model's (tied) embedding to ``N`` rows, as real checkpoints pad theirs past the
tokenizer: the rows never occur in the data, but every LM-head call computes their logits. The locally
trained tokenizer has 58 tokens, so by default the LM head is 0.4% of the model's parameters; in real
models it is 10-40% (Qwen2.5-0.5B: 136M of 494M, 28%). The run prints the share it measured at.

The floor, printed beside the SFT figures: the same steps as a bare loop of the HF model's forward on the
padded rows with its own loss, ``backward``, clip and fused AdamW (``PlainLoop``), no trainer around it.

Train tokens/s: the batch's tokens (prompts and answers, both rows of a pair) over a step's wall time, the
median over the steps after ``WARMUP``; RollFlow's step is the ``train_step`` call, TRL's runs from
``on_step_begin`` to ``on_step_end``. TRL's step reports the token count it saw, which must equal ours.
Each ratio is RollFlow's tokens/s over TRL's measured in the same run; the headline of each task is the
ratio against TRL's faster setting (the goal: at least 2, half TRL's time or better).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, median, result_line, scratch_dir  # noqa: E402

SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024)
SFT_ROWS = 64
DPO_PAIRS = 32
WARMUP = 2
STEPS = 12  # WARMUP included
LR = 1e-4
BETA = 0.1
GOAL = 2.0  # RollFlow's tokens/s over TRL's: half TRL's time or better


def build(out_dir: str, steps: int = STEPS, sft_rows: int = SFT_ROWS, pairs: int = DPO_PAIRS,
          shape: dict = SHAPE, vocab: int | None = None) -> tuple[str, list, list]:
    """The model, built from seed 0 with a tokenizer trained on the task's texts (its embedding padded to
    ``vocab`` rows when given), and ``steps`` batches of encoded SFT rows and preference pairs:
    ``(model path, EncodedRow list, EncodedPair list)``."""
    from transformers import AutoTokenizer

    from engines.data.chat import encode_preferences, encode_sft
    from engines.data.synthetic import preference_task, sft_task, texts_for_tokenizer
    from engines.models import TinyModelSpec, build_tiny_model

    sft, preferences = sft_task(steps * sft_rows, seed=0), preference_task(steps * pairs, seed=1)
    spec = TinyModelSpec(**shape, max_position_embeddings=256)
    model = str(build_tiny_model(Path(out_dir) / "model", texts_for_tokenizer(sft + preferences), spec, seed=0))
    if vocab is not None:
        _pad_vocabulary(model, vocab)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, rejected = encode_sft(tokenizer, sft, max_length=256)
    encoded_pairs, rejected_pairs = encode_preferences(tokenizer, preferences, max_length=256)
    if rejected.total or rejected_pairs.total:
        raise RuntimeError(f"SFT {rejected.summary()}; DPO {rejected_pairs.summary()}")
    return model, rows, encoded_pairs


def _pad_vocabulary(model_dir: str, rows: int) -> None:
    """Pad the model's embedding (tied to its LM head) to ``rows`` rows, the new ones drawn from seed 0."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model.resize_token_embeddings(rows, mean_resizing=False)
    model.save_pretrained(model_dir, safe_serialization=True)


def lm_head_share(model_dir: str) -> float:
    """The LM head's share of the model's parameters (tied: counted once, as the head)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.get_output_embeddings().weight.numel() / sum(p.numel() for p in model.parameters())


def write_rows(path: Path, model: str, rows: list, pairs: list) -> None:
    """The rows for ``bench/trl_post_training.py``: SFT rows as token ids and completion masks; pairs as
    strings (TRL tokenizes them itself) and the token ids RollFlow encoded them to (checked there)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    for row in [*rows, *(side for pair in pairs for side in (pair.chosen, pair.rejected))]:
        if row.loss_mask != [0] * row.prompt_length + [1] * (len(row.input_ids) - row.prompt_length):
            raise RuntimeError("a row's loss mask is not its tail: TRL's completion mask cannot express it")
    sft = [{"input_ids": r.input_ids, "completion_mask": r.loss_mask} for r in rows]
    dpo = []
    for pair in pairs:
        n = pair.chosen.prompt_length
        ids = {"prompt_ids": pair.chosen.input_ids[:n], "chosen_ids": pair.chosen.input_ids[n:],
               "rejected_ids": pair.rejected.input_ids[n:]}
        dpo.append({"prompt": tokenizer.decode(ids["prompt_ids"]), "chosen": tokenizer.decode(ids["chosen_ids"]),
                    "rejected": tokenizer.decode(ids["rejected_ids"]), **ids})
    path.write_text(json.dumps({"sft": sft, "dpo": dpo}))


def _engine(model: str, micro_batch_size: int, threads: int):
    from engines.training.torch import OptimSpec, TorchTrainEngine

    return TorchTrainEngine(model, OptimSpec(lr=LR, grad_clip=1.0), torch_threads=threads,
                            micro_batch_size=micro_batch_size)


def _steps(engine, batches: list, objective, after_step=None) -> dict:
    """``train_step`` on each batch: wall seconds, loss and tokens per step; ``after_step(i)`` after step i."""
    times, losses, tokens = [], [], []
    for i, batch in enumerate(batches):
        started = time.perf_counter()
        metrics = engine.train_step(batch, objective)
        times.append(time.perf_counter() - started)
        losses.append(metrics["train/loss"])
        tokens.append(int(batch.attention_mask.sum()))
        if after_step is not None:
            after_step(i)
    return {"step_times": times, "losses": losses, "tokens": tokens}


def rollflow_sft(model: str, rows: list, batch_rows: int, threads: int = 2, after_step=None) -> dict:
    """SFT steps of ``batch_rows`` rows each over ``rows``, in order."""
    from engines.algorithms.objective import SFTObjective
    from engines.data.chat import sft_batch_from

    engine = _engine(model, batch_rows, threads)
    pad = engine.tokenizer.pad_token_id
    batches = [sft_batch_from(rows[i:i + batch_rows], pad) for i in range(0, len(rows), batch_rows)]
    return _steps(engine, batches, SFTObjective(), after_step)


def rollflow_dpo(model: str, pairs: list, batch_pairs: int, threads: int = 2, before_steps=None,
                 after_step=None) -> dict:
    """The reference's summed log-probs of every pair once (``ref_s``), then DPO steps of ``batch_pairs``;
    ``before_steps()`` between the two."""
    from engines.algorithms.objective import DPOObjective
    from engines.data.chat import pair_batch_from
    from engines.training.torch import ReferenceEngine

    reference = ReferenceEngine(model, torch_threads=threads, micro_batch_size=2 * batch_pairs)
    pad = reference.model.config.pad_token_id
    started = time.perf_counter()
    ref_logps = reference.sequence_logprobs(pair_batch_from(pairs, pad))  # [2P]: chosen0, rejected0, ...
    ref_s = time.perf_counter() - started
    del reference
    engine = _engine(model, 2 * batch_pairs, threads)
    batches = [pair_batch_from(pairs[i:i + batch_pairs], pad, ref_logps[2 * i:2 * (i + batch_pairs)])
               for i in range(0, len(pairs), batch_pairs)]
    if before_steps is not None:
        before_steps()
    return {**_steps(engine, batches, DPOObjective(loss="sigmoid", beta=BETA), after_step), "ref_s": ref_s}


class PlainLoop:
    """The floor: the SFT steps as a bare loop, no trainer. ``step(i)`` pads batch i's rows to its longest
    (``sft_batch_from``) and runs the model's own loss on the answer tokens, ``backward``, the clip and a
    fused AdamW step."""

    def __init__(self, model: str, rows: list, batch_rows: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from engines.data.chat import sft_batch_from

        self.net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).train()
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=LR, weight_decay=0.0, fused=True)
        pad = self.net.config.pad_token_id
        self.batches = [sft_batch_from(rows[i:i + batch_rows], pad) for i in range(0, len(rows), batch_rows)]
        self.run = {"step_times": [], "losses": [], "tokens": []}

    def step(self, i: int) -> None:
        import torch

        started = time.perf_counter()
        batch = self.batches[i]
        labels = batch.input_ids.masked_fill(batch.loss_mask == 0, -100)  # [B, L]
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.net(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        self.optimizer.step()
        self.run["step_times"].append(time.perf_counter() - started)
        self.run["losses"].append(float(loss.detach()))
        self.run["tokens"].append(int(batch.attention_mask.sum()))


class TRLPeer:
    """``bench/trl_post_training.py`` in its own process, taking its steps in turn with ours: ``step()`` lets
    it run one training step and waits until that step is done (``--lockstep``), so every side's steps see
    the same background load. Its set-up runs while our first (warm-up) step does."""

    def __init__(self, model: str, rows_file: Path, task: str, steps: int, batch: int, **options) -> None:
        import os
        import subprocess

        from bench.common import REPO
        from bench.perf import FLOW_ENV

        go_read, self._go = os.pipe()
        self._done, done_write = os.pipe()
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        name = "-".join(["trl", task, *(f"{k}{v}" for k, v in options.items())])
        self._log = open(rows_file.parent / f"{name}.log", "w+")
        self._proc = subprocess.Popen(
            [sys.executable, "bench/trl_post_training.py", model, str(rows_file), f"--task={task}", f"--steps={steps}",
             f"--batch={batch}", f"--lr={LR}", f"--lockstep={go_read},{done_write}", *flags],
            cwd=REPO, env={**os.environ, **FLOW_ENV, "PYTHONPATH": str(REPO)}, stdout=self._log,
            stderr=subprocess.STDOUT, pass_fds=(go_read, done_write))
        os.close(go_read)
        os.close(done_write)

    def step(self, _: int = 0) -> None:
        import os

        os.write(self._go, b"g")
        if not os.read(self._done, 1):
            raise RuntimeError(f"the TRL process ended early:\n{self._output()[-4000:]}")

    def _output(self) -> str:
        self._proc.wait(timeout=120)
        self._log.seek(0)
        return self._log.read()

    def result(self) -> dict:
        from bench.common import read_result

        return read_result(self._output())


def rate(run: dict) -> dict:
    """Median tokens/s, step seconds and steps/s over the steps after ``WARMUP``."""
    step_s = median(run["step_times"][WARMUP:])
    return {"tokens_per_s": median(run["tokens"][WARMUP:]) / step_s, "step_s": step_s, "steps_per_s": 1 / step_s,
            "tokens_per_step": median(run["tokens"][WARMUP:]), "first_loss": run["losses"][0]}


def _print_rate(name: str, side: str, r: dict) -> None:
    print(f"{name} {side:>27}: {r['tokens_per_s']:7.0f} train tokens/s, {r['step_s']:.3f} s a step "
          f"({r['steps_per_s']:.2f} steps/s, {r['tokens_per_step']:.0f} tokens), first-step loss {r['first_loss']:.6f}",
          flush=True)


def _compare(name: str, ours: dict, theirs: dict[str, dict]) -> dict:
    """RollFlow's rate against each TRL setting's; the headline is the ratio against TRL's faster setting,
    printed as ``<name>_tokens_per_s_vs_trl <ratio> goal >=2 met|missed``."""
    a = rate(ours)
    _print_rate(name, "RollFlow", a)
    out = {"rollflow": a, "trl": {}, "ratios": {}, "trl_setup_s": {}}
    for setting, run in theirs.items():
        if run["tokens"] != ours["tokens"]:
            raise RuntimeError(f"{name}: TRL ({setting}) saw other batches: tokens per step {run['tokens']} "
                               f"against {ours['tokens']}")
        b = rate(run)
        _print_rate(name, f"TRL {setting}", b)
        out["trl"][setting], out["trl_setup_s"][setting] = b, run["setup_s"]
        out["ratios"][setting] = a["tokens_per_s"] / b["tokens_per_s"]
        print(f"{name} RollFlow / TRL {setting}: {out['ratios'][setting]:.3f}; first-step losses differ by "
              f"{abs(a['first_loss'] - b['first_loss']):.2e}", flush=True)
    out["trl_setting"] = min(out["ratios"], key=out["ratios"].get)
    out["ratio"] = out["ratios"][out["trl_setting"]]
    print(result_line(f"{name}_tokens_per_s_vs_trl", out["ratio"], ">=", GOAL) + f" (TRL {out['trl_setting']})",
          flush=True)
    return out


def _in_turn(*sides):
    """``after_step`` that runs step i of each of ``sides`` (callables of i) after ours."""
    return lambda i: [side(i) for side in sides]


def main(argv: list[str]) -> None:
    import torch

    args = dict(a.split("=", 1) for a in argv)
    vocab = int(args["vocab"]) if "vocab" in args else None
    torch.set_num_threads(2)
    started = time.perf_counter()
    out = Path(scratch_dir("post-training"))
    model, rows, pairs = build(str(out), STEPS, SFT_ROWS, DPO_PAIRS, SHAPE, vocab)
    rows_file = out / "rows.json"
    write_rows(rows_file, model, rows, pairs)
    from transformers import AutoConfig

    print(f"model {SHAPE}, vocabulary {AutoConfig.from_pretrained(model).vocab_size} (LM head "
          f"{lm_head_share(model):.1%} of the parameters), {STEPS} steps ({WARMUP} warm-up), SFT {SFT_ROWS} rows "
          f"a step, DPO {DPO_PAIRS} pairs; each step of every side in turn", flush=True)

    peers = {f"padding_free={flag}": TRLPeer(model, rows_file, "sft", STEPS, SFT_ROWS, padding_free=int(flag))
             for flag in (True, False)}
    loop = PlainLoop(model, rows, SFT_ROWS)
    ours = rollflow_sft(model, rows, SFT_ROWS, after_step=_in_turn(loop.step, *(p.step for p in peers.values())))
    sft = _compare("sft", ours, {setting: peer.result() for setting, peer in peers.items()})
    floor = rate(loop.run)
    _print_rate("sft", "plain torch loop", floor)
    print(f"sft RollFlow / plain torch loop: {sft['rollflow']['tokens_per_s'] / floor['tokens_per_s']:.3f}", flush=True)

    peers = {}

    def start_dpo_peers() -> None:  # after our reference pass, so that it runs alone
        peers.update({f"precompute_ref_log_probs={flag}": TRLPeer(model, rows_file, "dpo", STEPS, DPO_PAIRS,
                                                                  precompute_ref=int(flag)) for flag in (True, False)})

    ours = rollflow_dpo(model, pairs, DPO_PAIRS, before_steps=start_dpo_peers,
                        after_step=lambda i: [peer.step(i) for peer in peers.values()])
    dpo = _compare("dpo", ours, {setting: peer.result() for setting, peer in peers.items()})
    print(f"dpo reference pass: RollFlow {ours['ref_s']:.3f} s, once; TRL's set-up took "
          + ", ".join(f"{s:.3f} s with {k}" for k, s in dpo["trl_setup_s"].items())
          + f"; ln 2 = {math.log(2):.6f}", flush=True)
    print(f"bench wall time {time.perf_counter() - started:.0f} s", flush=True)
    emit({"sft": sft, "sft_plain_loop": floor, "dpo": dpo, "dpo_ref_s": ours["ref_s"],
          "ratios": {"sft_tokens_per_s": sft["ratio"], "dpo_tokens_per_s": dpo["ratio"]}})


if __name__ == "__main__":
    main(sys.argv[1:])
