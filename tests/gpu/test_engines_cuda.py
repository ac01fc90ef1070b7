"""The GPU checks of ``gpu_checks.py`` as tests: HF engine and trainer in bf16 on CUDA, their log-prob
parity, one RL step with the CUDA IPC, bucket and shared-memory weight paths, CUDA IPC across processes,
memory freed by offload/reload. Marker ``gpu`` (deselected by default); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import gpu_checks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return gpu_checks.build_models(tmp_path_factory.mktemp("gpu-models"))


@pytest.mark.parametrize("check", gpu_checks.CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_gpu_check(check, models):
    check(models)
