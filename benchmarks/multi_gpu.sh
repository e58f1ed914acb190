#!/usr/bin/env bash
# The DDP figures of BENCHMARKS.md: 1 against 2 GPUs on an nvidia-h200-x2 machine (2x H200, 32
# cores), benchmarks/ddp_bench.py (the training of examples/train_ddp.py, timed) at 224 px, batch
# 256 per rank, 96 batches per rank per epoch, 4 epochs, 12 workers and 8 DALI threads per rank,
# each rank pinned to its own 16 cores (--cpus-per-rank 16). MODELS: `resnet50` (bf16: the model
# sets the pace) and/or `tiny` (gradient sync does). Without flags it runs mmproxy's plain runs.
#   CONTROL=1      the same models on one fixed batch made on the GPU (--synthetic: no loader, the
#                  ceiling the model and DDP allow), and without gradient sync (--independent: the
#                  loaders alone, per rank)
#   READER=1       the same training fed by DALI's own shard reader (--loader dali-reader)
#   NOBROADCAST=1  2 GPUs without the per-step BatchNorm-buffer broadcast (--no-broadcast-buffers)
#   PROFILE=1      torch.profiler traces of 8 steps on 1 and 2 GPUs, with the loader and without
#                  (--synthetic), summed up by benchmarks/ddp_profile.py
#   MAIN=1         the plain mmproxy runs too, along with CONTROL, READER or PROFILE
# Each run's JSON goes to $OUT (default /tmp/out), with the host's topology; at the end the runs
# are gathered into $OUT/ddp.json (and the profiles summed up in $OUT/ddp-profile.json): the files
# of benchmarks/results/gpu-h200x2/ that benchmarks/report.py renders.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -c "from mmproxy.apps.bench.shards import write_shards; write_shards('/tmp/bench', 'image', 8192)" >/dev/null
{ nvidia-smi -L; nvidia-smi topo -m; lscpu | grep -i -E "numa|socket|model name"; } > "$out/topology.txt" 2>&1
ddp() {  # ddp NAME NPROC [ddp_bench args]
  local name=$1 n=$2; shift 2
  (timeout 240 python3 -m torch.distributed.run --nproc_per_node="$n" \
    --master_port=$((29800 + n)) benchmarks/ddp_bench.py \
    --data '/tmp/bench/image-8192/image-{0000..0127}.tar' --samples 8192 --epoch-length 96 \
    --batch-size 256 --workers 12 --threads 8 --image-size 224 --epochs 4 --cpus-per-rank 16 \
    --json "$out/ddp-$name-$n.json" "$@" 2>&1 | grep -a -E '"world"|Error|error' | head -5)
}
if [ -z "${CONTROL:-}${PROFILE:-}${READER:-}" ] || [ -n "${MAIN:-}" ]; then
  for model in ${MODELS:-tiny resnet50}; do
    for n in 1 2; do ddp "$model" "$n" --model "$model"; done
  done
fi
if [ -n "${CONTROL:-}" ]; then
  for model in ${MODELS:-tiny resnet50}; do
    for n in 1 2; do ddp "$model-synthetic" "$n" --model "$model" --synthetic; done
    ddp "$model-independent" 2 --model "$model" --independent
  done
fi
if [ -n "${READER:-}" ]; then
  for model in ${MODELS:-tiny resnet50}; do
    for n in 1 2; do ddp "$model-reader" "$n" --model "$model" --loader dali-reader; done
  done
fi
if [ -n "${NOBROADCAST:-}" ]; then  # no BatchNorm-buffer broadcast at each step
  for model in ${MODELS:-tiny resnet50}; do
    ddp "$model-no-broadcast-buffers" 2 --model "$model" --no-broadcast-buffers
  done
fi
if [ -n "${PROFILE:-}" ]; then  # torch.profiler over 8 steps of the second epoch, summed per launcher
  for model in ${MODELS:-resnet50}; do
    for n in 1 2; do
      ddp "$model-profile" "$n" --model "$model" --epochs 2 --profile "$out/profile-$model-$n"
      ddp "$model-synthetic-profile" "$n" --model "$model" --epochs 2 --synthetic \
        --profile "$out/profile-$model-synthetic-$n"
    done
  done
  python3 benchmarks/ddp_profile.py "$out"/profile-* --json "$out/ddp-profile.json"
fi
# the runs of this call in one file, named by run (ddp-NAME.json -> NAME)
python3 - "$out" <<'EOF'
import json, os, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem[len("ddp-"):]: json.loads(p.read_text()) for p in sorted(out.glob("ddp-*.json"))
        if p.name != "ddp-profile.json"}
if runs:
    first = next(iter(runs.values()))
    asked = " ".join(f"{k}={os.environ[k]}" for k in ("MODELS", "MAIN", "CONTROL", "READER",
                                                      "NOBROADCAST", "PROFILE") if os.environ.get(k))
    (out / "ddp.json").write_text(json.dumps(
        {"command": f"{asked} bash benchmarks/multi_gpu.sh".strip(), "commit": first["commit"],
         "date": first["date"], "machine_kind": "two H200s, 32 cores", "runs": runs}, indent=1) + "\n")
EOF
