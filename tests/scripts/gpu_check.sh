#!/usr/bin/env bash
# The GPU check: tests/test_gpu.py with NCCL, world size 1, on one CUDA GPU, then a verdict table.
# Installs nothing; needs torch (with CUDA) and pytest there. If wrapt is missing and a wrapt wheel lies in
# .whl/, it is unpacked to a temporary folder. Well under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if ! python3 -c "import wrapt" 2>/dev/null && ls .whl/wrapt-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$scratch/site" .whl/wrapt-*.whl
  export PYTHONPATH=$scratch/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FSDP_AUTOCAST_FIX_TEST_BACKEND=nccl
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
timeout 450 python3 -m pytest -q -m gpu -rA tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$scratch/gpu_check.log"
rc=${PIPESTATUS[0]}
echo; echo "| GPU check | verdict |"; echo "|---|---|"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$scratch/gpu_check.log" | sed -E 's/^(PASSED|FAILED|ERROR|SKIPPED) ([^ ]+).*/| \2 | \1 |/'
exit "$rc"
