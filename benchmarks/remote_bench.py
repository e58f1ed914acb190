"""Remote shards against local ones, epochs interleaved: local, HTTP, S3 and cached in one process.

``mmproxy bench --systems mmproxy,mmproxy-http,mmproxy-s3,mmproxy-cached`` runs the systems one
after the other, so load from elsewhere on the machine lands on whichever system runs at the
time. Here the four loaders share one image server (the bench's image pipeline and shards) and
take turns epoch by epoch, in a rotating order, so every round holds one epoch of each and the
ratio to local is taken within the round; the median over rounds is reported with its range.
Before the rounds each system's first batch is timed from a fresh loader (workers starting, first
shard fetched; the cache cold); the first of these rounds also fills the cache.

    python benchmarks/remote_bench.py --samples 4096 --rounds 8 \\
        --json remote-rounds.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from typing import Any

import _harness  # this script's folder is on the path

from mmproxy.apps.bench.pipes import proxied_pipeline
from mmproxy.apps.bench.remote import SpreadEndpoints, cpu_list, s3_processes, serving
from mmproxy.apps.bench.shards import write_shards
from mmproxy.apps.bench.systems import Setup
from mmproxy.apps.bench.timing import count_samples

SYSTEMS = ("local", "http", "s3", "cached")  # "local" is the reference and always runs


def epoch(loader: Any) -> tuple[float, float, int]:
    """(samples/s, seconds to the first batch, samples) of one epoch."""
    start = time.perf_counter()
    first, n = 0.0, 0
    for batch in loader:
        if not n:
            first = time.perf_counter() - start
        n += count_samples(batch)
    return n / (time.perf_counter() - start), first, n


def main() -> None:
    from mmproxy.datasets import MultiModalDataset
    from mmproxy.datasets.remote import RemoteOptions

    import mmproxy

    parser = _harness.parser(__doc__)
    parser.add_argument("--samples", type=int, default=4096, help="images in the shards")
    parser.add_argument("--rounds", type=int, default=8, help="epochs of each system, taking turns")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="a subset of local,http,s3,cached (s3 needs boto3 and moto[server])")
    parser.add_argument("--server-cpus", default=None,
                        help="run the HTTP and S3 server processes on these cores (like 16-31), "
                        "apart from the loader's, as a remote server would be")
    args = parser.parse_args()
    servers = cpu_list(args.server_cpus)
    systems = ("local", *[s for s in SYSTEMS[1:] if s in args.systems.split(",")])
    gpu, device_id, batch, folder = _harness.setup(args)
    paths = write_shards(folder, "image", args.samples, args.workers)
    bench_args = argparse.Namespace(threads=args.threads, prefetch=2, cpu_resize="torchvision")
    setup = Setup(bench_args, "image", paths, folder, gpu, device_id, batch)
    server = mmproxy.DALIServer(proxied_pipeline(setup), name="image")
    with contextlib.ExitStack() as stack:
        stack.enter_context(server)
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="mmproxy-cache-"))
        urls = {"local": paths}
        if "http" in systems or "cached" in systems:
            urls["http"] = urls["cached"] = stack.enter_context(
                serving("http", paths, cpus=servers))
        if "s3" in systems:
            urls["s3"] = stack.enter_context(
                serving("s3", paths, s3_processes(args.workers), servers))

        def loader(system: str) -> Any:
            remote = RemoteOptions(cache_dir=cache if system == "cached" else None)
            dataset = MultiModalDataset(urls[system], {"image": ("jpg", server.proxy)},
                                        batch_size=setup.batch, shuffle_buffer=256,
                                        keep_keys=False, on_error="skip", remote=remote,
                                        prefetch_next_epoch=False)
            return dataset.loader(server, num_workers=args.workers, persistent_workers=True,
                                  worker_init_fn=SpreadEndpoints())

        epoch(loader("local"))  # the process's first pipeline runs pay for DALI's start
        loaders, first = {}, {}
        for system in systems:
            loaders[system] = loader(system)
            rate, first[system], _ = epoch(loaders[system])
            print(f"{system:7s} first batch {first[system]:.3f} s (fresh loader), {rate:.0f} "
                  "samples/s (its first epoch)", flush=True)
        rates: dict[str, list[float]] = {s: [] for s in systems}
        for r in range(args.rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for system in order:
                rates[system].append(epoch(loaders[system])[0])
            print(f"round {r}: " + ", ".join(f"{s} {rates[s][-1]:.0f}" for s in systems), flush=True)
    out: dict[str, Any] = {"batch_size": setup.batch, "first_batch_s": first, "rates": rates,
                           "systems": {}}
    for system in systems:
        ratios = _harness.ratios(rates[system], rates["local"])
        vs_local = _harness.spread(ratios)
        out["systems"][system] = {
            "median_samples_per_s": round(statistics.median(rates[system]), 1),
            "best_samples_per_s": round(max(rates[system]), 1),
            "median_vs_local": vs_local["median"], "range_vs_local": vs_local["range"],
            "best_vs_best_local": round(max(rates[system]) / max(rates["local"]), 3)}
        print(system, out["systems"][system])
    _harness.write_json(args.json, args, gpu, out)


if __name__ == "__main__":
    main()
