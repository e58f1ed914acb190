"""CLIP-style image-text training: images through an image server, captions tokenized in workers.

Run: python examples/clip_train.py [--data 'shards-{0000..0009}.tar' --tokenizer FOLDER]
Checkpoint and resume (the model, the optimizer and the loader's position):
    python examples/clip_train.py --steps 6 --checkpoint ckpt.pt    # saves after every step
    python examples/clip_train.py --steps 12 --checkpoint ckpt.pt   # goes on from step 6
"""

import argparse
import os
import time

import torch
from _models import TinyCLIP, clip_step
from mmproxy.datasets import image_text_dataset, load_tokenizer
from mmproxy.pipelines import image_train_pipeline, resolve_device

import mmproxy
from mmproxy.testing import demo_shards, demo_tokenizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", help="image-text shards (default: the demo's synthetic set)")
    parser.add_argument("--tokenizer", help="a transformers tokenizer folder (default: the demo's)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--checkpoint", help="save here after every step; resume from it if it exists")
    args = parser.parse_args()
    urls = args.data or demo_shards(128)
    tok = load_tokenizer(args.tokenizer or demo_tokenizer())
    device = "cuda" if resolve_device()[0] else "cpu"

    # sample_seeded: crops drawn from each sample's seed, so a resumed run repeats them exactly
    image = mmproxy.DALIServer(image_train_pipeline(batch_size=args.batch_size, size=args.image_size,
                                                    num_threads=2, sample_seeded=True), name="image")
    dataset = image_text_dataset(urls, image, tok, batch_size=args.batch_size, max_length=32,
                                 shuffle_buffer=64, on_error="skip", partial=False)
    torch.manual_seed(0)
    model = TinyCLIP(len(tok)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = dataset.loader(image, num_workers=args.workers)
    step, first, start = 0, 0, time.perf_counter()
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])  # the next batch is the one after the last step
        step = first = saved["step"]
        print(f"resumed at step {step} (epoch {saved['loader']['epoch']})")
        if step >= args.steps:
            print(f"clip: nothing left to train: the checkpoint is at step {step}, --steps is "
                  f"{args.steps}")
            return
    with image:
        while step < args.steps:
            for batch in loader:
                loss = clip_step(model, opt, batch, device)
                step += 1
                print(f"step {step}: loss {loss.item():.3f}")
                if args.checkpoint:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "loader": loader.state_dict(), "step": step}, args.checkpoint)
                if step == args.steps:
                    break
    done = f"steps {first + 1}-{step}" if first else f"{step} steps"
    print(f"clip: {done} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
