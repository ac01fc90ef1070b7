"""Chat data for SFT and preference training: load rows, render them, mask the assistant tokens, batch.

Row forms (TRL's):

- SFT, conversational: ``{"messages": [{"role", "content"}, ...]}`` with roles system/user/assistant/tool;
  every assistant turn is trained. Or ``{"prompt": [...], "completion": [...]}`` (message lists): the
  assistant turns of ``completion`` are trained, ``prompt`` is context.
- SFT, standard: ``{"prompt": str, "completion": str}``: the tokens are ``encode(prompt) ++
  encode(completion) ++ [EOS]`` (each string encoded on its own, no chat format), the loss on
  ``completion ++ EOS`` (exactly the RLVR quickstart's warm start, ``engines.data.sft.sft_batch``).
- Preference: ``{"prompt", "chosen", "rejected"}``, all message lists or all strings; or implicit-prompt
  rows ``{"chosen", "rejected"}`` whose prompt is their common prefix (whole messages for message lists;
  for strings, TRL's rule: the common characters, less a trailing space that goes back to the answers).
  Each side is encoded like an SFT row ``prompt ++ answer``; the prompt tokens are the same on both sides.

Rendering: the tokenizer's chat template (``apply_chat_template``) when it has one; otherwise the plain
turn format, one ``"{role}:\\n{content}"`` block per message, each closed by the EOS token (its
end-of-turn token), and ``"assistant:\\n"`` as the generation prompt::

    system:\\nReverse the letters.<EOS>user:\\na b c<EOS>assistant:\\nc b a<EOS>

The newline after the role keeps the generation prompt's tokens a prefix of the answered conversation
under byte-level BPE (a trailing space would merge into the answer's first token); a tiny tokenizer
trained on ``engines.data.synthetic.texts_for_tokenizer`` encodes every character of it.

Loss mask: the conversation is rendered prefix by prefix; the tokens of ``render(messages[:i+1])`` past
``render(messages[:i])`` belong to turn ``i``, and before a trained assistant turn the prefix is rendered
with the generation prompt, so the mask covers the turn's content and its end-of-turn token (and what
the template writes after it up to the next turn), not the role header. Rows are rejected, not raised,
when the mask is empty (``empty_mask``), when a shorter rendering's tokens are not a prefix of the longer
one (``not_prefix``: templates that rewrite history, e.g. drop earlier turns' reasoning), when the
template raises on the row (``template_error``), when the two sides of a pair disagree on the prompt
tokens (``prompt_mismatch``) or when a row is longer than ``max_length`` tokens (``too_long``). A row of
the wrong shape (missing key, wrong type, unknown role) raises a one-line ValueError instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.types import TrainBatch

ROLES = ("system", "user", "assistant", "tool")
PLAIN_GENERATION_PROMPT = "assistant:\n"


@dataclass(frozen=True)
class EncodedRow:
    """One tokenized sequence: ``input_ids[:prompt_length]`` is the prompt (no loss), ``loss_mask`` is 1 on
    the trained assistant tokens (end-of-turn tokens included) and 0 elsewhere; both of one length."""

    input_ids: list[int]
    loss_mask: list[int]
    prompt_length: int  # index of the first trained token


@dataclass(frozen=True)
class EncodedPair:
    """The two sides of a preference row; ``chosen.input_ids[:prompt_length]`` equals ``rejected``'s."""

    chosen: EncodedRow
    rejected: EncodedRow


@dataclass
class Rejected:
    """Rows an encode function left out: how many per reason, one example per reason (row index and what
    went wrong) and the indices of every rejected row, in input order."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)

    def add(self, index: int, reason: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.examples.setdefault(reason, f"row {index}: {detail}")
        self.indices.append(index)

    @property
    def total(self) -> int:
        return len(self.indices)

    def summary(self) -> str:
        """One line for the log, e.g. ``rejected 2 rows: empty_mask 2 (row 4: no assistant turn ...)``."""
        parts = [f"{reason} {n} ({self.examples[reason]})" for reason, n in sorted(self.counts.items())]
        return f"rejected {self.total} rows: " + "; ".join(parts) if parts else "rejected 0 rows"


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------------------------------------- loading

def load_records(path: str) -> list[dict]:
    """Rows of a ``.jsonl``/``.json``/``.parquet`` file or a ``save_to_disk`` folder (split ``train`` of a
    DatasetDict), local or at an fsspec URI (``s3://…``, downloaded once into the local cache), through
    ``datasets``. Keys that ``datasets`` fills with None where a row lacks them are dropped again."""
    from engines.data.prompts import _load

    return [_drop_none(record) for record in _load(_local_path(path), "train").to_list()]


def _local_path(path: str) -> str:
    from engines import checkpoint_store as store

    if not store.is_remote(path):
        return path.removeprefix("file://")
    fs, inner = store.filesystem(path)
    if fs.isdir(inner):
        return store.local_copy(path)
    root = Path(os.environ.get("ROLLFLOW_CACHE") or Path.home() / ".cache" / "rollflow") / "remote"
    out = root / (hashlib.sha256(path.encode()).hexdigest()[:16] + "-" + os.path.basename(inner))
    if not out.exists():
        root.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=root)
        os.close(handle)
        fs.get_file(inner, tmp)
        os.replace(tmp, out)  # a crash never leaves a half-downloaded file under the final name
    return str(out)


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def records_fingerprint(*splits: list[dict]) -> str:
    """sha256 over the rows of every split, in order, as canonical JSON (``flows.lineage.dataset_fingerprint``)."""
    digest = hashlib.sha256()
    for rows in splits:
        for row in rows:
            digest.update(json.dumps(row, sort_keys=True, default=str).encode())
            digest.update(b"\n")
        digest.update(b"\x00")
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------ row shapes

def _messages(value, index: int, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"row {index}: {key!r} must be a non-empty list of messages, got {value!r:.80}")
    for j, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"row {index}: {key}[{j}] must be a message with 'role' one of {ROLES}, "
                             f"got {message!r:.80}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"row {index}: {key}[{j}] 'content' must be a string, got {message.get('content')!r:.80}")
    return value


def _sft_parts(row: dict, index: int) -> tuple[list[dict] | str, list[dict] | str]:
    """``(prompt, completion)``: message lists (the prompt empty for a ``messages`` row) or two strings."""
    if not isinstance(row, dict):
        raise ValueError(f"row {index}: must be a dict, got {type(row).__name__}")
    if "messages" in row:
        return [], _messages(row["messages"], index, "messages")
    if "prompt" not in row or "completion" not in row:
        raise ValueError(f"row {index}: needs 'messages' or both 'prompt' and 'completion'; its keys are {sorted(row)}")
    return _pair_of_forms(row, index, "prompt", "completion")


def _pair_of_forms(row: dict, index: int, prompt_key: str, answer_key: str):
    prompt, answer = row[prompt_key], row[answer_key]
    if isinstance(prompt, str) and isinstance(answer, str):
        return prompt, answer
    if isinstance(prompt, str) or isinstance(answer, str):
        raise ValueError(f"row {index}: {prompt_key!r} and {answer_key!r} must both be strings or both message lists")
    prompt = [] if prompt == [] else _messages(prompt, index, prompt_key)
    return prompt, _messages(answer, index, answer_key)


def _preference_parts(row: dict, index: int):
    """``(prompt, chosen, rejected)``, the prompt split off implicit-prompt rows."""
    if not isinstance(row, dict):
        raise ValueError(f"row {index}: must be a dict, got {type(row).__name__}")
    for key in ("chosen", "rejected"):
        if key not in row:
            raise ValueError(f"row {index}: preference rows need 'chosen' and 'rejected'; its keys are {sorted(row)}")
    if "prompt" in row:
        prompt, chosen = _pair_of_forms(row, index, "prompt", "chosen")
        _, rejected = _pair_of_forms(row, index, "prompt", "rejected")
        return prompt, chosen, rejected
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError(f"row {index}: 'chosen' and 'rejected' must both be strings or both message lists")
    if not isinstance(chosen, str):
        chosen, rejected = _messages(chosen, index, "chosen"), _messages(rejected, index, "rejected")
    prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
    if not chosen or not rejected:
        raise ValueError(f"row {index}: 'chosen' and 'rejected' must differ after their common prefix (one is empty)")
    return prompt, chosen, rejected


def split_implicit_prompt(chosen, rejected):
    """``(prompt, chosen, rejected)`` of an implicit-prompt row: the longest common prefix of the two message
    lists (or strings) is the prompt. For strings, a space that ends the common prefix goes back to both
    answers (TRL's ``extract_prompt``): ``"Q: ab" / "Q: ac"`` splits as ``"Q: a" + "b" / "c"``, and
    ``"Q: yes" / "Q: no"`` as ``"Q:" + " yes" / " no"``."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and n > 0 and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


# ------------------------------------------------------------------------------------------- rendering

def _render_ids(tokenizer, messages: list[dict], generation_prompt: bool, tools) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        import jinja2

        options = {"tools": tools} if tools is not None else {}
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                 **options)
        except jinja2.TemplateError as e:
            raise _Reject("template_error", f"the chat template raised: {str(e)[:120]}") from e
    else:
        text = plain_render(messages, tokenizer.eos_token, generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def plain_render(messages: list[dict], eos_token: str, generation_prompt: bool = False) -> str:
    """The plain turn format of ``messages`` (module docstring), with ``assistant:\\n`` after when asked."""
    text = "".join(f"{m['role']}:\n{m['content']}{eos_token}" for m in messages)
    return text + (PLAIN_GENERATION_PROMPT if generation_prompt else "")


def _extend(ids: list[int], mask: list[int], rendered: list[int], trained: int, what: str) -> None:
    if rendered[: len(ids)] != ids:
        at = next((k for k, (a, b) in enumerate(zip(ids, rendered)) if a != b), min(len(ids), len(rendered)))
        raise _Reject("not_prefix", f"the tokens up to {what} are not a prefix of the rendering with it "
                                    f"(they differ at token {at}); the chat template rewrites earlier turns")
    mask.extend([trained] * (len(rendered) - len(ids)))
    ids.extend(rendered[len(ids):])


def _encode_conversation(tokenizer, prompt: list[dict], completion: list[dict], tools,
                         completion_loss: bool = False) -> EncodedRow:
    """``prompt ++ completion`` rendered prefix by prefix; the assistant turns of ``completion`` trained, or
    with ``completion_loss`` every turn of it (an agentic warm start's observations: a world-model loss)."""
    messages = prompt + completion
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        trained = int(i >= len(prompt) and (message["role"] == "assistant" or completion_loss))
        if trained and message["role"] == "assistant":  # the role header belongs to the prompt side
            _extend(ids, mask, _render_ids(tokenizer, messages[:i], True, tools), 0, f"turn {i}'s generation prompt")
        _extend(ids, mask, _render_ids(tokenizer, messages[: i + 1], False, tools), trained, f"turn {i}")
    if 1 not in mask:
        raise _Reject("empty_mask", "no assistant token to train on (no assistant turn, or it renders to nothing)")
    return EncodedRow(ids, mask, mask.index(1))


def encode_standard(tokenizer, prompt: str, completion: str) -> EncodedRow:
    """``encode(prompt) ++ encode(completion) ++ [EOS]``, the loss on ``completion ++ EOS``."""
    p = tokenizer.encode(prompt, add_special_tokens=False)
    c = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    return EncodedRow(p + c, [0] * len(p) + [1] * len(c), len(p))


def _encode(tokenizer, prompt, completion, tools, max_length: int, completion_loss: bool = False) -> EncodedRow:
    if isinstance(prompt, str):
        row = encode_standard(tokenizer, prompt, completion)
    else:
        row = _encode_conversation(tokenizer, prompt, completion, tools, completion_loss)
    if len(row.input_ids) > max_length:
        raise _Reject("too_long", f"{len(row.input_ids)} tokens, over max_length {max_length}")
    return row


# -------------------------------------------------------------------------------------------- encoding

def encode_sft(tokenizer, rows: list[dict], *, max_length: int,
               loss_on: str = "assistant") -> tuple[list[EncodedRow], Rejected]:
    """The SFT rows that encode cleanly, in order, and a report of the others (module docstring). ``loss_on``:
    ``assistant`` (the assistant turns of the completion) or ``completion`` (all of its turns)."""
    if loss_on not in ("assistant", "completion"):
        raise ValueError(f"loss_on must be 'assistant' or 'completion', got {loss_on!r}")
    kept, rejected = [], Rejected()
    for index, row in enumerate(rows):
        prompt, completion = _sft_parts(row, index)
        try:
            kept.append(_encode(tokenizer, prompt, completion, row.get("tools"), max_length, loss_on == "completion"))
        except _Reject as e:
            rejected.add(index, e.reason, e.detail)
    return kept, rejected


def encode_preferences(tokenizer, rows: list[dict], *, max_length: int) -> tuple[list[EncodedPair], Rejected]:
    """The preference rows that encode cleanly on both sides, in order, and a report of the others."""
    kept, rejected = [], Rejected()
    for index, row in enumerate(rows):
        prompt, chosen, rejected_answer = _preference_parts(row, index)
        try:
            pair = EncodedPair(*(_encode(tokenizer, prompt, answer, row.get("tools"), max_length)
                                 for answer in (chosen, rejected_answer)))
            n = pair.chosen.prompt_length
            if n != pair.rejected.prompt_length or pair.chosen.input_ids[:n] != pair.rejected.input_ids[:n]:
                raise _Reject("prompt_mismatch", "the chosen and rejected sides render different prompt tokens")
            kept.append(pair)
        except _Reject as e:
            rejected.add(index, e.reason, e.detail)
    return kept, rejected


# ------------------------------------------------------------------------------------------- batching

def sft_batch_from(encoded: list[EncodedRow], pad_token_id: int) -> TrainBatch:
    """Left-aligned, right-padded ``[B, L]`` batch of ``encoded`` (L = the longest row), float loss mask."""
    width = max(len(row.input_ids) for row in encoded)
    input_ids = torch.full((len(encoded), width), pad_token_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)  # [B, L]
    loss_mask = torch.zeros((len(encoded), width), dtype=torch.float32)  # [B, L]
    for i, row in enumerate(encoded):
        n = len(row.input_ids)
        input_ids[i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(row.loss_mask, dtype=torch.float32)
    return TrainBatch(input_ids, attention_mask, loss_mask)


def pair_batch_from(pairs: list[EncodedPair], pad_token_id: int, ref_logps: torch.Tensor | None = None) -> TrainBatch:
    """``[2P, L]`` batch with rows chosen0, rejected0, chosen1, rejected1, …; ``group_ids`` = pair index.

    ``ref_logps``: the reference model's summed log-probs of those rows, ``[2P]`` or ``[2P, 1]`` in the
    same row order, or ``[P, 2]`` (chosen, rejected) per pair; stored as ``tensors["ref_logps"]``
    ``[2P, 1]`` float32, which ``TrainBatch.select`` keeps aligned with the rows."""
    batch = sft_batch_from([row for pair in pairs for row in (pair.chosen, pair.rejected)], pad_token_id)
    group_ids = torch.arange(len(pairs), dtype=torch.long).repeat_interleave(2)  # [2P]
    tensors = {}
    if ref_logps is not None:
        if ref_logps.numel() != 2 * len(pairs):
            raise ValueError(f"ref_logps has {ref_logps.numel()} values for {len(pairs)} pairs; "
                             f"expected {2 * len(pairs)}")
        tensors["ref_logps"] = ref_logps.detach().reshape(2 * len(pairs), 1).float()  # [2P, 1]
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, tensors, group_ids=group_ids)
