"""A run's audio outputs from DALI to torch: what a server's conversion costs, fed from memory.

The bench's WAV clips in memory, fed to P instances of ``audio_pipeline`` (each run by a thread of
its own, ``prefetch_queue_depth`` runs deep, as a server's runners run them), the clips padded
inside DALI (``pad_to_longest=True``) or left ragged and padded by the server (``pad=[0]``, the
README's recipe). Each variant adds one step of the runner's way to torch tensors:

- ``outputs only``: DALI's outputs, dropped at once (the pipelines' own rate);
- ``copy on the stream``: the dense output copied into a tensor of PyTorch's, on the thread's stream;
- ``the server's conversion``: what a runner does (``Pipe.outputs``: the copy, the padding, an
  event), padded inside DALI or by the server.

    python benchmarks/output_cost.py --pipelines 1,2,3 --thread-counts 8,7,5
"""

from __future__ import annotations

import ctypes
import tarfile
import threading
import time
from typing import Any

import _harness  # this script's folder is on the path
import numpy as np

VARIANTS = {  # name: (padded inside DALI, how a run's outputs are taken)
    "padded in DALI, outputs only": (True, "outputs"),
    "padded in DALI, copy on the stream": (True, "copy"),
    "padded in DALI, the server's conversion": (True, "server"),
    "ragged, outputs only": (False, "outputs"),
    "ragged, the server's conversion and padding": (False, "server"),
}


def _take(how: str, pipe: Any, stream: Any, pad: set[int], held: list[Any]) -> None:
    import torch

    if how == "outputs":
        pipe.take(stream)
    elif how == "copy":
        with torch.cuda.stream(stream):
            tensor = pipe.take(stream)[0].as_tensor()
            out = torch.empty(tensor.shape(), dtype=torch.float32, device="cuda")
            tensor.copy_to_external(ctypes.c_void_p(out.data_ptr()),
                                    ctypes.c_void_p(stream.cuda_stream), non_blocking=True)
        held[:] = [out]
    else:
        held[:] = [pipe.outputs(pad, stream)]


def _rate(batches: list[list[Any]], pipes: int, threads: int, padded: bool, how: str,
          seconds: float) -> dict[str, float]:
    import torch
    from mmproxy.pipelines import audio_pipeline

    from mmproxy._server.dali import Pipe

    ps = [Pipe(audio_pipeline(batch_size=len(batches[0]), num_threads=threads, device="gpu",
                              pad_to_longest=padded, input_name="data"), "bench")
          for _ in range(pipes)]
    pad = set() if padded else {0}
    runs, cpu = [0] * pipes, [0.0] * pipes

    def loop(k: int, stop: float, count: bool) -> None:
        pipe, stream, held = ps[k], torch.cuda.Stream(), []
        i, inflight, start = k, 0, time.thread_time()
        while True:
            while inflight < pipe.queue_depth:
                pipe.feed([batches[i % len(batches)]])
                i, inflight = i + pipes, inflight + 1
            _take(how, pipe, stream, pad, held)
            inflight -= 1
            runs[k] += count
            if time.perf_counter() > stop:
                for _ in range(inflight):
                    pipe.take(stream)
                cpu[k] = time.thread_time() - start
                return

    for k in range(pipes):  # warm-up: each pipeline on its own for a second
        loop(k, time.perf_counter() + 1.0, False)
    start = time.perf_counter()
    workers = [threading.Thread(target=loop, args=(k, start + seconds, True)) for k in range(pipes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    for p in ps:
        p.close()
    done = sum(runs)
    return {"clips_per_s": round(done * len(batches[0]) / elapsed),
            "runner_cpu_ms_per_run": round(sum(cpu) / max(1, done) * 1e3, 3)}


def main() -> None:
    parser = _harness.parser(__doc__, threads=7, batch_size=64)
    parser.add_argument("--clips", type=int, default=8192, help="clips (written once)")
    parser.add_argument("--pipelines", default="2", help="comma-separated pipelines side by side")
    parser.add_argument("--seconds", type=float, default=6.0, help="each measurement's length")
    parser.add_argument("--rounds", type=int, default=2, help="every variant this many times, in turn")
    parser.add_argument("--thread-counts", default=None,
                        help="comma-separated DALI threads, one per --pipelines entry (default --threads)")
    args = parser.parse_args()
    gpu, _, _, data_dir = _harness.setup(args)
    if not gpu:
        parser.error("the conversion measured is a GPU pipeline's: run it on a GPU")
    from mmproxy.apps.bench.shards import write_shards

    clips = []
    for path in write_shards(data_dir, "audio", args.clips, workers=15):
        with tarfile.open(path) as tar:
            clips += [np.frombuffer(tar.extractfile(m).read(), np.uint8)  # type: ignore[union-attr]
                      for m in tar if m.name.endswith(".wav")]
    b = args.batch_size
    batches = [clips[i:i + b] for i in range(0, len(clips) - b + 1, b)]
    counts = [int(p) for p in args.pipelines.split(",")]
    threads = ([int(t) for t in args.thread_counts.split(",")] if args.thread_counts
               else [args.threads] * len(counts))
    rows = []
    for pipes, n in zip(counts, threads):
        for round_ in range(args.rounds):
            for name, (padded, how) in VARIANTS.items():
                row = {"pipelines": pipes, "threads": n, "round": round_, "variant": name,
                       **_rate(batches, pipes, n, padded, how, args.seconds)}
                print(row, flush=True)
                rows.append(row)
    _harness.write_json(args.json, args, gpu, {"rows": rows})


if __name__ == "__main__":
    main()
