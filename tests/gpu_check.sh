#!/usr/bin/env bash
# The GPU check: tests/test_gpu.py with NCCL, world size 1, on one CUDA GPU, then a verdict table.
# Installs nothing; needs torch (with CUDA) and pytest there. If wrapt is missing, put its wheel in .whl/
# (see /work/.library/device/README.md) and it is unpacked to a temporary folder. Well under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import wrapt" 2>/dev/null && ls .whl/wrapt-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/fsdp-fix-site .whl/wrapt-*.whl
  export PYTHONPATH=/tmp/fsdp-fix-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FSDP_AUTOCAST_FIX_TEST_BACKEND=nccl
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
timeout 450 python3 -m pytest -q -m gpu -rA tests/test_gpu.py -p no:cacheprovider 2>&1 | tee /tmp/gpu_check.log
rc=${PIPESTATUS[0]}
echo; echo "| GPU check | verdict |"; echo "|---|---|"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" /tmp/gpu_check.log | sed -E 's/^(PASSED|FAILED|ERROR|SKIPPED) ([^ ]+).*/| \2 | \1 |/'
exit "$rc"
