"""Memory: mmproxy over many epochs (every other one abandoned early), recording after each the
resident memory of the process and its workers, shared memory, and the runs the server holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmproxy.apps.bench.pipes import proxied_pipeline
from mmproxy.apps.bench.systems import Setup

__all__ = ["memory"]


def memory(setup: Setup, epochs: int) -> dict[str, Any]:
    """Runs ``epochs`` epochs of the image workload; returns one row per epoch."""
    import psutil

    import mmproxy
    from mmproxy.apps.bench.systems import worker_init
    from mmproxy.datasets import MultiModalDataset

    me = psutil.Process()
    server = mmproxy.DALIServer(proxied_pipeline(setup), name="mem")
    rows = []
    with server:
        dataset = MultiModalDataset(setup.paths, {"image": ("jpg", server.proxy)},
                                    batch_size=setup.batch)
        workers = setup.args.workers
        loader = dataset.loader(server, num_workers=workers, persistent_workers=workers > 0,
                                worker_init_fn=worker_init(setup))
        for epoch in range(epochs):
            for k, _ in enumerate(loader):
                if epoch % 2 and k == 2:
                    break  # abandon every other epoch early
            rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
            shm = sum(f.stat().st_size for f in Path("/dev/shm").iterdir() if f.is_file())
            meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            rows.append({"epoch": epoch, "rss_mb": round(rss / 2**20, 1),
                         "dev_shm_mb": round(shm / 2**20, 2),
                         "shmem_mb": round(int(meminfo["Shmem"].split()[0]) / 1024, 1),
                         "server_runs_held": len(server.table.runs)})
    return {"per_epoch": rows}
