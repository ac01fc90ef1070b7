"""Plain-torch training engine: one process, CPU or one GPU.

The model, its optimizer state and fp32 master weights live on the engine's device
(``engines.models.engine_device``: the GPU Ray assigned, else CPU); batches arriving on CPU move there,
and log-probabilities and values go back on CPU.

``train_step`` runs PPO's inner loop over a rollout batch (``engines.training.updates``: epochs ×
mini-batches of optimizer steps, each with micro-batches, gradient accumulation, a gradient-norm clip,
AdamW and the LR schedule). The loss is passed in (``engines.algorithms.objective``), so the engine knows nothing
of the algorithm. ``head="value"`` makes the same engine a critic: a scalar value per token instead of
log-probabilities, trained by a value objective. ``save``/``load`` cover model, optimizer, scheduler and RNG states through fsspec.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass
from typing import Callable

import fsspec
import numpy as np
import torch

from engines.checkpoint_store import write_bytes
from engines.models import load_model, load_tokenizer, load_value_model, resolve_device, set_torch_threads
from engines.training.lora import (AdapterUpdate, adapter_checksum, adapter_tensors, base_parameters, export_adapter,
                                   merge_tensors, peft_state_dict, scalings, wrap_lora)
from engines.training.logprobs import (batched_logprobs, batched_values, packed_vocab_logprobs, padded_vocab_logprobs,
                                      token_outputs, token_values)
from engines.training.precision import MasterWeights, needs_master_weights
from engines.training.updates import UpdateSpec, combine, run_updates
from engines.types import Rollouts, TrainBatch, build_train_batch
from engines.weight_sync import (Bucket, SharedWeights, SharedWeightWriter, node_id, pack_buckets, tensors_checksum,
                                 weights_checksum)
from engines.weight_sync_cuda import CudaWeightExporter, CudaWeights


@dataclass(frozen=True)
class OptimSpec:
    """AdamW and its LR schedule: linear warmup, then constant, linear or cosine decay to ``min_lr_ratio``."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | linear | cosine
    total_steps: int = 1
    min_lr_ratio: float = 0.0


def lr_multiplier(step: int, spec: OptimSpec) -> float:
    """LR factor after ``step`` optimizer steps."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.total_steps - spec.warmup_steps))
    decay = 1.0 - progress if spec.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * decay


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _read_torch(uri: str):
    """A ``torch.save`` file, its tensors on CPU (a GPU run's optimizer state loads on any machine:
    ``Optimizer.load_state_dict`` moves each state to its parameter's device)."""
    with fsspec.open(uri, "rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=False, map_location="cpu")


def _fused_adamw(model: torch.nn.Module) -> bool:
    """Whether AdamW can use its fused kernel (one pass per parameter: the same update as the default
    per-tensor loop, an order of magnitude faster on CPU): floating-point parameters on CPU or CUDA."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in model.parameters())


def adamw(parameters: list[torch.Tensor], optim: OptimSpec, *, fused: bool) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``parameters`` with ``optim``'s settings, and its LR schedule (``lr_multiplier``)."""
    optimizer = torch.optim.AdamW(parameters, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                  weight_decay=optim.weight_decay, fused=fused)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, optim))


class TorchTrainEngine:
    """Trainable policy (``head="policy"``) or critic (``head="value"``) with its optimizer. Lives in a Ray actor.

    The loss function receives ``logprobs`` and ``entropy`` (policy) or ``values`` (critic), each
    ``[b, l]`` for one micro-batch, plus the micro-batch itself, and the extra outputs its ``outputs``
    attribute names (``_forward``: token accuracy, the whole distribution, log-probs at given ids). With ``packing`` the policy's forward
    runs on the micro-batch's sequences packed without padding, and logprobs/entropy are computed at
    response tokens only (0 elsewhere; every objective masks with ``loss_mask``).

    ``attn_implementation`` picks transformers' attention kernel (None: its default); a flash-attention
    kernel takes no attention mask, so the rows of a group then do not share their prompt (``share_prompts``).
    ``gradient_checkpointing`` recomputes each layer's activations in the backward pass instead of keeping
    them (same gradients, less memory, one more forward). ``device``: None = ``engine_device()``.

    ``lora`` (``engines.training.lora.LoraSpec`` fields as a dict; policy only): the base stays frozen and
    only the adapter trains (the optimizer holds only it); syncs send the base under HF names once, then
    the adapter (``export_adapter``); the frozen base, adapter disabled, serves the KL reference
    (``reference_logprobs``); checkpoints hold the adapter and its optimizer state."""

    def __init__(self, model_path: str, optim: OptimSpec, *, dtype: str = "float32", seed: int = 0,
                 torch_threads: int = 0, micro_batch_size: int = 8, temperature: float = 1.0,
                 head: str = "policy", packing: bool = True, share_prompts: bool = True,
                 attn_implementation: str | None = None, gradient_checkpointing: bool = False,
                 device: str | None = None, lora: dict | None = None) -> None:
        if head not in ("policy", "value"):
            raise ValueError(f"head must be 'policy' or 'value', got {head!r}")
        set_torch_threads(torch_threads)
        torch.manual_seed(seed)
        self.head = head
        self.device = resolve_device(device)
        self.tokenizer = load_tokenizer(model_path)
        load = load_model if head == "policy" else load_value_model
        self.model = load(model_path, dtype, attn_implementation=attn_implementation, device=self.device)
        self.peft = None  # the peft wrapper of a LoRA model; self.model stays the HF model, its layers adapted
        if lora is not None:
            if head != "policy":
                raise ValueError("lora adapts the policy (head='policy'); a critic trains all its weights")
            self.peft = wrap_lora(self.model, lora)
        self._base_checksum: str | None = None  # LoRA: the frozen base's checksum, hashed once
        if gradient_checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", None)  # transformers 5's name
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.config.use_cache = False  # training forwards keep no KV cache (nothing to checkpoint)
        self.optim_spec = optim
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.packing = packing
        self.share_prompts = packing and share_prompts and "flash" not in (attn_implementation or "")
        self._shared_writer: SharedWeightWriter | None = None  # created at the first shared-memory sync
        self._cuda_exporter: CudaWeightExporter | None = None  # created at the first CUDA IPC sync
        self._build_optimizer(optim)

    def _build_optimizer(self, optim: OptimSpec) -> None:
        """``self.optimizer`` and ``self.scheduler`` (``adamw``) for the loaded model, with ``self.master``."""
        # bf16/fp16 parameters: the optimizer steps fp32 master copies (engines.training.precision)
        self.master = MasterWeights(self.model) if needs_master_weights(self.model) else None
        self.optimizer, self.scheduler = adamw(self._optimized_parameters(), optim, fused=_fused_adamw(self.model))
        if self.master is not None:
            self.master.attach(self.optimizer)

    def _optimized_parameters(self) -> list[torch.Tensor]:
        """What the optimizer steps: the fp32 masters of a low-precision model, else its trainable parameters
        (all of them; a LoRA model's adapter)."""
        return self.master.params if self.master is not None else [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token logprobs of ``batch.input_ids`` under the current weights, [B, L]."""
        self.model.eval()
        return batched_logprobs(self.model, batch.to(self.device), self.micro_batch_size, self.temperature,
                                self.packing, self.share_prompts).cpu()

    def rollout_logprobs(self, rollouts: Rollouts) -> torch.Tensor:
        """Logprobs of ``prompt ++ response`` rows, aligned like ``build_train_batch(rollouts)``: PPO's old logprobs."""
        return self.logprobs(build_train_batch(rollouts, pad_token_id=0))  # pads are masked out

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``logprobs`` under the frozen base, the adapter disabled: a LoRA policy's KL reference, [B, L]."""
        if self.peft is None:
            raise RuntimeError("reference_logprobs() needs a LoRA trainer (lora=...); start a reference engine instead")
        with self.peft.disable_adapter():
            return self.logprobs(batch)

    def reference_rollout_logprobs(self, rollouts: Rollouts) -> torch.Tensor:
        """``reference_logprobs`` of ``prompt ++ response`` rows, aligned like ``build_train_batch(rollouts)``."""
        return self.reference_logprobs(build_train_batch(rollouts, pad_token_id=0))  # pads are masked out

    @torch.no_grad()
    def rollout_values(self, rollouts: Rollouts) -> torch.Tensor:
        """Critic values of ``prompt ++ response`` rows, [B, L], aligned like ``build_train_batch(rollouts)``."""
        self.model.eval()
        batch = build_train_batch(rollouts, pad_token_id=0).to(self.device)
        return batched_values(self.model, batch, self.micro_batch_size).cpu()

    def _forward(self, micro: TrainBatch, *, entropy_grad: bool = True,
                 outputs: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """The loss function's inputs for ``micro``: ``logprobs`` and ``entropy`` [b, l], plus the objective's
        ``outputs`` (``engines.training.logprobs.token_outputs``: ``top1_correct``, ``vocab_logprobs``,
        ``gathered_logprobs`` at ``micro.tensors["gather_ids"]``), all from one log-softmax. The entropy is
        differentiable only with ``entropy_grad`` (the objective's ``needs_entropy_grad``); without, it is a
        metric and keeps no vocabulary-wide graph."""
        if self.head == "value":
            if outputs:
                raise ValueError(f"a critic (head='value') returns values only; the objective asks for {sorted(outputs)}")
            return {"values": token_values(self.model, micro.input_ids, micro.attention_mask)}
        if self.packing:
            vocab = packed_vocab_logprobs(self.model, micro.input_ids, micro.attention_mask, micro.loss_mask,
                                          temperature=self.temperature, share_prefixes=self.share_prompts)
        else:
            vocab = padded_vocab_logprobs(self.model, micro.input_ids, micro.attention_mask, temperature=self.temperature)
        return token_outputs(vocab, {"entropy", *outputs}, entropy_grad=entropy_grad,
                             gather_ids=micro.tensors.get("gather_ids"))

    def train_step(self, batch: TrainBatch, loss_fn: Callable, update: UpdateSpec = UpdateSpec()) -> dict[str, float]:
        """``update.epochs × update.mini_batches`` optimizer steps over ``batch`` (``engines.training.updates``),
        each in micro-batches with gradient accumulation; returns the steps' metrics combined."""
        self._export_done()
        self.model.train()
        batch = batch.to(self.device)
        entropy_grad = getattr(loss_fn, "needs_entropy_grad", True)
        outputs = frozenset(getattr(loss_fn, "outputs", frozenset()))  # extra forward outputs (``_forward``)
        forward = lambda micro: self._forward(micro, entropy_grad=entropy_grad, outputs=outputs)  # noqa: E731
        totals = run_updates(batch, loss_fn, update, forward=forward, micro_batch_size=self.micro_batch_size,
                             **self._step_kwargs())
        if self.head == "value":  # the critic's metrics live under critic/
            totals = {k.replace("train/", "critic/", 1): v for k, v in totals.items()}
            totals["perf/critic_compute_s"] = totals.pop("perf/train_compute_s")
        return totals

    @torch.no_grad()
    def evaluate(self, batch: TrainBatch, loss_fn: Callable) -> dict[str, float]:
        """``loss_fn``'s loss (``loss``) and metrics over ``batch`` without a gradient or an optimizer step, each
        micro-batch weighted by its share of the batch (``loss_fn.micro_weight``): held-out figures. Every rank
        of a sharded engine computes every micro-batch, so their collectives stay in step."""
        self._export_done()
        self.model.eval()
        batch = batch.to(self.device)
        outputs = frozenset(getattr(loss_fn, "outputs", frozenset()))
        entries, weights = [], []
        for micro in batch.micro_batches(self.micro_batch_size):
            loss, metrics = loss_fn(**self._forward(micro, entropy_grad=False, outputs=outputs), batch=micro)
            entries.append({**metrics, "loss": float(loss)})
            weights.append(loss_fn.micro_weight(micro, batch))
        return combine(entries, weights)

    def _step_kwargs(self) -> dict:
        """How ``engines.training.updates.optimizer_step`` steps this engine's optimizer."""
        return dict(parameters=self._optimized_parameters(), optimizer=self.optimizer, scheduler=self.scheduler,
                    grad_clip=self.optim_spec.grad_clip)

    # -- weights -------------------------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int = 64 << 20) -> list[Bucket]:
        """What a full sync sends (``_synced_parameters``), packed into buckets."""
        return pack_buckets(self._synced_parameters(), bucket_bytes)

    def _synced_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The HF-named weights of a full sync: every parameter, or a LoRA model's frozen base (its adapter
        follows in ``export_adapter``)."""
        return base_parameters(self.model) if self.peft is not None else list(self.model.named_parameters())

    def export_adapter(self, version: int, bucket_bytes: int = 64 << 20) -> AdapterUpdate | None:
        """A LoRA model's adapter (A and B of each adapted layer, and its scaling) for a rollout engine that
        holds the base (``engines.training.lora``); None without LoRA."""
        if self.peft is None:
            return None
        self._export_done()
        return export_adapter(self.model, version, self._lora_base_checksum(), bucket_bytes, self._adapter_tensors())

    def _adapter_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """A LoRA model's ``adapter_tensors`` (whole; a sharded engine gathers them)."""
        return adapter_tensors(self.model)

    def _lora_base_checksum(self) -> str:
        if self._base_checksum is None:  # the base is frozen: hashed once
            self._base_checksum = tensors_checksum(self._synced_parameters())
        return self._base_checksum

    def export_shared(self, version: int) -> SharedWeights | None:
        """Start copying the weights into a free shared-memory slot (``SharedWeightWriter``: none that a
        rollout engine still reads) and return where they go
        (None when ``/dev/shm`` has no room). The copy finishes in the background, so the caller's round
        trip to the receivers overlaps it; receivers wait for it, and so does every method here that
        changes the weights."""
        named = [(name, p.detach().cpu()) for name, p in self._synced_parameters()]  # a GPU's weights: host copies
        if self._shared_writer is None:
            if not SharedWeightWriter.fits(sum(p.numel() * p.element_size() for _, p in named)):
                return None
            self._shared_writer = SharedWeightWriter("weights")
        return self._shared_writer.write(version, named, node_id(), background=True)

    def export_cuda_ipc(self, version: int) -> CudaWeights | None:
        """Copy the weights (in the model's compute dtype) into this GPU's export buffer and return its CUDA
        IPC handles (``engines.weight_sync_cuda``), or None when the model is not on CUDA (or offloaded).
        ``CudaWeights.checksum`` is the exported weights' checksum; a rollout engine on the same GPU loads
        them with ``update_weights_cuda_ipc``. The buffer stays valid until the next export or ``offload``."""
        if next(self.model.parameters()).device.type != "cuda":
            return None
        self._cuda_exporter = self._cuda_exporter or CudaWeightExporter()
        return self._cuda_exporter.export(version, self._synced_parameters())

    def _export_done(self) -> None:  # before anything that changes the weights
        if self._shared_writer is not None:
            self._shared_writer.wait()

    def close(self) -> None:
        """Remove the shared-memory weight slots (called before the actor is killed)."""
        if self._shared_writer is not None:
            self._shared_writer.close()
            self._shared_writer = None
        self._close_cuda_export()

    def _close_cuda_export(self) -> None:
        if self._cuda_exporter is not None:
            self._cuda_exporter.close()
            self._cuda_exporter = None

    def weights_checksum(self) -> str:
        """``weights_checksum`` of the model; of a LoRA model, the ``adapter_checksum`` of its base and adapter
        (what a rollout engine holding both reports)."""
        self._export_done()
        if self.peft is not None:
            return adapter_checksum(self._lora_base_checksum(), self._adapter_tensors(), scalings(self.model))
        return weights_checksum(self.model)

    def exported_checksum(self) -> str:
        """Checksum of the weights as ``export_shared`` copied them, hashed during the copy (waits for
        it); without shared memory, the checksum of what ``export_weights`` sends (a LoRA model's base)."""
        if self._shared_writer is None:
            return self._lora_base_checksum() if self.peft is not None else self.weights_checksum()
        return self._shared_writer.wait()

    def optimizer_steps(self) -> int:
        return int(self.scheduler.last_epoch)

    # -- state ---------------------------------------------------------------------------------------
    def save(self, uri: str) -> list[str]:
        """Write model, optimizer, scheduler and RNG state under ``uri`` (a folder, local or s3://). The model
        file holds the trainable parameters: all of them, or a LoRA model's adapter (the base is the model's)."""
        from safetensors.torch import save

        state = {name: p.detach().contiguous() for name, p in self._trained_parameters()}  # tied weights once
        files = {
            "model.safetensors": save(state),
            "optimizer.pt": _torch_bytes(self.optimizer.state_dict()),
            "scheduler.pt": _torch_bytes(self.scheduler.state_dict()),
            "rng.pt": _torch_bytes({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}),
        }
        if self.master is not None:
            files["master.safetensors"] = save({k: v.contiguous() for k, v in self.master.state_dict().items()})
        for name, payload in files.items():
            write_bytes(f"{uri}/{name}", payload)
        return sorted(files)

    def load(self, uri: str) -> str:
        """Restore what ``save`` wrote; returns the loaded weights' checksum."""
        from safetensors.torch import load

        self._export_done()
        with fsspec.open(f"{uri}/model.safetensors", "rb") as f:
            state = load(f.read())
        params = dict(self._trained_parameters())
        if set(state) != set(params):
            raise ValueError(f"checkpoint {uri} does not match the model: "
                             f"missing={sorted(set(params) - set(state))} unexpected={sorted(set(state) - set(params))}")
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
        if self.master is not None:  # a low-precision model's optimizer state belongs to its fp32 masters
            fs, path = fsspec.core.url_to_fs(f"{uri}/master.safetensors")
            masters = load(fs.cat_file(path)) if fs.exists(path) else {n: p.float() for n, p in state.items()
                                                                       if n in self.master.names}
            self.master.load_state_dict(masters)  # a checkpoint without masters: they start from its weights
        self.optimizer.load_state_dict(_read_torch(f"{uri}/optimizer.pt"))
        for group in self.optimizer.param_groups:  # the saved groups carry the saving engine's kernel choice
            group["fused"], group["foreach"] = _fused_adamw(self.model), None
        self.scheduler.load_state_dict(_read_torch(f"{uri}/scheduler.pt"))
        rng = _read_torch(f"{uri}/rng.pt")
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        return self.weights_checksum()

    def _trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """What a checkpoint holds: the parameters that train (a LoRA model's adapter)."""
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    def save_pretrained(self, uri: str) -> list[str]:
        """The model in HF format (``model.safetensors`` + config + tokenizer) at ``uri`` (local or s3://),
        replacing what was there; returns the files written. A LoRA model is saved merged (``W_base +
        scaling · B @ A``, ``engines.training.lora.merge_tensors``) and as its adapter in peft's format
        under ``adapter/`` (``adapter_model.safetensors`` + ``adapter_config.json``)."""
        return self._save_gathered_pretrained(uri, rank=0)

    def _save_gathered_pretrained(self, uri: str, rank: int, dtype: torch.dtype | None = None) -> list[str]:
        """``save_pretrained`` of this engine or of a sharded one: every rank gathers the weights with the others
        (``_synced_parameters``, ``_adapter_tensors``) and rank 0 writes them (a LoRA model merged, its adapter
        under ``adapter/``; ``dtype`` in the config when given), the others return []."""
        import tempfile

        from engines.checkpoint_store import put_folder

        self._export_done()
        named = self._synced_parameters()
        adapter = self._adapter_tensors() if self.peft is not None else None
        if rank != 0:
            return []
        with tempfile.TemporaryDirectory() as tmp:
            if adapter is not None:
                named = merge_tensors(named, adapter, scalings(self.model))
                self.peft.save_pretrained(f"{tmp}/adapter", safe_serialization=True, state_dict=peft_state_dict(adapter))
            self.model.save_pretrained(tmp, state_dict=dict(named), safe_serialization=True)
            if dtype is not None:
                self.model.config.dtype = str(dtype).removeprefix("torch.")
                self.model.config.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            return put_folder(tmp, uri)

    # -- memory (engines.protocols) --------------------------------------------------------------------
    _offloaded: tuple[torch.device, list] | None = None  # offload(): the weights' device, the optimizer state moved

    def offload(self) -> None:
        """Move the parameters and the optimizer state to CPU memory, freeing the accelerator's; gradients
        are dropped (each step starts from zero). ``reload`` moves them back."""
        if self._offloaded is not None:
            return
        self._export_done()  # a background shared-memory copy still reads the parameters
        self._close_cuda_export()  # the CUDA IPC buffer is a copy of the weights on the GPU
        self.optimizer.zero_grad(set_to_none=True)
        moved = [(state, key, value.device) for state in self.optimizer.state.values()
                 for key, value in state.items() if torch.is_tensor(value) and value.device.type != "cpu"]
        for state, key, _ in moved:
            state[key] = state[key].to("cpu")
        if self.master is not None:
            self.master.to("cpu")
        self._offloaded = (_move(self._weights_module(), "cpu"), moved)

    def _weights_module(self) -> torch.nn.Module:
        """The module whose ``to()`` moves every weight: the model (a sharded engine's FSDP root)."""
        return self.model

    def reload(self) -> None:
        """Move back what ``offload`` moved (each optimizer state tensor to the device it was on)."""
        if self._offloaded is None:
            return
        home, moved = self._offloaded
        _move(self._weights_module(), home)
        if self.master is not None:
            self.master.to(home)
        for state, key, device in moved:
            state[key] = state[key].to(device)
        self._offloaded = None


class ReferenceEngine:
    """Frozen copy of the initial policy; scores sequences for the KL term."""

    def __init__(self, model_path: str, *, dtype: str = "float32", torch_threads: int = 0,
                 micro_batch_size: int = 8, temperature: float = 1.0, packing: bool = True,
                 share_prompts: bool = True, attn_implementation: str | None = None,
                 device: str | None = None) -> None:
        set_torch_threads(torch_threads)
        self.device = resolve_device(device)
        self.model = load_model(model_path, dtype=dtype, trainable=False, attn_implementation=attn_implementation,
                                device=self.device).eval()
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.packing = packing
        self.share_prompts = packing and share_prompts and "flash" not in (attn_implementation or "")

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return batched_logprobs(self.model, batch.to(self.device), self.micro_batch_size, self.temperature,
                                self.packing, self.share_prompts).cpu()

    def rollout_logprobs(self, rollouts: Rollouts) -> torch.Tensor:
        """Logprobs of ``prompt ++ response`` rows, aligned like ``build_train_batch(rollouts)``."""
        return self.logprobs(build_train_batch(rollouts, pad_token_id=0))  # pads are masked out

    def sequence_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``Σ_t logprobs[b, t] · loss_mask[b, t]``: each row's summed answer log-prob (DPO's reference), [B]."""
        return (self.logprobs(batch) * batch.loss_mask.cpu()).sum(-1)

    # -- memory (engines.protocols) --------------------------------------------------------------------
    _home: torch.device | None = None  # offload(): where the weights were; None while loaded

    def offload(self) -> None:
        """Move the weights to CPU memory, freeing the accelerator's; ``reload`` moves them back."""
        if self._home is None:
            self._home = _move(self.model, "cpu")

    def reload(self) -> None:
        """Move the weights back where ``offload`` took them from."""
        if self._home is not None:
            _move(self.model, self._home)
            self._home = None


def _move(model: torch.nn.Module, device: torch.device | str) -> torch.device:
    """Move ``model`` to ``device``; returns where it was. Leaving a CUDA device frees its cached blocks."""
    home = next(model.parameters()).device
    model.to(device)
    if home.type == "cuda" and home != torch.device(device):
        torch.cuda.empty_cache()
    return home
