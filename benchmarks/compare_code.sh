#!/usr/bin/env bash
# mmproxy of the checkout against mmproxy of an earlier commit, each against DALI's reader in the
# same run, the two codes interleaved round by round on one machine: the check that a change lost
# no throughput. Writes $OUT/compare-code.json (default /tmp/out), the file benchmarks/report.py
# renders from benchmarks/results/MACHINE/compare-code.json.
#   BEFORE=DIR     that commit's mmproxy, datasets, pipelines, pyproject.toml, README.md and
#                  benchmarks/video_bench.py, e.g.
#                  mkdir .before && git archive 9adb295 mmproxy datasets pipelines pyproject.toml \
#                    README.md benchmarks/video_bench.py | tar -x -C .before
#   BEFORE_COMMIT  its name in the results (default: the folder's name)
#   PART           the workloads, among image, audio and video (default "image audio"); video is
#                  benchmarks/video_bench.py with PyAV in the workers (no reader)
#   ROUNDS (2), SAMPLES (16384), WORKERS (15), THREADS (8), EPOCHS (4): on 2 cores
#                  SAMPLES=2048 WORKERS=2 THREADS=2
#   ARGS           more arguments for both codes' runs, e.g. ARGS="--pipelines 2"
# The earlier code is copied to /tmp/before-site-NAME (NAME: BEFORE_COMMIT) and run from /tmp,
# so that the checkout's folders on the path do not shadow it.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
before=$(realpath "${BEFORE:-.before}")
name=${BEFORE_COMMIT:-$(basename "$before")}
site=/tmp/before-site-$name
here=$(pwd)
runs=$(mktemp -d)
if [[ ! -d $site/mmproxy ]]; then  # the packages as pyproject.toml maps them (no build: its
  # setuptools may be older than the project's metadata needs)
  mkdir -p "$site" && cp -r "$before/mmproxy" "$site/" && cp -r "$before/datasets" "$site/mmproxy/datasets" \
    && cp -r "$before/pipelines" "$site/mmproxy/pipelines"
fi
common="--workers ${WORKERS:-15} --threads ${THREADS:-8} --epochs ${EPOCHS:-4} ${ARGS:-}"
new() { timeout 400 python3 -m mmproxy.cli bench "$@"; }
old() { (cd /tmp && PYTHONPATH=$site:$PYTHONPATH timeout 400 python3 -m mmproxy.cli bench "$@"); }
video() {  # video CODE ROUND SCRIPT DATA
  (cd "$5" && PYTHONPATH=$2 timeout 200 python3 "$3" --clips 256 --resolution 596x336 $common \
     --systems mmproxy-pyav --data-dir "$4" --json "$runs/video-$1-$6.json" 2>&1 | grep -a "clips/s")
}
for part in ${PART:-image audio}; do
  for r in $(seq "${ROUNDS:-2}"); do
    case "$part" in
    image|audio)
      w="--workload $part --samples ${SAMPLES:-16384} $common --systems mmproxy,dali-reader"
      new $w --data-dir /tmp/bench --json "$runs/$part-after-$r.json" 2>&1 | tail -2
      old $w --data-dir /tmp/bench-old --json "$runs/$part-before-$r.json" 2>&1 | tail -2 ;;
    video)
      video after "$PYTHONPATH" "$here/benchmarks/video_bench.py" /tmp/vbench "$here" "$r"
      video before "$site:$PYTHONPATH" "$before/benchmarks/video_bench.py" \
        /tmp/vbench-old /tmp "$r" ;;
    *) echo "PART must name image, audio or video" >&2; exit 2 ;;
    esac
  done
done
python3 - "$runs" "$out/compare-code.json" "$name" <<'EOF'
import json, os, pathlib, sys
runs, target, before = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
rows, head = [], None
for path in sorted(runs.glob("*.json"), key=lambda p: (p.stem.split("-")[0], int(p.stem.split("-")[-1]),
                                                       p.stem.split("-")[1] != "after")):
    workload, code, number = path.stem.split("-")
    data = json.loads(path.read_text())
    head = head if head or code != "after" else data
    systems = data["systems"] if "systems" in data else data["results"][workload]["systems"]
    mine = systems.get("mmproxy") or systems.get("mmproxy-pyav") or {}
    reader = systems.get("dali-reader", {})
    rows.append({"workload": workload, "code": code, "round": int(number),
                 "mmproxy": mine.get("samples_per_s"),
                 "mmproxy_sustained": mine.get("sustained_samples_per_s"),
                 "dali_reader": reader.get("samples_per_s"),
                 "ratio": mine.get("samples_per_s", 0) / reader["samples_per_s"] if reader else None})
asked = " ".join(f"{k}={os.environ[k]}" for k in ("PART", "ROUNDS", "SAMPLES", "WORKERS", "THREADS",
                                                  "EPOCHS", "ARGS") if os.environ.get(k))
target.write_text(json.dumps({"command": f"{asked} bash benchmarks/compare_code.sh".strip(),
                              "commit": (head or {}).get("commit", ""), "before": before,
                              "date": (head or {}).get("date", ""),
                              "machine": (head or {}).get("machine"), "runs": rows}, indent=1) + "\n")
print("wrote", target)
EOF
