"""HF/torch inference engine: batched sampling with a KV cache, on CPU or one GPU.

The model and every tensor of a ``generate`` call live on the engine's device (``engines.models.engine_device``:
the GPU Ray assigned, else CPU); prompts arrive as lists and ``Rollouts`` go back on CPU.

Prompts are left-padded and decoded together; each step feeds one token per row through the cache.
Logprobs are of ``logits / temperature`` before top-k/top-p filtering, the distribution the trainer
recomputes, so train/rollout logprobs agree to float rounding. Weights arrive as versioned updates
(``begin_update``/``receive``/``commit``, the contract of ``engines.protocols``) or, from a trainer on
the same node, through shared memory (``update_weights_shared``), or from a trainer on the same GPU
through CUDA IPC (``update_weights_cuda_ipc``). A LoRA trainer's adapter (``update_adapter``) is merged
into the weights of a base that arrived whole before (``engines.training.lora.AdapterMerger``): generation
then runs the plain model, with no adapter branch in its forwards.
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass, field

import torch

from engines.inference.gate import UpdateGate
from engines.models import load_model, load_tokenizer, resolve_device, set_torch_threads
from engines.protocols import UpdateReport
from engines.training.logprobs import position_ids_from_mask
from engines.training.lora import AdapterMerger, AdapterUpdate
from engines.types import Rollouts, SamplingParams
from engines.weight_sync import Bucket, SharedWeightReader, SharedWeights, node_id, unpack_bucket, weights_checksum
from engines.weight_sync_cuda import CudaWeights, load_cuda_weights


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


@dataclass
class _OpenUpdate:
    """A weight update between ``begin_update`` and ``commit``: what has arrived so far."""

    version: int
    params: dict[str, torch.nn.Parameter]
    received: set[str] = field(default_factory=set)
    tensors: int = 0
    nbytes: int = 0


class HFInferenceEngine(UpdateGate):
    """Rollout engine over a transformers causal LM. Lives in a Ray actor; plain object in tests."""

    def __init__(self, model_path: str, *, dtype: str = "float32", torch_threads: int = 0,
                 attn_implementation: str | None = None, device: str | None = None) -> None:
        """``attn_implementation``: transformers' attention kernel (None: its default); ``device``: where the
        model runs (None: ``engine_device()``)."""
        set_torch_threads(torch_threads)
        model = load_model(model_path, dtype=dtype, trainable=False, attn_implementation=attn_implementation,
                           device=resolve_device(device))
        self._serve(model.eval(), load_tokenizer(model_path))

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer) -> "HFInferenceEngine":
        """An engine over a model already in memory (e.g. another trainer's, for evaluation); shares its weights."""
        engine = cls.__new__(cls)
        engine._serve(model, tokenizer)
        return engine

    def _serve(self, model: torch.nn.Module, tokenizer) -> None:
        self.tokenizer, self.model = tokenizer, model
        self.device = next(model.parameters()).device
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 renamed it
        self._version = 0
        self._shared: SharedWeightReader | None = None
        self._update: _OpenUpdate | None = None  # between begin_update and commit
        self._full_checksum: str | None = None  # the weights of the last whole update, while held unmerged
        self._lora: AdapterMerger | None = None  # a LoRA base and the adapter merged into it
        self._home: torch.device | None = None  # where offload() took the weights from; None while loaded
        self._init_gate()  # each forward pass is a step (engines.inference.gate)

    # -- weights: versioned updates (engines.protocols) ----------------------------------------------
    def begin_update(self, version: int) -> None:
        """Open weight update ``version``; re-opening the open version restarts it (a retried sync)."""
        if self._update is not None and self._update.version != version:
            raise RuntimeError(f"weight update v{self._update.version} is still open: commit it before "
                               f"begin_update({version})")
        with self._gate:  # generation pauses before its next step until commit
            self._own_weights()
            self._update = _OpenUpdate(version, dict(self.model.named_parameters()))

    def _own_weights(self) -> None:
        """Parameters that are views of the trainer's shared slots get storage of their own (before writing)."""
        if self._shared is not None:
            for param in self.model.parameters():
                param.data = param.data.clone()
            self._shared.close()
            self._shared = None

    def _held_whole(self, checksum: str | None) -> str | None:
        """Record a whole update of checksum ``checksum`` (None: none arrived): any adapter merged before is gone."""
        if checksum is not None:
            self._full_checksum, self._lora = checksum, None
        return checksum

    def receive(self, bucket: Bucket) -> int:
        """Copy one bucket's tensors into the parameters of the same names; returns the tensors loaded."""
        if self._update is None:
            raise RuntimeError("receive() outside a weight update: call begin_update(version) first")
        params = self._update.params
        with torch.no_grad():
            for name, tensor in unpack_bucket(bucket):
                if name not in params:
                    raise KeyError(f"weight {name!r} is not a parameter of the receiving model")
                params[name].copy_(tensor)
                self._update.received.add(name)
        self._update.tensors += len(bucket.metas)
        self._update.nbytes += int(bucket.data.nbytes)
        return len(bucket.metas)

    def commit(self, version: int) -> UpdateReport:
        """Close update ``version`` once every parameter has arrived; it is the version held from now on.
        This engine keeps no prefix cache across calls, so there is none to reset."""
        update = self._update
        if update is None or update.version != version:
            opened = "no update is open" if update is None else f"the open update is v{update.version}"
            raise RuntimeError(f"commit({version}) without begin_update({version}): {opened}")
        missing = sorted(set(update.params) - update.received)
        if missing:
            raise ValueError(f"weight update v{version} is incomplete: {len(missing)} of {len(update.params)} "
                             f"parameters not received, e.g. {missing[0]!r}")
        with self._gate:
            self._update, self._version = None, version
            self._gate.notify_all()
        return UpdateReport(version, self._held_whole(weights_checksum(self.model)), update.tensors, update.nbytes)

    def update_weights(self, version: int, buckets: list[Bucket]) -> str:
        """A whole update in one call (one Ray round trip): begin, receive every bucket, commit; returns
        the new checksum."""
        with self._gate:  # one update: no decoding step in between
            self.begin_update(version)
            for bucket in buckets:
                self.receive(bucket)
            return self.commit(version).checksum

    def update_weights_shared(self, shared: SharedWeights | None) -> str | None:
        """Point the parameters into the trainer's shared-memory slot; returns the new checksum, or None
        when that slot is not reachable from here (another node, no slot), so the caller sends buckets."""
        if shared is None or shared.node_id != node_id() or not os.path.exists(shared.path):
            return None
        with self._gate:
            self._check_ready("update_weights_shared()")
            self._shared = self._shared or SharedWeightReader()
            checksum = self._held_whole(self._shared.load(self.model, shared))
            self._version = shared.version
        return checksum

    def update_weights_cuda_ipc(self, weights: CudaWeights | None) -> str | None:
        """Copy the weights a trainer on this GPU exported (``TorchTrainEngine.export_cuda_ipc``) into the
        parameters, device to device; returns the new checksum, or None when they are not reachable from
        here (no handles, this engine not on CUDA or offloaded, another node or GPU), so the caller sends
        buckets instead."""
        with self._gate:
            if self._update is not None:
                raise RuntimeError(f"update_weights_cuda_ipc() during weight update v{self._update.version}: commit it first")
            checksum = self._held_whole(load_cuda_weights(self.model, weights))
            if checksum is not None:
                self._version = weights.version
        return checksum

    def update_adapter(self, update: AdapterUpdate) -> UpdateReport | None:
        """Merge a LoRA adapter into the base it belongs to (``engines.training.lora.AdapterMerger``); returns
        the report (``checksum``: ``adapter_checksum`` of the base and adapter), or None when this engine does
        not hold that base (none arrived yet, or another), so the caller sends the base first."""
        with self._gate:
            self._check_ready("update_adapter()")
            if self._lora is None and self._full_checksum == update.base_checksum:
                self._own_weights()  # the merge writes the adapted layers' weights
                self._lora, self._full_checksum = AdapterMerger(self.model, update.base_checksum), None
            if self._lora is None or self._lora.base_checksum != update.base_checksum:
                return None
            checksum, tensors, nbytes = self._lora.apply(update)
            self._version = update.version
        return UpdateReport(update.version, checksum, tensors, nbytes)

    def weights_version(self) -> int:
        """The version of the last committed update (0 before any)."""
        return self._version

    def weights_checksum(self) -> str:
        """``weights_checksum`` of the weights held now; with a LoRA adapter merged, its ``adapter_checksum``."""
        if self._lora is not None and self._lora.checksum is not None:
            return self._lora.checksum
        return weights_checksum(self.model)

    # -- memory ----------------------------------------------------------------------------------------
    def offload(self) -> None:
        """Move the weights to CPU memory, freeing the accelerator's; generation is refused until ``reload``."""
        if self._home is None:
            self._home = next(self.model.parameters()).device
            self.model.to("cpu")
            if self._lora is not None:
                self._lora.to("cpu")
            if self._home.type == "cuda":
                torch.cuda.empty_cache()

    def reload(self) -> None:
        """Move the weights back where ``offload`` took them from."""
        if self._home is not None:
            self.model.to(self._home)
            if self._lora is not None:
                self._lora.to(self._home)
            self._home = None

    def sleep(self) -> None:
        """Free the accelerator memory between rollouts (colocation): the weights go to CPU memory, and
        no cache outlives a ``generate`` call."""
        self.offload()

    def wake(self) -> None:
        """Undo ``sleep``."""
        self.reload()

    def _check_ready(self, call: str) -> None:
        """Refuse ``call`` while the weights are half-updated or offloaded."""
        if self._update is not None:
            raise RuntimeError(f"{call} during weight update v{self._update.version}: commit it first")
        if self._home is not None:
            raise RuntimeError(f"{call} while the weights are offloaded (offload/sleep): call reload() or wake() first")

    # -- generation ----------------------------------------------------------------------------------
    def encode(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    @torch.inference_mode()
    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams) -> Rollouts:
        """Sample a completion of every prompt; rows stop at a stop token or ``max_new_tokens``.

        Identical prompts (a GRPO group) are prefilled once and their KV cache is repeated; rows that
        stop leave the batch (and the cache), so each decoding step computes only unfinished rows."""
        with self._gate:
            self._check_ready("generate()")
        start = time.perf_counter()
        prompt_ids = self.encode(prompts) if prompts and isinstance(prompts[0], str) else [list(p) for p in prompts]
        pad = self.tokenizer.pad_token_id
        rows = len(prompt_ids)
        device = self.device
        unique: dict[tuple[int, ...], int] = {}
        row_to_unique = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in prompt_ids], device=device)
        input_ids, attention_mask = (t.to(device) for t in left_pad(list(unique), pad))
        positions = position_ids_from_mask(attention_mask)
        stop_ids = torch.tensor(sampling.stop_token_ids or (self.tokenizer.eos_token_id,), dtype=torch.long, device=device)
        generator = torch.Generator(device=device).manual_seed(sampling.seed)  # seeded on the device it samples on
        if sampling.row_seeds and len(sampling.row_seeds) != rows:
            raise ValueError(f"sampling.row_seeds has {len(sampling.row_seeds)} seeds for {rows} prompts")
        row_generators = [torch.Generator(device=device).manual_seed(s) for s in sampling.row_seeds]
        greedy = sampling.temperature <= 0

        with self._step():
            start_version = version = self._version  # of the weights that compute the next token's logits
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        logits = out.logits[row_to_unique, -1]  # [B, V]: each row from its prompt's prefill
        if len(unique) < rows:
            cache.batch_select_indices(row_to_unique)
        attention_mask, next_pos = attention_mask[row_to_unique], positions[row_to_unique, -1] + 1

        response_ids = torch.full((rows, sampling.max_new_tokens), pad, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.float32, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        step_versions = []  # the weights version of each decoding step: rows decode in step, so one per step
        aborted = torch.zeros(rows, dtype=torch.bool)
        active = torch.arange(rows, device=device)  # original row of each row still decoding
        for t in range(sampling.max_new_tokens):
            if version != start_version and sampling.on_weight_update == "abort":
                aborted[active.cpu()] = True  # the rows still decoding stop where the update found them
                break
            logits = logits.float()
            if not greedy:
                logits = logits / sampling.temperature
            log_probs = torch.log_softmax(logits, dim=-1)
            if greedy:
                token = logits.argmax(-1)
            else:
                probs = filter_logits(logits, sampling.top_k, sampling.top_p).softmax(-1)
                token = (torch.multinomial(probs, 1, generator=generator).squeeze(-1) if not row_generators else
                         torch.cat([torch.multinomial(probs[j], 1, generator=row_generators[row])
                                    for j, row in enumerate(active.tolist())]))
            response_ids[active, t] = token
            step_versions.append(version)
            logprobs[active, t] = log_probs.gather(-1, token[:, None]).squeeze(-1)
            lengths[active] += 1
            done = torch.isin(token, stop_ids)
            if t + 1 == sampling.max_new_tokens:
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                active, token, attention_mask, next_pos = active[keep], token[keep], attention_mask[keep], next_pos[keep]
                cache.batch_select_indices(keep)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], dim=1)
            with self._step():
                version = self._version
                out = self.model(
                    input_ids=token[:, None],
                    attention_mask=attention_mask,
                    position_ids=next_pos[:, None],
                    use_cache=True,
                    **{self._cache_kw: cache},
                )
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            logits = out.logits[:, -1]
            next_pos = next_pos + 1

        if self._shared is not None:
            self._shared.check()  # the slot still holds the version generated with: no overwrite mid-call
        width = int(lengths.max()) if rows else 0
        # the outputs go back on CPU (Ray hands them to other actors); the decoding below reads them there
        response_ids, logprobs, lengths = response_ids[:, :width].cpu(), logprobs[:, :width].cpu(), lengths.cpu()
        partial = any(v != start_version for v in step_versions)
        stop_ids = stop_ids.cpu()
        stopped = torch.isin(response_ids[torch.arange(rows), (lengths - 1).clamp(min=0)], stop_ids) & (lengths > 0)
        stop_set = set(stop_ids.tolist())
        completions = [
            self.tokenizer.decode([t for t in response_ids[i, : lengths[i]].tolist() if t not in stop_set],
                                  skip_special_tokens=True)
            for i in range(rows)
        ]
        return Rollouts(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=logprobs,
            response_lengths=lengths,
            finish_reasons=["abort" if bool(a) else "stop" if bool(s) else "length" for s, a in zip(stopped, aborted)],
            completions=completions,
            weights_version=start_version,
            compute_seconds=time.perf_counter() - start,
            token_versions=torch.tensor(step_versions[:width]).expand(rows, width).clone() if partial else None,
        )


def left_pad(sequences: list[list[int]] | list[tuple[int, ...]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``[N, max_len]``, each sequence right-aligned."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, sequence in enumerate(sequences):
        input_ids[i, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[i, width - len(sequence):] = 1
    return input_ids, attention_mask
