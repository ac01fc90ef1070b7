"""Typed values that move between engines: sampling settings, rollouts, training batches.

Shapes use B = rows (prompts × group size), P = padded prompt length, T = padded response length,
L = P + T.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the inference engine samples. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0  # seeds the sampling generator: same seed + weights + prompts → same completions
    # one seed per row, each row sampled from its own generator: a row's completion then does not depend
    # on the other rows of the call (agentic rollouts batch the turns of independent episodes)
    row_seeds: tuple[int, ...] = ()
    # a weight update that lands while rows are decoding (an engine that takes updates between decoding
    # steps): "keep" decodes on with the new weights (``Rollouts.token_versions`` records each token's),
    # "abort" stops the rows still decoding (finish reason "abort")
    on_weight_update: str = "keep"


@dataclass(frozen=True)
class Rollouts:
    """Completions of a batch of prompts, as the inference engine returns them.

    Row ``i`` continues ``prompt_ids[i]``. Responses are right-padded with ``pad_token_id``.
    ``logprobs`` are log-softmax of ``logits / temperature`` (temperature 1 when greedy) at the sampled
    token, before top-k/top-p filtering; 0 past ``response_lengths``.

    Multi-turn: a response may be several (model response, environment observation) segments, token
    ids as generated and as the environment returned them. ``response_loss_mask`` marks the model's
    tokens (``logprobs`` are 0 on observation tokens) and ``response_turn_index`` each token's segment;
    ``response_lengths`` then count both kinds. Both ``None``: one segment, every token the model's.
    """

    prompt_ids: list[list[int]]  # B lists of prompt token ids (unpadded)
    response_ids: torch.Tensor  # [B, T] int64
    logprobs: torch.Tensor  # [B, T] float32
    response_lengths: torch.Tensor  # [B] int64, tokens generated including a stop token
    finish_reasons: list[str]  # B of "stop" | "length" | "abort" (a weight update stopped the row)
    completions: list[str]  # B decoded responses, stop token stripped
    weights_version: int
    compute_seconds: float = 0.0  # wall time inside the engine's generate call
    response_loss_mask: torch.Tensor | None = None  # [B, T] float32, 1 on model tokens, 0 on observations
    response_turn_index: torch.Tensor | None = None  # [B, T] int64, k >= 1 on the k-th segment's tokens
    # [B, T] int64, the weights version that produced each token, when a weight update landed during the call
    # (a partial rollout); None: every token is ``weights_version``'s
    token_versions: torch.Tensor | None = None

    def model_token_mask(self) -> torch.Tensor:
        """``[B, T]`` float32: ``response_loss_mask``, or 1 everywhere (every sampled token is the model's)."""
        if self.response_loss_mask is None:
            return torch.ones(self.response_ids.shape, dtype=torch.float32, device=self.response_ids.device)
        return self.response_loss_mask.float()

    def turn_index(self) -> torch.Tensor:
        """``[B, T]`` int64: ``response_turn_index``, or else derived from the mask: a segment starts at
        each model token that opens the response or follows an observation token (an observation belongs
        to the segment of the response before it). Pass ``response_turn_index`` where an empty
        observation separates two responses: the mask cannot show that boundary."""
        if self.response_turn_index is not None:
            return self.response_turn_index.long()
        model = self.model_token_mask() > 0  # [B, T]
        after_observation = torch.nn.functional.pad(~model[:, :-1], (1, 0), value=True)  # [B, T]
        return (model & after_observation).long().cumsum(-1).clamp(min=1)


@dataclass(frozen=True)
class TrainBatch:
    """Left-aligned sequences ``prompt ++ response`` for the training engine.

    Row ``i`` holds its prompt at ``[0, p_i)`` and its response at ``[p_i, p_i + r_i)``, right-padded.
    Every per-token tensor is aligned with ``input_ids``: entry ``t`` of ``logprobs`` is the log-probability
    of ``input_ids[:, t]`` given tokens before it (entry 0 is 0). In a multi-turn row the response is
    several (model response, environment observation) segments: ``loss_mask`` covers the model's tokens
    only, with holes at the observations, and ``turn_index`` numbers the segments.
    """

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64, 1 on real tokens
    loss_mask: torch.Tensor  # [B, L] float32, 1 on model (response) tokens, 0 on prompt, observations, padding
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token [B, L] floats: advantages, old_logprobs, ref_logprobs…
    # [B, L] int64: 0 on the prompt and padding, k >= 1 on the k-th (response, observation) segment;
    # None becomes 1 on the loss_mask tokens (a single-turn batch)
    turn_index: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None  # [B] int64: rows with one id are completions of one prompt

    def __post_init__(self) -> None:
        if self.turn_index is None:
            object.__setattr__(self, "turn_index", (self.loss_mask > 0).long())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: slice | torch.Tensor) -> "TrainBatch":
        """Rows ``rows`` of every tensor, trimmed to the longest remaining sequence."""
        length = int(self.attention_mask[rows].sum(-1).max())
        cut = lambda t: t[rows][:, :length]  # noqa: E731
        return TrainBatch(
            input_ids=cut(self.input_ids),
            attention_mask=cut(self.attention_mask),
            loss_mask=cut(self.loss_mask),
            turn_index=cut(self.turn_index),
            tensors={k: cut(v) for k, v in self.tensors.items()},
            group_ids=None if self.group_ids is None else self.group_ids[rows],
        )

    def micro_batches(self, size: int):
        """Consecutive row chunks of at most ``size`` rows, each trimmed to its own longest sequence."""
        for start in range(0, len(self), size):
            yield self.select(slice(start, start + size))

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The batch with every tensor on ``device`` (tensors already there are not copied)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask),
                          {k: move(v) for k, v in self.tensors.items()}, turn_index=move(self.turn_index),
                          group_ids=move(self.group_ids))

    def with_tensors(self, **tensors: torch.Tensor) -> "TrainBatch":
        return dataclasses.replace(self, tensors={**self.tensors, **tensors})


def build_train_batch(rollouts: Rollouts, pad_token_id: int) -> TrainBatch:
    """Join each prompt with its response into a left-aligned, right-padded TrainBatch.

    Vectorized: boolean masks pick, row after row, the prompt slots ``[0, p_i)`` and the response slots
    ``[p_i, p_i + r_i)``; filling them in row-major order places each row's tokens in order. The response
    slots take ``loss_mask`` and ``turn_index`` from the rollouts' model-token mask and turn index (1 and
    1 on every sampled token of a single-turn rollout); the prompt and the padding get 0 in both."""
    device = rollouts.response_ids.device
    prompt_lengths = torch.tensor([len(p) for p in rollouts.prompt_ids], dtype=torch.long, device=device)
    response_lengths = rollouts.response_lengths.long().to(device)
    lengths = prompt_lengths + response_lengths
    width = int(lengths.max()) if len(lengths) else 0
    columns = torch.arange(width, device=device)
    attention_mask = (columns < lengths[:, None]).long()  # [B, L]
    is_prompt = columns < prompt_lengths[:, None]
    is_response = attention_mask.bool() & ~is_prompt
    is_sampled = torch.arange(rollouts.response_ids.shape[1], device=device) < response_lengths[:, None]  # [B, T]
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long, device=device)
    input_ids[is_prompt] = torch.tensor([t for prompt in rollouts.prompt_ids for t in prompt], dtype=torch.long,
                                        device=device)
    input_ids[is_response] = rollouts.response_ids[is_sampled].long()
    old_logprobs = torch.zeros((len(lengths), width), dtype=torch.float32, device=device)
    old_logprobs[is_response] = rollouts.logprobs[is_sampled].float()
    loss_mask = torch.zeros((len(lengths), width), dtype=torch.float32, device=device)
    loss_mask[is_response] = rollouts.model_token_mask()[is_sampled]
    turn_index = torch.zeros((len(lengths), width), dtype=torch.long, device=device)
    turn_index[is_response] = rollouts.turn_index()[is_sampled]
    return TrainBatch(input_ids, attention_mask, loss_mask, {"rollout_logprobs": old_logprobs}, turn_index=turn_index)
