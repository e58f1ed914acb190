"""The demo: the shards --data names, tokenizers, and the decoder noise it counts instead of printing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from cli_helpers import HINT, ROOT, image_folder, run_cli, solid
from mmproxy.datasets import Tokenize, load_tokenizer, make_shards

import mmproxy
from mmproxy import cli
from mmproxy.testing import (
    image_bytes,
    make_tokenizer,
    synth_image,
    write_tar,
)

pytestmark = pytest.mark.timeout(240)


# demo --data ---------------------------------------------------------------------------------


def test_demo_on_image_only_shards_uses_the_image_server_and_says_audio_is_missing(tmp_path):
    """The fields line names every extension read (it said "image (png)", the first sample's,
    while the JPEGs were read too)."""
    src = image_folder(tmp_path / "src", per_class=5)
    (src / "cat" / "9.jpg").write_bytes(solid(90, "JPEG"))
    written = make_shards(src, tmp_path / "out", max_count=6)
    proc = run_cli(["demo", "--data", str(tmp_path / "out" / "shard-{000000..000001}.tar"),
                    "--batch-size", "4", "--workers", "2", "--device", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "epoch 1/1" not in proc.stderr  # no progress bar in a pipe
    assert ("fields image (jpg/jpeg/png/webp/bmp/tif/tiff), text (txt/caption), label (cls); "
            "not in these shards: audio (no flac/wav/ogg)") in out
    counts = dict(re.findall(r"^  (\w+) +(\d+) samples +[\d.]+ samples/s", out, re.M))
    assert counts == {"image": "11", "text": "11", "label": "11"} and written.samples == 11
    assert "server 'audio'" not in out and "skipped 0 samples" in out


def test_demo_names_every_missing_shard_and_reports_an_unreadable_one(tmp_path):
    """A pattern naming shards that do not exist is refused before anything runs (not a run on
    part of the data); a shard cut short is reported as a shard, apart from skipped samples."""
    src = image_folder(tmp_path / "src", per_class=5)
    make_shards(src, tmp_path / "out", max_count=5)
    pattern = str(tmp_path / "out" / "shard-{000000..000003}.tar")
    proc = run_cli(["demo", "--data", pattern, "--quiet"], tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert re.search(r"error: no shard at .*shard-000002\.tar, .*shard-000003\.tar \(2 of the 4 "
                     r"that --data names\)", proc.stderr), proc.stderr
    shard = tmp_path / "out" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:1500])  # cut inside its second header
    proc = run_cli(["demo", "--data", str(tmp_path / "out" / "shard-{000000..000001}.tar"),
                    "--quiet", "--batch-size", "4", "--workers", "2", "--device", "cpu",
                    "--on-error", "skip", "--max-skipped", "0.5"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "skipped 0 samples and 1 unreadable shard(s)" in proc.stdout, proc.stdout
    assert "the shard ends at byte 1500, inside the header at byte 1024" in proc.stdout
    assert re.search(r"epoch \d+: 5 samples delivered, 0 samples skipped and 1 unreadable shard\(s\)"
                     r".*\n  +1 x unreadable shard; first: .*shard-000001\.tar: unreadable shard",
                     proc.stdout), proc.stdout


def test_a_damaged_or_empty_first_shard_does_not_stop_the_demo(tmp_path):
    """The fields are read from the first shard that has a sample: a folder whose first shard (by
    name) is a 0-byte file and whose second holds no files runs, and reports both; when no shard
    has a sample, the error names what was wrong with each (up to three)."""
    src = image_folder(tmp_path / "src", per_class=5)
    make_shards(src, tmp_path / "out", max_count=5)
    (tmp_path / "out" / "a-broken.tar").write_bytes(b"")
    with tarfile.open(tmp_path / "out" / "b-none.tar", "w"):
        pass
    proc = run_cli(["demo", "--data", str(tmp_path / "out"), "--quiet", "--batch-size", "4",
                    "--workers", "2", "--device", "cpu", "--max-skipped", "0.5", "--epochs", "2"],
                   tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("skipped 0 samples and 2 unreadable and 2 empty shard(s) over 2 epochs (each epoch "
            "counts its own)") in proc.stdout, proc.stdout
    assert re.search(r"4 shard\(s\): \S+a-broken\.tar, \.\.\., \S+shard-000001\.tar", proc.stdout)
    assert re.search(r"\(from the first sample of \S+shard-000000\.tar\)", proc.stdout), proc.stdout
    assert "a-broken.tar: unreadable shard: ReadError: the file is 0 bytes long" in proc.stdout
    listed = proc.stdout.split("  skipped, each once (2):\n", 1)[1].splitlines()[:2]  # not 4
    assert [line.split(": ", 1)[0].rsplit("/", 1)[1] for line in listed] == ["a-broken.tar",
                                                                             "b-none.tar"]
    proc = run_cli(["demo", "--data", str(tmp_path / "out" / "[ab]-*.tar"), "--quiet"], tmp_path)
    assert proc.returncode == 1
    assert re.search(r"error: no sample to read the fields from in the first 2 shards: "
                     r".*a-broken\.tar cannot be read: the file is 0 bytes long .*; "
                     r".*b-none\.tar holds no samples", proc.stderr), proc.stderr


def test_demo_without_image_audio_or_video_fails_in_one_line(tmp_path):
    shard = tmp_path / "text-000.tar"
    with tarfile.open(shard, "w") as tar:
        for name in ("k0.txt", "k0.cls"):
            tar.add(__file__, arcname=name)
    proc = run_cli(["demo", "--data", str(shard), "--quiet"], tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == HINT and len(lines) == 2, proc.stderr
    assert re.match(r"mmproxy demo: error: the one sample of .*text-000\.tar holds no field the "
                    r"demo's servers read \(image \(jpg/.*\), audio \(flac/wav/ogg\), video "
                    r"\(mp4/.*\)\), only txt, cls: give --data shards of images, audio or videos$",
                    lines[0])
    proc = run_cli(["demo", "--data", str(tmp_path / "none-{0..3}.tar")], tmp_path)
    assert proc.returncode == 1 and "error: no shard at" in proc.stderr and "none-0.tar" in proc.stderr
    assert "and 1 more (4 of the 4 that --data names)" in proc.stderr


def test_data_expands_as_the_datasets_do_and_still_refuses_missing_shards(tmp_path):
    """--data goes through the datasets' expand(): ``::`` lists and braces with a glob (which it
    used to take as one path, or glob without the braces); a folder whose name holds ``[``; and a
    pattern naming local shards that do not exist is still refused, before anything runs."""
    from mmproxy.apps.data import expand_data, first_sample_fields

    shards = {}
    for folder in ("a", "b", "run[1]"):
        (tmp_path / folder).mkdir()
        for k in range(2):
            shards[folder, k] = str(tmp_path / folder / f"s-{k}.tar")
            write_tar(shards[folder, k], [{"__key__": f"k{k}", "txt": "hello", "cls": 1}])
    assert expand_data(f"{shards['a', 1]}::{shards['b', 0]}") == [shards["a", 1], shards["b", 0]]
    assert expand_data(str(tmp_path / "{a,b}" / "*.tar")) == [
        shards["a", 0], shards["a", 1], shards["b", 0], shards["b", 1]]
    assert expand_data(str(tmp_path / "run[1]")) == [shards["run[1]", 0], shards["run[1]", 1]]
    assert expand_data(f"{tmp_path / 'a'}::{shards['b', 0]}") == [  # a folder among several
        shards["a", 0], shards["a", 1], shards["b", 0]]
    assert expand_data(str(tmp_path / "run[1]" / "*.tar")) == [shards["run[1]", 0], shards["run[1]", 1]]
    assert first_sample_fields(expand_data(str(tmp_path / "a" / "s-{0..1}.tar")))[1] == ["txt", "cls"]
    with pytest.raises(mmproxy.ShardError, match=r"no shard matches .*/c/\*\.tar"):
        expand_data(str(tmp_path / "c" / "*.tar"))
    named = f"{shards['a', 0]}::{tmp_path / 'b' / 's-{1..4}.tar'}"
    with pytest.raises(FileNotFoundError, match=r"^no shard at .*/b/s-2\.tar, .*/b/s-3\.tar, "
                       r".*/b/s-4\.tar \(3 of the 5 that --data names\)$"):
        first_sample_fields(expand_data(named))


# tokenizers ----------------------------------------------------------------------------------


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="a tokenizer is needed.*folder of a saved one"):
        load_tokenizer(None)
    with pytest.raises(ValueError, match="a tokenizer is needed"):
        Tokenize(None, 16, "longest")
    with pytest.raises(ValueError, match="expected a transformers tokenizer.*got int"):
        Tokenize(3, 16, "longest")


def test_a_folder_without_a_tokenizer_and_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match=r"holds no tokenizer \(none of tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "sub" / "tok"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "tok")
    folder = make_tokenizer(tmp_path / "tok")
    for given in (folder, Path(folder)):
        assert Tokenize(given, 8, "longest")({"text": ["a red circle"]})["input_ids"].shape[0] == 1


def test_a_tokenizer_file_is_loaded_not_called_a_missing_folder(tmp_path):
    """``--tokenizer tok/tokenizer.json`` was "tokenizer folder ... does not exist"."""
    import shutil

    folder = Path(make_tokenizer(tmp_path / "tok"))
    for given in (str(folder / "tokenizer.json"), folder / "tokenizer.json"):
        tokenizer = load_tokenizer(given)  # its folder: the pad token of its config too
        assert tokenizer.pad_token == "[PAD]" and tokenizer("a red circle")["input_ids"]
    shutil.copy(folder / "tokenizer.json", tmp_path / "mine.json")  # a lone tokenizers file
    assert load_tokenizer(str(tmp_path / "mine.json"))("a red circle")["input_ids"]
    (tmp_path / "notes.md").write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.md' is a file, but not a tokenizer's"):
        load_tokenizer(str(tmp_path / "notes.md"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer file .*bad\.json' cannot be loaded"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*tokenizer\.json' does not exist"):
        load_tokenizer(str(tmp_path / "gone" / "tokenizer.json"))


NAME = "mmproxy-tests/no-such-tokenizer-7f3c"


def _fails_fast(match, limit=10.0):
    import transformers  # noqa: F401  (its import is not part of the wait)

    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=match) as info:
        load_tokenizer(NAME)
    elapsed = time.perf_counter() - start
    assert elapsed < limit, f"took {elapsed:.1f} s"
    assert "give the folder of a saved tokenizer" in str(info.value)
    return str(info.value)


def test_a_wrong_name_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fails_fast(rf"tokenizer '{NAME}' is neither a local folder nor in the Hugging Face cache, "
                "and HF_HUB_OFFLINE", limit=5)


def test_a_wrong_name_fails_in_seconds_whether_or_not_there_is_a_network(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    _fails_fast(rf"tokenizer '{NAME}' is neither a local folder nor in the Hugging Face cache, "
                "nor downloadable")


def test_an_unreachable_or_silent_hub_fails_within_the_check_time(monkeypatch):
    import mmproxy.datasets.recipes as recipes
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "https_proxy", "HTTPS_PROXY",
                "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    _fails_fast(r"nor downloadable \(127\.0\.0\.1:9 cannot be reached")

    def silent(*args, **kwargs):
        time.sleep(30)
        raise TimeoutError("a server that never answers")

    monkeypatch.setattr(recipes.socket, "create_connection", silent)
    monkeypatch.setattr(recipes, "HUB_CHECK_SECONDS", 0.5)
    _fails_fast(r"127\.0\.0\.1:9 did not answer within 0\.5 s", limit=4)


def test_training_the_demo_tokenizer_prints_nothing(tmp_path, capfd):
    """The tokenizers trainer's progress bar wrote three blank lines into a first demo's log."""
    from mmproxy.testing import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    assert capfd.readouterr().out == ""


# decoder noise -------------------------------------------------------------------------------


def test_decoder_warnings_are_counted_and_every_other_line_goes_through(capfd):
    from mmproxy.apps.noise import DecoderWarnings

    with DecoderWarnings() as noise:
        os.write(2, b"Corrupt JPEG data: 2 extraneous bytes before marker 0xd9\n")
        print("a line of Python's own", file=sys.stderr)
        subprocess.run([sys.executable, "-c", "import os; os.write(2, b'Premature end of JPEG "
                        "file\\nSegmentation fault in a child\\n')"], check=True)
        os.write(2, b"Corrupt JPEG data: 2 extraneous bytes before marker 0xd9\n")
    err = capfd.readouterr().err
    assert err.splitlines() == ["a line of Python's own", "Segmentation fault in a child"]
    assert noise.counts == {"Corrupt JPEG data: N extraneous bytes before marker 0xN": 2,
                            "Premature end of JPEG file": 1}
    assert noise.summary() == [
        "decoder warnings kept off stderr (the files decoded): 3",
        "  2 x Corrupt JPEG data: N extraneous bytes before marker 0xN",
        "  1 x Premature end of JPEG file"]


def test_tiff_decoders_warnings_and_refusals_are_counted_apart(capfd):
    """libtiff's warnings, and DALI's decoders refusing a TIFF before the next one read it (in
    colour), printed hundreds of lines for a folder of real TIFFs."""
    from mmproxy.apps.noise import DecoderWarnings

    with DecoderWarnings() as noise:
        for _ in range(2):
            os.write(2, b'TIFFFetchNormalTag: Warning, IO error during reading of "Tag 42112"; '
                        b'tag ignored.\n')
            os.write(2, b"\x1b[0;31m[ERROR] \x1b[0m[libtiff_decoder] Planar TIFFs are not "
                        b"supported\n")
        os.write(2, b"TIFFFillStrip: Seek error at scanline 4294967295, strip 0.\n")
        os.write(2, b"[ERROR:0@4.648] global loadsave.cpp:1409 imdecode_ imdecode_(''): can't "
                    b"read data\n")
        os.write(2, b"[ WARN:3@4.764] global grfmt_tiff.cpp:122 TIFF_Warning TIFFReadDirectory: "
                    b"Unknown field with tag 42112\n")
        os.write(2, "\n".join(_NOT_NOISE).encode() + b"\n")
    assert capfd.readouterr().err.splitlines() == _NOT_NOISE
    assert noise.summary() == [
        "decoder warnings kept off stderr (the files decoded): 3",
        '  2 x TIFFFetchNormalTag: Warning, IO error during reading of "Tag N"; tag ignored.',
        "  1 x [ WARN:N@N.N] global grfmt_tiff.cpp:N TIFF_Warning TIFFReadDirectory: Unknown field "
        "with tag N",
        "decoder errors kept off stderr (a decoder refused a file and the next was tried; a file "
        "none reads fails its sample, by name): 4",
        "  2 x [ERROR] [libtiff_decoder] Planar TIFFs are not supported",
        "  1 x TIFFFillStrip: Seek error at scanline N, strip N.",
        "  1 x [ERROR:N@N.N] global loadsave.cpp:N imdecode_ imdecode_(''): can't read data"]


# lines like the decoders' that are not theirs: a user's log, exceptions, OpenCV reading a path,
# a GPU decoder failing (not a file refused)
_NOT_NOISE = [
    "train: Warning, loss is NaN at step 120",
    "RuntimeError: Warning, the pipeline was rebuilt",
    "TIFF: wrote 120 pages",
    "TIFFDecodeError: sample 000123 of shard-0003.tar",
    "[ WARN:0@0.5] global loadsave.cpp:248 findDecoder imread_('missing.jpg'): can't open/read file",
    "[ERROR] [nvjpeg_cuda_decoder] Could not allocate device memory",
    "[ERROR] something else"]


def test_decoder_warnings_past_a_pipe_buffer_are_counted_by_kind(capfd):
    """Counts of 3,000 distinct lines filled the result pipe: the filter blocked, no counts."""
    from mmproxy.apps.noise import DecoderWarnings

    start = time.monotonic()
    with DecoderWarnings() as noise:
        for i in range(3000):
            os.write(2, f"Corrupt JPEG data: {i} extraneous bytes before marker 0x{i:x}\n".encode())
        for i in range(150):  # kinds without numbers: a hundred apart, the others together
            name = "".join(chr(ord("a") + int(d)) for d in f"{i:03d}")
            os.write(2, f"libpng warning: {name}: unknown chunk\n".encode())
    assert time.monotonic() - start < 5
    assert capfd.readouterr().err == ""
    assert sum(noise.counts.values()) == 3150 and len(noise.counts) == 101
    assert noise.counts["Corrupt JPEG data: N extraneous bytes before marker 0xN"] == 3000
    assert noise.counts["other decoder warnings"] == 51


def test_the_decoder_warnings_filter_ends_quietly_when_no_one_reads_its_counts():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the command stopped waiting
    proc = subprocess.run(
        [sys.executable, "-c", f"from mmproxy.apps.noise import _filter; _filter({write_end})"],
        input=b"Premature end of JPEG file\n", capture_output=True, pass_fds=(write_end,),
        cwd=ROOT, timeout=60)
    os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, b"")


def test_the_demo_summarises_decoder_noise_instead_of_printing_it(tmp_path):
    """"Corrupt JPEG data: ..." lines from DALI's decoder threads filled stderr."""
    jpeg = image_bytes(synth_image(3, 96, 128))
    scan = jpeg.index(b"\xff\xda")
    scan += 2 + int.from_bytes(jpeg[scan + 2:scan + 4], "big")
    # a marker at the start of the image data: it decodes, with a warning from libjpeg, however
    # little of it the random-crop decoder reads (a fault at the end is not always reached)
    noisy = jpeg[:scan] + b"\xff\xff\xff\xfe" + jpeg[scan + 4:]
    write_tar(tmp_path / "a.tar", [{"__key__": f"k{i}", "jpg": noisy, "cls": 1}
                                   for i in range(48)])
    proc = run_cli(["demo", "--data", str(tmp_path / "a.tar"), "--batch-size", "8",
                    "--workers", "1", "--device", "cpu", "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Corrupt JPEG" not in proc.stderr, proc.stderr
    found = re.search(r"^  decoder warnings kept off stderr \(the files decoded\): (\d+)\n"
                      r"    (\d+) x Corrupt JPEG data: premature end of data segment$",
                      proc.stdout, re.M)
    assert found and found[1] == found[2], proc.stdout
    debug = run_cli(["demo", "--data", str(tmp_path / "a.tar"), "--batch-size", "8",
                     "--workers", "1", "--device", "cpu", "--quiet", "--debug"], tmp_path)
    assert "Corrupt JPEG data: " in debug.stderr  # --debug: every line, as it comes
    assert "decoder warnings" not in debug.stdout


@pytest.mark.timeout(300)
def test_the_bench_runs_its_systems_without_workers(tmp_path):
    """`mmproxy bench --workers 0` (the main process loads) runs mmproxy and PyTorch's loader;
    DALI's proxy, which needs workers, is reported by its own reason."""
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--device", "cpu", "--workers", "0", "--samples", "32", "--epochs", "2",
                     "--data-dir", str(tmp_path / "data"), "--systems", "mmproxy,torch,dali-proxy",
                     "--json", str(out)]) == 0
    systems = json.loads(out.read_text())["results"]["image"]["systems"]
    assert systems["mmproxy"]["samples"] == systems["torch"]["samples"] == 32
    assert "num_workers" in systems["dali-proxy"]["error"]
