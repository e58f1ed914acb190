#!/usr/bin/env bash
# Second GPU run: GPU tests, the proxy machinery, where the image/audio time goes (server
# starvation, prefetch depth), and 1 vs 2 GPUs with and without DDP's gradient sync.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -4 | tee "$out/gpu-tests.log"
bench() { CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python3 -m mmproxy.cli bench --samples 8192 \
  --workers 15 --threads 8 --epochs 3 --data-dir /tmp/bench "$@" 2>&1 | grep -a "^\[" ; }
bench --workload machinery --systems mmproxy,dali-proxy --json "$out/machinery.json"
bench --workload image,audio,image-text --systems mmproxy,dali-reader --json "$out/depth2.json"
bench --workload image,audio --systems mmproxy --prefetch 4 --json "$out/depth4.json"
cd examples
for mode in independent ddp; do
  for n in 1 2; do
    python3 -m torch.distributed.run --nproc_per_node=$n --master_port=2980$n train_ddp.py \
      --data '/tmp/bench/image-8192/image-{0000..0127}.tar' --samples 8192 --epoch-length 96 \
      --batch-size 256 --workers 15 --threads 8 --image-size 224 --epochs 4 \
      $([ $mode = independent ] && echo --independent) --json "$out/ddp-$mode-$n.json" 2>&1 | grep world
  done
done
