"""The vLLM worker extension of ``VLLMEngine`` (``worker_extension_cls``): weight updates inside the worker.

vLLM mixes this class into its worker; ``VLLMEngine`` calls these methods through ``collective_rpc``.
Weights arrive in checkpoint format (HF names, unfused) and load through vLLM's layerwise reload:
``begin`` restores each layer's checkpoint-format parameters, ``load`` streams one bucket at a time
into ``model.load_weights`` (a layer is repacked for its kernels once all its tensors arrived), and
``commit`` finalizes the layers. A tied LM head is a second module over the embedding's tensor, whose
CPU kernel holds a packed copy made at load time; ``commit`` ties it to the new embedding and repacks
it, else the head keeps the old weights (checked by the drift tests).
"""

from __future__ import annotations


class WeightReceiver:
    """Methods vLLM adds to its worker (``self`` is the worker: ``model_runner``, ``vllm_config``)."""

    def rollflow_begin_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def rollflow_load(self, named_tensors: list) -> int:
        """Load ``(hf_name, tensor)`` pairs into the open update; returns the vLLM parameters they filled."""
        return len(self.model_runner.get_model().load_weights(iter(named_tensors)))

    def rollflow_load_cuda(self, weights) -> list[tuple[str, bytes]]:
        """Load a colocated trainer's weights from its CUDA IPC export (``engines.weight_sync_cuda``) into
        the open update, device to device; returns each tensor's name and digest (of a host copy)."""
        import torch

        from engines.weight_sync import _tensor_digest, byte_views
        from engines.weight_sync_cuda import open_cuda_weights

        buffer = open_cuda_weights(weights, self.device)
        named = list(byte_views(buffer, weights.metas))
        self.rollflow_load(named)
        digests = [(name, _tensor_digest(view)) for name, view in named]
        torch.cuda.current_stream(self.device).synchronize()  # done reading before the mapping closes
        del named, buffer
        return digests

    def rollflow_commit_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.vllm_config.model_config)
        head, embedding = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = getattr(self.vllm_config.model_config.hf_text_config, "tie_word_embeddings", False)
        if tied and head is not None and embedding is not None and head is not embedding:
            head.weight = embedding.weight
            head.quant_method.process_weights_after_loading(head)  # repacks the CPU kernel's copy
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
