"""mmproxy bench on a user's shards: what each system can read is said, not failed."""

from __future__ import annotations

import argparse
import tarfile

from mmproxy.apps.bench.systems import SYSTEMS, Setup


def test_the_reader_says_it_reads_no_gzip_shards(tmp_path):
    plain, packed = tmp_path / "a.tar", tmp_path / "b.tar.gz"
    for path, mode in ((plain, "w"), (packed, "w:gz")):
        with tarfile.open(path, mode):
            pass
    setup = Setup(argparse.Namespace(), "image", [str(plain), str(packed)], tmp_path, False, None, 4)
    result = SYSTEMS["dali-reader"].run(setup)
    assert result == {"error": "not run: DALI's webdataset reader reads plain tars only, and 1 of "
                               f"the shards are gzip (e.g. {packed})"}
