"""Multi-GPU image-text training under torchrun: one image server per rank, on its own GPU.

Run:  torchrun --nproc_per_node=2 examples/train_ddp.py [--data 'shards-{0000..0127}.tar']
      (CPU: the same command uses the gloo backend and CPU pipelines)
Multi-node: torchrun --nnodes=N --node_rank=R --master_addr=HOST --nproc_per_node=G ...

Shards are split by rank (webdataset's split_by_node, after a shuffle every rank agrees on) and
by worker; --epoch-length gives every rank the same number of batches, so DDP never waits on a
short rank.
"""

import argparse
import contextlib
import itertools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from _common import demo_shards
from _models import TinyCLIP
from mmproxy.datasets import image_text_dataset, load_tokenizer
from mmproxy.pipelines import image_train_pipeline
from torch.profiler import ProfilerActivity, record_function

import mmproxy


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


class synthetic:  # noqa: N801 - used like a loader
    """``epoch_length`` copies of one batch already on the device, each epoch."""

    def __init__(self, args, vocab_size, epoch_length, device):
        n, size = args.batch_size, args.image_size
        self.length = epoch_length
        self.batch = {"image": torch.randn(n, 3, size, size, device=device),
                      "input_ids": torch.randint(0, vocab_size, (n, 32), device=device),
                      "attention_mask": torch.ones(n, 32, dtype=torch.long, device=device),
                      "__key__": [f"synthetic-{i}" for i in range(n)]}

    def __iter__(self):
        return (self.batch for _ in range(self.length))


def finish_profile(profiler, folder: str, rank: int, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
    profiler.stop()
    os.makedirs(folder, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(folder, f"rank{rank}.trace.json.gz"))
    table = profiler.key_averages().table(
        sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40)
    with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
        f.write(table)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", help="image-text shards (default: the demo's synthetic set)")
    parser.add_argument("--samples", type=int, default=0, help="samples in --data, for the "
                        "default epoch length (default: 128 for the demo set)")
    parser.add_argument("--tokenizer", help="a transformers tokenizer folder")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--epoch-length", type=int, default=0,
                        help="batches per rank per epoch (default: samples / (ranks * batch))")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="DALI threads per rank")
    parser.add_argument("--image-size", type=int, default=96)
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
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if args.cpus_per_rank:
        bind_cpus(local, args.cpus_per_rank)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    if rank == 0 and not args.data:
        demo_shards(128)  # made once, by one rank
    if world > 1:
        dist.barrier()
    urls = args.data or demo_shards(128)
    samples = args.samples or 128
    epoch_length = args.epoch_length or max(1, math.floor(samples / (world * args.batch_size)))
    tokenizer = args.tokenizer
    if tokenizer is None:
        from mmproxy.cli import _cache_dir
        from mmproxy.testing import WORDS, make_tokenizer

        folder = _cache_dir() / "demo" / "tokenizer-ddp"
        if rank == 0:
            make_tokenizer(folder, [f"{w}, take {i}" for i, w in enumerate(WORDS * 10)])
        if world > 1:
            dist.barrier()
        tokenizer = str(folder)
    tok = load_tokenizer(tokenizer)

    # Each rank: its own server on its own GPU (device="auto" picks LOCAL_RANK's GPU); none for
    # --synthetic, whose ceiling must not pay for an idle pipeline's memory and threads.
    image = None if args.synthetic else mmproxy.DALIServer(
        image_train_pipeline(batch_size=args.batch_size, size=args.image_size,
                             device_id=local if cuda else None, num_threads=args.threads),
        name=f"image-rank{rank}")
    model = TinyCLIP(len(tok), image_tower=args.model).to(device)
    big = cuda and args.model == "resnet50"
    if big:
        model = model.to(memory_format=torch.channels_last)
        torch.backends.cudnn.benchmark = True
    if world > 1 and not args.independent:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local] if cuda else None,
            broadcast_buffers=not args.no_broadcast_buffers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    keys: list[list[str]] = []
    profiler = None
    if args.profile:
        if args.epochs < 2 or epoch_length < args.profile_steps + 2:
            raise SystemExit(f"--profile needs --epochs >= 2 and an epoch of at least "
                             f"{args.profile_steps + 2} batches (--profile-steps + 2); this run "
                             f"has {args.epochs} epochs of {epoch_length}")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        profiler = torch.profiler.profile(activities=activities)
    # Past the first epoch's start-up, in the middle of the second epoch.
    profile_epoch, profile_from = 1, max(1, (epoch_length - args.profile_steps) // 2)
    with image or contextlib.nullcontext():
        if image is None:
            loader = synthetic(args, len(tok), epoch_length, device)
        else:
            dataset = image_text_dataset(urls, image, tok, batch_size=args.batch_size,
                                         max_length=32, epoch_length=epoch_length,
                                         shuffle_buffer=256, seed=1234, partial=False)
            loader = dataset.loader(image, num_workers=args.workers, persistent_workers=True,
                                    pin_memory=cuda)
        rates, seconds = [], []
        for epoch in range(args.epochs):
            epoch_keys, n = [], 0
            start = time.perf_counter()
            batches = iter(loader)
            for step in itertools.count():
                if profiler is not None and epoch == profile_epoch:
                    if step == profile_from:
                        profiler.start()
                    elif step == profile_from + args.profile_steps:
                        finish_profile(profiler, args.profile, rank, cuda)
                        profiler = None
                with record_function("next_batch"):  # the main loop's wait, in a profile
                    batch = next(batches, None)
                if batch is None:
                    break
                with record_function("train_step"):
                    images = batch["image"].to(device, non_blocking=True)
                    with torch.autocast(device.type, torch.bfloat16, enabled=big):
                        loss = model(images.contiguous(memory_format=torch.channels_last) if big
                                     else images, batch["input_ids"].to(device, non_blocking=True),
                                     batch["attention_mask"].to(device, non_blocking=True))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                epoch_keys += batch["__key__"]
                n += len(batch["__key__"])
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            if epoch == 0:
                start_up_wait = image.wait_seconds if image else 0.0
            rates.append(n / seconds[-1])
            keys.append(epoch_keys)
            print(f"rank {rank} epoch {epoch}: {len(epoch_keys)} samples, {rates[-1]:.0f} "
                  f"samples/s, loss {loss.item():.3f}", flush=True)
    # Per rank: the best epoch; over the epochs after the first (start-up): the sustained rate and
    # how long the main loop waited on the server per batch.
    later = seconds[1:] or seconds
    later_samples = sum(len(k) for k in keys[-len(later):])
    waited = (image.wait_seconds if image else 0.0) - (start_up_wait if len(seconds) > 1 else 0.0)
    mine = torch.tensor([max(rates), later_samples / sum(later),
                         waited * 1000 * args.batch_size / max(1, later_samples)], device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, mine)
    else:
        gathered = [mine]
    if args.dump_keys:
        with open(f"{args.dump_keys}.rank{rank}.json", "w") as f:
            json.dump(keys, f)
    if rank == 0:
        per_rank = [round(g[0].item(), 1) for g in gathered]
        sustained = [round(g[1].item(), 1) for g in gathered]
        waits = [round(g[2].item(), 2) for g in gathered]
        summary = {"world": world, "model": args.model, "per_rank_samples_per_s": per_rank,
                   "total_samples_per_s": round(sum(per_rank), 1),
                   "per_rank_sustained_samples_per_s": sustained,
                   "total_sustained_samples_per_s": round(sum(sustained), 1),
                   "per_rank_main_loop_wait_ms_per_batch": waits,
                   "batch_size": args.batch_size,
                   "epoch_length": epoch_length, "workers": args.workers,
                   "cpus_per_rank": args.cpus_per_rank or None}
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
