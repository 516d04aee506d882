#!/usr/bin/env bash
# Issue 19's one command, run on the lent GPU machine (Python 3.12, torch with CUDA,
# transformers; no megatron-core and nothing to fetch from). `make device-wheel` puts
# megatron-core's cp312 wheel in .device/ here first; the device tool carries it:
#     run(command="bash tools/gpu_suite.sh", carry=[".device"], timeout_s=600)
# Arguments go to device_check.py: `bash tools/gpu_suite.sh --parts training` reruns one part.
# It installs the wheel into .device/site (no dependencies: the image has numpy and packaging)
# and writes $OUT/device_check.json with the parts numerics, training, memory, attention and
# documents (rewritten as each part ends, so a run cut off at the time limit keeps the parts it
# finished), and the whole output to $OUT/suite.log (the tool returns only its tail).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the results go to}"
wheel=$(ls .device/megatron_core-*-cp312-*.whl)
python -m pip install -q --no-deps --no-index --target .device/site "$wheel"
export PYTHONPATH="$PWD/.device/site:$PWD"
python - <<'PY'
import importlib.util, platform, torch
missing = [m for m in ("megatron.core", "numpy", "packaging", "transformers", "safetensors")
           if importlib.util.find_spec(m) is None]
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"cuda {torch.cuda.is_available()}, missing: {missing or 'none'}", flush=True)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python tools/device_check.py "$OUT" --suite gpu "$@" 2>&1 | tee "$OUT/suite.log"
