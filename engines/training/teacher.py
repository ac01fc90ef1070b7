"""Teacher engine for distillation: a frozen HF model, any path, that scores the student's data.

Offline distillation stores, per answer token, the teacher's top-k token ids with their log-probs under
the **full-vocabulary** softmax at the teacher temperature, plus the log of the mass outside them
(``topk_logprobs``): k + 1 buckets that make top-k forward KL exact once the top-k holds the teacher's
support. On-policy distillation needs the teacher's log-prob of each token the student sampled
(``logprobs`` / ``rollout_logprobs``, temperature 1). A teacher is a reference scorer with one more
question to answer, so it holds a ``ReferenceEngine`` and asks it the shared ones.
"""

from __future__ import annotations

import torch

from engines.models import load_tokenizer
from engines.training.logprobs import batched_outputs, packed_vocab_logprobs
from engines.training.torch import ReferenceEngine
from engines.types import Rollouts, TrainBatch


def topk_with_tail(log_probs: torch.Tensor, k: int, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``log_probs`` ``[N, V]`` (a log-softmax) among its first
    ``tokens`` columns (default all: the rows past a tokenizer's length are padding no student can hold),
    sorted descending: ``(ids [N, k] int64, logprobs [N, k], tail [N])`` with ``tail = log Σ_{v ∉ top-k} p_v``
    over all V columns (``-inf`` when ``k = V``). The tail is a log-sum-exp over the other entries, exact
    where ``log(1 − Σ_top-k p)`` would cancel (a top-k holding nearly all the mass)."""
    tokens = log_probs.shape[-1] if tokens is None else min(tokens, log_probs.shape[-1])
    if not 0 < k <= tokens:
        raise ValueError(f"top-k needs 0 < k <= vocabulary size {tokens}, got k={k}")
    top, ids = log_probs[:, :tokens].topk(k, dim=-1)  # [N, k], sorted
    tail = log_probs.scatter(-1, ids, float("-inf")).logsumexp(-1)  # [N]
    return ids, top, tail


class TeacherEngine:
    """A frozen teacher model in a Ray actor (``"teacher/torch"``): top-k distributions for offline
    distillation, sampled-token log-probs for on-policy distillation, summed answer log-probs.

    Positions are those of ``batch.loss_mask`` (the answer tokens); each runs the LM head once, on packed
    rows without padding, in micro-batches of ``micro_batch_size`` rows, without gradients. Results are on CPU."""

    def __init__(self, model_path: str, *, dtype: str = "float32", torch_threads: int = 0,
                 micro_batch_size: int = 8, attn_implementation: str | None = None,
                 device: str | None = None) -> None:
        self.scorer = ReferenceEngine(model_path, dtype=dtype, torch_threads=torch_threads,
                                      micro_batch_size=micro_batch_size, temperature=1.0, packing=True,
                                      attn_implementation=attn_implementation, device=device)
        self.tokens = len(load_tokenizer(model_path))  # output rows past it are padding

    @torch.no_grad()
    def topk_logprobs(self, batch: TrainBatch, k: int, temperature: float) -> dict[str, torch.Tensor]:
        """The teacher's top-k at each ``loss_mask`` token, from ``log softmax(logits / temperature)`` over
        the whole vocabulary (ids among the tokenizer's tokens): ``ids`` [B, L, k] int64 and ``logprobs`` [B, L, k] float32 (sorted descending)
        and ``tail`` [B, L] float32 (``topk_with_tail``), 0 at the other positions. Entry ``t`` is the
        distribution of token ``t`` given the tokens before it, aligned like ``input_ids`` (the student's
        ``gather_ids``)."""
        scorer = self.scorer
        scorer.model.eval()

        def forward(micro: TrainBatch) -> dict[str, torch.Tensor]:
            vocab = packed_vocab_logprobs(scorer.model, micro.input_ids, micro.attention_mask, micro.loss_mask,
                                          temperature=temperature, share_prefixes=scorer.share_prompts)
            ids, top, tail = topk_with_tail(vocab.log_probs, k, self.tokens)
            return {"ids": vocab.place(ids), "logprobs": vocab.place(top), "tail": vocab.place(tail)}

        out = batched_outputs(forward, batch.to(scorer.device), scorer.micro_batch_size)
        return {key: value.cpu() for key, value in out.items()}

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-prob of each ``loss_mask`` token at temperature 1 (0 elsewhere), [B, L]."""
        return self.scorer.logprobs(batch)

    def rollout_logprobs(self, rollouts: Rollouts) -> torch.Tensor:
        """``logprobs`` of ``prompt ++ response`` rows, aligned like ``build_train_batch(rollouts)``: the
        teacher's score of each sampled token."""
        return self.scorer.rollout_logprobs(rollouts)

    def sequence_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Summed log-probs of each row's ``loss_mask`` tokens, [B]."""
        return self.scorer.sequence_logprobs(batch)

    def vocab_size(self) -> int:
        """Tokens of the teacher's tokenizer: the largest top-k (the output layer's padding rows after them
        never enter a top-k)."""
        return self.tokens

    # -- memory (engines.protocols) --------------------------------------------------------------------
    def offload(self) -> None:
        self.scorer.offload()

    def reload(self) -> None:
        self.scorer.reload()
