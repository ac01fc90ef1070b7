"""Per-token log-probabilities (policy) and values (critic) of given sequences, shared by the training and
reference engines. Both are aligned with ``input_ids``: entry ``t`` is computed from tokens ``< t``.

``packed_token_logprobs`` is the padding-free form: sequences are packed into rows (first-fit decreasing,
rows about two sequences wide: ``pack_width``), each restarting its position ids so attention stays within it,
and the LM head runs only at the positions whose next token is needed (the response tokens).

Both forms compute one log-softmax over the vocabulary (``VocabLogprobs``); ``token_outputs`` derives from
it what a loss asks for (``FORWARD_OUTPUTS``): the sampled token's log-prob, the entropy, whether the
argmax is the token, the whole distribution, or its values at given ids (a teacher's top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from engines.types import TrainBatch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left and right padding give the same values."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def token_entropy(log_probs: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """``H = -sum_v p_v log p_v`` over the last (vocabulary) dimension, ``[..., V]`` → ``[...]``.

    With ``grad`` the entropy is differentiable (an entropy bonus trains through it) and autograd keeps
    ``p`` and ``p log p`` over the whole vocabulary for the backward pass. Without, it is a metric only:
    computed under ``no_grad`` on detached log-probs, so none of that is kept."""
    if grad:
        return -(log_probs.exp() * log_probs).sum(-1)
    with torch.no_grad():
        detached = log_probs.detach()
        return -(detached.exp() * detached).sum(-1)


FORWARD_OUTPUTS: dict[str, str] = {"entropy": "entropy", "top1": "top1_correct", "vocab_logprobs": "vocab_logprobs",
                                   "gathered_logprobs": "gathered_logprobs"}
"""What a forward returns besides ``logprobs`` on request (an objective's ``outputs``): name -> key of the result."""


@dataclass(frozen=True)
class VocabLogprobs:
    """``log softmax(logits / temperature)`` over the vocabulary at ``N`` positions of a ``[B, L]`` batch: every
    position after the first (padded form) or the needed ones (packed form). Row ``n`` is the distribution
    of the token at ``index[n]``, computed from the tokens before it."""

    log_probs: torch.Tensor  # [N, V] float32, differentiable
    index: tuple[torch.Tensor, torch.Tensor]  # ([N], [N]): the positions' rows and columns in [B, L]
    targets: torch.Tensor  # [N] int64: the token at each position
    shape: tuple[int, int]  # (B, L)

    def place(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[N, ...]`` at their positions of a ``[B, L, ...]`` tensor, 0 elsewhere (differentiable)."""
        out = values.new_zeros((*self.shape, *values.shape[1:]))
        out[self.index] = values
        return out


def padded_vocab_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L] int64
    attention_mask: torch.Tensor,  # [B, L]
    *,
    temperature: float = 1.0,
) -> VocabLogprobs:
    """The tempered log-softmax at every position ``t >= 1`` (from the logits at ``t - 1``), one forward of
    the padded batch."""
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits[:, :-1]
    logits = logits.float() / (temperature if temperature > 0 else 1.0)
    log_probs = torch.log_softmax(logits, dim=-1)  # [B, L-1, V]
    rows, width = input_ids.shape
    cols = torch.arange(1, width, device=input_ids.device)
    index = (torch.arange(rows, device=input_ids.device).repeat_interleave(width - 1), cols.repeat(rows))
    return VocabLogprobs(log_probs.reshape(-1, log_probs.shape[-1]), index, input_ids[index], (rows, width))


def token_outputs(vocab: VocabLogprobs, outputs: Iterable[str] = (), *, entropy_grad: bool = False,
                  gather_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``logprobs`` ``[B, L]`` (the token's log-prob) and the requested ``outputs`` (``FORWARD_OUTPUTS``), all
    from ``vocab``'s one log-softmax and 0 at the positions it does not cover:

    - ``entropy`` → ``entropy`` ``[B, L]``, differentiable only with ``entropy_grad`` (``token_entropy``);
    - ``top1`` → ``top1_correct`` ``[B, L]`` float: 1 where the argmax of the tempered logits is the token
      (no gradient);
    - ``vocab_logprobs`` → ``vocab_logprobs`` ``[B, L, V]``: the whole log-softmax, differentiable;
    - ``gathered_logprobs`` → ``gathered_logprobs`` ``[B, L, k]``: the log-softmax at ``gather_ids``
      ``[B, L, k]`` int64 (e.g. a teacher's top-k ids, aligned like ``input_ids``), differentiable."""
    unknown = set(outputs) - FORWARD_OUTPUTS.keys()
    if unknown:
        raise ValueError(f"unknown forward outputs {sorted(unknown)}; known: {', '.join(sorted(FORWARD_OUTPUTS))}")
    log_probs = vocab.log_probs  # [N, V]
    out = {"logprobs": vocab.place(log_probs.gather(-1, vocab.targets[:, None]).squeeze(-1))}
    if "entropy" in outputs:
        out["entropy"] = vocab.place(token_entropy(log_probs, grad=entropy_grad))
    if "top1" in outputs:
        out["top1_correct"] = vocab.place((log_probs.detach().argmax(-1) == vocab.targets).float())
    if "vocab_logprobs" in outputs:
        out["vocab_logprobs"] = vocab.place(log_probs)
    if "gathered_logprobs" in outputs:
        if gather_ids is None or tuple(gather_ids.shape[:2]) != vocab.shape or gather_ids.dim() != 3:
            raise ValueError(f"gathered_logprobs needs gather_ids [B, L, k] with (B, L) = {vocab.shape} "
                             f"(batch.tensors['gather_ids']), got {None if gather_ids is None else tuple(gather_ids.shape)}")
        out["gathered_logprobs"] = vocab.place(log_probs.gather(-1, gather_ids[vocab.index].long()))
    return out


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L] int64
    attention_mask: torch.Tensor,  # [B, L]
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logprobs[:, t] = log softmax(logits_{t-1} / temperature)[input_ids[:, t]]``; column 0 is 0.

    Returns ``(logprobs [B, L], entropy [B, L] or None)``; entropy is of the same tempered distribution,
    differentiable only with ``entropy_grad`` (``token_entropy``).
    """
    vocab = padded_vocab_logprobs(model, input_ids, attention_mask, temperature=temperature)
    out = token_outputs(vocab, ("entropy",) if with_entropy else (), entropy_grad=entropy_grad)
    return out["logprobs"], out.get("entropy")


@dataclass(frozen=True)
class PackedSequences:
    """Left-aligned rows of a ``[B, L]`` batch packed into ``[R, W]`` rows (``R <= B``).

    ``logit_index`` (rows, cols in the packed layout) are the positions whose logits predict the tokens at
    ``target_index`` (rows, cols in the ``[B, L]`` layout); ``target_ids`` are those tokens. With
    ``attention_mask`` (additive, ``[R, 1, W, W]``) rows with one prompt share a single copy of it;
    without, sequences are told apart by their position ids alone."""

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]; a new sequence (or the pad tail) starts at 0
    logit_index: tuple[torch.Tensor, torch.Tensor]  # ([N], [N])
    target_index: tuple[torch.Tensor, torch.Tensor]  # ([N], [N])
    target_ids: torch.Tensor  # [N]
    attention_mask: torch.Tensor | None = None


SHARED_PROMPT_MIN_SAVING = 0.1  # share prompts when that removes at least this share of the tokens
SHARED_SEGMENT_WIDTH = 512  # a shared segment grows past the longest sequence up to this many tokens
SHARED_MAX_WIDTH = 2048  # longer sequences are not shared: the dense [W, W] mask grows with the square


def _prompt_segments(input_ids: torch.Tensor, lengths: list[int], prompt_lengths: list[int],
                     share_prompts: bool) -> list[tuple[int, list[int]]]:
    """``(prefix length, rows)`` per segment: rows whose prompts are identical (a GRPO group) form one
    segment of the prompt once, then each row's response; unshared, every row is a segment of its own.

    Shared segments are cut at ``max(longest sequence, SHARED_SEGMENT_WIDTH)`` tokens, and sharing is
    dropped when it would save under ``SHARED_PROMPT_MIN_SAVING`` of the tokens (the masked attention of
    a shared row costs more than position-separated packing) or a sequence is longer than
    ``SHARED_MAX_WIDTH``."""
    alone = [(0, [i]) for i in range(len(lengths))]
    if not share_prompts or max(lengths) > SHARED_MAX_WIDTH:
        return alone
    groups: dict[tuple, list[int]] = {}
    ids = input_ids.tolist()  # once: slicing the tensor row by row costs more than the grouping
    for i, p in enumerate(prompt_lengths):
        groups.setdefault(tuple(ids[i][:p]) if p else ("row", i), []).append(i)
    saved = sum((len(rows) - 1) * prompt_lengths[rows[0]] for rows in groups.values())
    if saved < SHARED_PROMPT_MIN_SAVING * sum(lengths):
        return alone
    cap, segments = max(max(lengths), SHARED_SEGMENT_WIDTH), []
    for rows in groups.values():
        prefix = prompt_lengths[rows[0]]
        current, size = [], prefix
        for i in rows:
            if current and size + lengths[i] - prefix > cap:
                segments.append((prefix, current))
                current, size = [], prefix
            current.append(i)
            size += lengths[i] - prefix
        segments.append((prefix, current))
    return segments


def attention_cost(config) -> float | None:
    """The row width ``c`` at which a token's attention in a decoder layer costs as much as its linear layers
    (None when the config does not say): attention reads the whole row, ``4 W h`` FLOPs a token for width
    ``W`` and hidden size ``h``, against ``2 (4 h² + 3 h f)`` for the projections and an MLP of width ``f``,
    so ``c = 2 h + 1.5 f``."""
    config = getattr(config, "text_config", None) or config
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(hidden, int):
        return None
    mlp = getattr(config, "intermediate_size", None)
    return 2 * hidden + 1.5 * (mlp if isinstance(mlp, int) else 4 * hidden)


def pack_width(longest: int, cost: float | None) -> int:
    """The width of packed rows for segments of at most ``longest`` tokens. Rows as wide as the longest segment
    fit one segment each when the lengths are alike (no less padding than a padded batch); wider rows let
    first-fit fill them, but each token then attends over the whole row (a dense mask on the CPU and with
    SDPA), and its softmax and mask work grow with the width faster than the FLOPs say. So: twice the longest
    segment, which already fills rows of alike lengths, and at most ``cost / 8`` (``attention_cost``);
    ``longest`` alone without a cost."""
    return longest if not cost else max(longest, min(2 * longest, int(cost / 8)))


def _place_segments(sizes: list[int], width: int | None = None) -> tuple[int, list[tuple[int, int]], list[int]]:
    """First-fit decreasing of segments of ``sizes`` tokens into rows ``width`` wide (default: the largest
    segment's): the width, each segment's ``(packed row, offset)`` and the room left at the end of each
    packed row."""
    width = max(sizes) if width is None else width
    if width < max(sizes):
        raise ValueError(f"packed rows of width {width} cannot hold a segment of {max(sizes)} tokens")
    free: list[int] = []
    place = [(0, 0)] * len(sizes)
    for s in sorted(range(len(sizes)), key=lambda s: -sizes[s]):
        row = next((r for r, room in enumerate(free) if room >= sizes[s]), len(free))
        if row == len(free):
            free.append(width)
        place[s] = (row, width - free[row])
        free[row] -= sizes[s]
    return width, place, free


def _allowed_attention(segment_of: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``[R, W, W]`` bool: causal, within a segment (segment ids ``[R, W]``, 0 for a pad tail), each row's
    own tokens (``branch`` i + 1) seeing the shared prefix (branch 0) and themselves; a pad tail sees itself."""
    width = segment_of.shape[1]
    same = segment_of[:, :, None] == segment_of[:, None, :]
    visible = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    pad_tail = (segment_of == 0)[:, :, None] & (segment_of == 0)[:, None, :]
    return (same & visible | pad_tail) & torch.ones(width, width, dtype=torch.bool, device=segment_of.device).tril()


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, needed: torch.Tensor,
                   pad_token_id: int = 0, share_prefixes: bool = False,
                   dtype: torch.dtype = torch.float32, cost: float | None = None) -> PackedSequences:
    """Pack the rows of a left-aligned batch (first-fit decreasing into rows of ``pack_width`` of its longest
    segment and the model's ``attention_cost``, ``cost``; of its longest segment without one).

    ``needed`` [B, L] marks the tokens whose log-probability is wanted (column 0 never is). With
    ``share_prefixes``, rows whose tokens before their first needed one are identical (a GRPO group's
    prompt) share one copy of them (Prefix Grouper, Liu et al. 2025): each row's own tokens attend to the
    shared prefix and to themselves, through an additive ``[R, 1, W, W]`` mask of ``dtype``. The logits
    are those of the unshared rows."""
    needed = needed.bool().clone()
    needed[:, 0] = False
    lengths = attention_mask.sum(-1).tolist()
    prefix_lengths = torch.where(needed.any(-1), needed.int().argmax(-1), 0).tolist()
    segments = _prompt_segments(input_ids, lengths, prefix_lengths, share_prefixes)
    sizes = [prefix + sum(lengths[i] - prefix for i in rows) for prefix, rows in segments]
    width, place, free = _place_segments(sizes, pack_width(max(sizes), cost))
    # where each row's tokens go: its segment's prefix at the segment's start, its own tokens after those
    # of the segment's rows before it. Per-row integers here, then one scatter per tensor: placing the
    # tokens one slice at a time would cost a train step milliseconds of Python
    batch_rows, max_len = input_ids.shape
    row_of, prefix_of, start_of, own_start_of, segment_id = ([0] * batch_rows for _ in range(5))
    for s, ((prefix, rows), (row, offset)) in enumerate(zip(segments, place)):
        cursor = offset + prefix
        for i in rows:
            row_of[i], prefix_of[i], start_of[i], own_start_of[i], segment_id[i] = row, prefix, offset, cursor, s + 1
            cursor += lengths[i] - prefix
    device = input_ids.device  # every index and mask is built where the model runs
    columns = torch.arange(max_len, device=device)
    prefix_len = torch.tensor(prefix_of, device=device)[:, None]  # [B, 1]
    in_prefix = columns < prefix_len  # [B, L]
    is_token = columns < torch.tensor(lengths, device=device)[:, None]  # [B, L]
    packed_row = torch.tensor(row_of, device=device)  # [B]
    packed_col = torch.where(in_prefix, torch.tensor(start_of, device=device)[:, None] + columns,  # [B, L]; 0 past each row's end
                             torch.tensor(own_start_of, device=device)[:, None] + columns - prefix_len) * is_token
    token_rows, token_cols = is_token.nonzero(as_tuple=True)
    at = (packed_row[token_rows], packed_col[token_rows, token_cols])
    packed_ids = torch.full((len(free), width), pad_token_id, dtype=torch.long, device=device)
    positions = torch.zeros((len(free), width), dtype=torch.long, device=device)
    branch = torch.zeros((len(free), width), dtype=torch.long, device=device)  # 0: shared prefix or pad tail; i + 1: row i's own
    segment_of = torch.zeros((len(free), width), dtype=torch.long, device=device)  # segment id + 1; pad tails stay 0
    packed_ids[at] = input_ids[token_rows, token_cols]  # a shared prefix is written once per row, the same tokens
    positions[at] = token_cols
    branch[at] = torch.where(in_prefix[token_rows, token_cols], 0, token_rows + 1)
    segment_of[at] = torch.tensor(segment_id, device=device)[token_rows]
    used = torch.tensor([width - room for room in free], device=device)[:, None]  # [R, 1]
    tail_columns = torch.arange(width, device=device) - used  # [R, W]; the pad tail is a sequence of its own
    positions = torch.where(tail_columns >= 0, tail_columns, positions)
    rows, cols = needed.nonzero(as_tuple=True)
    mask = None
    if any(len(rows_) > 1 for _, rows_ in segments):
        allowed = _allowed_attention(segment_of, branch)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
    return PackedSequences(packed_ids, positions, (packed_row[rows], packed_col[rows, cols - 1]), (rows, cols),
                           input_ids[rows, cols], mask)


def _output_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on hidden states ``[N, H]``, with the final soft-capping of models that have it (Gemma 2/3)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def packed_vocab_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L] int64, left-aligned
    attention_mask: torch.Tensor,  # [B, L]
    needed: torch.Tensor,  # [B, L]: tokens whose distribution is wanted, e.g. the response mask
    *,
    temperature: float = 1.0,
    share_prefixes: bool = False,
) -> VocabLogprobs:
    """The tempered log-softmax at the ``needed`` positions only, computed on packed rows without padding,
    the LM head run at those positions alone; with ``share_prefixes``, rows with one prompt share it (see
    ``pack_sequences``). Same values as ``padded_vocab_logprobs`` there up to float rounding."""
    packed = pack_sequences(input_ids, attention_mask, needed, share_prefixes=share_prefixes, dtype=model.dtype,
                            cost=attention_cost(model.config))
    # without a mask, transformers tells the packed sequences apart by their restarting positions
    hidden = model.get_decoder()(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                 attention_mask=packed.attention_mask, use_cache=False).last_hidden_state
    logits = _output_logits(model, hidden[packed.logit_index]).float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    log_probs = torch.log_softmax(logits, dim=-1)  # [N, V]
    return VocabLogprobs(log_probs, packed.target_index, packed.target_ids, tuple(input_ids.shape))


def packed_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L] int64, left-aligned
    attention_mask: torch.Tensor,  # [B, L]
    needed: torch.Tensor,  # [B, L]: tokens whose logprob is wanted, e.g. the response mask
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_prefixes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` at the ``needed`` tokens (0 elsewhere), computed on packed rows without padding;
    with ``share_prefixes``, rows with one prompt share it (see ``pack_sequences``).

    Same values as the padded form up to float rounding; ``[B, L]`` outputs, differentiable (the entropy
    only with ``entropy_grad``)."""
    vocab = packed_vocab_logprobs(model, input_ids, attention_mask, needed, temperature=temperature,
                                  share_prefixes=share_prefixes)
    out = token_outputs(vocab, ("entropy",) if with_entropy else (), entropy_grad=entropy_grad)
    return out["logprobs"], out.get("entropy")


def token_values(
    model: torch.nn.Module,  # a ...ForTokenClassification with one label
    input_ids: torch.Tensor,  # [B, L] int64
    attention_mask: torch.Tensor,  # [B, L]
) -> torch.Tensor:
    """``values[:, t] = V(tokens < t)``: the head's output at position ``t - 1``; column 0 is 0. ``[B, L]``."""
    scores = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits[:, :-1, 0].float()  # [B, L-1]
    return torch.cat([scores.new_zeros(scores.shape[0], 1), scores], dim=1)


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int, temperature: float,
                     packing: bool = False, share_prompts: bool = False) -> torch.Tensor:
    """``token_logprobs`` over ``batch`` in micro-batches, padded back to the batch width, [B, L].

    With ``packing`` only the response tokens get logprobs (0 elsewhere), computed without padding (and
    with ``share_prompts`` one copy of each group's prompt)."""
    if packing:
        return _batched(lambda m: packed_token_logprobs(model, m.input_ids, m.attention_mask, m.loss_mask,
                                                        temperature=temperature, share_prefixes=share_prompts)[0],
                        batch, micro_batch_size)
    return _batched(lambda m: token_logprobs(model, m.input_ids, m.attention_mask, temperature=temperature)[0],
                    batch, micro_batch_size)


@torch.no_grad()
def batched_values(model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
    """``token_values`` over ``batch`` in micro-batches, padded back to the batch width, [B, L]."""
    return _batched(lambda m: token_values(model, m.input_ids, m.attention_mask), batch, micro_batch_size)


def batched_outputs(forward: Callable[[TrainBatch], dict[str, torch.Tensor]], batch: TrainBatch,
                    micro_batch_size: int) -> dict[str, torch.Tensor]:
    """``forward`` (a dict of ``[b, l, ...]`` tensors) over ``batch``'s micro-batches, each padded back to the
    batch width with zeros: ``[B, L, ...]`` per key, in the dtype ``forward`` gives it."""
    out: dict[str, torch.Tensor] = {}
    start = 0
    for micro in batch.micro_batches(micro_batch_size):
        for key, values in forward(micro).items():
            if key not in out:
                out[key] = values.new_zeros((len(batch), batch.input_ids.shape[1], *values.shape[2:]))
            out[key][start : start + len(micro), : values.shape[1]] = values
        start += len(micro)
    return out


def _batched(forward, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
    out = batched_outputs(lambda micro: {"values": forward(micro).float()}, batch, micro_batch_size)
    return out.get("values", torch.zeros(batch.input_ids.shape, device=batch.input_ids.device))
