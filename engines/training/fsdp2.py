"""FSDP2 training engine (``train.engine: fsdp2``): the torch engine's model sharded over N ranks.

Each rank is one Ray actor (``engines.rank_group``) in one process group (``engines.training.distributed``:
gloo on CPU, NCCL on CUDA). torch's ``fully_shard`` (FSDP2, per-parameter DTensor sharding on dim 0)
wraps every transformer block (the model's ``_no_split_modules``), then a root holding the rest
(embeddings, final norm, LM head; tied weights stay one parameter). A block's weights are gathered
whole for its forward and backward and resharded after; gradients are reduce-scattered, so each rank
holds and steps 1/N of the parameters, gradients and AdamW state.

Precision: the sharded parameters, gradients and optimizer state are fp32 (the master weights), started
from the checkpoint's weights in the run's ``dtype`` as the torch engine's masters are; the forward and
backward compute in ``dtype`` (``MixedPrecisionPolicy.param_dtype``) and gradients are reduced in fp32.

Data: every rank receives the whole batch and computes its share of the micro-batches
(``engines.training.updates.optimizer_step``); each backpropagates its micro-batches' share of the whole
batch's loss, so the reduce-scatter sums the ranks' gradients (FSDP2 averages by default) and the step is
the single-process one whatever the rank count. The gradient-norm clip takes the global norm over the
shards.

Weights leave whole: every rank gathers each parameter in step (``full_tensor``), rank 0 sends them in
the compute dtype (buckets or shared memory; no CUDA IPC) and the other ranks return nothing. Checkpoints
are ``torch.distributed.checkpoint`` folders (each rank writes its shards; local or s3:// through
fsspec) that load into any rank count, plus rank 0's file of scheduler and per-rank RNG states.

LoRA (``lora``): the torch engine wraps the model with peft before it is sharded, so each block's shards
hold its frozen base and trainable adapter together (FSDP2 reduce-scatters only the gradients that exist)
and AdamW holds the adapter's shards. What the torch engine does with a LoRA model it does here on
gathered tensors: the base sync (HF names, compute dtype), ``export_adapter`` (fp32, rank 0), the
checksum (the base's hashed once), the merged and adapter exports. The reference log-probs disable the
adapter. Checkpoints hold the adapter and its optimizer state, not the base.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from engines.checkpoint_store import is_remote, write_bytes
from engines.models import resolve_device
from engines.training.distributed import gather_objects, init_ranks
from engines.training.lora import AdapterUpdate
from engines.training.torch import OptimSpec, TorchTrainEngine, _read_torch, _torch_bytes
from engines.types import Rollouts, TrainBatch
from engines.weight_sync import Bucket, SharedWeights, pack_buckets, tensors_checksum

ENGINE_STATE = "engine_state.pt"
"""A checkpoint's file of what is not sharded: the LR scheduler's state and every rank's RNG states."""


class _Root(torch.nn.Module):
    """The FSDP root around the HF model: its forward runs any function of the model, so computations that
    call the decoder and the LM head separately (packed log-probs) still gather the root's weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(*args, **kwargs)


def shard_model(model: torch.nn.Module, mesh, compute_dtype: torch.dtype, reshard_after_forward: bool) -> _Root:
    """``fully_shard`` each transformer block of ``model`` (fp32 parameters), then a ``_Root`` around it; returns
    the root. Blocks are the modules whose class is in ``model._no_split_modules``. Gradients are summed over
    the ranks, not averaged (a divide factor of 1, reduced with SUM, which gloo has)."""
    policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    root = fully_shard(_Root(model), mesh=mesh, mp_policy=policy)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


class FSDP2TrainEngine(TorchTrainEngine):
    """``TorchTrainEngine`` (same constructor keywords, same forward, objectives and update loop) with its model
    sharded by FSDP2 over ``world_size`` ranks; see the module docstring. Every method is called on every
    rank in the same order (``engines.rank_group``); results come from rank 0, and the weight exports and
    checksums of the other ranks are empty or None.

    ``rank``/``world_size``/``rendezvous``: this rank's place in the process group (``init_ranks``; None: a
    group of one). ``reshard_after_forward``: free each block's gathered weights after its forward and
    gather them again for the backward (less memory, one more all-gather per block)."""

    def __init__(self, model_path: str, optim: OptimSpec, *, dtype: str = "float32", seed: int = 0,
                 torch_threads: int = 0, micro_batch_size: int = 8, temperature: float = 1.0,
                 head: str = "policy", packing: bool = True, share_prompts: bool = True,
                 attn_implementation: str | None = None, gradient_checkpointing: bool = False,
                 device: str | None = None, rank: int = 0, world_size: int = 1, rendezvous: str | None = None,
                 reshard_after_forward: bool = True, lora: dict | None = None) -> None:
        device = resolve_device(device)
        init_ranks(rank, world_size, rendezvous, device)
        self.rank, self.world_size = rank, world_size
        self.compute_dtype = getattr(torch, dtype)
        # fp32 on CPU: fully_shard moves each block's shard to the device, never the whole model
        super().__init__(model_path, optim, dtype="float32", seed=seed, torch_threads=torch_threads,
                         micro_batch_size=micro_batch_size, temperature=temperature, head=head, packing=packing,
                         share_prompts=share_prompts, attn_implementation=attn_implementation,
                         gradient_checkpointing=gradient_checkpointing, device="cpu", lora=lora)
        self.device = device
        with torch.no_grad():  # the masters start from the weights in the run's dtype, as the torch engine's do
            for param in self.model.parameters():
                param.copy_(param.to(self.compute_dtype))
        mesh = init_device_mesh(device.type, (world_size,))
        self._root = shard_model(self.model, mesh, self.compute_dtype, reshard_after_forward)
        self._build_optimizer(optim)  # AdamW over the sharded parameters (a LoRA model's: the adapter's)

    # -- forward: through the FSDP root ------------------------------------------------------------------
    @torch.no_grad()
    def _scoring(self, fn: Callable, *args):
        """``fn(*args)`` without gradients, through the root; every gathered weight freed after."""
        out = self._root(fn, *args)
        for module in self._root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return out

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._scoring(super().logprobs, batch)

    def rollout_values(self, rollouts: Rollouts) -> torch.Tensor:
        return self._scoring(super().rollout_values, rollouts)

    def _forward(self, micro: TrainBatch, **options) -> dict[str, torch.Tensor]:
        return self._root(super()._forward, micro, **options)

    def _step_kwargs(self) -> dict:
        return {**super()._step_kwargs(), "rank": self.rank, "world_size": self.world_size, "step": self._step}

    def _step(self) -> float:
        """Clip the gradients to the global norm over every rank's shards, then AdamW and the LR schedule;
        returns the norm before the clip."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.optim_spec.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    # -- weights -------------------------------------------------------------------------------------
    def _gathered(self, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Each of ``named``'s (sharded) parameters whole, in ``dtype`` (None: its own), one at a time: each
        rank gathers each parameter in step (``full_tensor``); only rank 0's iteration yields them."""
        for name, param in named:
            full = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
            if self.rank == 0:
                yield name, full if dtype is None else full.to(dtype)

    def _synced_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """What a full sync sends (the torch engine's: every parameter by HF name, tied weights once, or a LoRA
        model's base), gathered in the compute dtype: rank 0's whole weights, the other ranks' empty."""
        return list(self._gathered(super()._synced_parameters(), self.compute_dtype))

    def _adapter_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """A LoRA model's adapter gathered whole in its own dtype (fp32, as the torch engine's): rank 0's."""
        return list(self._gathered(super()._adapter_tensors(), None))

    def export_weights(self, bucket_bytes: int = 64 << 20) -> list[Bucket]:
        """What a full sync sends in buckets of at most ``bucket_bytes`` on rank 0 (each parameter packed as it
        is gathered); ``[]`` on the others."""
        return pack_buckets(self._gathered(super()._synced_parameters(), self.compute_dtype), bucket_bytes)

    def export_adapter(self, version: int, bucket_bytes: int = 64 << 20) -> AdapterUpdate | None:
        """The torch engine's ``export_adapter`` of the gathered adapter on rank 0; None on the others."""
        update = super().export_adapter(version, bucket_bytes)
        return update if self.rank == 0 else None

    def export_shared(self, version: int) -> SharedWeights | None:
        """Rank 0 copies the gathered weights into shared memory (``TorchTrainEngine.export_shared``); the
        other ranks gather with it and return None."""
        if self.rank == 0:
            return super().export_shared(version)
        self._synced_parameters()
        return None

    def export_cuda_ipc(self, version: int) -> None:
        """None: a sharded trainer syncs through shared memory or buckets."""
        return None

    def weights_checksum(self) -> str | None:
        """The torch engine's ``weights_checksum`` of the whole weights in the compute dtype, or of a LoRA
        model's base (hashed once) and gathered adapter (rank 0; None on the other ranks, which gather with it)."""
        self._export_done()
        checksum = super().weights_checksum() if self.peft is not None else tensors_checksum(self._synced_parameters())
        return checksum if self.rank == 0 else None

    def exported_checksum(self) -> str | None:
        """Checksum of what ``export_shared`` copied (rank 0 wrote it; waits for the copy), or of the
        current weights when nothing went through shared memory (every rank gathers)."""
        shared = [self._shared_writer is not None]
        if self.world_size > 1:
            dist.broadcast_object_list(shared, src=0)  # only rank 0 knows whether it wrote shared memory
        if shared[0] and self.rank != 0:
            return None
        checksum = super().exported_checksum()  # without shared memory every rank gathers in step
        return checksum if self.rank == 0 else None

    # -- state ---------------------------------------------------------------------------------------
    def save(self, uri: str) -> list[str]:
        """Write model and optimizer shards (``torch.distributed.checkpoint``, every rank its own), then rank 0
        writes ``ENGINE_STATE``; returns the files under ``uri``. The model state is the trained parameters:
        all of them, or a LoRA model's adapter (its frozen base is the model's, not saved)."""
        self._export_done()
        metadata = dcp.save(self._checkpoint_state(),
                            storage_writer=FsspecWriter(uri, sync_files=not is_remote(uri)))  # S3: no fsync
        rngs = gather_objects(_rng_state())
        if self.rank == 0:
            write_bytes(f"{uri}/{ENGINE_STATE}", _torch_bytes({"scheduler": self.scheduler.state_dict(), "rng": rngs}))
        shards = {info.relative_path for info in metadata.storage_data.values()}
        return sorted({".metadata", ENGINE_STATE, *shards})

    def load(self, uri: str) -> str | None:
        """Restore what ``save`` wrote, by any number of ranks; returns the loaded weights' checksum (rank 0).
        A rank without an RNG state of its own in the checkpoint (more ranks than saved it) takes rank 0's."""
        self._export_done()
        state = self._checkpoint_state()  # the shapes and shards to fill
        dcp.load(state, storage_reader=FsspecReader(uri))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=self.peft is None))  # a LoRA model's base is no key of it
        extra = _read_torch(f"{uri}/{ENGINE_STATE}")
        self.scheduler.load_state_dict(extra["scheduler"])
        rng = extra["rng"][self.rank] if self.rank < len(extra["rng"]) else extra["rng"][0]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        return self.weights_checksum()

    def _checkpoint_state(self) -> dict:
        """``{"model", "optim"}``: the sharded state a checkpoint holds. A LoRA model's model state is its
        trained parameters only (``_trained_parameters``: the adapter; torch's ``ignore_frozen_params`` would
        keep the tied copy of a frozen embedding); ``dcp.load`` fails on any of them a checkpoint lacks."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        if self.peft is not None:
            trained = {name for name, _ in self._trained_parameters()}
            model_state = {name: value for name, value in model_state.items() if name in trained}
        return {"model": model_state, "optim": optim_state}

    def save_pretrained(self, uri: str) -> list[str]:
        """The whole model in HF format at ``uri`` in the compute dtype (the config says so, not the fp32 shards'),
        written by rank 0; the other ranks gather with it and return []. A LoRA model is saved as the torch
        engine saves it: merged, and its adapter in peft's format under ``adapter/``."""
        return self._save_gathered_pretrained(uri, self.rank, self.compute_dtype)

    # -- memory --------------------------------------------------------------------------------------
    def _weights_module(self) -> torch.nn.Module:
        """``offload``/``reload`` move the FSDP root: its ``to()`` keeps FSDP's shards in step."""
        return self._root
