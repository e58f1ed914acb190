#!/usr/bin/env bash
# One GPU session on an nvidia-h200-x2 machine (2x H200, 32 cores). `PART=1`: GPU tests and the
# single-GPU comparison (GPU 0, cores 0-15: one H200 and 16 cores, like the reference machine of
# ../shared/DESIGN.md), then 1 vs 2 GPUs with each rank pinned to its own 16 cores.
# `PART=2`: the comparison again (the host's run-to-run noise).
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
bench() { CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python3 -m mmproxy.cli bench --samples 8192 \
  --workers 15 --threads 8 --epochs 3 --data-dir /tmp/bench "$@" 2>&1 | grep -a "^\[" ; }
ddp() {  # ddp NAME NPROC ARGS...
  local name=$1 n=$2; shift 2
  (python3 -m torch.distributed.run --nproc_per_node="$n" --master_port=$((29800 + n)) \
    benchmarks/ddp_bench.py --data '/tmp/bench/image-8192/image-{0000..0127}.tar' --samples 8192 \
    --epoch-length 96 --batch-size 256 --workers 12 --threads 8 --image-size 224 --epochs 4 \
    --cpus-per-rank 16 --json "$out/ddp-$name-$n.json" "$@" 2>&1 | grep -a '"world"')
}
if [ "${PART:-1}" = 1 ]; then
  { nvidia-smi -L; nproc; python3 -c "import nvidia.dali, torch; print('dali', nvidia.dali.__version__, 'torch', torch.__version__)"; } 2>&1 | tee "$out/machine.txt"
  python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -4 | tee "$out/gpu-tests.log"
  bench --workload image,audio,image-text --systems mmproxy,dali-reader,dali-proxy --json "$out/bench-1.json"
  for n in 1 2; do
    ddp ddp $n
    ddp independent $n --independent
  done
else
  bench --workload image,audio,image-text --systems mmproxy,dali-reader,dali-proxy,torch \
    --json "$out/bench-2.json" --memory-epochs 20
fi
