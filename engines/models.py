"""Load a Hugging Face causal LM and tokenizer, or build a tiny one offline.

``build_tiny_model`` makes a Qwen2-architecture model from a small config and trains a byte-level BPE
tokenizer on the task's own text with ``tokenizers``; both are saved in HF format (``model.safetensors``),
so every later stage loads them by path exactly like a hub model.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny Qwen2 model; the vocabulary comes from the trained tokenizer."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 128
    vocab_size: int = 64  # upper bound for the BPE trainer


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer that splits digits one by one (arithmetic stays learnable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, EOS_TOKEN], show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)


def build_tiny_model(out_dir: str | os.PathLike, texts: Iterable[str], spec: TinyModelSpec, seed: int) -> Path:
    """Train a tokenizer on ``texts``, initialise a Qwen2 model with ``seed`` and save both to ``out_dir``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)  # a crash never leaves a half-written model folder behind
    return out


def set_torch_threads(threads: int = 0) -> int:
    """Use ``threads`` intra-op threads, or every core when 0 (Ray sets OMP_NUM_THREADS=1 in actors)."""
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    return threads


_warned_no_cuda = False


def engine_device() -> torch.device:
    """Where this engine puts its model and tensors: ``cuda:0`` when Ray assigned this actor GPUs (Ray
    sets ``CUDA_VISIBLE_DEVICES`` to them, so the first visible device is the assigned one) and CUDA is
    available; CPU otherwise. GPU ids without CUDA (GPUs declared to a CPU-only Ray, as in tests) stay on
    CPU, with one warning per process. Ray is asked only when this process already imported and started
    it, so plain objects (tests, ``tests/gpu/run.sh``) default to CPU and take ``device=`` instead."""
    global _warned_no_cuda
    ray = sys.modules.get("ray")
    gpu_ids = ray.get_gpu_ids() if ray is not None and ray.is_initialized() else []
    if not gpu_ids:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if not _warned_no_cuda:
        _warned_no_cuda = True
        warnings.warn(f"Ray assigned GPUs {list(gpu_ids)} to this engine but torch sees no CUDA device: it runs on CPU",
                      RuntimeWarning, stacklevel=2)
    return torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as given (an engine's constructor argument), or ``engine_device()`` for None."""
    return engine_device() if device is None else torch.device(device)


def local_model_path(path: str) -> str:
    """A path ``from_pretrained`` can read: local paths and hub ids as given, ``s3://…`` (any fsspec URL)
    downloaded once into the local cache."""
    from engines.checkpoint_store import local_copy

    return local_copy(path)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_model_path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _model_options(dtype: str, attn_implementation: str | None) -> dict:
    """``from_pretrained`` keywords: the dtype, and the attention kernel when one is chosen (None keeps
    transformers' default)."""
    options = {"dtype": getattr(torch, dtype)}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    return options


def load_model(path: str, dtype: str = "float32", trainable: bool = True, *, attn_implementation: str | None = None,
               device: str | torch.device = "cpu"):
    """Any HF causal LM by local path, hub id or fsspec URL (s3://…), on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local_model_path(path), **_model_options(dtype, attn_implementation))
    model.train(trainable)  # before the move: transformers' hub kernels re-kernelize on a mode change
    if not trainable:
        model.requires_grad_(False)
    return model.to(device)


def load_value_model(path: str, dtype: str = "float32", *, attn_implementation: str | None = None,
                     device: str | torch.device = "cpu"):
    """A critic: the causal LM's backbone with a fresh scalar head per token (``...ForTokenClassification``,
    ``num_labels=1``). The head starts at zero so the first values are 0, not noise."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(local_model_path(path), num_labels=1,
                                                            **_model_options(dtype, attn_implementation))
    head = model.score if hasattr(model, "score") else model.classifier
    torch.nn.init.zeros_(head.weight)
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    return model.train(True).to(device)


def stop_token_ids(tokenizer, stop_strings: Iterable[str] = ()) -> tuple[int, ...]:
    """EOS plus every stop string that is a single token of this tokenizer."""
    ids = {tokenizer.eos_token_id}
    for text in stop_strings:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"stop string {text!r} is {len(encoded)} tokens; stop strings must be single tokens")
        ids.add(encoded[0])
    return tuple(sorted(i for i in ids if i is not None))


def check_vocabularies(student_path: str, teacher_path: str) -> None:
    """Pass when a teacher can score a student's tokens: both load the same tokenizer (every token has one
    id, same special tokens) and both models' vocabularies (``config.vocab_size``, the embedding rows) hold
    every token of it, so they differ at most in padding rows past its length. Otherwise a one-line
    ``ValueError`` naming both paths and what differs. Reads tokenizers and configs, never weights."""
    from transformers import AutoConfig

    student, teacher = load_tokenizer(student_path), load_tokenizer(teacher_path)
    pair = f"student {student_path} vs teacher {teacher_path}"
    student_ids, teacher_ids = student.get_vocab(), teacher.get_vocab()
    moved = sorted(t for t in student_ids.keys() | teacher_ids.keys() if student_ids.get(t) != teacher_ids.get(t))
    if moved:
        raise ValueError(f"{pair}: the teacher tokenizer maps {len(moved)} tokens differently (e.g. {moved[0]!r}: "
                         f"{student_ids.get(moved[0])} vs {teacher_ids.get(moved[0])}); distillation needs one tokenizer")
    if student.special_tokens_map != teacher.special_tokens_map:
        raise ValueError(f"{pair}: special tokens differ: {student.special_tokens_map} vs {teacher.special_tokens_map}")
    rows = [AutoConfig.from_pretrained(local_model_path(path)).get_text_config().vocab_size
            for path in (student_path, teacher_path)]
    if min(rows) < len(student):
        raise ValueError(f"{pair}: vocab sizes {rows[0]} vs {rows[1]} differ beyond padding: the tokenizer has "
                         f"{len(student)} tokens")
