#!/usr/bin/env bash
# mmproxy of the checkout against mmproxy of an earlier commit, each against DALI's reader, in one
# call on one machine: the check that a change lost no throughput (images, audio, video).
#   BEFORE=DIR   that commit's mmproxy, datasets, pipelines, pyproject.toml and README.md, e.g.
#                mkdir .before && git archive 0ae4320 mmproxy datasets pipelines pyproject.toml \
#                  README.md benchmarks/video_bench.py | tar -x -C .before
#   PART=image   mmproxy bench --workload image, 16,384 JPEGs, 5 epochs x RUNS (2) runs, both codes
#   PART=audio   the same on 4,096 clips
#   PART=video   benchmarks/video_bench.py, PyAV in the workers, both codes, interleaved twice
# The earlier code is installed to /tmp/before-site and run from /tmp, so that the checkout's
# folders on the path do not shadow it. JSON to $OUT (default /tmp/out).
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
before=$(realpath "${BEFORE:-.before}")
here=$(pwd)
if [[ ! -d /tmp/before-site/mmproxy ]]; then
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/before-site "$before"
fi
quiet() { grep -a -v -E "Index file not provided|^\s*$" | tail -"${1:-8}"; }
new() { timeout "$1" python3 -m mmproxy.cli bench "${@:2}"; }
old() { (cd /tmp && PYTHONPATH=/tmp/before-site:$PYTHONPATH timeout "$1" python3 -m mmproxy.cli bench "${@:2}"); }
common="--workers 15 --threads 8 --epochs 5 --runs ${RUNS:-2}"
case "${PART:-image}" in
image|audio)
  new 250 --workload "$PART" --samples 16384 $common --data-dir /tmp/bench \
    --systems mmproxy,dali-reader,dali-proxy --json "$out/$PART-after.json" 2>&1 | quiet
  old 250 --workload "$PART" --samples 16384 $common --data-dir /tmp/bench-old \
    --systems mmproxy,dali-reader --json "$out/$PART-before.json" 2>&1 | quiet ;;
video)
  v() { timeout 100 python3 "$1" --clips 256 --resolution 596x336 --workers 15 --threads 8 \
          --epochs 3 --systems mmproxy-pyav --json "$2" --data-dir "$3" 2>&1 | grep -a "clips/s"; }
  for r in 1 2; do
    (cd /tmp && PYTHONPATH=/tmp/before-site:$PYTHONPATH v "$before/benchmarks/video_bench.py" \
      "$out/video-pyav-before-$r.json" /tmp/vbench-old)
    v "$here/benchmarks/video_bench.py" "$out/video-pyav-after-$r.json" /tmp/vbench
  done ;;
*) echo "PART must be image, audio or video" >&2; exit 2 ;;
esac
