"""mmproxy.datasets: WebDataset shards into batches whose heavy fields go through servers.

Text and labels stay in PyTorch (tokenized in the workers); images and audio go to DALI servers
through their proxies; a composite collate puts them into one batch per step.
"""

import importlib
import sys

from mmproxy.datasets.multimodal import Field, MultiModalDataset, Source
from mmproxy.datasets.recipes import (
    Tokenize,
    audio_label_dataset,
    image_text_dataset,
    load_tokenizer,
    video_label_dataset,
    video_text_dataset,
)
from mmproxy.datasets.remote import RemoteOptions
from mmproxy.datasets.writer import make_shards
from mmproxy.datasets.writer._written import manifest_sources

from mmproxy.media.checks import check_header
from mmproxy.skips import add_file_lookup

__all__ = ["Field", "MultiModalDataset", "RemoteOptions", "Source", "Tokenize",
           "audio_label_dataset", "check_header", "image_text_dataset", "load_tokenizer",
           "make_shards", "video_label_dataset", "video_text_dataset"]

add_file_lookup(manifest_sources)  # skip summaries name a sample by the file make-shards read

# The stage modules answer to mmproxy.datasets.NAME too (mmproxy.datasets.plan, ...).
for _name in ("batcher", "buffer", "elastic", "fields", "mixer", "plan", "position", "reader"):
    globals()[_name] = sys.modules[f"{__name__}.{_name}"] = importlib.import_module(
        f"{__name__}.stages.{_name}")
del _name

