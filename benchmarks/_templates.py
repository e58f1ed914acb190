"""The words of BENCHMARKS.md and of the README's table: the method, a few lines a section, and
which results each section and each summary row reads (``report.py`` renders the figures)."""

from __future__ import annotations

from dataclasses import dataclass, field

APART = "¹"  # a ratio of rates from separate runs
APART_TEXT = ("rates of separate runs one after the other on the same machine, not of one run "
              "(the reference's median over the other's)")
BEST = "²"  # best epochs, from runs that predate the sustained rate

MACHINES = {"gpu-h200": "one H200, 16 cores", "gpu-h200x2": "two H200s, 32 cores",
            "cpu-2core": "2-core CPU"}
MACHINES_LONG = {"gpu-h200": "One H200, 16 cores", "gpu-h200x2": "Two H200s, 32 cores (DDP)",
                 "cpu-2core": "2-core CPU"}
COLUMNS = {"graph": "× DALI graph alone", "reader": "× DALI reader", "proxy": "× DALI's proxy",
           "torch": "× PyTorch workers", "spdl": "× SPDL"}


@dataclass
class Section:
    """A section of the page: the results files of one machine it reads, how it renders them
    (``systems``: one table row a system; or one of ``report.KINDS``) and its words."""

    machine: str
    title: str
    files: list[str]
    text: str
    kind: str = "systems"
    reference: tuple[str, str] | None = None  # (file, system) the ratios are over; mmproxy's


@dataclass
class Row:
    """A summary row: mmproxy's (file, system) and, per column, the (file, system) of the peer or
    the words for a cell without one."""

    workload: str
    workload_text: str
    machine: str
    mmproxy: tuple[str, str]
    peers: dict[str, tuple[str, str] | str] = field(default_factory=dict)
    headline: bool = True  # in the README's table too


TITLE = """
# Benchmarks

<!-- Rendered by `python benchmarks/report.py` from benchmarks/results/: edit the results or the
words in benchmarks/_templates.py, not this page (CI runs `report.py --check`). -->

Where mmproxy stands against the DALI pipeline fed from memory, DALI's own reader and proxy,
PyTorch DataLoader workers and SPDL, on one H200, on two H200s under DDP and on a 2-core CPU. Every
figure comes from a results file under [`benchmarks/results/`](benchmarks/results) (one folder a
machine, the latest file a workload), which names the command, the code and the date; each section
below gives them. What was tried and why it went or stayed: [benchmarks/HISTORY.md](benchmarks/HISTORY.md).
"""

SUMMARY_LEGEND = f"""
mmproxy's rate over each system's: the median (range) over the runs of one bench run, sustained
(epochs 2 to N by wall clock). {APART} Rates of separate runs one after the other on the same
machine, not of one run. {BEST} Best epoch after the first (that run predates the sustained rate).
The DALI graph alone is the workload's graph fed from memory, outputs copied into torch, no
loader: the most a loader reaches with it. The measured column dates mmproxy's run, and any
peer's run of another date; each section names the code measured.
"""

METHOD = """
## How the figures are taken

**`mmproxy bench`** writes its own data (JPEGs of 500x375, ~45 KB; WAV clips of 2-10 s at 44.1
kHz, 16 bit: `--samples` counts images, the audio workload writes a quarter as many clips) and
runs every system on the same shards with the same batch size, workers and DALI threads, one
after the other in one process; `--runs N` interleaves N runs of each. An epoch's first is the
warm-up: the **sustained** rate is epochs 2 to N by wall clock, the gaps between epochs included;
the **best epoch** is the fastest after the first. `benchmarks/video_bench.py` does the same with
H.264 clips. `mmproxy bench --data DIR` runs every system on your shards.

**Ratios** are mmproxy's rate over the other system's, run by run within one bench run, as the
median (range) over the runs. A system's own rate moves by 5-20% from run to run on these
machines, so rates of separate runs are set side by side only where marked, and then only for runs
one after the other on one machine.

**Systems.**

- **mmproxy**: `MultiModalDataset` and `DALIServer` (with `pipelines=N` copies of the pipeline where
  a row says so: [docs/pipelines.md](docs/pipelines.md)).
- **dali-graph**: the workload's graph (as the reader runs it) fed from memory to the same number
  of pipelines, outputs copied into torch, no loader and no workers: the limit.
- **dali-reader**: `fn.readers.webdataset` feeding the same operators, no Python in the loop.
- **dali-proxy**: DALI 2.4.0's own proxy with the same pipeline and its defaults.
- **torch**: DataLoader workers: PIL and torchvision v2 (random-resized crop, flip, normalize);
  soundfile and torchaudio's resampler; PyAV and torchvision for video.
- **spdl**: SPDL 0.8.0's thread pipeline in one process (the `[spdl]` extra): webdataset's tar
  reader, `spdl.io`'s FFmpeg decode and filters, each batch normalized on the GPU where there is one.
- **video**: `mmproxy-pyav` (`decoder="pyav"`: PyAV in the workers), `mmproxy-torchcodec`
  (`decoder="nvdec"` through TorchCodec: NVDEC in the server), `mmproxy-mixed-torchcodec[auto]`
  (`decoder="mixed"`: NVDEC and the workers' PyAV, balanced by NVDEC's backlog), `mmproxy-dali`
  (DALI's in-memory decoder): [docs/video.md](docs/video.md).

**Code.** A results file names the commit measured (`git describe` of the checkout, `-dirty` when
its files differed from the commit) and `machine.mmproxy.source`, a hash of the engine's, datasets'
and pipelines' sources. A file written before the bench recorded its commit names the commit that
added it.
"""

MACHINE_TEXT = {
    "gpu-h200": """
The one-GPU machine (one H200, 16 cores), or GPU 0 and cores 0-15 of the two-H200 host, pinned
(each file says which). 15 workers; image batch 256, audio batch 64, video batch 32; DALI 2.4.0,
PyTorch 2.11. `benchmarks/single_gpu.sh` (`PART=...`) runs each section's commands.
""",
    "gpu-h200x2": """
Two H200s and 32 cores in one host, one NUMA node; `benchmarks/multi_gpu.sh` runs each command.
""",
    "cpu-2core": """
Two cores, no GPU (DALI's CPU operators); 2 workers, 2 DALI threads; image batch 64, audio batch
32, video batch 8. The workers, DALI's threads and the main loop share the two cores, so a system's
rate moves by up to ±20% from run to run. The CPU image pipeline resizes with torchvision inside
the DALI pipeline (`cpu_resize="torchvision"`, the default).
""",
}

H200, X2, CPU = "gpu-h200", "gpu-h200x2", "cpu-2core"
MIXED = "mmproxy-mixed-torchcodec[auto]"

SECTIONS = [
    Section(H200, "Images, several pipelines a server (one H200)",
            ["image.json", "image-reader-proxy.json", "image-4-pipelines.json"], """
16,384 JPEGs. mmproxy's server runs three copies of the image pipeline (`pipelines=3`) of 5
threads each; the graph fed from memory, with the same three copies, is the limit. DALI's reader
and proxy run their one pipeline of 8 threads, in the bench run just before; four copies of 3
threads in another.
"""),
    Section(H200, "Images, one pipeline (one H200)", ["image-one-pipeline.json"], """
Every system with one pipeline of 8 threads, in one run (`--pipelines 1`): one DALI executor is the
limit here, below what the GPU does, and the reader is nearest it.
"""),
    Section(H200, "The image graph alone, by pipelines and threads (one H200)",
            ["image-graph-sweep.json"], """
`--systems dali-graph`: the image pipeline fed from memory, no loader, N copies of T threads on the
16 cores. One copy stops well below what three or four reach; `pipelines="auto"` takes as many as
the cores hold at the pipeline's threads ([docs/pipelines.md](docs/pipelines.md)).
""", kind="sweep"),
    Section(H200, "What stops the image graph (one H200)", ["image-graph-limits.json"], """
`benchmarks/pipeline_cost.py --kind image --only fed`: the graph fed from the shards' mappings,
no loader, with one more freedom each. The hardware JPEG decoder tops near 40,000 images a second
(its share 1.0 frees five cores and runs slower); the whole image decoded costs more than the
window alone; two or three processes at once run below one. Each row is the measurement "fed
from the shards' mappings, shuffled". With DALI's default share (0.65) the graph stops near
49,000 images a second, 1.2x the reader; a lower share lifts it (next section).
""", kind="variants"),
    Section(H200, "The image graph by the hardware decoder's share (one H200)",
            ["image-graph-hw-share.json"], """
The same measurement with four pipelines, the hardware JPEG decoder's share (`hw_decoder_load`)
set lower than DALI's default, so that DALI's threads decode more: 0.5 with 4 threads a pipeline
reached 54,400-56,900 images a second, where the hardware decoder alone tops near 40,000 and the
default share near 50,000. `image_train_pipeline(hw_decoder_load=...)` and `mmproxy bench
--hw-decoder-load` set it.
""", kind="variants"),
    Section(H200, "Images against SPDL (one H200)", ["image-spdl.json"], """
16,384 JPEGs, mmproxy with one pipeline. SPDL's CUDA build on that machine has no nvJPEG, so
`spdl` decodes on the CPU with PyAV's bundled FFmpeg (the machine has none of its own) and moves
each batch to the GPU.
"""),
    Section(H200, "Images, audio and image-text against PyTorch's workers (one H200)",
            ["image-audio-torch.json"], """
8,192 JPEGs and 2,048 WAV clips, mmproxy with one pipeline; the latest run of PyTorch's workers on
the GPU (soundfile is not installed on the one-GPU machine). Best epochs, as the bench gave them
then. Image-text: images through the server and captions tokenized in the workers, against the
reader's images alone.
"""),
    Section(H200, "Audio, several pipelines a server (one H200)",
            ["audio.json"], """
8,192 WAV clips (`--samples 32768`) resampled to 16 kHz and padded, the README's recipe
(`audio_pipeline` and `pad=[0]`). mmproxy and the graph with two pipelines of 7 threads, the
reader with its one. The graph alone runs far above both: what a clip costs on its way from the
workers to the pipeline is the gap ("Audio part by part", below).
"""),
    Section(H200, "Audio, this code against a4773b2 (one H200)", ["compare-code.json"], """
`benchmarks/compare_code.sh` with two pipelines of 7 threads: this code (less work a batch in
the main process: small tensors inside the batch, shards found by the version the worker sends,
a worker's position kept as bytes) against the commit before it, each against the reader in the
same run, the two interleaved. Best epochs 1.13 and 1.23 of the reader against 1.05 and 1.11;
the sustained rates overlap. The README's recipe with labels gains more (`benchmarks/main_cost.py
--labels`); this bench's audio system loads the clips alone.
""", kind="compare"),
    Section(H200, "Audio part by part (one H200)", ["audio-parts.json"], """
`benchmarks/pipeline_cost.py --pipelines 2 --threads 7`: the bench's graph (16-bit decode, on the
GPU resample and pad) fed from memory, behind a server fed in its own process (the runners, the
run table, the batches' resolution), and with the runs sent by a forked process (the transport
and the server's listener too); the reader rows run its one pipeline. Served to sent (the
listener and transport) costs about 11,000 clips a second; the workers and torch's DataLoader take
about 13,000 more, to the loader's rate ("Audio, several pipelines a server").
""", kind="variants"),
    Section(H200, "Audio, one pipeline (one H200)", ["audio-one-pipeline.json"], """
The same clips, every system with one pipeline of 8 threads, in one run.
"""),
    Section(H200, "Audio against SPDL (one H200)", ["audio-spdl.json"], """
2,048 clips, mmproxy with one pipeline. SPDL's WAV reader and torchaudio's resampler run on SPDL's
threads at about 12 ms of CPU a clip, and its rate did not grow with the threads.
"""),
    Section(H200, "Audio against DALI's proxy (one H200)", ["audio-proxy.json"], """
2,048 clips, mmproxy with one pipeline. DALI's proxy pickles every clip through one pipe to its
server thread. This run read shards written just before it while the kernel wrote them back to
disk, so every system ran about a third below its rate in the next run; the bench now flushes each
shard it writes before any system reads it.
"""),
    Section(H200, "Video at 596x336: NVDEC and PyAV (one H200)",
            ["video-596x336-mixed-pinned.json", "video-596x336-mixed.json",
             "video-596x336-torchcodec.json", "video-596x336-pyav.json", "video-596x336-torch.json"],
            """
1,024 H.264 clips of 596x336 (5-10 s, a key frame every 12 frames), a training clip of 16 frames
at stride 4, 12 decode threads, 3 epochs; one process a system, one after the other. `"mixed"`
sends a clip to the workers' PyAV when NVDEC's queue would keep it waiting; with the workers on
cores 7-15 and the server's threads on 0-6 (a `worker_init_fn`: [docs/video.md](docs/video.md))
it ran fastest. NVDEC alone stops near its engines' limit (busy ~90% of the time); PyNvVideoCodec,
the default `nvdec_library`, ran level with TorchCodec on these clips.
""", reference=("video-596x336-mixed-pinned.json", MIXED)),
    Section(H200, "Video at 1280x720 (one H200)",
            ["video-1280x720-mixed.json", "video-1280x720-torch.json"], """
96 clips of 1280x720, the same sampling and settings: NVDEC does nearly all the work at this size.
""", reference=("video-1280x720-mixed.json", MIXED)),
    Section(H200, "Video with DALI's decoders (one H200)", ["video-596x336-dali.json"], """
512 clips of 596x336, 2 epochs, every system in one process: DALI's reader (`fn.readers.video`,
NVDEC) and proxy (`fn.decoders.video`) against PyAV in the workers. DALI 2.4's in-memory decoder
spends ~150 ms of CPU a clip in its own threads whatever its options, so `decoder="auto"` never
picks it.
""", reference=("video-596x336-dali.json", "mmproxy-pyav")),
    Section(H200, "Damaged data (one H200)", ["damage.json"], """
`--damage 0.01`: a copy of the shards with 1% of the JPEGs cut to a third, which the workers'
header checks catch (`on_error="skip"`); the damaged run's rate counts the samples delivered, and
its ratio is the clean run's rate over it. The epochs of one system spread by 5-15% here, so a
ratio near 1 is noise.
"""),
    Section(H200, "Remote shards (one H200)", ["remote.json"], """
The same shards over HTTP (a local server process), S3 (moto servers, one process per three
workers) and through the node cache (HTTP underneath, filled by the first epoch), the servers on
the host's other 16 cores as a remote server would be. Measured with the S3 client of its date
(GETs presigned by boto3, sent through urllib), before S3 moved to obstore; not measured again
on the H200 since.
"""),
    Section(H200, "Resume (one H200)", ["resume.json"], """
`benchmarks/resume_bench.py`: the first batch of a fresh loader and of loaders resumed from states
saved at 10% and 90% of an epoch (a shuffle buffer of 1,024); and, epochs alternated, the image
pipeline with its crop and flip drawn from each sample's seed (`sample_seeded=True`, exact
augmentation on resume) against DALI drawing them.
""", kind="resume"),
    Section(X2, "DDP training (two H200s)", ["ddp.json"], """
Image-text training of `examples/train_ddp.py`, timed by `benchmarks/ddp_bench.py` under torchrun:
a ResNet-50 image tower (bf16 autocast, channels_last: the model sets the pace), 8,192 images,
batch 256 a rank, 4 epochs, 12 workers and 8 DALI threads a rank, each rank on 16 cores of its own.
Controls: `--synthetic` (one fixed batch on the GPU, no loader: what the model and DDP allow) and
`--independent` (the loaders without gradient sync).
""", kind="ddp"),
    Section(X2, "Where a DDP step's time goes (two H200s)", ["ddp-profile.json"], """
`--profile`: 8 steps of the second epoch on 2 GPUs, summed up by `benchmarks/ddp_profile.py`, GPU
time a step in ms. The profiler slows each step's host side, so the differences between rows count
more than the figures. The training kernels fill the GPU, so the pipeline's GPU work cannot hide
behind them, and each gradient all-reduce waits for the slower rank.
""", kind="profile"),
    Section(CPU, "Images (2-core CPU)", ["image.json"], """
2,048 JPEGs, 4 epochs x 3 runs. The pipeline is the limit here: DALI's threads take most of the CPU
under every DALI system.
"""),
    Section(CPU, "Audio (2-core CPU)", ["audio.json"], """
512 WAV clips resampled from 44.1 to 16 kHz by libsoxr inside the pipeline
(`cpu_resample="soxr"`, the CPU default), 4 epochs x 3 runs. Resampling is most of every system's
CPU, and the lead over PyTorch's workers and SPDL is mostly libsoxr's over torchaudio's resampler.
"""),
    Section(CPU, "Video (2-core CPU)", ["video.json"], """
128 H.264 clips of 320x240, 3 epochs, one run. Both decode with the same PyAV code; mmproxy resizes,
crops and normalizes in the server's DALI threads while the workers go on decoding.
""", reference=("video.json", "mmproxy-pyav")),
    Section(CPU, "The code against an earlier commit (2-core CPU)", ["compare-code.json"], """
`benchmarks/compare_code.sh`: the code with several pipelines a server (one on a CPU) against the
commit before them, each against the reader in the same run, the two interleaved; images and the
README's audio recipe.
""", kind="compare"),
    Section(CPU, "Remote shards (2-core CPU)", ["remote.json"], """
`benchmarks/remote_bench.py`: 4,096 JPEGs, 64 a shard, local, HTTP, S3 (moto), GCS
(fake-gcs-server), Azure (Azurite) and cached epochs taking turns, each round's ratio to local;
the servers on the same two cores, so their CPU counts against the loader.
"""),
    Section(CPU, "Streaming: the first sample of one 512 MB shard (2-core CPU)",
            ["remote-first-sample.json"], """
11,377 members of 45 KB; S3's first sample is the process's first request through obstore.
""", kind="first-sample"),
    Section(CPU, "Resume (2-core CPU)", ["resume.json"], """
As on the H200, with 4,096 JPEGs and batches of 64.
""", kind="resume"),
]

SUMMARY = [
    Row("image", "images", H200, ("image.json", "mmproxy"), {
        "graph": ("image.json", "dali-graph"), "reader": ("image-reader-proxy.json", "dali-reader"),
        "proxy": ("image-reader-proxy.json", "dali-proxy"),
        "torch": ("image-audio-torch.json", "torch"), "spdl": ("image-spdl.json", "spdl")}),
    Row("audio", "audio", H200, ("audio.json", "mmproxy"), {
        "graph": ("audio.json", "dali-graph"), "reader": ("audio.json", "dali-reader"),
        "proxy": ("audio-proxy.json", "dali-proxy"), "torch": ("image-audio-torch.json", "torch"),
        "spdl": ("audio-spdl.json", "spdl")}),
    Row("video", "video, PyAV in the workers, 596x336", H200,
        ("video-596x336-pyav.json", "mmproxy-pyav"), {
            "graph": "–", "reader": ("video-596x336-dali.json", "dali-reader"),
            "proxy": ("video-596x336-dali.json", "dali-proxy"),
            "torch": ("video-596x336-torch.json", "torch")}, headline=False),
    Row("video", "video, NVDEC (TorchCodec), 596x336", H200,
        ("video-596x336-torchcodec.json", "mmproxy-torchcodec"), {
            "graph": "–", "torch": ("video-596x336-torch.json", "torch")}, headline=False),
    Row("video", 'video, `"mixed"`, workers on cores of their own, 596x336', H200,
        ("video-596x336-mixed-pinned.json", MIXED), {
            "graph": "–", "torch": ("video-596x336-torch.json", "torch")}),
    Row("video", 'video, `"mixed"`, 1280x720', H200, ("video-1280x720-mixed.json", MIXED), {
        "graph": "–", "torch": ("video-1280x720-torch.json", "torch")}),
    Row("image", "images", CPU, ("image.json", "mmproxy"), {
        "reader": ("image.json", "dali-reader"), "proxy": ("image.json", "dali-proxy"),
        "torch": ("image.json", "torch"), "spdl": ("image.json", "spdl")}),
    Row("audio", "audio", CPU, ("audio.json", "mmproxy"), {
        "reader": ("audio.json", "dali-reader"), "proxy": ("audio.json", "dali-proxy"),
        "torch": ("audio.json", "torch"), "spdl": ("audio.json", "spdl")}),
    Row("video", "video, PyAV in the workers, 320x240", CPU, ("video.json", "mmproxy-pyav"), {
        "graph": "–", "reader": "needs a GPU", "proxy": "needs a GPU",
        "torch": ("video.json", "torch")}),
]

DDP_LOADERS = [("-synthetic", "none (`--synthetic`): the ceiling"), ("", "**mmproxy**"),
               ("-reader", "DALI's reader (`--loader dali-reader`)"),
               ("-independent", "mmproxy, no gradient sync (`--independent`)")]
PROFILE_COLUMNS = ["step", "training kernels", "NCCL", "NCCL alone", "pipeline",
                   "pipeline beside training", "GPU idle"]

SCRIPTS = """
## The scripts

Each takes `--help`; `benchmarks/_harness.py` holds what the Python scripts share (the options,
the median and range, the JSON with its command, commit, date and machine).

- `mmproxy bench`: every system on the same shards (images, audio, image-text, video, remote
  shards, damaged data, your shards with `--data`, `--pipelines N`).
- `single_gpu.sh`, `multi_gpu.sh`: the commands behind the one-H200 and the DDP results files
  (`PART=...`), pinned.
- `compare_code.sh`: the checkout's code against an earlier commit's, each against DALI's reader,
  interleaved.
- `video_bench.py`: video with mmproxy's decoders, PyTorch's workers, DALI's reader and proxy.
- `remote_bench.py`, `remote_first_sample.py`: local, HTTP, S3 and cached shards taking turns on
  one server; the first sample of one large shard.
- `resume_bench.py`: the first batch after a resume; sample-seeded crops against DALI-drawn ones.
- `ddp_bench.py`, `ddp_profile.py`: DDP training under torchrun, with controls and profiles.
- `pipeline_cost.py`, `transport_cost.py`, `worker_cost.py`, `main_cost.py`,
  `cpu_image_stages.py`: one part alone (the graph behind each feed, the transport's CPU a run, a
  worker's CPU a sample, the main process's CPU a batch behind a pipeline that does next to
  nothing, the CPU image pipeline's stages).
- `video_decode_cost.py`, `nvdec_cut.py`: PyAV's decode with and without the pictures nothing
  refers to; NVDEC on whole and cut clips.
- `photo_shards.py`: shards of real photographs for `mmproxy bench --data`.
- `dali_decoder_crash.py`: whether a DALI release's image decoders crash on damaged files.
- `fork_leftovers.py`, `soak.py`: what a loader leaves for the garbage collector; many epochs with
  early breaks and restarts.

`python benchmarks/report.py` renders this page and the README's table from the results.
"""
