"""HF/torch inference engine: batched sampling with a KV cache, on CPU or one GPU.

Prompts are left-padded and decoded together; each step feeds one token per row through the cache.
Logprobs are of ``logits / temperature`` before top-k/top-p filtering, the distribution the trainer
recomputes, so train/rollout logprobs agree to float rounding.
"""

from __future__ import annotations

import inspect
import time

import torch

from engines.models import load_model, load_tokenizer, set_torch_threads
from engines.training.logprobs import position_ids_from_mask
from engines.types import Rollouts, SamplingParams
from engines.weight_sync import Bucket, load_buckets, weights_checksum


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest top-p nucleus. logits: [B, V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class HFInferenceEngine:
    """Rollout engine over a transformers causal LM. Lives in a Ray actor; plain object in tests."""

    def __init__(self, model_path: str, *, dtype: str = "float32", torch_threads: int = 0) -> None:
        set_torch_threads(torch_threads)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, dtype=dtype, trainable=False).eval()
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 renamed it
        self._version = 0

    # -- weights -------------------------------------------------------------------------------------
    def update_weights(self, version: int, buckets: list[Bucket]) -> str:
        """Load a full set of weights published by the trainer; returns the new checksum."""
        load_buckets(self.model, buckets)
        self._version = version
        return weights_checksum(self.model)

    def weights_version(self) -> int:
        return self._version

    def weights_checksum(self) -> str:
        return weights_checksum(self.model)

    def sleep(self) -> None:
        """Free accelerator memory between rollouts (colocation). Nothing to free on CPU."""

    def wake(self) -> None:
        """Undo ``sleep``."""

    # -- generation ----------------------------------------------------------------------------------
    def encode(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    @torch.inference_mode()
    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams) -> Rollouts:
        start = time.perf_counter()
        prompt_ids = self.encode(prompts) if prompts and isinstance(prompts[0], str) else [list(p) for p in prompts]
        pad = self.tokenizer.pad_token_id
        rows, width = len(prompt_ids), max(len(p) for p in prompt_ids)
        input_ids = torch.full((rows, width), pad, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p) :] = 1
        positions = position_ids_from_mask(attention_mask)
        stop_ids = torch.tensor(sampling.stop_token_ids or (self.tokenizer.eos_token_id,), dtype=torch.long)
        generator = torch.Generator().manual_seed(sampling.seed)
        greedy = sampling.temperature <= 0

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        next_pos = positions[:, -1] + 1  # [B]
        finished = torch.zeros(rows, dtype=torch.bool)
        lengths = torch.zeros(rows, dtype=torch.long)
        tokens, logprobs = [], []
        for _ in range(sampling.max_new_tokens):
            logits = out.logits[:, -1].float()  # [B, V]
            if not greedy:
                logits = logits / sampling.temperature
            log_probs = torch.log_softmax(logits, dim=-1)
            if greedy:
                token = logits.argmax(-1)
            else:
                probs = filter_logits(logits, sampling.top_k, sampling.top_p).softmax(-1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            logprob = log_probs.gather(-1, token[:, None]).squeeze(-1)
            token = token.masked_fill(finished, pad)
            tokens.append(token)
            logprobs.append(logprob.masked_fill(finished, 0.0))
            lengths += (~finished).long()
            finished |= torch.isin(token, stop_ids)
            if bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention_mask,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{self._cache_kw: cache},
            )
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            next_pos = next_pos + 1

        response_ids = torch.stack(tokens, dim=1)  # [B, T]
        stopped = torch.isin(response_ids, stop_ids) & (torch.arange(response_ids.shape[1]) < lengths[:, None])
        finish_reasons = ["stop" if bool(s.any()) else "length" for s in stopped]
        completions = [
            self.tokenizer.decode(
                [t for t in response_ids[i, : lengths[i]].tolist() if t not in set(stop_ids.tolist())],
                skip_special_tokens=True,
            )
            for i in range(rows)
        ]
        return Rollouts(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=torch.stack(logprobs, dim=1),
            response_lengths=lengths,
            finish_reasons=finish_reasons,
            completions=completions,
            weights_version=self._version,
            compute_seconds=time.perf_counter() - start,
        )
