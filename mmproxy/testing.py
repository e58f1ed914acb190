"""Testing: synthetic data for tests, the demo, the examples and the benchmarks.

The one place for it: media (images with gradients and shapes, speech-like audio, moving video)
and their encoders, damaged JPEGs, captions, shards, an ImageFolder tree, a tiny tokenizer trained
on the captions, and the cache folder they are kept in. Nothing is downloaded.

Modules: this one (the public names), ``_media`` (synthetic media and their encoders),
``_damage`` (damaged files) and ``_sets`` (captions, shards, the ImageFolder tree, the tokenizer,
the cache folder).
"""

from __future__ import annotations

from mmproxy._testing.media import (
    audio_bytes,
    damage_jpeg,
    faststart_mp4,
    image_bytes,
    synth_image,
    synth_speech,
    synth_video,
    video_bytes,
)
from mmproxy._testing.sets import (
    WORDS,
    cache_dir,
    caption,
    demo_shards,
    demo_tokenizer,
    image_folder,
    make_tokenizer,
    write_tar,
    writing_cache,
)

__all__ = ["WORDS", "audio_bytes", "cache_dir", "caption", "damage_jpeg", "demo_shards",
           "demo_tokenizer", "faststart_mp4", "image_bytes", "image_folder", "make_tokenizer",
           "synth_image", "synth_speech", "synth_video", "video_bytes", "write_tar",
           "writing_cache"]
