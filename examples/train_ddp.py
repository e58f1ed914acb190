"""Multi-GPU image-text training under torchrun: one image server per rank, on its own GPU.

Run:  torchrun --nproc_per_node=2 examples/train_ddp.py [--data 'shards-{0000..0127}.tar' --samples N]
      (CPU: the same command uses the gloo backend and CPU pipelines)
Multi-node: torchrun --nnodes=N --node_rank=R --master_addr=HOST --nproc_per_node=G ...

Shards are split by rank (webdataset's split_by_node, after a shuffle every rank agrees on) and
by worker; --epoch-length gives every rank the same number of batches, so DDP never waits on a
short rank. benchmarks/ddp_bench.py times this training (rates, profiles, controls).
"""

import argparse
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from _models import TinyCLIP, clip_step
from mmproxy.datasets import image_text_dataset, load_tokenizer
from mmproxy.pipelines import image_train_pipeline, resolve_device

import mmproxy
from mmproxy.testing import demo_shards, demo_tokenizer


class Rank(NamedTuple):
    world: int  # ranks in all
    rank: int
    device_id: int | None  # this rank's GPU (LOCAL_RANK), None on CPU
    device: torch.device


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--data", help="image-text shards (default: the demo's synthetic set)")
    parser.add_argument("--samples", type=int, default=128,
                        help="samples in --data, for the default epoch length (default 128)")
    parser.add_argument("--tokenizer", help="a transformers tokenizer folder (default: the demo's)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--epoch-length", type=int, default=0,
                        help="batches per rank per epoch (default: samples / (ranks * batch))")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="DALI threads per rank")
    parser.add_argument("--image-size", type=int, default=96)
    return parser


def init_rank() -> Rank:
    """Joins the process group (NCCL on GPUs, gloo on CPU) and takes this rank's device."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    gpu, device_id = resolve_device("auto", int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1:
        dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", device_id) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    return Rank(world, rank, device_id, device)


def epoch_length(args: argparse.Namespace, rank: Rank) -> int:
    return args.epoch_length or max(1, args.samples // (rank.world * args.batch_size))


def tokenizer(args: argparse.Namespace):
    return load_tokenizer(args.tokenizer or demo_tokenizer())  # every rank may make the demo's


def image_text_data(args: argparse.Namespace, rank: Rank, tok) -> tuple:
    """This rank's image server on its own GPU, and its share of the image-text shards."""
    image = mmproxy.DALIServer(
        image_train_pipeline(batch_size=args.batch_size, size=args.image_size,
                             device_id=rank.device_id, num_threads=args.threads),
        name=f"image-rank{rank.rank}")
    dataset = image_text_dataset(args.data or demo_shards(128), image, tok,
                                 batch_size=args.batch_size, max_length=32,
                                 epoch_length=epoch_length(args, rank), shuffle_buffer=256,
                                 seed=1234, partial=False)
    return image, dataset


def main():
    args = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()
    rank = init_rank()
    tok = tokenizer(args)
    image, dataset = image_text_data(args, rank, tok)
    model = TinyCLIP(len(tok)).to(rank.device)
    if rank.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=None if rank.device_id is None else [rank.device_id])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with image:
        loader = dataset.loader(image, num_workers=args.workers, persistent_workers=True,
                                pin_memory=rank.device.type == "cuda")
        for epoch in range(args.epochs):
            samples = 0
            for batch in loader:
                loss = clip_step(model, opt, batch, rank.device)
                samples += len(batch["__key__"])
            print(f"rank {rank.rank} epoch {epoch}: {samples} samples, loss {loss.item():.3f}",
                  flush=True)
    if rank.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
