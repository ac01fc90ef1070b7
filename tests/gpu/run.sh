#!/usr/bin/env bash
# The GPU checks (pytest marker `gpu`), for a machine with a CUDA device: `bash tests/gpu/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
python -m pytest -m gpu -p no:cacheprovider tests/gpu "$@"
