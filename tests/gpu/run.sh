#!/usr/bin/env bash
# The GPU checks, for a host with a CUDA device, Python, torch, transformers and numpy, and nothing else
# needed (no Ray, vLLM, network or install step): `bash tests/gpu/run.sh`. One line per check; exits
# non-zero when one fails or the whole run passes 8 minutes.
# - With pytest there: every `gpu`-marked test under tests/gpu (the checks of gpu_checks.py and the
#   algorithms on CUDA), summarised one line per test (-rA); extra arguments go to pytest.
# - Without: `python tests/gpu/gpu_checks.py`, which prints PASS/FAIL per check.
# Without xxhash, weight checksums use BLAKE2b-128 (engines/weight_sync.py): both sides of every check
# hash alike. Transformers' hub kernels are off (they download kernels; this host has no network).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
export USE_HUB_KERNELS=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
if python -c "import pytest" 2>/dev/null; then
    timeout 480 python -m pytest -m gpu -p no:cacheprovider -q -rA tests/gpu "$@"
else
    timeout 480 python tests/gpu/gpu_checks.py
fi
