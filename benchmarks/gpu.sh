#!/usr/bin/env bash
# The GPU machine's run (see ../shared/gpu/README.md): GPU tests, then every benchmark, into $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
{ nvidia-smi -L; nproc; df -h /dev/shm; python3 -c "import nvidia.dali, torch; print('dali', nvidia.dali.__version__, 'torch', torch.__version__)"; } 2>&1 | tee "$out/machine.txt"
python3 -m pytest -m gpu -v -p no:cacheprovider tests 2>&1 | tail -20 | tee "$out/gpu-tests.log"
# one GPU and 16 cores, like the reference machine of ../shared/DESIGN.md
CUDA_VISIBLE_DEVICES=${GPU:-0} taskset -c "${CPUS:-0-15}" python3 -m mmproxy.cli bench --workload "${WORKLOAD:-all}" --samples "${SAMPLES:-8192}" --workers "${WORKERS:-15}" \
  --threads "${THREADS:-8}" --epochs 3 --json "$out/bench-gpu.json" --plot "$out/bench-gpu.png" \
  --memory-epochs "${MEMORY_EPOCHS:-20}" --data-dir /tmp/bench 2>&1 | grep -av "Index file" | tee "$out/bench-gpu.log"
