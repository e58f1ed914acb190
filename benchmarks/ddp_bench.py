"""Times examples/train_ddp.py's training under torchrun: rates per rank, the main loop's wait on
the server, controls without a loader or without gradient sync, profiles, core pinning.

Run:  torchrun --nproc_per_node=2 benchmarks/ddp_bench.py [train_ddp.py's options] [these]

Rank 0 prints (and with --json writes) a summary: per rank the best epoch's rate, the sustained
rate over the epochs after the first (start-up) and the main loop's wait per batch.
benchmarks/multi_gpu.sh runs it on two GPUs; benchmarks/ddp_profile.py sums up its --profile traces.
"""

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

import _harness  # this script's folder is on the path
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _models import TinyCLIP, clip_step  # noqa: E402
from train_ddp import add_arguments, epoch_length, image_text_data, init_rank, tokenizer  # noqa: E402


def bind_cpus(local_rank: int, count: int) -> None:
    """Pins this process (and so the threads and workers it starts) to its own share of cores.

    On a NUMA host prefer torchrun's ``--numa-binding`` (PyTorch >= 2.9), which picks the cores
    near each GPU; this is the plain split for hosts where every core is as near as any other.
    """
    allowed = sorted(os.sched_getaffinity(0))
    mine = allowed[local_rank * count:(local_rank + 1) * count]
    if len(mine) < count:
        raise SystemExit(f"--cpus-per-rank {count}: local rank {local_rank} needs cores "
                         f"{local_rank * count}-{(local_rank + 1) * count - 1} but only "
                         f"{len(allowed)} are allowed")
    os.sched_setaffinity(0, mine)


class Synthetic:
    """``epoch_length`` copies of one batch already on the device, each epoch (no loader)."""

    def __init__(self, args, vocab_size, length, device):
        n, size = args.batch_size, args.image_size
        self.length = length
        self.batch = {"image": torch.randn(n, 3, size, size, device=device),
                      "input_ids": torch.randint(0, vocab_size, (n, 32), device=device),
                      "attention_mask": torch.ones(n, 32, dtype=torch.long, device=device),
                      "__key__": [f"synthetic-{i}" for i in range(n)]}

    def __iter__(self):
        return (self.batch for _ in range(self.length))


class ReaderLoader:
    """The same training fed by DALI's own shard reader, no Python workers: ``fn.readers.webdataset``
    on this rank's share of the shards (``shard_id``/``num_shards``), shuffled, through the graph
    of ``image_train_pipeline``; the captions come out as padded bytes and are tokenized in the
    main loop (a pure DALI loader has no workers to do it). ``epoch_length`` batches an epoch, the
    reader running on across its own epochs."""

    def __init__(self, args, rank, tok, length):
        import braceexpand
        from mmproxy.datasets import Tokenize
        from mmproxy.pipelines import image_train_graph
        from nvidia.dali import fn, pipeline_def
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        from mmproxy.testing import demo_shards

        gpu = rank.device.type == "cuda"
        paths = list(braceexpand.braceexpand(args.data or demo_shards(128)))

        @pipeline_def
        def pipe():
            jpg, txt = fn.readers.webdataset(paths=paths, ext=["jpg", "txt"], random_shuffle=True,
                                             initial_fill=256, shard_id=rank.rank,
                                             num_shards=rank.world, name="reader")
            return image_train_graph(jpg, gpu=gpu, size=args.image_size), fn.pad(txt, fill_value=0)

        self.batches = DALIGenericIterator(
            pipe(batch_size=args.batch_size, num_threads=args.threads, device_id=rank.device_id,
                 seed=1234 + rank.rank), ["image", "text"], reader_name="reader", auto_reset=True,
            last_batch_policy=LastBatchPolicy.DROP)
        self.tokenize = Tokenize(tok, 32, "longest")
        self.length = length

    def _next(self):
        try:
            return next(self.batches)[0]
        except StopIteration:  # the reader's epoch ended: auto_reset started the next
            return next(self.batches)[0]

    def __iter__(self):
        for _ in range(self.length):
            out = self._next()
            text = [bytes(row).rstrip(b"\0").decode() for row in out["text"].numpy()]
            batch = self.tokenize({"text": text})
            batch["image"] = out["image"]
            batch["__key__"] = [""] * len(text)
            yield batch


class Bf16ChannelsLast(torch.nn.Module):
    """A CLIP-sized step on a GPU: the model in channels-last memory format, run in bf16."""

    def __init__(self, model):
        super().__init__()
        self.model = model.to(memory_format=torch.channels_last)
        torch.backends.cudnn.benchmark = True

    def forward(self, images, input_ids, attention_mask):
        with torch.autocast("cuda", torch.bfloat16):
            return self.model(images.contiguous(memory_format=torch.channels_last), input_ids,
                              attention_mask)


class Profile:
    """torch.profiler over ``steps`` steps in the middle of the second epoch; each rank writes
    DIR/rank{r}.trace.json.gz (a Chrome trace) and DIR/rank{r}.txt (the ops by CUDA time)."""

    def __init__(self, folder, steps, length, rank, cuda):
        self.folder, self.steps, self.rank, self.cuda = folder, steps, rank, cuda
        self.first = max(1, (length - steps) // 2)  # past the start-up, mid-epoch
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = torch.profiler.profile(activities=activities)

    def at(self, epoch, step):
        if epoch != 1:
            return
        if step == self.first:
            self.profiler.start()
        elif step == self.first + self.steps:
            self.finish()

    def finish(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.stop()
        os.makedirs(self.folder, exist_ok=True)
        self.profiler.export_chrome_trace(os.path.join(self.folder, f"rank{self.rank}.trace.json.gz"))
        table = self.profiler.key_averages().table(
            sort_by="cuda_time_total" if self.cuda else "cpu_time_total", row_limit=40)
        with open(os.path.join(self.folder, f"rank{self.rank}.txt"), "w") as f:
            f.write(table)


def bench_arguments(parser):
    parser.add_argument("--model", choices=["tiny", "resnet50"], default="tiny",
                        help="image tower: 'tiny' (the data loading sets the pace) or 'resnet50' "
                        "(bf16 on a GPU: a CLIP-sized step)")
    parser.add_argument("--dump-keys", help="write each rank's sample keys to PATH.rankN.json")
    parser.add_argument("--json", help="rank 0 writes the throughput summary here")
    parser.add_argument("--independent", action="store_true",
                        help="skip DDP's gradient sync (measures data loading alone per rank)")
    parser.add_argument("--synthetic", action="store_true",
                        help="train on one fixed batch made on the device, no loader: the ceiling "
                        "the model and DDP allow, to compare the loaded runs with")
    parser.add_argument("--loader", choices=["mmproxy", "dali-reader"], default="mmproxy",
                        help="dali-reader: the same training fed by DALI's own shard reader "
                        "(ReaderLoader), to compare mmproxy's scaling with the pure DALI one")
    parser.add_argument("--no-broadcast-buffers", action="store_true",
                        help="DDP(broadcast_buffers=False): no BatchNorm-buffer broadcast (a sync "
                        "between the ranks) at the start of every step")
    parser.add_argument("--profile", metavar="DIR",
                        help="torch.profiler (CPU and CUDA) over --profile-steps steps of the "
                        "second epoch; each rank writes DIR/rank{r}.trace.json.gz (a Chrome trace) "
                        "and DIR/rank{r}.txt (the ops by CUDA time); that epoch's rate includes the "
                        "profiler's cost, so take rates from a run without it. "
                        "benchmarks/ddp_profile.py sums a trace up by who launched the GPU work")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--cpus-per-rank", type=int, default=0,
                        help="pin each rank (its DALI threads and its workers) to its own K cores: "
                        "local rank r gets cores [r*K, (r+1)*K) of those allowed")
    return parser


def timed_epochs(args, rank, model, opt, loader, profile, server):
    """Trains ``args.epochs`` epochs; returns each epoch's keys and seconds, and how long the main
    loop had waited on the server by the end of each."""
    keys, seconds, waits = [], [], []
    for epoch in range(args.epochs):
        epoch_keys = []
        start = time.perf_counter()
        batches = iter(loader)
        for step in itertools.count():
            if profile is not None:
                profile.at(epoch, step)
            with record_function("next_batch"):  # the main loop's wait, in a profile
                batch = next(batches, None)
            if batch is None:
                break
            with record_function("train_step"):
                loss = clip_step(model, opt, batch, rank.device)
            epoch_keys += batch["__key__"]
        if rank.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        keys.append(epoch_keys)
        waits.append(server.wait_seconds if server else 0.0)
        print(f"rank {rank.rank} epoch {epoch}: {len(epoch_keys)} samples, "
              f"{len(epoch_keys) / seconds[-1]:.0f} samples/s, loss {loss.item():.3f}", flush=True)
    return keys, seconds, waits


def summarize(args, rank, keys, seconds, waits, length):
    """Gathers every rank's rates and waits; rank 0 prints (and writes) the summary."""
    later = seconds[1:] or seconds  # past the first epoch's start-up, when there are more
    later_samples = sum(len(k) for k in keys[-len(later):])
    waited = waits[-1] - (waits[0] if len(seconds) > 1 else 0.0)
    rates = [len(k) / s for k, s in zip(keys, seconds)]
    mine = torch.tensor([max(rates), later_samples / sum(later),
                         waited * 1000 * args.batch_size / max(1, later_samples)], device=rank.device)
    gathered = [torch.zeros_like(mine) for _ in range(rank.world)]
    if rank.world > 1:
        dist.all_gather(gathered, mine)
    else:
        gathered = [mine]
    if rank.rank != 0:
        return
    per_rank = [round(g[0].item(), 1) for g in gathered]
    sustained = [round(g[1].item(), 1) for g in gathered]
    summary = {"world": rank.world, "model": args.model,
               "loader": "none" if args.synthetic else args.loader, "per_rank_samples_per_s": per_rank,
               "total_samples_per_s": round(sum(per_rank), 1),
               "per_rank_sustained_samples_per_s": sustained,
               "total_sustained_samples_per_s": round(sum(sustained), 1),
               "per_rank_main_loop_wait_ms_per_batch": [round(g[2].item(), 2) for g in gathered],
               "batch_size": args.batch_size, "epoch_length": length, "workers": args.workers,
               "cpus_per_rank": args.cpus_per_rank or None}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_harness.stamped(summary), f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = bench_arguments(add_arguments(parser)).parse_args()
    if args.cpus_per_rank:
        bind_cpus(int(os.environ.get("LOCAL_RANK", 0)), args.cpus_per_rank)
    rank = init_rank()
    cuda = rank.device.type == "cuda"
    length = epoch_length(args, rank)
    if args.profile and (args.epochs < 2 or length < args.profile_steps + 2):
        raise SystemExit(f"--profile needs --epochs >= 2 and an epoch of at least "
                         f"{args.profile_steps + 2} batches (--profile-steps + 2); this run "
                         f"has {args.epochs} epochs of {length}")
    tok = tokenizer(args)
    # No server for --synthetic: its ceiling must not pay for an idle pipeline's memory and threads.
    reader = args.loader == "dali-reader" and not args.synthetic
    image, dataset = ((None, None) if args.synthetic or reader else
                      image_text_data(args, rank, tok))
    model = TinyCLIP(len(tok), image_tower=args.model).to(rank.device)
    if cuda and args.model == "resnet50":
        model = Bf16ChannelsLast(model)
    if rank.world > 1 and not args.independent:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank.device_id] if cuda else None,
            broadcast_buffers=not args.no_broadcast_buffers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profile = Profile(args.profile, args.profile_steps, length, rank.rank, cuda) if args.profile else None
    with image or contextlib.nullcontext():
        if reader:
            loader = ReaderLoader(args, rank, tok, length)
        elif image is None:
            loader = Synthetic(args, len(tok), length, rank.device)
        else:
            loader = dataset.loader(image, num_workers=args.workers, persistent_workers=True,
                                    pin_memory=cuda)
        keys, seconds, waits = timed_epochs(args, rank, model, opt, loader, profile, image)
    summarize(args, rank, keys, seconds, waits, length)
    if args.dump_keys:
        with open(f"{args.dump_keys}.rank{rank.rank}.json", "w") as f:
            json.dump(keys, f)
    if rank.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
