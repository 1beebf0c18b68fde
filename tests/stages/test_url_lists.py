"""Hostile or broken URL lists: invalid UTF-8 is a verdict per row, never a "b'...'" caption or a
crash; duplicate keys and keys that cannot name a tar member are refused before any download,
naming the rows; a missing caption (null, NaN) is missing, not "nan". The source stage's task is
called directly here (no Ray): it is plain Python that writes partitions through a Storage."""
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import capline
from pipeline.config import load_config
from stages.base import read_ledger
from stages.dataplane import Storage
from stages.source.stage import _read_file_task
from infra.errors import UserError


def _source(tmp_path, path, *overrides):
    cfg = load_config(None, ["source.kind=urls", f"source.path={path}", *overrides]).source
    storage = Storage.local(tmp_path / "run")
    parts = _read_file_task(storage, str(path), cfg)
    (tmp_path / "run" / "source").mkdir(parents=True, exist_ok=True)
    import json

    (tmp_path / "run" / "source" / "parts.json").write_text(json.dumps([p.to_json() for p in parts]))
    # details name a text file's line (1-based, after its header) and a Parquet file's row (1-based):
    # here, both as the 0-based row (these files have no malformed lines)
    first = 2 if cfg.header and not cfg.columns else 1

    def row(detail: str) -> str:
        where = detail.split(":")[0]
        n = int(where.rsplit(" ", 1)[1])
        return str(n - first) if " line " in where else str(n - 1)

    return {row(r["detail"]): r for r in read_ledger(storage, "source").to_pylist()}


def test_malformed_lines_are_dropped_with_their_line_and_the_rest_kept(tmp_path):
    """A CC3M-style TSV (no header, CRLF) with a URL missing its caption, a caption holding a tab and
    an empty line: each bad line is a dropped sample naming its line, every other row is kept."""
    path = tmp_path / "Train_GCC-training.tsv"
    path.write_bytes(b"a red square\thttp://a.example/1.jpg\r\n"
                     b"http://a.example/2.jpg\r\n"                           # line 2: no caption
                     b"a blue\tcircle\thttp://a.example/3.jpg\r\n"          # line 3: a tab in the caption
                     b"\r\n"                                                 # line 4: empty
                     b"a green star\thttp://a.example/5.jpg\r\n")
    cfg = load_config(None, ["source.kind=urls", f"source.path={path}", "source.header=false",
                             "source.url_col=1", "source.caption_col=0"]).source
    storage = Storage.local(tmp_path / "run")
    parts = _read_file_task(storage, str(path), cfg)
    assert sum(p.n_in for p in parts) == 5 and sum(p.kept for p in parts) == 2
    (tmp_path / "run" / "source" / "parts.json").write_text(__import__("json").dumps([p.to_json() for p in parts]))
    by_line = {int(r["detail"].split(" line ")[1].split(":")[0]): r for r in read_ledger(storage, "source").to_pylist()}
    assert sorted(by_line) == [1, 2, 3, 4, 5]
    assert by_line[1]["verdict"] == by_line[5]["verdict"] == "kept" and by_line[5]["caption"] == "a green star"
    assert by_line[5]["url"] == "http://a.example/5.jpg"                       # no \r left on it
    for line, got in ((2, "1 columns where 2"), (3, "3 columns where 2")):
        assert by_line[line]["reason"] == "malformed_row:columns" and got in by_line[line]["detail"], by_line[line]
    assert by_line[4]["reason"] == "malformed_row:missing_url"
    assert "Train_GCC-training.tsv line 3: 3 columns" in by_line[3]["detail"]


def _bad_utf8_strings(values: list[bytes]) -> pa.Array:
    """A string array holding bytes that are not UTF-8, as a broken writer leaves them in Parquet."""
    raw = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())


def test_invalid_utf8_in_a_csv_is_a_verdict_for_its_row(tmp_path):
    path = tmp_path / "list.csv"
    path.write_bytes(b"url,caption\nhttp://a.example/1.jpg,a red square\n"
                     b"http://a.example/2.jpg,caf\xe9 au lait\nhttp://a.example/3.jpg,a blue circle\n")
    rows = _source(tmp_path, path)
    assert rows["0"]["caption"] == "a red square" and rows["2"]["caption"] == "a blue circle"
    assert rows["1"]["verdict"] == "dropped" and rows["1"]["reason"] == "malformed_row:invalid_utf8"
    assert "caption is not UTF-8" in rows["1"]["detail"]
    assert not any(r["caption"].startswith("b'") for r in rows.values())


def test_invalid_utf8_in_parquet_does_not_crash(tmp_path):
    path = tmp_path / "list.parquet"
    pq.write_table(pa.table({"url": _bad_utf8_strings([b"http://a.example/1.jpg", b"http://a.example/\xff.jpg"]),
                             "caption": ["one", "two"]}), path)
    rows = _source(tmp_path, path)
    assert rows["0"]["verdict"] == "kept"
    assert rows["1"]["reason"] == "malformed_row:invalid_utf8" and "url is not UTF-8" in rows["1"]["detail"]


def test_a_missing_caption_is_empty_not_nan(tmp_path):
    path = tmp_path / "list.parquet"
    pq.write_table(pa.table({"url": [f"http://a.example/{i}.jpg" for i in range(3)],
                             "caption": pa.array([1.5, float("nan"), None], pa.float64())}), path)
    rows = _source(tmp_path, path)
    assert [rows[str(i)]["caption"] for i in range(3)] == ["1.5", "", ""]
    # numbers-looking captions in a CSV stay the text they were
    csv = tmp_path / "nums.csv"
    csv.write_text("url,caption\nhttp://a.example/1.jpg,007\nhttp://a.example/2.jpg,NaN\n")
    rows = _source(tmp_path, csv)
    assert rows["0"]["caption"] == "007" and rows["1"]["caption"] == "NaN"


def test_duplicate_keys_are_refused_naming_the_rows(tmp_path):
    path = tmp_path / "list.csv"
    path.write_text("id,url,caption\na,http://x.example/1.jpg,one\na,http://x.example/2.jpg,two\n"
                    "a_1,http://x.example/3.jpg,three\nb,http://x.example/4.jpg,four\nb,http://x.example/5.jpg,five\n")
    with pytest.raises(UserError, match=r"2 duplicate id value\(s\): rows 0 and 1 \('a'\), rows 3 and 4 \('b'\)"):
        _source(tmp_path, path, "source.key_col=id")


@pytest.mark.parametrize("key", ["k" * 91, "has space", "tab\there", "ünïcode"])
def test_keys_that_cannot_name_a_tar_member_are_refused(tmp_path, key):
    path = tmp_path / "list.parquet"
    pq.write_table(pa.table({"id": ["fine", key], "url": ["http://x.example/1.jpg", "http://x.example/2.jpg"],
                             "caption": ["one", "two"]}), path)
    with pytest.raises(UserError, match="1 id value\\(s\\) cannot be sample keys .* row 1"):
        _source(tmp_path, path, "source.key_col=id")


@pytest.mark.slow
def test_the_cli_refuses_duplicate_keys_before_downloading(tmp_path):
    path = tmp_path / "list.csv"
    path.write_text("id,url,caption\na,http://127.0.0.1:9/1.jpg,one\na,http://127.0.0.1:9/2.jpg,two\n")
    out = capline("run", "--run-dir", str(tmp_path / "run"), "--set", "source.kind=urls", "--set", f"source.path={path}",
                  "--set", "source.key_col=id", "--set", "stages.dedup.eval_sets=[]", "--set", "train.steps=0")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "duplicate id value(s): rows 0 and 1 ('a')" in out.stderr
    assert "ingest: running" not in out.stdout


def test_explain_shows_escape_sequences_from_the_data_instead_of_sending_them():
    from pipeline.inspect_run import format_explain

    text = format_explain("k1", [
        {"stage": "(input)", "detail": "url http://x.example/\x1b[2J\x1b]0;pwned\x07.jpg"},
        {"stage": "ingest", "verdict": "dropped", "reason": "http_404", "score": None,
         "detail": "HTTP Error 404: \x1b[31mNot Found\u202e\r"}])
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "\r" not in text
    assert "\\x1b[2J" in text and "\\u202e" in text


CC3M_ROWS = [("a tabby cat asleep on a sofa", "http://a.example/1.jpg"),
             ("clip art of analogue clock", "http://a.example/2.jpg"),
             ("a red bicycle leaning on a wall", "http://a.example/3.jpg")]


def _cc3m(path, opener=open):
    with opener(path, "wt") as f:
        f.write("".join(f"{c}\t{u}\n" for c, u in CC3M_ROWS))


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz", ".tsv.zst"])
def test_a_headerless_tsv_keeps_its_first_row_columns_by_position(tmp_path, suffix):
    import gzip

    path = tmp_path / f"cc3m{suffix}"
    if suffix == ".tsv.zst":
        import pyarrow as pa

        with pa.output_stream(str(path), compression="zstd") as out:
            out.write("".join(f"{c}\t{u}\n" for c, u in CC3M_ROWS).encode())
    else:
        _cc3m(path, gzip.open if suffix.endswith(".gz") else open)
    rows = _source(tmp_path, path, "source.header=false", "source.url_col=1", "source.caption_col=0")
    assert [(r["caption"], r["url"]) for r in (rows[str(i)] for i in range(3))] == CC3M_ROWS   # row 0 kept
    named = _source(tmp_path / "named", path, "source.header=false", "source.columns=[caption,url]")
    assert named["0"]["url"] == CC3M_ROWS[0][1]


def test_a_headerless_file_read_with_a_header_says_how_to_fix_it(tmp_path):
    from stages.source.stage import check_url_list

    path = tmp_path / "cc3m.tsv"
    _cc3m(path)
    cfg = load_config(None, ["source.kind=urls", f"source.path={path}"]).source
    with pytest.raises(UserError, match="set source.header: false and name columns by position"):
        check_url_list(cfg)
    with pytest.raises(UserError, match="source.url_col: column position 5, but the file has 2"):
        check_url_list(load_config(None, ["source.kind=urls", f"source.path={path}", "source.header=false",
                                          "source.url_col=5"]).source)


def test_init_detects_a_headerless_compressed_list(tmp_path):
    import gzip

    from pipeline.init_config import detect

    path = tmp_path / "cc3m.tsv.gz"
    _cc3m(path, gzip.open)
    found = detect(path)
    assert (found["url_col"], found["caption_col"], found["header"], found["format"]) == (1, 0, False, "tsv")
    assert found["rows_seen"] == 3                 # the first line counted as a row


def test_init_writes_the_one_measured_language_default(tmp_path):
    from pipeline.init_config import detect, write_config
    from stages.filters.language import LanguageConfig

    path = tmp_path / "list.csv"
    path.write_text("url,caption\n" + "".join(f"http://a.example/{i}.jpg,a photo of thing {i}\n" for i in range(5)))
    write_config(path, tmp_path / "cfg.yaml", detect(path))
    cfg = load_config(tmp_path / "cfg.yaml", [])
    assert cfg.stages.language.min_confidence == LanguageConfig().min_confidence == 0.1


def test_init_names_the_malformed_lines_it_read_and_uses_a_similarity_column(tmp_path):
    path = tmp_path / "laion.tsv"
    lines = ["url\tcaption\tsimilarity"] + [f"http://a.example/{i}.jpg\ta photo of thing {i}\t0.3{i}" for i in range(6)]
    lines[3] = "http://a.example/2.jpg\tno similarity here"            # line 4: one column short
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "laion.yaml"
    proc = capline("init", str(path), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "1 line(s) of those read are not rows of the list (line 4: too few or too many columns)" in proc.stdout
    text = out.read_text()
    assert "# 1 line(s) of those read are not rows" in text and "'similarity' column is the score" in text
    cfg = load_config(out, [])
    assert (cfg.stages.clip_score.scorer, cfg.stages.clip_score.column, cfg.stages.clip_score.threshold) == \
        ("column", "similarity", 0.28)


def test_a_float_id_column_keeps_integer_ids(tmp_path):
    path = tmp_path / "list.parquet"
    pq.write_table(pa.table({"url": ["http://a.example/1.jpg", "http://a.example/2.jpg"],
                             "caption": ["one", "two"], "SAMPLE_ID": pa.array([1000056.0, 7.5], pa.float64())}), path)
    rows = _source(tmp_path, path, "source.key_col=SAMPLE_ID")
    assert rows["0"]["key"] == "1000056" and rows["1"]["key"] == "7_5"


@pytest.mark.slow   # 1.6-5.5 s: kept out of the fast set (under a minute)
def test_capline_check_names_each_mistake_before_anything_downloads(tmp_path):
    """A misspelled score column, a URL in allow_hosts, an unpinned TorchScript descriptor: each a
    one-line error naming the setting and the value to use; the corrected config passes."""
    path = tmp_path / "laion.tsv"
    path.write_text("url\tcaption\tsimilarity\nhttp://a.example/1.jpg\ta photo of a cat\t0.31\n")
    base = ["--set", "source.kind=urls", "--set", f"source.path={path}", "--set", "stages.dedup.eval_sets=[]",
            "--set", "stages.clip_score.scorer=column", "--set", "stages.clip_score.keep_fraction=null",
            "--set", "stages.clip_score.threshold=0.28"]
    for extra, said in ((["stages.clip_score.column=similarty"], "has no column 'similarty'; did you mean 'similarity'?"),
                        (["stages.clip_score.column=similarity", "stages.ingest.allow_hosts=['http://127.0.0.1:8600/']"],
                         "'http://127.0.0.1:8600/' is not host[:port]; write '127.0.0.1:8600'")):
        proc = capline("check", *base, *(x for e in extra for x in ("--set", e)))
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    ok = capline("check", *base, "--set", "stages.clip_score.column=similarity")
    assert ok.returncode == 0 and "is ready to run" in ok.stdout, ok.stderr
    # an evaluation set whose caption column holds bytes that are not UTF-8: named before the run
    pq.write_table(pa.table({"caption": pa.array([b"fine", b"bad \xff"], pa.binary()).view(pa.string()),
                             "path": ["a.jpg", "b.jpg"]}), tmp_path / "eval.parquet")
    sets = f"stages.dedup.eval_sets=[{{name: held, kind: parquet, path: {tmp_path / 'eval.parquet'}, caption_col: caption}}]"
    told = capline("check", *base[:-8], *base[-6:], "--set", "stages.clip_score.column=similarity", "--set", sets)
    assert told.returncode == 0 and "note: evaluation set held: 1 caption(s)" in told.stdout \
        and "not valid UTF-8 (first: row 1)" in told.stdout, told.stdout + told.stderr


def test_two_lists_that_differ_only_in_compression_get_two_runs_and_a_batch_that_fits(tmp_path):
    from pipeline.dataset_card import open_clip_example
    from pipeline.init_config import detect, write_config

    names = set()
    for suffix in (".tsv", ".tsv.gz"):
        path = tmp_path / f"foo{suffix}"
        _cc3m(path, __import__("gzip").open if suffix.endswith(".gz") else open)
        names.add(write_config(path, tmp_path / f"{suffix}.yaml", detect(path)))
    assert names == {"foo-tsv", "foo-tsv-gz"}
    shards = lambda n: {"artifacts": {"shard": {"shards": [{"samples": n}]}}}   # noqa: E731
    assert "--batch-size 64 " in open_clip_example(shards(72))        # not 256 for 72 samples
    assert "--batch-size 256 " in open_clip_example(shards(10**6))


@pytest.mark.slow   # 1.6-5.5 s: kept out of the fast set (under a minute)
def test_init_writes_a_data_build_that_says_why_and_leaves_private_hosts_to_the_user(tmp_path):
    path = tmp_path / "mixed.tsv"
    path.write_text("url\tcaption\nhttp://127.0.0.1:8600/a.jpg\ta photo of a cat\nhttp://example.com/b.jpg\ta dog on grass\n")
    out = tmp_path / "mixed.yaml"
    proc = capline("init", str(path), "--output", str(out))
    assert proc.returncode == 0 and "private or loopback hosts (127.0.0.1:8600)" in proc.stdout, proc.stdout
    text = out.read_text()
    assert "# ingest: {allow_hosts: [\"127.0.0.1:8600\"]}" in text          # written, but left to the user
    cfg = load_config(out, [])
    assert cfg.stages.ingest.allow_hosts == [] and cfg.train.steps == 0 and cfg.stages.dedup.eval_sets == []
    assert "# train: {model: cappa" in text and "DataComp's basic filter" in text
    assert capline("check", str(out)).returncode == 0


def test_a_folder_reads_every_documented_compression_and_names_what_it_cannot(tmp_path):
    """.csv.zst, .csv.bz2 and .jsonl.gz were skipped in silence ('1 file(s)'), and --incremental never
    saw them; a file that is no list is named, not skipped."""
    import bz2
    import gzip
    import json as _json

    from stages.source.stage import check_url_list, partition_files

    folder = tmp_path / "lists"
    folder.mkdir()
    (folder / "a.csv").write_text("url,caption\nhttp://a.example/1.jpg,one\n")
    with bz2.open(folder / "b.csv.bz2", "wt") as f:
        f.write("url,caption\nhttp://a.example/2.jpg,two\n")
    with gzip.open(folder / "c.jsonl.gz", "wt") as f:
        f.write(_json.dumps({"url": "http://a.example/3.jpg", "caption": "three"}) + "\n")
    with pa.output_stream(str(folder / "d.csv.zst"), compression="zstd") as out:
        out.write(b"url,caption\nhttp://a.example/4.jpg,four\n")
    cfg = load_config(None, ["source.kind=urls", f"source.path={folder}"]).source
    assert [p.name for p in partition_files(cfg)] == ["a.csv", "b.csv.bz2", "c.jsonl.gz", "d.csv.zst"]
    check_url_list(cfg)
    rows = {r["url"] for name in ("a.csv", "b.csv.bz2", "c.jsonl.gz", "d.csv.zst")
            for r in _source(tmp_path / name, folder / name).values()}
    assert rows == {f"http://a.example/{i}.jpg" for i in range(1, 5)}
    (folder / "notes.txt").write_text("my notes")
    with pytest.raises(UserError, match="notes.txt is not a URL list capline reads"):
        partition_files(cfg)


def test_list_columns_named_like_capline_scores_are_prefixed_not_posing_as_them(tmp_path):
    import json as _json

    path = tmp_path / "list.parquet"
    pq.write_table(pa.table({"url": ["http://a.example/1.jpg"], "caption": ["one"], "clip_score": [0.99],
                             "language": ["xx"], "language_score": [1.0], "LICENSE": ["CC-BY"]}), path)
    notes = _json.loads(_source(tmp_path, path)["0"]["notes"])
    assert notes.pop("source_detail") == "list.parquet row 1"          # the source stage's own note
    assert notes == {"source_clip_score": 0.99, "source_language": "xx", "source_language_score": 1.0,
                     "LICENSE": "CC-BY"}


def test_what_a_sample_carries_from_its_list_is_capped(tmp_path):
    """A 1.2 MB Parquet put 289 KB of JSON into every sample: now source.carried_bytes per sample
    (values past it left out, counted), and more than 64 carried columns is refused naming the setting."""
    import json as _json

    wide = {f"c{i:03d}": ["x" * 900] for i in range(40)}                # 36 KB a row
    path = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"url": ["http://a.example/1.jpg"], "caption": ["one"], **wide}), path)
    notes = _json.loads(_source(tmp_path, path)["0"]["notes"])
    assert len(_json.dumps(notes).encode()) <= 4096 + 200
    assert notes["source_left_out"] == 40 - sum(1 for k in notes if k.startswith("c"))
    many = tmp_path / "many.parquet"
    pq.write_table(pa.table({"url": ["http://a.example/1.jpg"], "caption": ["one"],
                             **{f"c{i}": [i] for i in range(70)}}), many)
    with pytest.raises(UserError, match="would carry 70 columns into every sample .at most 64.; name the ones"):
        _source(tmp_path / "m", many)


def test_explain_takes_the_lists_own_id_as_written(tmp_path):
    from pipeline.inspect_run import explain

    path = tmp_path / "list.parquet"
    pq.write_table(pa.table({"url": ["http://a.example/1.jpg"], "caption": ["one"], "id": ["img.001"]}), path)
    rows = _source(tmp_path, path, "source.key_col=id")
    assert rows["0"]["key"] == "img_001"                 # a key names tar members: '.' becomes '_'
    (tmp_path / "run" / "manifest.json").write_text("{}")
    got = explain(tmp_path / "run", "img.001")           # as the list has it
    assert [r["key"] for r in got if r["stage"] == "source"] == ["img_001"]


def test_the_names_list_columns_may_not_take_are_every_stages_notes():
    from stages.registry import STAGES
    from stages.source.stage import STAGE_NOTES

    assert {n for stage in STAGES for n in stage.note_names() if n} <= STAGE_NOTES


def test_preflight_reads_a_lists_header_in_its_own_thread(tmp_path):
    """The preflight of a URL list leaves no Arrow thread behind: a run it refuses ends at once, and
    Arrow's read-ahead threads still starting then have aborted the process at exit (apache/arrow#34314,
    once in CI: exit -6 after the one-line error). Checked in a fresh process, whose threads are counted
    before and after; the header it reads is the one Arrow's reader reads (quotes, a BOM, a TSV)."""
    import subprocess
    import sys

    lists = {"quoted.csv": b'\xef\xbb\xbf"url","cap,tion"\nhttp://a/1.jpg,a cat\n' + b"http://a/2.jpg,a dog\n" * 50000,
             "tabs.tsv": b"url\tcaption\nhttp://a/1.jpg\ta cat\n"}
    for name, data in lists.items():
        (tmp_path / name).write_bytes(data)
    probe = (
        "import os, sys, pyarrow, pyarrow.csv\n"
        "from pathlib import Path\n"
        "from stages.source.stage import _read_columns\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "names = [_read_columns(Path(p), 'auto') for p in sys.argv[1:]]\n"
        "print(before, len(os.listdir('/proc/self/task')), names)\n")
    out = subprocess.run([sys.executable, "-c", probe, *(str(tmp_path / n) for n in lists)], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2]).stdout.split(maxsplit=2)
    assert out[0] == out[1], f"threads before and after the header read: {out}"
    assert out[2].strip() == "[['url', 'cap,tion'], ['url', 'caption']]"


def test_a_header_that_is_not_utf8_or_an_empty_list_is_refused_by_name(tmp_path):
    from stages.source.stage import check_url_list

    for name, data, why in (("bad.csv", b"url,cap\xfftion\nhttp://a/1.jpg,b\n", "its header is not UTF-8"),
                            ("empty.csv", b"\n\n", "the file is empty")):
        (tmp_path / name).write_bytes(data)
        cfg = load_config(None, ["source.kind=urls", f"source.path={tmp_path / name}"]).source
        with pytest.raises(UserError, match=why):
            check_url_list(cfg)
    # bytes that are not UTF-8 in a row are that row's verdict later, not the list's
    (tmp_path / "rows.csv").write_bytes(b"url,caption\nhttp://a/1.jpg,\xff\xfe\n")
    check_url_list(load_config(None, ["source.kind=urls", f"source.path={tmp_path / 'rows.csv'}"]).source)
