#!/usr/bin/env bash
# The one-H200 results files (benchmarks/results/gpu-h200/, rendered into BENCHMARKS.md by
# benchmarks/report.py): every run pinned to GPU 0 and cores 0-15 (one H200 and 16 cores). On an
# nvidia-h200-x2 machine (2x H200, 32 cores) that leaves cores 16-31 for the shard servers of
# PART=remote; on an nvidia-h200 machine (16 cores) the pinning changes nothing and PART=remote runs
# its servers on the loader's cores (SERVER_CPUS= empty). Each PART writes the files it names into
# $OUT (default /tmp/out); copy them over the old ones in benchmarks/results/gpu-h200/.
#   PART=image     16,384 JPEGs: mmproxy and the graph alone with 3 pipelines of 5 threads, 5 epochs
#                  x 2 runs (image.json); DALI's reader and proxy (image-reader-proxy.json); mmproxy
#                  with 4 pipelines of 3 threads (image-4-pipelines.json)
#   PART=image-one-pipeline  every system with one pipeline of 8 threads (image-one-pipeline.json)
#   PART=spdl      mmproxy, the reader and SPDL on images and on 2,048 clips (image-spdl.json,
#                  audio-spdl.json)
#   PART=torch     mmproxy, the reader, DALI's proxy and PyTorch's workers on 8,192 JPEGs, 2,048
#                  clips and image-text, and the memory over 20 epochs (image-audio-torch.json)
#   PART=photos    mmproxy and the reader on shards of real photographs (image-photographs.json)
#   PART=audio     8,192 WAV clips: mmproxy, the graph alone and the reader with 2 pipelines of 7
#                  threads (audio.json); mmproxy with 3 of 5 (audio-3-pipelines.json); every system
#                  with one of 8 (audio-one-pipeline.json)
#   PART=audio-proxy  mmproxy, the reader and DALI's proxy on 2,048 clips (audio-proxy.json)
#   PART=video     benchmarks/video_bench.py, one process a system, 1,024 clips of 596x336:
#                  decoder="mixed" with the workers on cores 7-15 and unpinned, NVDEC (TorchCodec),
#                  PyAV in the workers, PyTorch's workers (video-596x336-*.json); 96 clips of
#                  1280x720: "mixed" and PyTorch's workers (video-1280x720-*.json)
#   PART=video-dali  512 clips of 596x336 in one process: PyAV in the workers, PyTorch's workers,
#                  DALI's in-memory decoder, DALI's reader and proxy (video-596x336-dali.json)
#   PART=damage    mmproxy on a copy of the image shards with 1% of the JPEGs damaged (KIND:
#                  truncate, or corrupt), against the same shards clean (damage.json)
#   PART=remote    mmproxy bench's remote systems, the servers on cores 16-31 (remote.json)
#   PART=resume    benchmarks/resume_bench.py: first batch after a resume, sample-seeded crops
#                  (resume.json)
#   PART=tests     the GPU tests (pytest -m gpu)
# mmproxy bench writes its JSON after every system, so a run cut short keeps what it measured. Two
# H200s under DDP: benchmarks/multi_gpu.sh.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
one() { CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout "$@"; }
quiet() { grep -a -v -E "Index file not provided|^\s*$" | tail -"${1:-40}"; }
bench="python3 -m mmproxy.cli bench"  # a command timeout can run (it cannot run a function)
# TorchCodec loads the system's FFmpeg; where there is none, PyAV's bundled FFmpeg under the plain
# names it asks for (libavutil.so.N, ...), through LD_LIBRARY_PATH
if ! ldconfig -p 2>/dev/null | grep -q "libavutil.so"; then
  bundled=$(python3 -c "import av, pathlib; print(pathlib.Path(av.__file__).parent.parent / 'av.libs')" 2>/dev/null)
  if [ -d "$bundled" ]; then
    mkdir -p /tmp/pyav-ffmpeg
    for f in "$bundled"/*.so*; do
      b=$(basename "$f")
      ln -sf "$f" "/tmp/pyav-ffmpeg/$b"
      ln -sf "$f" "/tmp/pyav-ffmpeg/$(echo "$b" | sed -E 's/-[0-9a-f]{8}//; s/(\.so\.[0-9]+).*/\1/')"
    done
    export LD_LIBRARY_PATH="/tmp/pyav-ffmpeg${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
case "${PART:-image}" in
image)  # a system's run costs ~30 s of start-up
  img="$bench --workload image --samples 16384 --workers 15 --data-dir /tmp/bench"
  one 400 $img --epochs 5 --runs 2 --threads 5 --pipelines 3 --systems mmproxy,dali-graph \
    --json "$out/image.json" 2>&1 | quiet 8
  one 400 $img --epochs 5 --runs 2 --threads 8 --pipelines 1 --systems dali-reader,dali-proxy \
    --json "$out/image-reader-proxy.json" 2>&1 | quiet 8
  one 200 $img --epochs 4 --threads 3 --pipelines 4 --systems mmproxy \
    --json "$out/image-4-pipelines.json" 2>&1 | quiet 4 ;;
image-one-pipeline)
  one 300 $bench --workload image --samples 16384 --workers 15 --data-dir /tmp/bench --epochs 4 \
    --threads 8 --pipelines 1 --systems dali-reader,mmproxy,dali-graph \
    --json "$out/image-one-pipeline.json" 2>&1 | quiet 6 ;;
spdl)
  one 540 $bench --workload image --samples 16384 --workers 15 --threads 8 --data-dir /tmp/bench \
    --epochs 5 --runs 3 --systems mmproxy,dali-reader,spdl --json "$out/image-spdl.json" 2>&1 | quiet 12
  one 540 $bench --workload audio --samples 8192 --workers 15 --threads 8 --data-dir /tmp/bench \
    --epochs 5 --runs 3 --systems mmproxy,dali-reader,spdl --json "$out/audio-spdl.json" 2>&1 | quiet 12 ;;
torch)
  one 540 $bench --workload image,audio,image-text --samples 8192 --workers 15 --threads 8 \
    --data-dir /tmp/bench --epochs 3 --systems mmproxy,dali-reader,dali-proxy,torch \
    --memory-epochs 20 --json "$out/image-audio-torch.json" 2>&1 | quiet 24 ;;
photos)
  python3 benchmarks/photo_shards.py /tmp/photos --count 16384 2>&1 | tail -2
  one 520 $bench --data '/tmp/photos/photo-{0000..0255}.tar' --workers 15 --threads 8 --epochs 5 \
    --runs 3 --systems "${SYSTEMS:-mmproxy,dali-reader}" \
    --json "$out/image-photographs.json" 2>&1 | quiet 12 ;;
audio)  # --samples counts images: the audio workload writes a quarter as many clips
  aud="$bench --workload audio --samples 32768 --workers 15 --data-dir /tmp/bench"
  one 400 $aud --epochs 5 --runs 2 --threads 7 --pipelines 2 --systems mmproxy,dali-graph,dali-reader \
    --json "$out/audio.json" 2>&1 | quiet 8
  one 200 $aud --epochs 4 --threads 5 --pipelines 3 --systems mmproxy \
    --json "$out/audio-3-pipelines.json" 2>&1 | quiet 4
  one 300 $aud --epochs 4 --threads 8 --pipelines 1 --systems dali-reader,mmproxy \
    --json "$out/audio-one-pipeline.json" 2>&1 | quiet 6 ;;
audio-proxy)
  one 540 $bench --workload audio --samples 8192 --workers 15 --threads 8 --data-dir /tmp/bench \
    --epochs 5 --runs 3 --systems mmproxy,dali-reader,dali-proxy \
    --json "$out/audio-proxy.json" 2>&1 | quiet 12 ;;
video)  # one process a system: PyTorch's workers crash when they fork after NVDEC in one process
  v() { one 250 python3 benchmarks/video_bench.py --resolution "$1" --clips "$2" --workers 15 \
          --threads 8 --epochs 3 --decode-threads 12 --data-dir /tmp/vbench --json "$out/$3" \
          --systems "${@:4}" 2>&1 | grep -a "clips/s"; }
  v 596x336 1024 video-596x336-mixed-pinned.json 'mmproxy-mixed-torchcodec[auto]' --worker-cpus 7-15
  v 596x336 1024 video-596x336-mixed.json 'mmproxy-mixed-torchcodec[auto]'
  v 596x336 1024 video-596x336-torchcodec.json mmproxy-torchcodec
  v 596x336 1024 video-596x336-pyav.json mmproxy-pyav
  v 596x336 1024 video-596x336-torch.json torch
  v 1280x720 96 video-1280x720-mixed.json 'mmproxy-mixed-torchcodec[auto]'
  v 1280x720 96 video-1280x720-torch.json torch ;;
video-dali)
  one 540 python3 benchmarks/video_bench.py --clips 512 --resolution 596x336 --workers 15 \
    --threads 8 --epochs 2 --data-dir /tmp/vbench \
    --systems mmproxy-pyav,torch,mmproxy-dali,dali-reader,dali-proxy \
    --json "$out/video-596x336-dali.json" 2>&1 | quiet 12 ;;
damage)
  kind=${KIND:-truncate}
  one 400 $bench --workload image --systems mmproxy,dali-reader --samples 16384 --workers 15 \
    --threads 8 --epochs 4 --data-dir /tmp/bench --damage 0.01 --damage-kind "$kind" \
    --json "$out/damage${KIND:+-$kind}.json" 2>&1 | quiet 12 ;;
remote)
  servers=${SERVER_CPUS-16-31}
  one 200 $bench --workload image --samples 16384 --workers 15 --threads 8 --data-dir /tmp/bench \
    --epochs 5 --runs 2 ${servers:+--server-cpus $servers} \
    --systems mmproxy,mmproxy-http,mmproxy-s3,mmproxy-cached \
    --json "$out/remote.json" 2>&1 | quiet 8 ;;
resume)
  one 280 python3 benchmarks/resume_bench.py --samples 16384 --workers 15 --threads 8 --rounds 4 \
    --data-dir /tmp/bench --json "$out/resume.json" 2>&1 | quiet 6 ;;
tests)  # the GPU tests of the code at hand
  one 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -8 ;;
*) echo "PART must be image, image-one-pipeline, spdl, torch, photos, audio, audio-proxy, video," \
        "video-dali, damage, remote, resume or tests" >&2
   exit 2 ;;
esac
