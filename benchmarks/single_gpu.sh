#!/usr/bin/env bash
# The one-GPU figures of BENCHMARKS.md: every run pinned to GPU 0 and cores 0-15 (one H200 and 16
# cores). On an nvidia-h200-x2 machine (2x H200, 32 cores) that leaves cores 16-31 for the shard
# servers of PART=remote; on an nvidia-h200 machine (16 cores) the pinning changes nothing and
# PART=remote runs its servers on the loader's cores (SERVER_CPUS= empty).
#   PART=image     mmproxy bench, 5 epochs x 3 interleaved runs on the bench's synthetic JPEGs
#                  (SYSTEMS: mmproxy, DALI's reader, DALI's proxy with its defaults and with its
#                  documentation's prefetch_queue_depth=2*workers; add torch for PyTorch workers)
#   PART=photos    the same on shards of real photographs (benchmarks/photo_shards.py)
#   PART=audio     mmproxy bench on CLIPS WAV clips (default 4,096), 5 epochs x 3 runs (SYSTEMS
#                  as for image)
#   PART=video     benchmarks/video_bench.py on 512 H.264 clips of 596x336: PyAV in the workers,
#                  PyTorch workers, DALI's in-memory decoder, DALI's reader and proxy
#   PART=video-options  DALI's in-memory decoder with its build_index and affine options, against
#                  PyAV in the workers and DALI's video reader
#   PART=nvdec     benchmarks/video_bench.py on 256 clips of 596x336, one system a call: NVDEC in
#                  the server (12 decode threads, then 4, 8, 16, 24), PyTorch workers; then 96
#                  clips of 1280x720: NVDEC, PyAV in the workers, PyTorch workers
#   PART=torchcodec  the same clips of 596x336, then 320x240 (RES: the sizes; CLIPS: how many,
#                  default 256, 96 of 1280x720), one system a call: NVDEC driven by TorchCodec, TorchCodec with the
#                  workers' PyAV on a SHARE of the clips (default 0.15), NVDEC driven by
#                  PyNvVideoCodec (12 decode threads each), PyAV in the workers, PyTorch workers
#   PART=mixed     decoder="mixed" with TorchCodec, PyAV in the workers and PyTorch's workers, one
#                  process a system: 1,024 clips of 596x336 and of 320x240, 96 of 1280x720 (no
#                  PyAV); RES picks the sizes, SYSTEMS the systems, WORKER_CPUS the workers'
#                  cores (the server's threads on the others)
#   PART=damage    mmproxy on a copy of the image shards with 1% of the JPEGs damaged (KIND:
#                  truncate or corrupt), against the same shards clean
#   PART=remote    benchmarks/remote_bench.py (rounds interleaved) with the HTTP and S3 servers on
#                  cores 16-31 and on the loader's own cores; then mmproxy bench's remote systems
#   PART=resume    benchmarks/resume_bench.py: first batch after a resume, sample-seeded crops
#   PART=tests     the GPU tests (pytest -m gpu)
# The JSON goes to $OUT (default /tmp/out); mmproxy bench writes it after every system, so a call
# cut short keeps what it measured. Two H200s under DDP: benchmarks/multi_gpu.sh.
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
image)  # a system's run costs ~30 s of start-up: 12 runs take ~6-8 minutes
  one 540 $bench --workload image --samples 16384 --workers 15 --threads 8 --data-dir /tmp/bench \
    --epochs 5 --runs 3 --systems "${SYSTEMS:-mmproxy,dali-reader,dali-proxy,dali-proxy-seed}" \
    --json "$out/image-systems.json" 2>&1 | quiet 12 ;;
photos)
  python3 benchmarks/photo_shards.py /tmp/photos --count 16384 2>&1 | tail -2
  one 520 $bench --data '/tmp/photos/photo-{0000..0255}.tar' --workers 15 --threads 8 --epochs 5 \
    --runs 3 --systems "${SYSTEMS:-mmproxy,dali-reader,dali-proxy,dali-proxy-seed}" \
    --json "$out/image-photographs.json" 2>&1 | quiet 12 ;;
audio)  # --samples counts images: the audio workload writes a quarter as many clips
  clips=${CLIPS:-4096}
  one 540 $bench --workload audio --samples $((clips * 4)) --workers 15 --threads 8 \
    --data-dir /tmp/bench --epochs 5 --runs 3 \
    --systems "${SYSTEMS:-mmproxy,dali-reader,dali-proxy,torch}" \
    --json "$out/audio-$clips-systems.json" 2>&1 | quiet 12 ;;
video)
  one 540 python3 benchmarks/video_bench.py --clips 512 --resolution 596x336 --workers 15 \
    --threads 8 --epochs 2 --data-dir /tmp/vbench \
    --systems "${SYSTEMS:-mmproxy-pyav,torch,mmproxy-dali,dali-reader,dali-proxy}" \
    --json "$out/video-systems.json" 2>&1 | quiet 12 ;;
video-options)
  one 280 python3 benchmarks/video_bench.py --clips 192 --resolution 596x336 --workers 15 \
    --threads 8 --epochs 2 --data-dir /tmp/vbench --json "$out/video-decoder-options.json" \
    --systems 'mmproxy-dali[build_index=False],mmproxy-dali[affine=False],mmproxy-dali[build_index=False,affine=False],mmproxy-dali,mmproxy-pyav,dali-reader' \
    2>&1 | quiet 30 ;;
nvdec)  # one system a call: PyTorch's workers crash when they run after NVDEC in one process
  v() { one 150 python3 benchmarks/video_bench.py --clips 256 --resolution 596x336 --workers 15 \
          --threads 8 --epochs 3 --data-dir /tmp/vbench "$@" 2>&1 | grep -a "clips/s"; }
  v --decode-threads 12 --systems mmproxy-nvdec --json "$out/video-596x336-nvdec.json"
  v --systems torch --json "$out/video-596x336-torch.json"
  for n in 4 8 16 24; do
    v --decode-threads "$n" --systems mmproxy-nvdec --json "$out/video-596x336-nvdec-threads$n.json"
  done
  big() { one 150 python3 benchmarks/video_bench.py --clips 96 --resolution 1280x720 --workers 15 \
            --threads 8 --epochs 3 --data-dir /tmp/vbench "$@" 2>&1 | grep -a "clips/s"; }
  big --decode-threads 12 --systems mmproxy-nvdec --json "$out/video-1280x720-nvdec.json"
  big --systems mmproxy-pyav --json "$out/video-1280x720-pyav.json"
  big --systems torch --json "$out/video-1280x720-torch.json" ;;
torchcodec)  # one system a call, as for nvdec; RES picks the sizes, SHARE the mixed system's CPU share
  for res in ${RES:-596x336 320x240}; do
    n=${CLIPS:-256}; [ "$res" = 1280x720 ] && n=${CLIPS:-96}
    t() { one 300 python3 benchmarks/video_bench.py --clips $n --resolution $res --workers 15 \
            --threads 8 --epochs 3 --data-dir /tmp/vbench "$@" 2>&1 | grep -a "clips/s"; }
    t --decode-threads 12 --systems mmproxy-torchcodec --json "$out/video-$res-torchcodec-$n.json"
    t --decode-threads 12 --systems "mmproxy-mixed-torchcodec[${SHARE:-0.15}]" \
      --json "$out/video-$res-mixed-torchcodec-$n.json"
    t --decode-threads 12 --systems mmproxy-nvdec --json "$out/video-$res-nvdec-$n.json"
    t --systems mmproxy-pyav --json "$out/video-$res-pyav-$n.json"
    t --systems torch --json "$out/video-$res-torch-$n.json"
  done ;;
mixed)  # decoder="mixed" (TorchCodec), PyAV in the workers, PyTorch's workers: one process a
  # system; 1,024 clips of 596x336 and of 320x240, 96 of 1280x720 without PyAV (RES picks sizes)
  apart="${WORKER_CPUS:+--worker-cpus $WORKER_CPUS}"
  m() { one 250 python3 benchmarks/video_bench.py --clips "$2" --resolution "$1" --workers 15 \
          --threads 8 --epochs 3 --decode-threads 12 --data-dir /tmp/vbench --systems "$3" $apart \
          --json "$out/video-$1-$(echo "$3" | tr -c 'a-zA-Z0-9\n-' '_')${WORKER_CPUS:+-w$WORKER_CPUS}-$2.json" \
          2>&1 | grep -a "clips/s"; }
  for res in ${RES:-596x336 320x240 1280x720}; do
    if [ "$res" = 1280x720 ]; then
      for s in ${SYSTEMS:-'mmproxy-mixed-torchcodec[auto]' torch}; do m "$res" 96 "$s"; done
    else
      for s in ${SYSTEMS:-'mmproxy-mixed-torchcodec[auto]' mmproxy-pyav torch}; do m "$res" 1024 "$s"; done
    fi
  done ;;
damage)
  kind=${KIND:-truncate}
  one 400 $bench --workload image --systems mmproxy,dali-reader --samples 16384 --workers 15 \
    --threads 8 --epochs 4 --data-dir /tmp/bench --damage 0.01 --damage-kind "$kind" \
    --json "$out/damage-$kind.json" 2>&1 | quiet 12 ;;
remote)
  servers=${SERVER_CPUS-16-31}
  one 200 python3 benchmarks/remote_bench.py --systems http,s3 --samples 16384 --workers 15 \
    --threads 8 --rounds 4 ${servers:+--server-cpus $servers} --data-dir /tmp/bench \
    --json "$out/remote-interleaved-servers-apart.json" 2>&1 | quiet 8
  one 150 python3 benchmarks/remote_bench.py --systems s3 --samples 16384 --workers 15 \
    --threads 8 --rounds 4 --data-dir /tmp/bench \
    --json "$out/remote-interleaved-servers-shared.json" 2>&1 | quiet 4
  one 200 $bench --workload image --samples 16384 --workers 15 --threads 8 --data-dir /tmp/bench \
    --epochs 5 --runs 2 ${servers:+--server-cpus $servers} \
    --systems mmproxy,mmproxy-http,mmproxy-s3,mmproxy-cached \
    --json "$out/remote-bench.json" 2>&1 | quiet 8 ;;
resume)
  for i in 1 2; do
    one 280 python3 benchmarks/resume_bench.py --samples 16384 --workers 15 --threads 8 --rounds 4 \
      --data-dir /tmp/bench --json "$out/resume-$i.json" 2>&1 | quiet 6
  done ;;
tests)  # the GPU tests of the code at hand
  one 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -8 ;;
*) echo "PART must be image, photos, audio, video, video-options, nvdec, torchcodec, mixed, damage, remote, resume or tests" >&2
   exit 2 ;;
esac
