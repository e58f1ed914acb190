"""Resuming: time to the first batch after a resume at 10% and at 90% of an epoch, and what the
sample-seeded crop (``sample_seeded=True``, needed for exact augmentation on resume) costs.

One process, the bench's image shards. Part 1 times the first batch of a fresh loader and of
loaders resumed from states saved after 10% and after 90% of an epoch's batches, and counts the
samples the server ran before that first batch (a resume that decoded what it skips would show
it here). Part 2 alternates epochs of two image servers on the same shards: the crop window
and flip drawn per sample from its seed in the workers (``fn.decoders.image_slice``) against
DALI drawing them (``fn.decoders.image_random_crop``, ``fn.random.coin_flip``), and the seeded
window applied after decoding the whole image (``fn.decoders.image`` + ``fn.slice``).

    python benchmarks/resume_bench.py --samples 4096 --rounds 3 \\
        --json benchmarks/results/cpu-2core/resume.json
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import _harness  # this script's folder is on the path


def main() -> None:
    from mmproxy.datasets import MultiModalDataset
    from mmproxy.pipelines import external_pipeline, image_train_graph
    from mmproxy.pipelines.image import RandomResizedCrop

    import mmproxy
    from mmproxy.apps.bench.shards import write_shards
    from mmproxy.apps.bench.timing import count_samples

    parser = _harness.parser(__doc__)
    parser.add_argument("--samples", type=int, default=4096, help="images in the shards")
    parser.add_argument("--rounds", type=int, default=3,
                        help="resumes timed at each point, and epochs of each pipeline")
    parser.add_argument("--shuffle-buffer", type=int, default=1024)
    args = parser.parse_args()
    gpu, device_id, batch, folder = _harness.setup(args)
    paths = write_shards(folder, "image", args.samples, args.workers)

    def server(seeded: bool, roi: bool = True) -> mmproxy.DALIServer:
        graph = partial(image_train_graph, gpu=gpu, size=224, roi_decode=roi)
        drawn = RandomResizedCrop("data", (0.08, 1.0), (3 / 4, 4 / 3), 0.5) if seeded else None
        pipe = external_pipeline(graph, input_name="data", batch_size=batch,
                                 num_threads=args.threads, device_id=device_id,
                                 more_inputs=drawn.names if drawn else ())
        name = ("seeded" if roi else "seeded-full") if seeded else "dali-drawn"
        return mmproxy.DALIServer(mmproxy.SampleSeeded(pipe, drawn), name=name)

    seeded, drawn, full = server(True), server(False), server(True, roi=False)

    def loader(srv: mmproxy.DALIServer) -> Any:
        ds = MultiModalDataset(paths, {"image": ("jpg", srv.proxy)}, batch_size=batch,
                               shuffle_buffer=args.shuffle_buffer, keep_keys=False, seed=1,
                               prefetch_next_epoch=False)
        return ds.loader(srv, num_workers=args.workers)

    out: dict[str, Any] = {"batch_size": batch}
    with seeded, drawn, full:
        # the states after 10% and 90% of the epoch's batches
        probe = loader(seeded)
        total = sum(1 for _ in probe)
        marks = {"10%": max(1, total // 10), "90%": max(1, total * 9 // 10)}
        states: dict[str, Any] = {}
        run = loader(seeded)
        for n, _ in enumerate(run, 1):
            for name, k in marks.items():
                if n == k:
                    states[name] = run.state_dict()
        firsts: dict[str, list[float]] = {"fresh": [], "10%": [], "90%": []}
        ran: dict[str, list[int]] = {name: [] for name in firsts}
        for _ in range(args.rounds):
            for name in firsts:
                fresh = loader(seeded)
                if name != "fresh":
                    fresh.load_state_dict(states[name])
                before = seeded.samples
                start = time.perf_counter()
                it = iter(fresh)
                next(it)
                firsts[name].append(time.perf_counter() - start)
                ran[name].append(seeded.samples - before)
                it.close()
        out["batches_per_epoch"] = total
        out["resume_at_batch"] = marks
        out["first_batch_s"] = {k: round(statistics.median(v), 4) for k, v in firsts.items()}
        out["first_batch_s_all"] = firsts
        out["server_samples_before_first_batch"] = ran
        for name in firsts:
            print(f"first batch, {name:5s}: {out['first_batch_s'][name]:.3f} s (median), server "
                  f"ran {ran[name]} samples by then", flush=True)
        # sample-seeded crop against DALI's own random crop, epochs alternated
        loaders = {"seeded": loader(seeded), "dali-drawn": loader(drawn),
                   "seeded-full": loader(full)}
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for r in range(args.rounds + 1):
            names = list(loaders)
            for name in names[r % 3:] + names[:r % 3]:
                start, n = time.perf_counter(), 0
                for b in loaders[name]:
                    n += count_samples(b)
                if r:  # round 0 warms both up
                    rates[name].append(n / (time.perf_counter() - start))
        out["seeded_full_decode_vs_dali_drawn"] = _harness.spread(
            _harness.ratios(rates["seeded-full"], rates["dali-drawn"]))
        print(f"seeded, whole image decoded then sliced / dali-drawn: "
              f"{out['seeded_full_decode_vs_dali_drawn']}", flush=True)
        out["rates"] = rates
        out["seeded_vs_dali_drawn"] = _harness.spread(_harness.ratios(rates["seeded"],
                                                                      rates["dali-drawn"]))
        print(f"throughput: seeded {statistics.median(rates['seeded']):.0f}, dali-drawn "
              f"{statistics.median(rates['dali-drawn']):.0f} samples/s; ratio "
              f"{out['seeded_vs_dali_drawn']}", flush=True)
    _harness.write_json(args.json, args, gpu, out)


if __name__ == "__main__":
    main()
