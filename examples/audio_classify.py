"""Audio classification: clips through an audio server (resample + log-mel), labels in PyTorch.

Run: python examples/audio_classify.py [--data 'shards-{0000..0009}.tar']
"""

import argparse
import time

import torch
import torch.nn.functional as F
from _models import TinyAudioNet
from mmproxy.datasets import audio_label_dataset
from mmproxy.pipelines import audio_pipeline, resolve_device

import mmproxy
from mmproxy.testing import demo_shards


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", help="audio-label shards (default: the demo's synthetic set)")
    parser.add_argument("--classes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n-mels", type=int, default=40)
    args = parser.parse_args()
    urls = args.data or demo_shards(128)
    device = "cuda" if resolve_device()[0] else "cpu"

    audio = mmproxy.DALIServer(audio_pipeline(batch_size=args.batch_size, sample_rate=16000,
                                              n_mels=args.n_mels, num_threads=2),
                               name="audio", pad=[0])
    dataset = audio_label_dataset(urls, audio, batch_size=args.batch_size, shuffle_buffer=64)
    model = TinyAudioNet(args.n_mels, args.classes).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step, start = 0, time.perf_counter()
    loader = dataset.loader(audio, num_workers=args.workers)  # one loader: each pass is a new
    with audio:                                                # epoch (order and draws anew)
        while step < args.steps:
            for batch in loader:
                mel = batch["audio"].data.to(device)  # PaddedBatch: [batch, n_mels, frames]
                logits = model(mel, batch["audio_length"])
                loss = F.cross_entropy(logits, batch["label"].to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                print(f"step {step}: loss {loss.item():.3f}")
                if step == args.steps:
                    break
    print(f"audio: {step} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
