"""Models for the examples: tiny ones that train a few steps on a CPU, and a ResNet-50 image tower
for GPU runs where the model, not the data, should set the pace; the CLIP training step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyCLIP(nn.Module):
    """A conv image tower and a bag-of-tokens text tower meeting in a shared embedding.

    ``image_tower="resnet50"`` swaps the two-layer conv tower for torchvision's ResNet-50 (random
    weights), a CLIP-sized amount of work per image.
    """

    def __init__(self, vocab_size: int, dim: int = 64, image_tower: str = "tiny") -> None:
        super().__init__()
        if image_tower == "resnet50":
            from torchvision.models import resnet50

            self.image: nn.Module = resnet50(num_classes=dim)
        elif image_tower == "tiny":
            self.image = nn.Sequential(
                nn.Conv2d(3, 16, 5, stride=4), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, dim))
        else:
            raise ValueError(f"image_tower must be 'tiny' or 'resnet50', got {image_tower!r}")
        self.text = nn.EmbeddingBag(vocab_size, dim, mode="sum")
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        img = F.normalize(self.image(images.float()), dim=-1)
        weights = attention_mask.float()
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=1)  # mean over real tokens
        txt = F.normalize(self.text(input_ids, per_sample_weights=weights), dim=-1)
        logits = self.scale.exp() * img @ txt.t()
        target = torch.arange(len(logits), device=logits.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


class TinyAudioNet(nn.Module):
    """1-D convolutions over log-mel frames, masked mean pooling, a linear classifier."""

    def __init__(self, n_mels: int, classes: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(n_mels, 64, 5, padding=2), nn.ReLU(),
                                  nn.Conv1d(64, 64, 5, padding=2), nn.ReLU())
        self.head = nn.Linear(64, classes)

    def forward(self, mel: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        h = self.conv(mel / 50.0)
        mask = (torch.arange(h.shape[-1], device=h.device)[None] < frames[:, None].to(h.device))
        pooled = (h * mask[:, None]).sum(-1) / mask.sum(-1, keepdim=True).clamp(min=1)
        return self.head(pooled)


def clip_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict, device: torch.device | str
              ) -> torch.Tensor:
    """One training step of a CLIP model on an image-text batch; returns the loss."""
    loss = model(batch["image"].to(device, non_blocking=True),
                 batch["input_ids"].to(device, non_blocking=True),
                 batch["attention_mask"].to(device, non_blocking=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
