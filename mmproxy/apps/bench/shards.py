"""Bench shards: the synthetic image, audio and video shards every system reads, some JPEGs
damaged.

Images are ~45 KB JPEGs of 500x375 with a caption and a label, like the reference workload; audio
clips are 44.1 kHz WAV of 2-10 s with a label; videos are H.264 MP4 clips of 2 s (50 frames,
160x120, a key frame every 12) with a label. Shards are written once per folder, in parallel
processes, and reused by later runs.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["is_damaged", "write_shards", "written_shards"]


def is_damaged(i: int, damage: float) -> bool:
    """Whether sample ``i`` is damaged: a fraction ``damage`` of the samples, evenly spread."""
    return damage > 0 and math.floor((i + 1) * damage) > math.floor(i * damage)


def write_shards(folder: str | os.PathLike[str], kind: str, count: int, workers: int = 1,
                 damage: float = 0.0, damage_kind: str = "truncate") -> list[str]:
    """Writes (once) ``count`` synthetic samples of ``kind`` ("image", "audio" or "video") as shards of 64
    under ``folder/KIND-COUNT/``, smaller shards when 64 would leave one of ``workers`` without
    one; returns their paths. With ``damage``, that fraction of the images is damaged
    (:func:`mmproxy.testing.damage_jpeg` of ``damage_kind``), spread evenly over the shards, in a
    folder of its own."""
    from concurrent.futures import ProcessPoolExecutor

    from mmproxy.parts import remove_stale_parts
    from mmproxy.testing import writing_cache

    per_shard = min(64, max(1, count // max(1, workers)))
    name = f"{kind}-{count}" if per_shard == 64 else f"{kind}-{count}-by{per_shard}"
    where = Path(folder) / (name + (f"-{damage_kind}{damage:g}" if damage else ""))
    jobs = [(str(where / f"{kind}-{s:04d}.tar"), kind, s * per_shard, min(count, (s + 1) * per_shard),
             damage, damage_kind) for s in range(math.ceil(count / per_shard))]
    if all(os.path.exists(job[0]) for job in jobs):
        return [job[0] for job in jobs]
    with writing_cache(where), ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        where.mkdir(parents=True, exist_ok=True)
        remove_stale_parts(where)
        return list(pool.map(_write_shard, jobs))


def written_shards(folder: str | os.PathLike[str], kind: str) -> list[str]:
    """The clean shards of ``kind`` already written under ``folder`` (by any ``--samples``; not
    the damaged copies), for scripts that reuse the bench's data."""
    return sorted(str(path) for path in Path(folder).glob(f"{kind}-*/{kind}-*.tar")
                  if re.fullmatch(rf"{kind}-\d+(-by\d+)?", path.parent.name))


def _write_shard(job: tuple[str, str, int, int, float, str]) -> str:
    from mmproxy.testing import write_tar

    path, kind, lo, hi, damage, damage_kind = job
    if not os.path.exists(path):
        write_tar(path, (_sample(kind, i, damage, damage_kind) for i in range(lo, hi)))
        # on the disk before any system reads it: the kernel writing gigabytes of new shards
        # back while systems run slows every one of them (BENCHMARKS.md)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def _sample(kind: str, i: int, damage: float, damage_kind: str) -> dict[str, Any]:
    from mmproxy.testing import (
        audio_bytes,
        caption,
        damage_jpeg,
        image_bytes,
        synth_image,
        synth_speech,
        synth_video,
        video_bytes,
    )

    if kind == "video":
        return {"__key__": f"{i:07d}", "mp4": video_bytes(synth_video(i, 50, 120, 160), crf=23),
                "cls": str(i % 10)}
    if kind == "image":
        jpeg = image_bytes(synth_image(i, 375, 500))
        if is_damaged(i, damage):
            jpeg = damage_jpeg(jpeg, damage_kind)
        return {"__key__": f"{i:07d}", "jpg": jpeg, "txt": caption(i), "cls": str(i % 10)}
    seconds = 2 + (i * 7919 % 800) / 100
    return {"__key__": f"{i:07d}", "wav": audio_bytes(synth_speech(i, seconds, 44100), 44100, "WAV"),
            "cls": str(i % 10)}
