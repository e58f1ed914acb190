#!/usr/bin/env bash
# The runs behind BENCHMARKS.md's "Images, 5 epochs x 3 runs" figures, the S3 figures with the
# S3 server on cores of its own, and the video decoder experiments, on an nvidia-h200-x2 machine
# (2x H200, 32 cores): every single-GPU run is pinned to GPU 0 and cores 0-15 (one H200 and 16
# cores, like the reference machine), leaving cores 16-31 for the shard servers.
#   PART=video   fn.decoders.video's options (build_index, affine) against PyAV in the workers
#   PART=image   mmproxy bench, 5 epochs x 3 interleaved runs on the bench's synthetic JPEGs; DALI's
#                proxy with its defaults and with its documentation's prefetch_queue_depth=2*workers
#   PART=photos  the same on shards of real photographs (benchmarks/photo_shards.py)
#   (the JSON is written after every system, so a call cut short keeps what it measured)
#   PART=ab      benchmarks/engine_ab.py: mmproxy against one variant of its engine (VARIANT, e.g.
#                mmproxy-list-feed, mmproxy-depth4, mmproxy-feed-ahead, mmproxy-pinned-maps) and
#                the reader, 5 epochs x RUNS (8) interleaved runs, on DATA=synthetic (the bench's)
#                or DATA=photos; ~2.5 min; SYSTEMS names the systems instead (the file keeps
#                VARIANT's name), LIMIT the seconds, LINES the lines of the summary shown
#   PART=tests   the GPU tests (pytest -m gpu)
#   PART=probe   feed_probe.py: the reader against the list and tensor-list feeds
#   PART=held    image_profile.py on mmproxy at depths 2 and 4, mmproxy feeding ahead, and the
#                reader: how long DALI held one run instead of two, and the runner's gap between
#                a run's outputs and the next run (next session's first call: is the gap what
#                depth 4 recovers, and does feeding ahead close it?)
#   PART=apart   mmproxy with its workers on cores 8-15 and everything else on 0-7
#                (--worker-cpus; the reader, without workers, keeps 0-15), against the same
#                without; then feed_probe.py (two calls' worth: run it alone)
#   PART=s3      remote_bench (interleaved) with the S3 / HTTP servers on cores 16-31, and on the
#                loader's own cores; then mmproxy bench's remote systems, servers on 16-31
# DDP: benchmarks/gpu_ddp.sh.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
one() { CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout "$@"; }
quiet() { grep -a -v -E "Index file not provided|^\s*$" | tail -"${1:-40}"; }
case "${PART:-image}" in
video)
  one 280 python3 benchmarks/video_bench.py --clips 192 --resolution 596x336 --workers 15 \
    --threads 8 --epochs 2 --data-dir /tmp/vbench --json "$out/video-decoder-options.json" \
    --systems 'mmproxy-nvdec[build_index=False],mmproxy-nvdec[affine=False],mmproxy-nvdec[build_index=False,affine=False],mmproxy-nvdec,mmproxy-pyav,dali-reader' \
    2>&1 | quiet 30 ;;
image)  # one call each (a system's run costs ~30 s of start-up: 12 runs take ~6-8 minutes)
  one 540 python3 -m mmproxy.cli bench --workload image --samples 16384 --workers 15 --threads 8 \
    --data-dir /tmp/bench --epochs 5 --runs 3 --systems mmproxy,dali-reader,dali-proxy,dali-proxy-seed \
    --json "$out/image-synthetic-runs.json" 2>&1 | quiet 12 ;;
photos)
  python3 benchmarks/photo_shards.py /tmp/photos --count 16384 2>&1 | tail -2
  one 520 python3 -m mmproxy.cli bench --data '/tmp/photos/photo-{0000..0255}.tar' --workers 15 \
    --threads 8 --epochs 5 --runs 3 --systems mmproxy,dali-reader,dali-proxy,dali-proxy-seed \
    --json "$out/image-photos-runs.json" 2>&1 | quiet 12 ;;
ab)  # session 10
  variant=${VARIANT:-mmproxy-list-feed}
  if [[ ${DATA:-synthetic} == photos ]]; then
    python3 benchmarks/photo_shards.py /tmp/photos --count 16384 2>&1 | tail -1
    data=(--data '/tmp/photos/photo-{0000..0255}.tar')
  else
    data=(--workload image --samples 16384 --data-dir /tmp/bench)
  fi
  one "${LIMIT:-400}" python3 benchmarks/engine_ab.py "${data[@]}" --workers 15 --threads 8 \
    --epochs 5 --runs "${RUNS:-8}" --systems "${SYSTEMS:-mmproxy,$variant,dali-reader}" \
    --json "$out/image-${DATA:-synthetic}-$variant-ab.json" 2>&1 | quiet "${LINES:-4}" ;;
held)  # SYSTEMS, RUNS: session 12 ran the reader 4 deep too, one run each
  one "${LIMIT:-420}" python3 benchmarks/image_profile.py --json "$out/profile-held.json" -- \
    --workload image --samples 16384 --workers 15 --threads 8 --epochs 5 --runs "${RUNS:-3}" \
    --data-dir /tmp/bench --json "$out/bench-held.json" \
    --systems "${SYSTEMS:-mmproxy,mmproxy-depth4,mmproxy-feed-ahead,dali-reader}" 2>&1 \
    | grep -a -E "^(==|   DALI|  image)" ;;
tests)  # the GPU tests of the code at hand
  one 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -8 ;;
probe)
  one 100 python3 benchmarks/feed_probe.py --data-dir /tmp/bench --samples 16384 --threads 8 \
    --iters 300 --rounds 2 --feeds reader,views,tensorlist --json "$out/feed-probe-tensorlist.json" \
    2>&1 | grep -a "^round" ;;
apart)  # is it the workers sharing the cores with DALI's threads? (BENCHMARKS.md, session 9)
  for cpus in 8-15 ""; do
    one 300 python3 -m mmproxy.cli bench --workload image --samples 16384 --workers 15 --threads 8 \
      --data-dir /tmp/bench --epochs 5 --runs 3 --systems mmproxy,dali-reader \
      ${cpus:+--worker-cpus $cpus} --json "$out/image-workers-apart-${cpus:-shared}.json" 2>&1 | quiet 3
  done
  one 120 python3 benchmarks/feed_probe.py --data-dir /tmp/bench --samples 16384 --threads 8 \
    --iters 300 --rounds 2 --json "$out/feed-probe.json" 2>&1 | grep -a "^round" ;;
s3)
  one 200 python3 benchmarks/remote_bench.py --systems http,s3 --samples 16384 --workers 15 \
    --threads 8 --rounds 4 --server-cpus 16-31 --data-dir /tmp/bench \
    --json "$out/interleaved-s3-servers-apart.json" 2>&1 | quiet 8
  one 150 python3 benchmarks/remote_bench.py --systems s3 --samples 16384 --workers 15 \
    --threads 8 --rounds 4 --data-dir /tmp/bench \
    --json "$out/interleaved-s3-servers-shared.json" 2>&1 | quiet 4
  one 200 python3 -m mmproxy.cli bench --workload image --samples 16384 --workers 15 --threads 8 \
    --data-dir /tmp/bench --epochs 5 --runs 2 --server-cpus 16-31 \
    --systems mmproxy,mmproxy-http,mmproxy-s3,mmproxy-cached \
    --json "$out/bench-remote-servers-apart.json" 2>&1 | quiet 8 ;;
*) echo "PART must be video, image, photos, ab, held, tests, probe, apart or s3" >&2; exit 2 ;;
esac
