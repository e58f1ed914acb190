"""Remote shards against local ones, epochs interleaved: local, HTTP, S3, GCS, Azure and cached in
one process; then the clients alone (throughput, first byte, CPU a MiB of plain GETs).

``mmproxy bench --systems mmproxy,mmproxy-http,mmproxy-s3,mmproxy-cached`` runs the systems one
after the other, so load from elsewhere on the machine lands on whichever system runs at the
time. Here the four loaders share one image server (the bench's image pipeline and shards) and
take turns epoch by epoch, in a rotating order, so every round holds one epoch of each and the
ratio to local is taken within the round; the median over rounds is reported with its range.
Before the rounds each system's first batch is timed from a fresh loader (workers starting, first
shard fetched; the cache cold); the first of these rounds also fills the cache. The servers: a
threaded HTTP server, moto, fake-gcs-server and Azurite, each in a process of its own.

The clients (``--client-gets`` GETs of ``--client-mib`` MiB each, in the main process, rounds
interleaved): mmproxy's own path per scheme (``open_remote``, into a memfd), and the raw clients it
could stand on: urllib, obstore, fsspec (when installed), boto3-presigned URLs over urllib.

    python benchmarks/remote_bench.py --samples 4096 --rounds 8 --json remote.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness  # this script's folder is on the path

from mmproxy.apps.bench.pipes import proxied_pipeline
from mmproxy.apps.bench.remote import SpreadEndpoints, cpu_list, s3_processes, serving
from mmproxy.apps.bench.shards import write_shards
from mmproxy.apps.bench.systems import Setup
from mmproxy.apps.bench.timing import count_samples

SYSTEMS = ("local", "http", "s3", "gs", "az", "cached")  # "local" is the reference, always run


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
                        help="a subset of local,http,s3,gs,az,cached (s3: moto[server]; gs: "
                        "fake-gcs-server; az: Azurite; all: obstore)")
    parser.add_argument("--client-gets", type=int, default=16, help="GETs a client and round")
    parser.add_argument("--client-mib", type=int, default=32, help="MiB a GET (0: no clients)")
    parser.add_argument("--client-rounds", type=int, default=3, help="rounds of the clients")
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
        for kind in ("gs", "az"):
            if kind in systems:
                urls[kind] = stack.enter_context(serving(kind, paths, cpus=servers))

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
        for loader_ in loaders.values():  # the workers go before this process reads object stores
            del loader_
        loaders.clear()
        remote = [s for s in ("http", "s3", "gs", "az") if s in systems]
        clients = measure_clients(args, folder, servers) if args.client_mib and remote else {}
    out: dict[str, Any] = {"results": {"image": {"batch_size": setup.batch, "systems": {}}},
                           "first_batch_s": first, "clients": clients}
    for system in systems:
        ratios = _harness.ratios(rates[system], rates["local"])
        vs_local = _harness.spread(ratios)
        name = "mmproxy" if system == "local" else f"mmproxy-{system}"
        out["results"]["image"]["systems"][name] = {
            "samples_per_s": round(statistics.median(rates[system]), 1),
            "sustained_samples_per_s": round(statistics.median(rates[system]), 1),
            "runs": [{"epochs": [round(x, 1)], "sustained": round(x, 1)} for x in rates[system]],
            "vs_local": vs_local["median"], "range_vs_local": vs_local["range"]}
        print(name, vs_local)
    _harness.write_json(args.json, args, gpu, out)


def _fill(chunks: Any, buffer: memoryview) -> int:
    """Copies a client's pieces into ``buffer``; returns the bytes."""
    at = 0
    for piece in chunks:
        view = memoryview(piece).cast("B")
        buffer[at:at + len(view)] = view
        at += len(view)
    return at


def _clients(urls: dict[str, list[str]]) -> dict[str, Callable[[str, memoryview], None]]:
    """The clients to compare, by name: each GETs one URL of its scheme into a buffer."""
    from mmproxy.datasets.remote import RemoteOptions, open_remote

    def mmproxy_path(url: str, buffer: memoryview) -> None:
        with open_remote(url, RemoteOptions(cache_dir=None)) as shard:
            shard.wait(len(shard.view))

    def urllib_get(url: str, buffer: memoryview) -> None:
        with urllib.request.urlopen(url) as answer:
            at = 0
            while n := answer.readinto(buffer[at:]):
                at += n

    def obstore_get(url: str, buffer: memoryview) -> None:
        import obstore
        from obstore.store import HTTPStore, from_url

        base, _, name = url.rpartition("/")
        key = ("obstore", base)
        if key not in stores:
            stores[key] = (HTTPStore.from_url(base, client_options={"allow_http": True})
                           if base.startswith("http") else
                           from_url(base, client_options={"allow_http": True}))
        _fill(obstore.get(stores[key], name).stream(1 << 20), buffer)

    def fsspec_get(url: str, buffer: memoryview) -> None:
        import fsspec

        with fsspec.open(url, "rb", block_size=1 << 20) as f:
            at = 0
            while n := f.readinto(buffer[at:]):
                at += n

    def presigned_get(url: str, buffer: memoryview) -> None:
        import boto3

        if "boto3" not in stores:
            stores["boto3"] = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        bucket, _, key = url[5:].partition("/")
        urllib_get(stores["boto3"].generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=900), buffer)

    stores: dict[Any, Any] = {}
    found: dict[str, Callable[[str, memoryview], None]] = {}
    for scheme in urls:
        found[f"mmproxy-{scheme}"] = mmproxy_path
        found[f"obstore-{scheme}"] = obstore_get
    if "http" in urls:
        found["urllib-http"] = urllib_get
    if "s3" in urls:
        found["boto3-presigned-urllib-s3"] = presigned_get
    for scheme, module in (("http", "aiohttp"), ("s3", "s3fs")):
        with contextlib.suppress(ImportError):
            if scheme in urls:
                __import__(module)
                found[f"fsspec-{scheme}"] = fsspec_get
    return found


def measure_clients(args: argparse.Namespace, folder: Path,
                    servers: frozenset[int] | None) -> dict[str, Any]:
    """Each client's MiB/s and CPU a MiB (this process's, all its threads) over ``--client-gets``
    GETs of ``--client-mib`` MiB, and its first byte (a whole GET of 64 KiB, ms), medians over
    interleaved rounds."""
    size = args.client_mib << 20
    blobs = folder / "clients"
    blobs.mkdir(exist_ok=True)
    paths = []
    for i in range(args.client_gets):
        path = blobs / f"blob-{i:03d}.tar"
        if not path.exists() or path.stat().st_size != size:
            path.write_bytes(os.urandom(size))
        paths.append(str(path))
    tiny = blobs / "tiny.tar"  # the latency: a whole GET of 64 KiB
    tiny.write_bytes(os.urandom(64 << 10))
    paths.append(str(tiny))
    buffer = memoryview(bytearray(size))
    figures: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        urls = {kind: stack.enter_context(serving(kind, paths, cpus=servers))  # type: ignore[arg-type]
                for kind in ("http", "s3", "gs", "az") if kind in args.systems.split(",")}
        clients = _clients(urls)
        for r in range(args.client_rounds):
            names = list(clients)[r % len(clients):] + list(clients)[:r % len(clients)]
            for name in names:
                get, scheme = clients[name], name.rsplit("-", 1)[1]
                *big, small = urls[scheme]
                start_cpu, start = time.process_time(), time.perf_counter()
                for url in big:
                    get(url, buffer)
                wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                mib = len(big) * args.client_mib
                entry = figures.setdefault(name, {"mib_per_s": [], "cpu_ms_per_mib": [],
                                                  "small_get_ms": []})
                entry["mib_per_s"].append(mib / wall)
                entry["cpu_ms_per_mib"].append(1000 * cpu / mib)
                for _ in range(8):
                    start = time.perf_counter()
                    get(small, buffer)
                    entry["small_get_ms"].append(1000 * (time.perf_counter() - start))
            print(f"clients round {r}: " + ", ".join(
                f"{n} {figures[n]['mib_per_s'][-1]:.0f} MiB/s {figures[n]['cpu_ms_per_mib'][-1]:.2f}"
                " ms/MiB" for n in clients), flush=True)
    return {name: {"mib_per_s": round(statistics.median(f["mib_per_s"]), 1),
                   "mib_per_s_range": [round(min(f["mib_per_s"]), 1), round(max(f["mib_per_s"]), 1)],
                   "cpu_ms_per_mib": round(statistics.median(f["cpu_ms_per_mib"]), 3),
                   "first_byte_ms": round(statistics.median(f["small_get_ms"]), 2)}
            for name, f in figures.items()}


if __name__ == "__main__":
    main()
