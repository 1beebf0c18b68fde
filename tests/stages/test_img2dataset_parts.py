"""img2dataset's pieces as an ingest worker imports them: without the package's command, torch or
pandas, and the shard written in img2dataset's layout by capline's sample writer."""
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.ingest.img2dataset_parts import TarSampleWriter

ROOT = Path(__file__).resolve().parents[2]

SCHEMA = pa.schema([("uid", pa.string()), ("key", pa.string()), ("status", pa.string()),
                    ("error_message", pa.string()), ("width", pa.int64())])


def _write_three(folder):
    """Two downloaded images and a failed URL through the writer, as img2dataset's downloader calls it."""
    w = TarSampleWriter(3, str(folder), True, 5, SCHEMA, "jpg")
    w.write(b"\xff\xd8jpeg-a", "000030000", "a red bus", {"uid": "a", "key": "000030000", "status": "success",
                                                           "error_message": None, "width": 4})
    w.write(None, "000030001", "gone", {"uid": "b", "key": "000030001", "status": "failed_to_download",
                                        "error_message": "http 404", "width": None})
    w.write(b"\xff\xd8jpeg-c", "000030002", None, {"uid": "c", "key": "000030002", "status": "success",
                                                    "error_message": None, "width": 7})
    w.close()


def test_the_sample_writer_writes_img2datasets_layout_and_a_row_per_url(tmp_path):
    _write_three(tmp_path)
    with tarfile.open(tmp_path / "00003.tar") as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == ["000030000.jpg", "000030000.json", "000030000.txt",
                         "000030002.jpg", "000030002.json", "000030002.txt"]
        assert {m.mtime for m in members} == {0} and {m.mode for m in members} == {0o444}
        assert tar.extractfile("000030000.jpg").read() == b"\xff\xd8jpeg-a"
        assert tar.extractfile("000030000.txt").read() == b"a red bus"
        assert tar.extractfile("000030002.txt").read() == b""
        assert json.loads(tar.extractfile("000030002.json").read())["width"] == 7
    rows = pq.read_table(tmp_path / "00003.parquet")
    assert rows.schema == SCHEMA
    assert rows.column("uid").to_pylist() == ["a", "b", "c"]
    assert rows.column("error_message").to_pylist() == [None, "http 404", None]
    # the same samples again: the same bytes (no clock in the headers)
    again = tmp_path / "again"
    again.mkdir()
    _write_three(again)
    assert (again / "00003.tar").read_bytes() == (tmp_path / "00003.tar").read_bytes()


@pytest.mark.slow
def test_an_ingest_worker_imports_no_torch_pandas_or_webdataset_and_img2dataset_still_works_whole():
    code = """
import sys
from stages.ingest.stage import IngestConfig, _downloader
d = _downloader(IngestConfig(), ())
print(sorted(m for m in ("torch", "pandas", "webdataset", "img2dataset.main", "wandb.sdk") if m in sys.modules))
import img2dataset
from img2dataset import download
print(callable(download), callable(img2dataset.main), type(d).__mro__[1].__module__)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "NO_ALBUMENTATIONS_UPDATE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "[]"
    assert lines[1] == "True True img2dataset.downloader"
