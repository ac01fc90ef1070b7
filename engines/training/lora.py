"""LoRA adapters (peft) for every train engine, and the adapter-only weight sync.

A LoRA model keeps the base weights frozen and trains, for each adapted linear layer ``W [out, in]``, two
matrices ``A [r, in]`` and ``B [out, r]`` (B starts at zero); the layer computes
``x W^T + scaling · (x A^T) B^T`` with ``scaling = alpha / r`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation
of Large Language Models"). The effective weight is ``W_base + scaling · B @ A``.

Train engines call ``wrap_lora`` on their HF model and keep using the HF model itself (its adapted layers
are peft's ``lora.Linear`` now): forwards, the trainable parameters and ``disable_adapter`` (the frozen base,
the KL reference) all work through it. From it:

* ``base_parameters``: the frozen base under the base model's HF names: what the first sync to a rollout
  engine sends (``Linear.base_layer.weight`` → ``Linear.weight``);
* ``adapter_tensors``: each adapted layer's ``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight``, named as
  in peft's saved adapters (without the ``base_model.model.`` prefix), with ``scalings`` per layer;
* ``merge_tensors``: the base with the adapter merged, under HF names (``merge_weight``): the merged export.

A rollout engine that holds the base takes an ``AdapterUpdate`` (``AdapterMerger``): it keeps a copy of
each adapted layer's base weight and writes ``W_base + scaling · B @ A`` into the layer, so generation runs
the plain model at full speed (no adapter branch per forward); a merge costs one rank-r product per layer.

Checksums: after an adapter sync a rollout engine reports ``adapter_checksum(base_checksum, adapter,
scalings)``: the ``tensors_checksum`` of the adapter tensors, their scalings and the checksum of the base
weights it verified when they arrived (the base is frozen, so it is hashed once). The trainer's
``weights_checksum`` is the same function of its own base and adapter; equal checksums mean the engine holds
the trainer's exact base and adapter (the merge itself is checked by comparing log-probabilities).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from engines.weight_sync import Bucket, pack_buckets, tensors_checksum, unpack_bucket

ADAPTER = "default"  # peft's adapter name; one adapter per model


@dataclass(frozen=True)
class LoraSpec:
    """The adapter's shape (``configs.schema.LoraConfig`` documents each field)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def wrap_lora(model: torch.nn.Module, spec: LoraSpec | dict) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` (in place) and freeze everything else; returns the peft wrapper
    (``.disable_adapter()``, ``.save_pretrained`` of the adapter). Adapter weights are drawn from torch's
    global RNG (seed it first). Only ``torch.nn.Linear`` layers can be adapted (what the merge handles)."""
    from peft import LoraConfig, get_peft_model

    spec = LoraSpec(**{**spec, "target_modules": tuple(spec["target_modules"])}) if isinstance(spec, dict) else spec
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=list(spec.target_modules), bias="none")
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    except ValueError as exc:  # peft's "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules {list(spec.target_modules)}: {exc}") from None
    layers = adapted_layers(model)
    if not layers:
        raise ValueError(f"model.lora.target_modules {list(spec.target_modules)} match no layer of the model")
    wrong = [name for name, layer in layers.items() if not isinstance(layer.base_layer, torch.nn.Linear)]
    if wrong:
        raise ValueError(f"model.lora.target_modules: {wrong[0]!r} is a {type(layers[wrong[0]].base_layer).__name__}, "
                         "not a Linear layer; name only linear layers (e.g. q_proj, v_proj)")
    return peft_model


def adapted_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers of ``model`` by module name (HF names: the model, not the peft wrapper)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def base_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The frozen base parameters of a wrapped ``model`` under the base model's HF names, in model order."""
    return [(name.replace(".base_layer.", "."), param) for name, param in model.named_parameters()
            if ".lora_" not in name]


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every adapted layer's ``<layer>.lora_A.weight`` ``[r, in]`` and ``<layer>.lora_B.weight`` ``[out, r]``."""
    return [(f"{name}.lora_{side}.weight", getattr(layer, f"lora_{side}")[ADAPTER].weight)
            for name, layer in adapted_layers(model).items() for side in ("A", "B")]


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """Each adapted layer's ``alpha / r``, by layer name."""
    return {name: float(layer.scaling[ADAPTER]) for name, layer in adapted_layers(model).items()}


def merge_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W_base + scaling · B @ A`` in fp32 on ``base``'s device, returned in its dtype. base: [out, in];
    A: [r, in]; B: [out, r] (on any device)."""
    lora_a, lora_b = (t.to(base.device, torch.float32) for t in (lora_a, lora_b))
    return (base.float() + (lora_b @ lora_a) * scaling).to(base.dtype)  # [out, in]


def merge_tensors(base: list[tuple[str, torch.Tensor]], adapter: list[tuple[str, torch.Tensor]],
                  scaling: dict[str, float]) -> list[tuple[str, torch.Tensor]]:
    """``base`` (``base_parameters``) with each adapted layer's weight merged with ``adapter``
    (``adapter_tensors``) at its ``scaling``: the effective weights under HF names."""
    lora, out = dict(adapter), []
    for name, param in base:
        layer = name.removesuffix(".weight")
        if layer in scaling:
            param = merge_weight(param.detach(), lora[f"{layer}.lora_A.weight"].detach(),
                                 lora[f"{layer}.lora_B.weight"].detach(), scaling[layer])
        out.append((name, param))
    return out


def peft_state_dict(adapter: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``adapter_tensors`` keyed as the peft wrapper's state dict (``base_model.model.<layer>.lora_A.default.weight``):
    what ``PeftModel.save_pretrained(state_dict=...)`` saves as the adapter when the model's own tensors are
    not whole (sharded)."""
    return {f"base_model.model.{name.removesuffix('.weight')}.{ADAPTER}.weight": tensor.contiguous()
            for name, tensor in adapter}


def adapter_checksum(base_checksum: str, adapter: list[tuple[str, torch.Tensor]], scaling: dict[str, float]) -> str:
    """``tensors_checksum`` of the adapter tensors, each layer's scaling (a float64 ``<layer>.lora_scaling``)
    and the base weights' checksum (its bytes as ``base_checksum``): what a rollout engine holding this base
    with this adapter merged reports."""
    extra = [(f"{name}.lora_scaling", torch.tensor([value], dtype=torch.float64)) for name, value in scaling.items()]
    extra.append(("base_checksum", torch.frombuffer(bytearray(base_checksum.encode()), dtype=torch.uint8)))
    return tensors_checksum([*adapter, *extra])


@dataclass(frozen=True)
class AdapterUpdate:
    """Version ``version`` of the adapter for a rollout engine that holds the base of checksum ``base_checksum``."""

    version: int
    base_checksum: str  # the trainer's base weights (tensors_checksum of base_parameters)
    scalings: dict[str, float]  # alpha / r by adapted layer
    buckets: list[Bucket]  # the adapter_tensors, packed

    @property
    def nbytes(self) -> int:
        """Tensor bytes sent: the adapter's A and B matrices."""
        return sum(int(bucket.data.nbytes) for bucket in self.buckets)


def export_adapter(model: torch.nn.Module, version: int, base_checksum: str, bucket_bytes: int,
                   adapter: list[tuple[str, torch.Tensor]] | None = None) -> AdapterUpdate:
    """The adapter of a wrapped ``model`` as an ``AdapterUpdate``: its ``adapter_tensors``, or ``adapter`` when
    given (a sharded model's, gathered whole)."""
    adapter = adapter_tensors(model) if adapter is None else adapter
    return AdapterUpdate(version, base_checksum, scalings(model), pack_buckets(adapter, bucket_bytes))


class AdapterMerger:
    """A rollout engine's side: the base weights of the adapted layers, kept as they arrived, and the
    adapter merged into the model's parameters. Made after a full weight update of checksum ``base_checksum``
    (the base); ``apply`` only rewrites the adapted layers' weights."""

    def __init__(self, model: torch.nn.Module, base_checksum: str) -> None:
        self.model, self.base_checksum = model, base_checksum
        self._base: dict[str, torch.Tensor] = {}  # adapted weights before any merge, by parameter name
        self.checksum: str | None = None  # adapter_checksum of the adapter merged now; None before any

    @torch.no_grad()
    def apply(self, update: AdapterUpdate) -> tuple[str, int, int]:
        """Merge ``update`` into the model; returns ``(checksum, tensors received, bytes received)``."""
        if update.base_checksum != self.base_checksum:
            raise ValueError(f"adapter v{update.version} is for base {update.base_checksum}, but this engine holds "
                             f"base {self.base_checksum}")
        tensors = {name: tensor for bucket in update.buckets for name, tensor in unpack_bucket(bucket)}
        params = dict(self.model.named_parameters())
        for layer, scaling in update.scalings.items():
            name = f"{layer}.weight"
            if name not in params:
                raise KeyError(f"adapter layer {layer!r} has no weight {name!r} in the receiving model")
            base = self._base.get(name)
            if base is None:
                base = self._base[name] = params[name].detach().clone()
            lora_a, lora_b = tensors[f"{layer}.lora_A.weight"], tensors[f"{layer}.lora_B.weight"]
            if base.dtype == torch.float32:  # one pass over the weight: W = W_base + scaling · B @ A
                torch.addmm(base, lora_b.to(base), lora_a.to(base), alpha=scaling, out=params[name])
            else:  # a low-precision weight: merged in fp32, then rounded once
                params[name].copy_(merge_weight(base, lora_a, lora_b, scaling))
        self.checksum = adapter_checksum(self.base_checksum, sorted(tensors.items()), update.scalings)
        return self.checksum, len(tensors), update.nbytes

    def to(self, device: torch.device | str) -> None:
        """Move the kept base weights (with the model, for offload/reload)."""
        self._base = {name: tensor.to(device) for name, tensor in self._base.items()}
