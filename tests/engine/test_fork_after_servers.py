"""What stopped servers leave behind: nothing a forked child's collector could free.

A forked child inherits every object of its parent; one that only the cyclic collector frees is
freed there, and a CUDA object freed in a forked child aborts it (a plain DataLoader's workers
after an NVDEC loader, say). So a stopped and dropped server leaves no cycle holding its runner,
its Prepare stage's runs or their inputs; on a GPU, a plain fork loader after image and NVDEC
loaders runs.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_prepare import _batch, _server

import mmproxy

pytestmark = pytest.mark.timeout(240)

_OURS = ("mmproxy._server.runner", "mmproxy._server.prepare", "mmproxy._server.isolation",
         "mmproxy._server.dali", "mmproxy._server.runs", "mmproxy.server")


def _left_in_cycles(make):
    """Types of mmproxy's objects (and numpy arrays) that only the collector frees once the
    servers ``make`` ran are stopped and dropped."""
    gc.collect()
    gc.disable()
    try:
        make()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                        if type(o).__module__ in _OURS or isinstance(o, np.ndarray)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found


def test_a_stopped_server_with_a_prepare_stage_leaves_nothing_in_cycles():
    def run():
        server, _ = _server()
        with server:
            server.produce_data(_batch(server, [0, 1, 2], skip=False))
            server.produce_data(_batch(server, [3, -1, 4], skip=True))  # a damaged sample too
    assert _left_in_cycles(run) == []


def test_a_stopped_pool_leaves_nothing_in_cycles():
    from conftest import cpu, double_pipe
    from torch.utils.data import default_collate

    def run():
        with mmproxy.DALIServer(cpu(double_pipe, batch_size=4), pipelines=3) as server:
            for k in range(6):
                server.produce_data(default_collate([server.proxy(np.full(2, k, np.float32))] * 4))
    assert _left_in_cycles(run) == []


@pytest.mark.gpu
def test_a_plain_fork_loader_with_pyav_runs_after_image_and_nvdec_loaders(tmp_path):
    pytest.importorskip("av")
    from mmproxy.pipelines.video._nvdec import nvdec_available

    if not nvdec_available("pynvvideocodec"):
        pytest.skip("needs PyNvVideoCodec")
    script = textwrap.dedent(f"""
        import gc, sys
        gc.disable()  # what the loaders leave in cycles is still there at the fork
        import numpy as np, torch
        import mmproxy
        from mmproxy.datasets import image_text_dataset, video_label_dataset
        from mmproxy.pipelines import decode_clip, image_train_pipeline, video_pipeline
        from mmproxy.testing import (image_bytes, make_tokenizer, synth_image, synth_video,
                                     video_bytes, write_tar)
        tmp = {str(tmp_path)!r}
        write_tar(f"{{tmp}}/i-0.tar", [{{"__key__": f"k{{i}}", "jpg": image_bytes(synth_image(i)),
                                        "txt": f"a caption {{i}}"}} for i in range(48)])
        clips = [video_bytes(synth_video(i, 40, 64, 96)) for i in range(8)]
        write_tar(f"{{tmp}}/v-0.tar", [{{"__key__": f"v{{i}}", "mp4": c, "cls": str(i)}}
                                      for i, c in enumerate(clips)])
        tokenizer = make_tokenizer(tmp)
        for _ in range(2):
            with mmproxy.DALIServer(image_train_pipeline(batch_size=16, device="gpu"),
                                    pipelines=2) as image:
                for batch in image_text_dataset(f"{{tmp}}/i-0.tar", image, tokenizer,
                                                batch_size=16).loader(image, num_workers=2):
                    pass
        with mmproxy.DALIServer(video_pipeline(batch_size=4, decoder="nvdec", device="gpu",
                                               train=True)) as video:
            for batch in video_label_dataset(f"{{tmp}}/v-0.tar", video,
                                             batch_size=4).loader(video, num_workers=2):
                pass
        del image, video, batch

        class Clips(torch.utils.data.Dataset):
            def __len__(self):
                return 16
            def __getitem__(self, i):
                gc.collect()  # what any long-running worker does sooner or later
                return torch.from_numpy(decode_clip(np.frombuffer(clips[i % 8], np.uint8), 0, 4, 1))

        loader = torch.utils.data.DataLoader(Clips(), batch_size=4, num_workers=4, timeout=60,
                                             multiprocessing_context="fork")
        print("batches", sum(1 for _ in loader))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0 and "batches 4" in done.stdout, done.stderr[-3000:]
