"""GPU checks of the HF rollout engine and the torch trainer on one CUDA device: bf16 engines, their
log-prob parity, one RL step with the three weight paths, CUDA IPC across processes, offload/reload; and
FSDP2 as one NCCL rank, and a LoRA trainer with adapter syncs merged on the GPU.

Plain functions that import only torch, transformers, numpy and this repository (xxhash when present),
so they run on a bare GPU host without Ray, vLLM, pytest or a network: ``bash tests/gpu/run.sh`` runs
them (``python tests/gpu/gpu_checks.py`` prints one line per check); ``test_engines_cuda.py`` runs the
same functions as ``@pytest.mark.gpu`` tests. Engines are plain objects given ``device="cuda"``.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engines.algorithms.objective import PolicyObjective, SFTObjective  # noqa: E402
from engines.batches import AdvantageSpec, advantage_batch  # noqa: E402
from engines.data.arithmetic import arithmetic_corpus, make_arithmetic_splits  # noqa: E402
from engines.data.sft import sft_batch  # noqa: E402
from engines.inference.hf import HFInferenceEngine  # noqa: E402
from engines.models import TinyModelSpec, build_tiny_model  # noqa: E402
from engines.training.torch import OptimSpec, TorchTrainEngine  # noqa: E402
from engines.types import SamplingParams, build_train_batch  # noqa: E402

DEVICE = "cuda"  # a device type
PROMPTS, TARGETS = ["12+3=", "1+1=", "29+30=", "7+8="], ["15", "2", "59", "15"]
SMALL = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
MEDIUM = TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024)  # ~4M parameters


def build_models(root: str | Path) -> dict[str, str]:
    """A small model (behaviour checks) and a medium one (memory checks, where sizes must dominate the
    allocator's rounding and cuBLAS workspaces), both random-initialised Qwen2 on arithmetic text."""
    train, _ = make_arithmetic_splits(num_train=300, num_heldout=20, max_operand=30, seed=0)
    return {name: str(build_tiny_model(Path(root) / name, arithmetic_corpus(train), spec, seed=0))
            for name, spec in (("small", SMALL), ("medium", MEDIUM))}


def _pad(engine: HFInferenceEngine) -> int:
    return engine.tokenizer.pad_token_id


def check_hf_engine_bf16(models: dict[str, str]) -> str:
    """The rollout engine's model is bf16 on CUDA; seeded sampling repeats; Rollouts come back on CPU."""
    engine = HFInferenceEngine(models["small"], dtype="bfloat16", device=DEVICE)
    assert {(p.device.type, p.dtype) for p in engine.model.parameters()} == {(DEVICE, torch.bfloat16)}
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    out = engine.generate(PROMPTS * 4, sampling)
    assert {t.device.type for t in (out.response_ids, out.logprobs, out.response_lengths)} == {"cpu"}
    for i, length in enumerate(out.response_lengths.tolist()):
        assert 1 <= length <= 8 and torch.isfinite(out.logprobs[i, :length]).all()
        assert (out.logprobs[i, :length] <= 0).all() and (out.logprobs[i, length:] == 0).all()
    assert torch.equal(engine.generate(PROMPTS * 4, sampling).response_ids, out.response_ids)
    return f"{int(out.response_lengths.sum())} tokens sampled"


def check_trainer_bf16(models: dict[str, str]) -> str:
    """The trainer computes in bf16 on CUDA and steps fp32 masters there; the loss falls on a fixed batch."""
    trainer = TorchTrainEngine(models["small"], OptimSpec(lr=1e-3), dtype="bfloat16", device=DEVICE, micro_batch_size=2)
    assert trainer.master is not None
    assert {(m.device.type, m.dtype) for m in trainer.master.params} == {(DEVICE, torch.float32)}
    batch = sft_batch(models["small"], PROMPTS, TARGETS)  # on CPU, as Ray hands it over
    losses = [trainer.train_step(batch, SFTObjective())["train/loss"] for _ in range(5)]
    assert losses[-1] < losses[0], losses
    states = [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    assert states and {v.device.type for v in states} == {DEVICE}
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in trainer.master.pairs)  # the masters, rounded
    assert trainer.logprobs(batch).device.type == "cpu"
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def check_logprob_parity(models: dict[str, str]) -> str:
    """Trainer vs rollout engine log-probs of the sampled tokens, same weights: fp32 to float rounding,
    bf16 within its precision (2^-8 relative on logits of magnitude ~1)."""
    details = []
    for dtype, tolerance in (("float32", 1e-4), ("bfloat16", 5e-2)):
        rollout = HFInferenceEngine(models["small"], dtype=dtype, device=DEVICE)
        trainer = TorchTrainEngine(models["small"], OptimSpec(), dtype=dtype, device=DEVICE, micro_batch_size=4,
                                   temperature=0.7)
        out = rollout.generate(PROMPTS * 4, SamplingParams(max_new_tokens=8, temperature=0.7, top_k=20, seed=1))
        batch = build_train_batch(out, _pad(rollout))
        diff = ((trainer.logprobs(batch) - batch.tensors["rollout_logprobs"]) * batch.loss_mask).abs()
        assert batch.loss_mask.sum() >= 16 and diff.max() < tolerance, (dtype, float(diff.max()))
        details.append(f"{dtype} max |diff| {float(diff.max()):.1e}")
    return ", ".join(details)


def _stand_in_rewards(rollouts) -> torch.Tensor:
    """A reward that varies within each group (the random model never answers right): the sampled token
    ids' sum mod 7, over 6."""
    sums = (rollouts.response_ids * (torch.arange(rollouts.response_ids.shape[1]) < rollouts.response_lengths[:, None]))
    return (sums.sum(-1) % 7).float() / 6


def check_rl_step_and_weight_sync(models: dict[str, str]) -> str:
    """generate → rewards → GRPO advantages → train_step, then the rollout engine takes the new weights
    through CUDA IPC, buckets and shared memory, each verified by checksum."""
    rollout = HFInferenceEngine(models["small"], dtype="bfloat16", device=DEVICE)
    trainer = TorchTrainEngine(models["small"], OptimSpec(lr=1e-3), dtype="bfloat16", device=DEVICE, micro_batch_size=8)
    group = 4
    out = rollout.generate([p for p in PROMPTS for _ in range(group)], SamplingParams(max_new_tokens=8, seed=3))
    group_ids = torch.arange(len(PROMPTS)).repeat_interleave(group)
    batch, summary, _ = advantage_batch(out, _stand_in_rewards(out), group_ids, AdvantageSpec("grpo", _pad(rollout)),
                                        old_logprobs=trainer.rollout_logprobs(out))
    assert summary["advantage/abs_mean"] > 0

    def step() -> str:
        before = trainer.weights_checksum()
        metrics = trainer.train_step(batch, PolicyObjective())
        assert math.isfinite(metrics["train/loss"]) and trainer.weights_checksum() != before
        assert rollout.weights_checksum() != trainer.weights_checksum()
        return trainer.weights_checksum()

    expected = step()
    handles = trainer.export_cuda_ipc(1)
    assert handles is not None and handles.checksum == expected
    assert rollout.update_weights_cuda_ipc(handles) == expected and rollout.weights_version() == 1
    greedy = build_train_batch(rollout.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0)), _pad(rollout))
    diff = (trainer.logprobs(greedy) - greedy.tensors["rollout_logprobs"]) * greedy.loss_mask
    assert diff.abs().max() < 5e-2  # the same weights on both sides: bf16 parity
    expected = step()
    assert rollout.update_weights(2, trainer.export_weights(1 << 16)) == expected and rollout.weights_version() == 2
    expected = step()
    shared = trainer.export_shared(3)  # a CUDA trainer's weights go through host memory
    assert shared is not None and rollout.update_weights_shared(shared) == trainer.exported_checksum() == expected
    return "CUDA IPC, buckets and shared memory: checksums equal"


_RECEIVER = """
import pickle, sys
sys.path.insert(0, sys.argv[3])
from engines.inference.hf import HFInferenceEngine
engine = HFInferenceEngine(sys.argv[1], dtype="bfloat16", device="cuda")
before = engine.weights_checksum()
with open(sys.argv[2], "rb") as f:
    handles = pickle.load(f)
print("RESULT", before, engine.update_weights_cuda_ipc(handles), engine.weights_version())
"""


def check_cuda_ipc_across_processes(models: dict[str, str]) -> str:
    """A rollout engine in another process on the same GPU opens the trainer's CUDA IPC handles and gets
    its weights; once it is done the trainer's offload frees the buffer too (no reader holds it)."""
    trainer = TorchTrainEngine(models["small"], OptimSpec(), dtype="bfloat16", device=DEVICE)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)  # other weights than the model file the receiver loads
    handles = trainer.export_cuda_ipc(7)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "handles.pkl"
        path.write_bytes(pickle.dumps(handles))
        run = subprocess.run([sys.executable, "-c", _RECEIVER, models["small"], str(path), str(ROOT)],
                             capture_output=True, text=True, timeout=180)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-2000:]
    before, received, version = lines[-1].split()[1:]
    assert before != handles.checksum and received == handles.checksum and version == "7", (
        f"receiver held {before}, received {received} (v{version}); the trainer exported {handles.checksum}")
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    trainer.offload()
    n = sum(p.numel() for p in trainer.model.parameters())
    # by hand: bf16 weights 2 B + fp32 masters 4 B + the export buffer's bf16 copy 2 B per parameter
    freed = loaded - torch.cuda.memory_allocated()
    assert freed >= 0.99 * 8 * n, (freed, 8 * n)
    return f"another process received v7; offload freed {freed / 2**20:.1f} MiB"


def _state(trainer: TorchTrainEngine) -> dict[str, torch.Tensor]:
    """Host copies of the masters and every optimizer state tensor."""
    out = {f"master/{n}": m.detach().cpu().clone() for n, m in trainer.master.state_dict().items()}
    for i, state in enumerate(trainer.optimizer.state.values()):
        out.update({f"optim/{i}/{k}": v.detach().cpu().clone() for k, v in state.items() if torch.is_tensor(v)})
    return out


def check_offload_frees_memory(models: dict[str, str]) -> str:
    """offload() frees the trainer's weights, masters and optimizer state and the rollout engine's weights
    on the GPU; reload() brings them back bit-identical and training goes on."""
    batch = sft_batch(models["medium"], PROMPTS, TARGETS)
    trainer = TorchTrainEngine(models["medium"], OptimSpec(lr=1e-4), dtype="bfloat16", device=DEVICE, micro_batch_size=4)
    trainer.train_step(batch, SFTObjective())
    n = sum(p.numel() for p in trainer.model.parameters())
    checksum, state = trainer.weights_checksum(), _state(trainer)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    trainer.offload()
    freed = loaded - torch.cuda.memory_allocated()
    # by hand: bf16 weights 2 B + fp32 masters 4 B + AdamW exp_avg and exp_avg_sq 8 B per parameter (the
    # masters' last gradients, 4 B more, go too)
    assert freed >= 0.99 * 14 * n, (freed, 14 * n)
    trainer.reload()
    assert trainer.weights_checksum() == checksum
    restored = _state(trainer)
    assert restored.keys() == state.keys() and all(torch.equal(v, restored[k]) for k, v in state.items())
    assert len(state) > 2 * len(trainer.master.params)  # masters, then step, exp_avg, exp_avg_sq of each
    assert math.isfinite(trainer.train_step(batch, SFTObjective())["train/loss"])

    rollout = HFInferenceEngine(models["medium"], dtype="bfloat16", device=DEVICE)
    checksum = rollout.weights_checksum()
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    rollout.sleep()
    rollout_freed = loaded - torch.cuda.memory_allocated()
    assert rollout_freed >= 0.99 * 2 * n, (rollout_freed, 2 * n)  # bf16 weights, 2 B per parameter
    try:
        rollout.generate(PROMPTS, SamplingParams(max_new_tokens=2))
        raise AssertionError("generate() ran while asleep")
    except RuntimeError:
        pass
    rollout.wake()
    assert rollout.weights_checksum() == checksum and next(rollout.model.parameters()).device.type == DEVICE
    rollout.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    return f"trainer freed {freed / 2**20:.0f} MiB, rollout {rollout_freed / 2**20:.0f} MiB of {n / 1e6:.1f}M parameters"


def _weights(engine) -> dict[str, torch.Tensor]:
    """An engine's exported weights (HF names) as fp32 host tensors."""
    from engines.weight_sync import unpack_bucket

    return {name: tensor.float().cpu() for bucket in engine.export_weights(64 << 20) for name, tensor in unpack_bucket(bucket)}


def check_fsdp2_one_rank_nccl(models: dict[str, str]) -> str:
    """FSDP2 as one rank of an NCCL group: bf16 compute with fp32 shards trains like the torch engine (3 SFT
    steps, weights within bf16 rounding), its export loads into a CUDA rollout engine with the trainer's
    checksum, and offload frees its shards and Adam state."""
    from engines.training.fsdp2 import FSDP2TrainEngine

    batch = sft_batch(models["medium"], PROMPTS, TARGETS)
    sharded = FSDP2TrainEngine(models["medium"], OptimSpec(lr=1e-4), dtype="bfloat16", device=DEVICE, micro_batch_size=2)
    reference = TorchTrainEngine(models["medium"], OptimSpec(lr=1e-4), dtype="bfloat16", device=DEVICE, micro_batch_size=2)
    for _ in range(3):
        ours, theirs = sharded.train_step(batch, SFTObjective()), reference.train_step(batch, SFTObjective())
    assert abs(ours["train/loss"] - theirs["train/loss"]) < 1e-2 * abs(theirs["train/loss"]), (ours, theirs)
    a, b = _weights(sharded), _weights(reference)
    gap = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert a.keys() == b.keys() and gap <= 2 ** -6, gap  # a few bf16 rounding steps of weights of magnitude < 2
    rollout = HFInferenceEngine(models["medium"], dtype="bfloat16", device=DEVICE)
    rollout.begin_update(1)
    for bucket in sharded.export_weights(64 << 20):
        rollout.receive(bucket)
    assert rollout.commit(1).checksum == sharded.weights_checksum()
    n = sum(p.numel() for p in reference.model.parameters())
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    sharded.offload()
    freed = loaded - torch.cuda.memory_allocated()
    assert freed >= 0.99 * 12 * n, (freed, 12 * n)  # by hand: fp32 shards 4 B + AdamW moments 8 B per parameter
    sharded.reload()
    assert math.isfinite(sharded.train_step(batch, SFTObjective())["train/loss"])
    return f"max |weight gap| to the torch engine {gap:.1e}; offload freed {freed / 2**20:.0f} MiB"


LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]}


def check_lora_on_cuda(models: dict[str, str]) -> str:
    """A bf16 LoRA trainer on CUDA: only the adapter moves, the CUDA rollout engine takes the base once and then
    the adapter (merged on the GPU) with the trainer's checksum and log-probs within bf16 precision, and the
    adapter disabled gives the base model's log-probs."""
    trainer = TorchTrainEngine(models["small"], OptimSpec(lr=1e-2), dtype="bfloat16", device=DEVICE, micro_batch_size=4,
                               lora=LORA)
    rollout = HFInferenceEngine(models["small"], dtype="bfloat16", device=DEVICE)
    batch = sft_batch(models["small"], PROMPTS, TARGETS)
    for _ in range(3):
        trainer.train_step(batch, SFTObjective())
    rollout.begin_update(1)
    for bucket in trainer.export_weights(64 << 20):  # the base, once
        rollout.receive(bucket)
    rollout.commit(1)
    update = trainer.export_adapter(2, 64 << 20)
    report = rollout.update_adapter(update)
    assert report is not None and report.checksum == trainer.weights_checksum()
    out = rollout.generate(PROMPTS * 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    sampled = build_train_batch(out, _pad(rollout))
    gap = ((trainer.logprobs(sampled) - sampled.tensors["rollout_logprobs"]) * sampled.loss_mask).abs().max()
    assert gap < 5e-2, float(gap)
    reference = TorchTrainEngine(models["small"], OptimSpec(), dtype="bfloat16", device=DEVICE, micro_batch_size=4)
    assert torch.allclose(trainer.reference_logprobs(batch), reference.logprobs(batch), atol=1e-6)
    return f"adapter {update.nbytes} bytes a sync; log-prob gap {float(gap):.1e}"


CHECKS = [check_hf_engine_bf16, check_trainer_bf16, check_logprob_parity, check_rl_step_and_weight_sync,
          check_cuda_ipc_across_processes, check_offload_frees_memory, check_fsdp2_one_rank_nccl, check_lora_on_cuda]


def main() -> int:
    if not torch.cuda.is_available():
        print("FAIL no CUDA device")
        return 1
    import transformers

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers {transformers.__version__}")
    failed = 0
    with tempfile.TemporaryDirectory() as root:
        models = build_models(root)
        for check in CHECKS:
            start = time.perf_counter()
            try:
                detail = check(models)
                print(f"PASS {check.__name__} ({time.perf_counter() - start:.1f} s): {detail}", flush=True)
            except Exception as error:  # noqa: BLE001 - every check runs and reports
                failed += 1
                print(f"FAIL {check.__name__} ({time.perf_counter() - start:.1f} s): {type(error).__name__}: {error}",
                      flush=True)
                traceback.print_exc(file=sys.stderr)
    print(f"{len(CHECKS) - failed} of {len(CHECKS)} GPU checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
