"""DeepSpeed ZeRO training engine: one Ray actor per rank, the model's training state sharded over them.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv:1910.02054) keeps data parallelism's compute and shards what each rank holds: stage 1 the
optimizer state (Adam moments and fp32 master weights), stage 2 also the gradients, stage 3 also the
parameters themselves, gathered module by module for each forward and backward. ``offload_optimizer``
and ``offload_params`` (stage 3) keep those shards in host memory (ZeRO-Offload).

Everything else is ``TorchTrainEngine``'s: the model's forward, the PPO inner loop
(``engines.training.updates``) with the loss passed in, the LR schedule (``lr_multiplier``). Each rank
receives the whole batch and computes micro-batches ``rank, rank + world_size, …``; ``backward`` scales
each rank's loss by the world size, so DeepSpeed's data-parallel mean becomes the sum of the ranks'
shares, the gradient of the whole batch. ``step()`` is the accumulation boundary (DeepSpeed's
``managed_gradient_accumulation: false``): any number of micro-batch backwards, then one reduction,
DeepSpeed's gradient clip, AdamW and the schedule.

The ZeRO config comes from typed arguments (``zero_config``). On a machine without CUDA the engine
imports DeepSpeed with ``DS_ACCELERATOR=cpu``, its ranks talk over gloo, and no compiled op is used (a
torch AdamW is the client optimizer). Checkpoints are DeepSpeed's own (each rank writes its shard),
staged locally and copied to a local folder or ``s3://``, plus each rank's RNG state.

LoRA (``lora``): the torch engine wraps the model with peft before ``deepspeed.initialize``, so AdamW (and
ZeRO's partitioned optimizer state) holds only the adapter; under ZeRO-3 the frozen base is partitioned
too. The torch engine's LoRA code (base sync under HF names, ``export_adapter``, the checksum, the merged
and adapter export) runs here on tensors gathered whole on rank 0 (``_synced_parameters``,
``_adapter_tensors``); the reference log-probs disable the adapter. Checkpoints hold the adapter and its
optimizer state, not the base (``_Calls``' ``saved`` keys, DeepSpeed's ``exclude_frozen_parameters``).
"""

from __future__ import annotations

import os
import random
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engines.checkpoint_store import filesystem, is_remote, join
from engines.models import resolve_device
from engines.training.distributed import gather_objects, init_ranks
from engines.training.lora import AdapterUpdate
from engines.training.torch import OptimSpec, TorchTrainEngine, _fused_adamw, _read_torch, _torch_bytes, adamw
from engines.types import Rollouts, TrainBatch
from engines.weight_sync import Bucket, SharedWeights, pack_buckets, tensors_checksum
from engines.weight_sync_cuda import CudaWeights

GATHER_BYTES = 256 << 20
"""Parameter bytes gathered at once under ZeRO-3 for a checksum or an HF export (buckets: their size)."""

CHECKPOINT_TAG = "zero"
"""DeepSpeed's tag (sub-folder) of the checkpoint under ``<uri>/deepspeed``."""


def zero_config(*, zero_stage: int, micro_batch_size: int, world_size: int, grad_clip: float, dtype: str,
                offload_optimizer: bool = False, offload_params: bool = False, pin_memory: bool = False,
                param_persistence_threshold: int | None = None) -> dict:
    """The DeepSpeed config of a ZeRO ``zero_stage`` engine. ``ValueError`` (one line) for settings it
    cannot run: another stage, parameter offload below stage 3, fp16 (bf16 or fp32 train here).

    One optimizer step accumulates whatever micro-batches its ranks run (``gradient_accumulation_steps``
    1 with ``managed_gradient_accumulation`` off: ``step()`` is the boundary); the loss is already the
    batch's, so DeepSpeed scales nothing. ``param_persistence_threshold``: parameters of fewer elements
    stay whole on every rank under ZeRO-3 (None: DeepSpeed's default)."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    if offload_params and zero_stage != 3:
        raise ValueError(f"offload_params needs zero_stage 3 (only ZeRO-3 shards parameters), got stage {zero_stage}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"the deepspeed engine trains in float32 or bfloat16, got dtype {dtype!r}")
    zero: dict = {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    if zero_stage == 3 and param_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = param_persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "bf16": {"enabled": dtype == "bfloat16"},
        **({"data_types": {"grad_accum_dtype": "fp32"}} if dtype == "bfloat16" else {}),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the client optimizer is torch's AdamW
        "zero_force_ds_cpu_optimizer": False,  # offloaded, it still is (DeepSpeedCPUAdam needs compiled ops)
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class _Calls(torch.nn.Module):
    """The model as DeepSpeed's engine sees it: ``engine(fn)`` runs ``fn()`` inside the engine's forward,
    so its hooks (ZeRO-3's gathers, the backward bookkeeping) see every pass, while ``fn`` calls the model
    as it needs (the packed path runs the decoder and the output head separately).

    ``saved``: the only keys its ``state_dict`` (DeepSpeed's checkpointed module state) holds (None: all);
    a LoRA model's adapter, without the frozen base and its tied aliases."""

    def __init__(self, model: torch.nn.Module, saved: set[str] | None = None) -> None:
        super().__init__()
        self.model = model
        self.saved = saved
        if saved is not None:
            self.register_state_dict_post_hook(_Calls._only_saved)

    @staticmethod
    def _only_saved(module: "_Calls", state: dict, prefix: str, local_metadata: dict) -> None:
        for key in [key for key in state if key.removeprefix(prefix) not in module.saved]:
            del state[key]

    def forward(self, fn):
        return fn()


class DeepSpeedTrainEngine(TorchTrainEngine):
    """``TorchTrainEngine`` on rank ``rank`` of ``world_size``, its training state sharded by ZeRO
    ``zero_stage``. ``rendezvous``: ``host:port`` of rank 0's TCP store (None: a group of one).

    Every method runs on all ranks at once (``engines.rank_group``); results come from rank 0 (other
    ranks return the same metrics, and None or empty lists where only rank 0 has the weights). ``lora``: the
    torch engine's, its adapter trained and checkpointed alone (see the module docstring)."""

    def __init__(self, model_path: str, optim: OptimSpec, *, dtype: str = "float32", seed: int = 0,
                 torch_threads: int = 0, micro_batch_size: int = 8, temperature: float = 1.0,
                 head: str = "policy", packing: bool = True, share_prompts: bool = True,
                 attn_implementation: str | None = None, gradient_checkpointing: bool = False,
                 device: str | None = None, rank: int = 0, world_size: int = 1, rendezvous: str | None = None,
                 zero_stage: int = 3, offload_optimizer: bool = False, offload_params: bool = False,
                 param_persistence_threshold: int | None = None, lora: dict | None = None) -> None:
        resolved = resolve_device(device)
        self.config = zero_config(zero_stage=zero_stage, micro_batch_size=micro_batch_size, world_size=world_size,
                                  grad_clip=optim.grad_clip, dtype=dtype, offload_optimizer=offload_optimizer,
                                  offload_params=offload_params, pin_memory=resolved.type == "cuda",
                                  param_persistence_threshold=param_persistence_threshold)
        if resolved.type != "cuda":
            os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is first imported
        init_ranks(rank, world_size, rendezvous, resolved)
        # what DeepSpeed's launcher would have set: this rank's place and its device's index among the visible
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(resolved.index or 0))
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if resolved.type == "cuda" else "gloo", dist_init_required=False)
        self.rank, self.world_size, self.zero_stage = rank, world_size, zero_stage
        super().__init__(model_path, optim, dtype=dtype, seed=seed, torch_threads=torch_threads,
                         micro_batch_size=micro_batch_size, temperature=temperature, head=head, packing=packing,
                         share_prompts=share_prompts, attn_implementation=attn_implementation,
                         gradient_checkpointing=gradient_checkpointing, device=device, lora=lora)

    def _build_optimizer(self, optim: OptimSpec) -> None:
        """The DeepSpeed engine around the model, a torch AdamW over its trainable parameters (a LoRA model's
        adapter) and its schedule: DeepSpeed keeps the fp32 master weights of a bf16 model itself (no
        ``MasterWeights``)."""
        import deepspeed

        self.master = None
        optimizer, scheduler = adamw(self._optimized_parameters(), optim, fused=_fused_adamw(self.model))
        saved = {f"model.{name}" for name, _ in self._trained_parameters()} if self.peft is not None else None
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=_Calls(self.model, saved), optimizer=optimizer, lr_scheduler=scheduler, config=self.config,
            dist_init_required=False)

    # -- forward and the update step ---------------------------------------------------------------------
    def _forward(self, micro: TrainBatch, **options) -> dict[str, torch.Tensor]:
        return self.engine(lambda: super(DeepSpeedTrainEngine, self)._forward(micro, **options))

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.engine(lambda: super(DeepSpeedTrainEngine, self).logprobs(batch))

    @torch.no_grad()
    def rollout_values(self, rollouts: Rollouts) -> torch.Tensor:
        return self.engine(lambda: super(DeepSpeedTrainEngine, self).rollout_values(rollouts))

    def _backward(self, loss: torch.Tensor) -> None:
        """This rank's share of the batch's gradient, summed over ranks (DeepSpeed averages them)."""
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def _step(self) -> float:
        """Reduce the accumulated gradients, clip them, step AdamW and the schedule; the norm before the clip."""
        self.engine.step()
        return float(self.engine.get_global_grad_norm())

    def _step_kwargs(self) -> dict:
        return dict(parameters=[], optimizer=self.optimizer, scheduler=self.scheduler,
                    grad_clip=self.optim_spec.grad_clip, rank=self.rank, world_size=self.world_size,
                    backward=self._backward, step=self._step)

    # -- weights -------------------------------------------------------------------------------------
    def _full_chunks(self, named: list[tuple[str, torch.Tensor]],
                     chunk_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``named``'s ``(name, parameter)`` pairs, whole, in chunks of at most ``chunk_bytes`` (or one
        parameter). Every rank iterates in lockstep: under ZeRO-3 each chunk is gathered from the ranks'
        shards and released when the next is asked for, so use its tensors before that."""
        import deepspeed

        chunk, size = [], 0
        for name, param in named:
            nbytes = getattr(param, "ds_numel", param.numel()) * param.element_size()
            if chunk and size + nbytes > chunk_bytes:
                with deepspeed.zero.GatheredParameters([p for _, p in chunk]):
                    yield chunk
                chunk, size = [], 0
            chunk.append((name, param))
            size += nbytes
        if chunk:
            with deepspeed.zero.GatheredParameters([p for _, p in chunk]):
                yield chunk

    def _gathered(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``named``'s parameters whole on rank 0 (copies under ZeRO-3); ``[]`` on the other ranks."""
        whole = []
        for chunk in self._full_chunks(named, GATHER_BYTES):
            if self.rank == 0:
                whole += [(name, p.detach().clone() if self.zero_stage == 3 else p.detach()) for name, p in chunk]
        return whole

    def _synced_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """What a full sync sends (the torch engine's: every parameter, tied weights once, or a LoRA model's
        base under HF names), whole on rank 0; ``[]`` on the others, which gather with it."""
        return self._gathered(super()._synced_parameters())

    def _adapter_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """A LoRA model's adapter, whole on rank 0; ``[]`` on the others, which gather with it."""
        return self._gathered(super()._adapter_tensors())

    def export_weights(self, bucket_bytes: int = 64 << 20) -> list[Bucket]:
        """What a full sync sends in buckets of at most ``bucket_bytes`` on rank 0; ``[]`` on the others."""
        buckets = []
        for chunk in self._full_chunks(super()._synced_parameters(), bucket_bytes):
            if self.rank == 0:
                buckets += pack_buckets(chunk, bucket_bytes)
        return buckets

    def export_adapter(self, version: int, bucket_bytes: int = 64 << 20) -> AdapterUpdate | None:
        """The torch engine's ``export_adapter`` of the gathered adapter on rank 0; None on the others."""
        update = super().export_adapter(version, bucket_bytes)
        return update if self.rank == 0 else None

    def export_shared(self, version: int) -> SharedWeights | None:
        """Rank 0 copies the weights into shared memory under ZeRO-1/2, where it holds them whole; None
        under ZeRO-3 and on the other ranks (the sync then sends buckets)."""
        return super().export_shared(version) if self.rank == 0 and self.zero_stage < 3 else None

    def export_cuda_ipc(self, version: int) -> CudaWeights | None:
        """As ``TorchTrainEngine.export_cuda_ipc`` on rank 0 under ZeRO-1/2; None otherwise (buckets then)."""
        return super().export_cuda_ipc(version) if self.rank == 0 and self.zero_stage < 3 else None

    def weights_checksum(self) -> str | None:
        """The torch engine's ``weights_checksum`` of the whole model, or of a LoRA model's base (hashed once)
        and adapter, on rank 0 (equal to the torch engine's for the same weights); None on the other ranks."""
        self._export_done()
        checksum = super().weights_checksum() if self.peft is not None else tensors_checksum(self._synced_parameters())
        return checksum if self.rank == 0 else None

    # -- state ---------------------------------------------------------------------------------------
    def save(self, uri: str) -> list[str]:
        """DeepSpeed's checkpoint (each rank writes its shard of the trained parameters and their optimizer
        state, a LoRA model's adapter only; the LR schedule is in rank 0's) under ``uri/deepspeed``, and each rank's RNG state, staged in a local
        folder and copied to ``uri`` (local or s3://). Returns every rank's files (on every rank)."""
        self._export_done()
        if self.rank == 0:  # a folder saved before, maybe by more ranks: nothing of it may stay
            fs, path = filesystem(uri)
            if fs.exists(path):
                fs.rm(path, recursive=True)
        torch.distributed.barrier()
        with tempfile.TemporaryDirectory() as tmp:
            self.engine.save_checkpoint(join(tmp, "deepspeed"), tag=CHECKPOINT_TAG, save_latest=False,
                                        exclude_frozen_parameters=self.peft is not None)  # LoRA: no base
            rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
            Path(tmp, "rng").mkdir()
            Path(tmp, "rng", f"rank_{self.rank}.pt").write_bytes(_torch_bytes(rng))
            mine = _upload(tmp, uri)
        return sorted(name for files in gather_objects(mine) for name in files)

    def load(self, uri: str) -> str | None:
        """Restore what ``save`` wrote (model, optimizer, LR schedule, this rank's RNG); returns the loaded
        weights' checksum (rank 0)."""
        self._export_done()
        strict = self.peft is None  # a LoRA checkpoint holds no base
        with _local_folder(uri) as folder, tempfile.TemporaryDirectory() as tmp:
            saved = join(folder, "deepspeed", CHECKPOINT_TAG)
            ranks = len(list(Path(saved).glob("*zero_pp_rank_*_optim_states.pt")))
            if ranks == 0:
                raise FileNotFoundError(f"no deepspeed checkpoint under {uri}/deepspeed/{CHECKPOINT_TAG}")
            if ranks == self.world_size:
                self.engine.load_checkpoint(join(folder, "deepspeed"), tag=CHECKPOINT_TAG, load_module_strict=strict)
            else:  # shards of another world size: through DeepSpeed's universal (whole-tensor) checkpoint
                _to_universal(saved, join(tmp, CHECKPOINT_TAG))
                self.engine._config.load_universal_checkpoint = True
                try:
                    self.engine.load_checkpoint(tmp, tag=CHECKPOINT_TAG, load_module_strict=strict)
                finally:
                    self.engine._config.load_universal_checkpoint = False
            own = Path(folder, "rng", f"rank_{self.rank}.pt")  # a rank the saving run had not: rank 0's
            rng = _read_torch(str(own if own.exists() else Path(folder, "rng", "rank_0.pt")))
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        return self.weights_checksum()

    def save_pretrained(self, uri: str) -> list[str]:
        """The whole model in HF format at ``uri`` from rank 0 (the others gather with it, return []). A LoRA
        model is saved as the torch engine saves it: merged, and its adapter in peft's format under ``adapter/``."""
        return self._save_gathered_pretrained(uri, self.rank)

    # -- memory (engines.protocols) --------------------------------------------------------------------
    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory (DeepSpeed's ``offload_states``);
        a no-op on CPU, where they are already."""
        if self.device.type == "cuda" and not self._offloaded:
            self._export_done()
            self._close_cuda_export()
            self.engine.offload_states()
            torch.cuda.empty_cache()
            self._offloaded = True

    def reload(self) -> None:
        """Move back what ``offload`` moved."""
        if self._offloaded:
            self.engine.reload_states()
            self._offloaded = False


def _to_universal(checkpoint: str, out: str) -> None:
    """Convert DeepSpeed checkpoint folder ``checkpoint`` (one tag) to a universal one at ``out``, which
    loads into any world size (``deepspeed.checkpoint.ds_to_universal``)."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main

    main(Namespace(input_folder=checkpoint, output_folder=out, num_extract_workers=1, num_merge_workers=1,
                   keep_temp_folder=False, strict=True, inject_missing_state=True))


def _upload(local_dir: str, uri: str) -> list[str]:
    """Copy the files under ``local_dir`` into the folder ``uri`` (beside what is there); their relative paths."""
    files = sorted(str(p.relative_to(local_dir)) for p in Path(local_dir).rglob("*") if p.is_file())
    fs, path = filesystem(uri)
    for name in files:
        if not is_remote(uri):
            os.makedirs(os.path.dirname(f"{path}/{name}"), exist_ok=True)
        fs.put_file(os.path.join(local_dir, name), f"{path}/{name}")
    return files


@contextmanager
def _local_folder(uri: str) -> Iterator[str]:
    """``uri`` as a local folder: itself when local, else a temporary copy."""
    if not is_remote(uri):
        yield uri.removeprefix("file://")
        return
    fs, path = filesystem(uri)
    with tempfile.TemporaryDirectory() as tmp:
        fs.get(path.rstrip("/") + "/", tmp, recursive=True)
        yield tmp
