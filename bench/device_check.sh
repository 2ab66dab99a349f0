#!/usr/bin/env bash
# The GPU checks in one go, on a GPU host that has torch (CUDA), numpy, msgpack,
# attrs, pytest and hypothesis but no package index (docs/gpu.md, "The device check").
#
#   bench/device_check.sh fetch    # here, once: the wheels that host lacks, into .whl/
#   bench/device_check.sh          # there, from the checkout (with .whl/ beside it)
#
# "fetch" downloads pyzmq, immutables and xxhash built for that host's Python
# (DEVICE_PYTHON, default 3.12) into .whl/ (ignored by git: take it along).
# The run installs them into a temporary folder, not into the host's Python,
# and writes into $OUT (default ./device-out): device.txt (the GPU, torch),
# gpu_check.log (bench/gpu_check.py: every byte checked, the ratios to a plain
# pinned copy, the pipelined copy unit), tests_gpu.log (tests/gpu with CUDA),
# bench_payload.log (kvproto bench --only payload: host bytes on that host)
# and summary.txt (the exit statuses). About 5 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(pyzmq immutables xxhash)

if [ "${1:-}" = fetch ]; then
    ver=${DEVICE_PYTHON:-3.12}
    exec "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$ver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
elif [ $# -gt 0 ]; then
    echo "usage: bench/device_check.sh [fetch]" >&2
    exit 2
fi

OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
site=$(mktemp -d)
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in .whl/: run 'bench/device_check.sh fetch' where pip can download" >&2
    exit 2
fi
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "${wheels[@]}"; then
    echo "the wheels in .whl/ do not install for $("$PY" -V 2>&1): fetch them with DEVICE_PYTHON set" >&2
    exit 2
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1

{ command -v nvidia-smi >/dev/null && nvidia-smi -L; \
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"; \
} 2>&1 | tee "$OUT/device.txt"
timeout 300 "$PY" bench/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
check=${PIPESTATUS[0]}
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/tests_gpu.log" 2>&1
tests=$?
tail -3 "$OUT/tests_gpu.log"
timeout 120 "$PY" -m kvproto bench --only payload --sizes 8,32 2>&1 | tee "$OUT/bench_payload.log"
bench=${PIPESTATUS[0]}
echo "gpu_check $check, tests/gpu $tests, kvproto bench $bench (0: passed)" | tee "$OUT/summary.txt"
[ "$check" -eq 0 ] && [ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
