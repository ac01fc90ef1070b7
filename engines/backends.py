"""Engine backends by role: a registered short name, or any class by dotted path ``package.module:Class``.

The config names a backend (``rollout.engine: hf``, ``train.engine: torch``, or a dotted path); the schema
checks the name with ``check_backend`` without importing anything, and the module is imported only when
an engine of that backend starts (``engine_class``), so a vLLM or Megatron backend costs nothing to a run
that does not use it, and may live only in its actors' own environment. A backend must pass the
conformance suite, ``tests/engines/test_conformance.py``.
"""

from __future__ import annotations

from engines.registry import DOTTED_PATH, import_path

BACKENDS: dict[str, dict[str, str]] = {
    "rollout": {"hf": "engines.inference.hf:HFInferenceEngine", "vllm": "engines.inference.vllm:VLLMEngine"},
    "train": {"torch": "engines.training.torch:TorchTrainEngine",
              "deepspeed": "engines.training.deepspeed:DeepSpeedTrainEngine",
              "fsdp2": "engines.training.fsdp2:FSDP2TrainEngine"},
    "reference": {"torch": "engines.training.torch:ReferenceEngine"},
    "teacher": {"torch": "engines.training.teacher:TeacherEngine"},
    "reward": {"worker": "engines.reward_worker:RewardWorker"},
    "env": {"worker": "engines.agentic.worker:EnvWorker"},
}
"""Role -> short name -> ``package.module:Class``. A role's short names are what its config key accepts."""

RANKED: frozenset[str] = frozenset({"engines.training.fsdp2:FSDP2TrainEngine",
                                    "engines.training.deepspeed:DeepSpeedTrainEngine"})
"""Sharded training backends: one actor per rank (``train.ranks``), driven as one by ``engines.rank_group``."""

ENVS: dict[str, str] = {"engines.inference.vllm:VLLMEngine": "vllm"}
"""Backends whose actors run in their own virtualenv (``engines.envs``): class path -> env name."""



def check_backend(role: str, name: str) -> str:
    """The ``package.module:Class`` path of backend ``name`` for ``role``, imported nowhere. ``ValueError``
    (one line) for an unknown short name, listing the registered ones, or a malformed dotted path."""
    registered = BACKENDS[role]
    if name in registered:
        return registered[name]
    if ":" not in name:
        raise ValueError(f"unknown {role} engine {name!r}; registered: {', '.join(sorted(registered))} "
                         f"(or a class by dotted path, package.module:Class)")
    if not DOTTED_PATH.fullmatch(name):
        raise ValueError(f"{role} engine {name!r} is not a dotted path package.module:Class")
    return name


def backend_env(kind: str) -> str | None:
    """The ``engines.envs`` env that backend ``kind`` (``"<role>/<name>"``) runs in; None: the driver's."""
    role, _, name = kind.partition("/")
    return ENVS.get(check_backend(role, name)) if role in BACKENDS else None


def is_ranked(kind: str) -> bool:
    """Whether backend ``kind`` (``"<role>/<name>"``) runs as a group of ranks (``RANKED``)."""
    role, _, name = kind.partition("/")
    return role in BACKENDS and check_backend(role, name) in RANKED


def engine_class(kind: str) -> type:
    """The class of ``kind``, ``"<role>/<name>"`` (e.g. ``"rollout/hf"``, ``"train/pkg.mod:Engine"``), its
    module imported now. ``ValueError`` as ``check_backend`` for a bad name."""
    role, _, name = kind.partition("/")
    if role not in BACKENDS:
        raise ValueError(f"unknown engine role {role!r} in {kind!r}; roles: {', '.join(sorted(BACKENDS))}")
    return import_path(check_backend(role, name))
