"""Unit level: the pieces behind what users see (capline init, progress, eval table, drop details,
the json names of filter scores, argument checks that come before Ray)."""
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import capline
from pipeline.init_config import detect
from infra.errors import UserError


@pytest.mark.slow   # capline processes (~1.5 s each)
def test_init_finds_url_caption_and_key_columns_in_csv_and_parquet(tmp_path):
    rows = {"id": ["a1", "a2", "a3"], "alt": ["a red bird on a branch", "two dogs", "a bowl of soup on a table"],
            "link": ["https://example.com/1.jpg", "http://example.org/2.png", "https://example.net/3"],
            "tag": ["x", "y", "z"], "w": [3, 4, 5]}
    pq.write_table(pa.table(rows), tmp_path / "list.parquet")
    found = detect(tmp_path / "list.parquet")
    assert (found["url_col"], found["caption_col"], found["key_col"], found["format"]) == ("link", "alt", "id", "parquet")
    csv = tmp_path / "list.csv"
    csv.write_text("link,title\n" + "".join(f"https://e.com/{i}.jpg,photo number {i} of a cat\n" for i in range(5)))
    out = tmp_path / "cfg.yaml"
    proc = capline("init", str(csv), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    from pipeline.config import load_config

    cfg = load_config(out)
    assert (cfg.source.kind, cfg.source.url_col, cfg.source.caption_col, cfg.source.key_col) == ("urls", "link", "title", None)
    assert capline("init", str(csv), "--output", str(out)).returncode == 2   # never overwrites
    # a folder of parts in several formats (LAION's, DataComp's, a dataset line's): one config for all
    import gzip

    parts = tmp_path / "parts"
    parts.mkdir()
    pq.write_table(pa.table({"url": ["https://e.com/a.jpg"] * 3, "caption": ["a photo of a red cat"] * 3}),
                   parts / "part-0.parquet")
    with gzip.open(parts / "part-1.tsv.gz", "wt") as f:
        f.write("url\tcaption\n" + "".join(f"https://e.com/{i}.jpg\ta dog on the grass {i}\n" for i in range(4)))
    proc = capline("init", str(parts), "--output", str(tmp_path / "parts.yaml"))
    assert proc.returncode == 0 and "2 list files in" in proc.stdout, proc.stdout + proc.stderr
    cfg = load_config(tmp_path / "parts.yaml")
    assert (cfg.source.path, cfg.source.format, cfg.source.url_col) == (str(parts.resolve()), "auto", "url")
    assert "FILE_OR_FOLDER" in capline("init", "--help").stdout


def test_init_says_what_it_could_not_find(tmp_path):
    p = tmp_path / "nourls.csv"
    p.write_text("a,b\nhello world,1\n")
    with pytest.raises(UserError, match="no column holds mostly http"):
        detect(p)
    proc = capline("init", str(tmp_path / "missing.csv"))
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_progress_off_a_terminal_logs_rate_and_eta_at_most_every_few_seconds(monkeypatch):
    from infra.progress import Progress

    lines = []
    monkeypatch.setenv("CAPLINE_PROGRESS", "0")
    p = Progress("ingest", 4, lines.append, unit="shards", every=0.05)
    p.update(1)
    p.update(2)         # too soon after the last line: nothing
    time.sleep(0.06)
    p.update(3, loss=1.25)
    p.update(4)         # the last: said by close(), once
    p.close()
    assert len(lines) == 2
    assert lines[0].startswith("ingest: 3/4 shards, ") and "ETA " in lines[0] and "loss 1.25" in lines[0]
    assert lines[1].startswith("ingest: 4/4 shards") and lines[1].count("ETA 0s") == 1


def test_failure_details_are_the_same_on_every_run():
    from stages.ingest.fetch import Failure, failure_of

    a = failure_of("failed_to_download", "capline:undecodable_image: UnidentifiedImageError: cannot identify "
                   "image file <_io.BytesIO object at 0x7fbd142d2e80>")
    b = failure_of("failed_to_download", "capline:undecodable_image: UnidentifiedImageError: cannot identify "
                   "image file <_io.BytesIO object at 0x7f0000000001>")
    assert a == b == Failure("undecodable_image", "UnidentifiedImageError: cannot identify image file <_io.BytesIO>")
    assert failure_of("failed_to_download", None) == Failure("download_error", "")
    assert failure_of("failed_to_download", "HTTP Error 404: Not Found").reason == "http_404"


def test_ingest_size_bounds_moved_to_basic_say_where():
    from pipeline.config import load_config

    with pytest.raises(UserError, match="stages.basic.min_image_side"):
        load_config(None, ["stages.ingest.min_image_size=16"])


def test_scores_get_the_names_users_read_in_the_shards_json():
    from stages.dataplane import add_notes
    from stages.registry import by_name

    def notes(stage):
        return add_notes(t, stage, by_name(stage).note_names()).column("notes")[0].as_py()

    t = pa.table({"key": ["a"], "verdict": ["kept"], "score": [0.5], "detail": ["en"], "notes": [None]})
    assert json.loads(notes("clip_score")) == {"clip_score": 0.5, "clip_score_detail": "en"}
    assert json.loads(notes("language")) == {"language_score": 0.5, "language": "en"}
    assert json.loads(notes("basic")) == {"basic_score": 0.5, "basic_detail": "en"}
    assert notes("ingest") is None


def test_evaluation_rows_have_every_shot_count_and_headline_metrics():
    from trainers.evaluation.run import eval_rows, headline, summary

    results = {"model": "cap", "size": "tiny", "skipped": ["zeroshot: no datasets in eval.zeroshot"],
               "fewshot": {"digits": {"1": {"mean": 0.2, "std": 0.01}, "10": {"mean": 0.5, "std": 0.02}}},
               "fewshot_map": {"digits": {"10": {"mean": 0.6, "std": 0.03}}},
               "captioning": {"coco": {"greedy": {"cider": 0.7, "bleu4": 0.1}, "lit_greedy": {"cider": 0.4, "bleu4": 0.0}}},
               "zeroshot": {"shapes": {"classes": 3, "ar": {"accuracy": 0.4, "seconds_per_1000_images": 1.0}}},
               "wordorder": {"demo": {"precision_at_1": {"accuracy": 0.3, "n": 5},
                                       "pairwise": {"a": {"accuracy": 0.6, "n": 5}, "b": {"accuracy": 0.8, "n": 5}}}}}
    rows = eval_rows(results)
    assert [(r["variant"], r["shots"]) for r in rows if r["task"] == "few-shot"] == [("linear", 1), ("linear", 10),
                                                                                   ("map", 10)]
    assert headline(rows) == pytest.approx({
        "eval.fewshot.digits.linear.10shot": 0.5, "eval.fewshot.digits.map.10shot": 0.6,
        "eval.captioning.coco.greedy.cider": 0.7, "eval.captioning.coco.lit_greedy.cider": 0.4,
        "eval.zeroshot.shapes.ar": 0.4, "eval.wordorder.demo.precision_at_1": 0.3})
    text = summary(results)
    assert "1-shot" in text and "10-shot" in text and "50.0%" in text and "20.0%" in text and "MAP-head" in text
    assert "skipped: zeroshot: no datasets" in text


@pytest.mark.slow   # capline processes (~1.5 s each)
def test_train_and_experiment_check_their_arguments_before_ray_starts(tmp_path):
    proc = capline("train", "--run-dir", str(tmp_path / "nothing"), timeout=60)
    assert proc.returncode == 2 and f"{tmp_path / 'nothing'}: no capline run folder there" in proc.stderr
    assert not (tmp_path / "nothing").exists()            # nothing made where nothing was
    assert "ray:" not in proc.stdout
    for args, needle in ((["--budget", "huge"], "--budget huge"), (["--models", "cap,clipp"], "--models clipp"),
                         ([], "no final shards")):
        proc = capline("experiment", "paper", "--run-dir", str(tmp_path), *args, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr and "ray:" not in proc.stdout, (args, proc.stderr)


@pytest.mark.slow   # capline processes (~1.5 s each)
def test_a_run_folders_config_that_no_longer_loads_says_what_to_do(tmp_path):
    (tmp_path / "config.yaml").write_text("name: old\nstages:\n  ingest: {min_image_size: 16}\n")
    proc = capline("train", "--run-dir", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "the run folder's own config" in proc.stderr
    assert "stages.basic.min_image_side" in proc.stderr and "capline train CONFIG --run-dir" in proc.stderr


def test_explain_json_escapes_controls_and_bidi_overrides(tmp_path, monkeypatch, capsys):
    """A caption is the web's text: C1 controls (\\x9b is a terminal's CSI) and bidi overrides must
    reach a terminal or a log escaped, as JSON can say them, never raw."""
    import pipeline.cli as cli
    import pipeline.inspect_run as inspect_run

    hostile = "a cat\x9b31m on a mat \u202egnp.exe\u2066 \x1b]0;owned\x07"
    rows = [{"stage": "(input)", "verdict": "", "reason": "", "score": None, "detail": f"caption={hostile!r}",
             "url": "http://example.com/x.jpg", "caption": hostile}]
    monkeypatch.setattr(cli, "_run_storage", lambda where: tmp_path)
    monkeypatch.setattr(inspect_run, "explain", lambda where, key: rows)
    assert cli.main(["explain", str(tmp_path), "k1", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.isascii() and "\\u202e" in out and "\\u009b" in out
    assert json.loads(out)[0]["caption"] == hostile


@pytest.mark.slow   # Ray tasks
def test_drift_compares_two_runs_ledgers_in_tasks_bucketed_by_key(tmp_path, ray_local, monkeypatch):
    """Two runs' ingest ledgers (several partitions each, keys in other partitions in the other
    run): died, changed and revived keys, found by tasks per key bucket; drift.json's lists are
    capped, every key is in drift/ as Parquet."""
    from infra.storage import Storage
    from pipeline import verify
    from pipeline.executor import Executor

    def run(folder, rows, per_part):
        storage = Storage.local(tmp_path / folder)
        parts = []
        for i in range(0, len(rows), per_part):
            rel = f"ingest/ledger/p{i}.parquet"
            chunk = rows[i:i + per_part]
            storage.write_table(rel, pa.table({**{c: [r[j] for r in chunk] for j, c in enumerate(("key", "verdict", "sha256"))},
                                               "url": [f"http://site.test/{r[0]}.jpg" for r in chunk]}))
            parts.append({"file": rel, "in": len(chunk)})
        storage.write_json("ingest/parts.json", parts)
        return tmp_path / folder

    old = [(f"k{i:04d}", "kept" if i < 1500 else "dropped", f"h{i}") for i in range(2000)]
    new = {k: (k, v, h) for k, v, h in old}
    died = [f"k{i:04d}" for i in range(0, 1500, 7)]
    changed = [f"k{i:04d}" for i in range(3, 1500, 11) if f"k{i:04d}" not in died]
    revived = [f"k{i:04d}" for i in range(1500, 2000, 50)]
    for k in died[::2]:
        del new[k]                                   # gone from the list: died too
    for k in died[1::2]:
        new[k] = (k, "dropped", None)
    for k in changed:
        new[k] = (k, "kept", "other")
    for k in revived:
        new[k] = (k, "kept", "h")
    monkeypatch.setattr(verify, "DRIFT_LISTED", 50)
    report = verify.drift(run("old", old, 300), run("new", sorted(new.values(), reverse=True), 700), Executor(log=lambda m: None))
    assert report["counts"] == {"died": len(died), "changed": len(changed), "revived": len(revived)}
    url = lambda keys: [f"http://site.test/{k}.jpg" for k in keys]   # noqa: E731
    assert report["died"] == url(died[:50]) and report["changed"] == url(changed[:50]) and report["revived"] == url(revived)
    everything = pq.read_table(tmp_path / "new" / "drift").to_pylist()
    assert sorted(r["key"] for r in everything if r["drift"] == "died") == died
    assert sorted(r["url"] for r in everything if r["drift"] == "changed") == url(changed)
    # compared through Ray's object store: nothing but the results in the run folder
    assert all(p.is_file() and p.stem.isdigit() for p in (tmp_path / "new" / "drift").iterdir())


@pytest.mark.slow   # Ray tasks
def test_a_stage_key_index_names_the_one_ledger_file_of_a_key(tmp_path, ray_local, monkeypatch):
    """Several ledger files, keys spread over several index buckets: every key's file is found,
    a key no file holds is "", and a stage without an index is None (explain then scans)."""
    from infra.storage import Storage
    from pipeline import key_index
    from pipeline.executor import Executor

    storage = Storage.local(tmp_path)
    files, rows = {}, {}
    for i in range(5):
        rel = f"dedup/ledger/p{i}.parquet"
        files[rel] = storage.write_table(rel, pa.table({"key": [f"s{j:05d}" for j in range(i, 5000, 5)]}))[0]
        rows[rel] = 1000
    monkeypatch.setattr(key_index, "ROWS_PER_BUCKET", 1500)
    monkeypatch.setattr(key_index, "ROW_GROUP", 100)
    meta = key_index.build(storage, Executor(log=lambda m: None), "dedup", files, rows)
    assert (meta.segments, meta.rows, meta.rows_written) == (1, 5000, 5000)
    assert sorted(p.name for p in (tmp_path / "dedup" / "keys").iterdir()) == [
        "files.parquet", "meta.json", *(f"s000000-00000{b}.parquet" for b in range(4))]   # 4 buckets, no map files
    assert all(key_index.lookup(storage, "dedup", f"s{j:05d}") == f"dedup/ledger/p{j % 5}.parquet"
               for j in range(0, 5000, 37))
    assert key_index.lookup(storage, "dedup", "s99999") == "" and key_index.lookup(storage, "basic", "s00001") is None
    monkeypatch.setattr(key_index, "ROWS_PER_BUCKET", 10**6)            # one bucket: one task
    assert key_index.build(storage, Executor(log=lambda m: None), "language", files, rows).rows_written == 5000
    assert all(key_index.lookup(storage, "language", f"s{j:05d}") == f"dedup/ledger/p{j % 5}.parquet"
               for j in range(0, 5000, 37))
    index = pq.ParquetFile(tmp_path / "language" / "keys" / "s000000-000000.parquet")
    assert index.metadata.num_row_groups > 1       # a lookup reads one row group of it
    # an append: p5 added, p0 gone; only p5's ledger is read, only its keys written (a new segment)
    storage.write_table("dedup/ledger/p5.parquet", pa.table({"key": ["t00001", "t00002"]}))
    grown = {f: sha for f, sha in files.items() if not f.endswith("p0.parquet")}
    grown["dedup/ledger/p5.parquet"] = "new"
    read = []
    monkeypatch.setattr(Storage, "read_table", lambda self, rel, columns=None, _r=Storage.read_table: (read.append(rel), _r(self, rel, columns))[1])
    meta = key_index.build(storage, None, "language", grown, {**rows, "dedup/ledger/p5.parquet": 2}, in_driver=True)
    assert [r for r in read if "/ledger/" in r] == ["dedup/ledger/p5.parquet"], read
    assert (meta.segments, meta.rows, meta.rows_written) == (2, 4002, 2)
    assert key_index.lookup(storage, "language", "t00002") == "dedup/ledger/p5.parquet"
    assert key_index.lookup(storage, "language", "s00001") == "dedup/ledger/p1.parquet"
    assert key_index.lookup(storage, "language", "s00000") == ""            # its partition is gone
    # the keys as the writing tasks handed them over (references into the object store): no ledger
    # read, neither in one file nor in buckets
    import ray

    given = {f: ray.put(pa.table({"key": [f"s{j:05d}" for j in range(i, 5000, 5)]})) for i, f in enumerate(files)}
    read.clear()
    for stage, rows_per_bucket in (("basic", 1500), ("tokenizer", 10**6)):
        monkeypatch.setattr(key_index, "ROWS_PER_BUCKET", rows_per_bucket)
        meta = key_index.build(storage, Executor(log=lambda m: None), stage, files, rows, given=given)
        assert (meta.rows_written, meta.ledgers_read, meta.ledgers_handed) == (5000, 0, 5), meta
        assert all(key_index.lookup(storage, stage, f"s{j:05d}") == f"dedup/ledger/p{j % 5}.parquet"
                   for j in range(0, 5000, 37))
    assert not [r for r in read if "/ledger/" in r], read
    # keys lost with their node (Ray says ObjectLostError): built from the ledgers instead; any other
    # failure of the build is said, not hidden behind a second try

    class Failing(Executor):
        def __init__(self, error):
            super().__init__(log=lambda m: None)
            self.error = error

        def run(self, fn, calls, *a, **k):
            if self.error is not None and any(isinstance(x, ray.ObjectRef) for c in calls for x in c):
                error, self.error = self.error, None
                raise RuntimeError("clip_score key index: task 0 failed") from error
            return super().run(fn, calls, *a, **k)

    lost = ray.exceptions.ObjectLostError("00" * 28, "", "")
    meta = key_index.build(storage, Failing(lost), "clip_score", files, rows, given=given)
    assert (meta.ledgers_read, meta.ledgers_handed) == (5, 0), meta
    assert all(key_index.lookup(storage, "clip_score", f"s{j:05d}") == f"dedup/ledger/p{j % 5}.parquet"
               for j in range(0, 5000, 37))
    with pytest.raises(RuntimeError, match="task 0 failed"):
        key_index.build(storage, Failing(ValueError("a bug")), "shard", files, rows, given=given)


@pytest.mark.slow   # seconds: kept out of the fast set (its 45 s budget)
def test_the_key_index_writes_what_an_append_adds_and_merges_its_segments_geometrically(tmp_path, monkeypatch):
    """Thirty 1 % appends: each writes its own keys and the small segments it merges, never the
    stage's first segment, and the segments stay few; a ledger rewritten in place, ledgers removed,
    and a stage rebuilt from other input are each answered right, with dead rows dropped by merges."""
    from infra.storage import Storage
    from pipeline import key_index

    monkeypatch.setattr(key_index, "ROW_GROUP", 64)
    storage = Storage.local(tmp_path)
    files, rows, where = {}, {}, {}

    def ledger(name: str, keys: list[str]) -> None:
        rel = f"basic/ledger/{name}.parquet"
        files[rel], _ = storage.write_table(rel, pa.table({"key": keys}))
        rows[rel] = len(keys)
        where.update({k: rel for k in keys})

    def found() -> bool:
        return all(key_index.lookup(storage, "basic", k) == f for k, f in list(where.items())[::7])

    for i in range(10):
        ledger(f"p{i:03d}", [f"a{i:03d}_{j:03d}" for j in range(100)])
    assert key_index.build(storage, None, "basic", files, rows, in_driver=True).rows_written == 1000
    written, most = [], 0
    for i in range(30):
        ledger(f"q{i:03d}", [f"b{i:03d}_{j:02d}" for j in range(10)])
        meta = key_index.build(storage, None, "basic", files, rows, in_driver=True)
        written.append(meta.rows_written)
        most = max(most, meta.segments)
        assert meta.rows == 1000 + 10 * (i + 1)
    assert max(written) < 1000 and sum(written) <= 300 * 6, written     # never the first segment again
    assert most <= 6 and found(), most
    # a ledger rewritten in place: its old keys are gone from the stage, its new ones found
    gone = [k for k, f in where.items() if f.endswith("p003.parquet")]
    for k in gone:
        del where[k]
    ledger("p003", ["c_new_1", "c_new_2"])
    meta = key_index.build(storage, None, "basic", files, rows, in_driver=True)
    assert meta.rows_written == 2 and found() and all(key_index.lookup(storage, "basic", k) == "" for k in gone[::9])
    # most of the first segment's ledgers removed: spent, merged away without its dead rows
    for i in range(6):
        rel = f"basic/ledger/p{i:03d}.parquet"
        del files[rel], rows[rel]
        where = {k: f for k, f in where.items() if f != rel}
    meta = key_index.build(storage, None, "basic", files, rows, in_driver=True)
    assert meta.rows == sum(rows.values()) and found()
    on_disk = sum(pq.ParquetFile(p).metadata.num_rows for p in (tmp_path / "basic" / "keys").glob("s*.parquet"))
    assert on_disk == sum(rows.values()), (on_disk, sum(rows.values()))
    # the stage rebuilt from other input (every ledger new): the old segments deleted unread
    old = sorted(p.name for p in (tmp_path / "basic" / "keys").glob("s*.parquet"))
    files, rows, where = {}, {}, {}
    for i in range(3):
        ledger(f"p{i:03d}", [f"d{i}_{j}" for j in range(50)])
    meta = key_index.build(storage, None, "basic", files, rows, in_driver=True)
    assert (meta.segments, meta.rows, meta.rows_written) == (1, 150, 150) and found()
    assert not set(old) & {p.name for p in (tmp_path / "basic" / "keys").glob("s*.parquet")}
    assert key_index.lookup(storage, "basic", "a007_001") == ""


def test_a_segment_stays_while_any_ledger_it_indexed_is_current(tmp_path):
    """The rows the runner gives are the stage's counts; a segment is deleted only when none of its
    ledgers is current, whatever those counts say (here they overstate the ledger that goes)."""
    from infra.storage import Storage
    from pipeline import key_index

    storage = Storage.local(tmp_path)
    files = {f"basic/ledger/{n}.parquet": storage.write_table(f"basic/ledger/{n}.parquet",
                                                              pa.table({"key": [f"{n}{j}" for j in range(100)]}))[0]
             for n in ("a", "b")}
    key_index.build(storage, None, "basic", files, {"basic/ledger/a.parquet": 250, "basic/ledger/b.parquet": 100},
                    in_driver=True)
    del files["basic/ledger/a.parquet"]
    meta = key_index.build(storage, None, "basic", files, {"basic/ledger/b.parquet": 100}, in_driver=True)
    assert meta.segments == 1 and key_index.lookup(storage, "basic", "b7") == "basic/ledger/b.parquet"
    assert key_index.lookup(storage, "basic", "a7") == ""
    # a build stopped between its file list and its meta (the list names a segment the meta does not):
    # the next build starts the index over rather than failing the stage
    known = storage.read_table("basic/keys/files.parquet").to_pylist()
    storage.write_table("basic/keys/files.parquet", pa.Table.from_pylist([{**r, "segment": 99} for r in known],
                                                                         schema=key_index.FILES))
    meta = key_index.build(storage, None, "basic", files, {"basic/ledger/b.parquet": 100}, in_driver=True)
    assert (meta.segments, meta.rows_written) == (1, 100)
    assert key_index.lookup(storage, "basic", "b7") == "basic/ledger/b.parquet"


def test_segments_a_stopped_build_meant_to_delete_are_deleted_by_the_next(tmp_path, monkeypatch):
    """A driver that stops after a build wrote its meta and before it deleted the segments that meta
    no longer names (a rebuilt stage: every old segment dropped) leaves files nothing reads; the next
    build that changes the index deletes them with its own."""
    from infra.storage import Storage
    from pipeline import key_index

    storage = Storage.local(tmp_path)
    files, rows = {}, {}

    def ledger(name: str, keys: list[str]) -> None:
        rel = f"basic/ledger/{name}.parquet"
        files[rel], _ = storage.write_table(rel, pa.table({"key": keys}))
        rows[rel] = len(keys)

    on_disk = lambda: sorted(p.name for p in (tmp_path / "basic" / "keys").glob("s*.parquet"))   # noqa: E731
    ledger("p0", [f"a{j}" for j in range(50)])
    key_index.build(storage, None, "basic", files, rows, in_driver=True)
    first = on_disk()
    files.clear(), rows.clear()
    ledger("p1", [f"b{j}" for j in range(50)])

    def stops(rels):
        raise KeyboardInterrupt("the driver stopped")

    with monkeypatch.context() as m:
        m.setattr(storage, "delete_files", stops)
        with pytest.raises(KeyboardInterrupt):
            key_index.build(storage, None, "basic", files, rows, in_driver=True)
    assert set(first) <= set(on_disk())      # left behind: the meta no longer names them
    assert key_index.lookup(storage, "basic", "a7") == "" and key_index.lookup(storage, "basic", "b7") == "basic/ledger/p1.parquet"
    ledger("p2", [f"c{j}" for j in range(50)])
    meta = key_index.build(storage, None, "basic", files, rows, in_driver=True)
    assert meta.rows == 100 and not set(first) & set(on_disk()), on_disk()
    named = {key_index.segment_file("x", s["id"], b).split("/")[-1]
             for s in storage.read_json("basic/keys/meta.json")["segments"] for b in range(s["buckets"])}
    assert set(on_disk()) == named


def test_an_index_of_the_first_format_is_read_and_then_rebuilt(tmp_path):
    """A run folder from before segments: `explain` still finds keys through it, and the next build
    replaces it whole."""
    from infra.storage import Storage
    from pipeline import key_index

    storage = Storage.local(tmp_path)
    sha, _ = storage.write_table("dedup/ledger/p0.parquet", pa.table({"key": ["k1", "k2"]}))
    storage.write_table("dedup/keys/000000.parquet", pa.table({"key": ["k1", "k2"], "file": ["dedup/ledger/p0.parquet"] * 2}))
    storage.write_json("dedup/keys/meta.json", {"buckets": 1, "rows": 2, "files": {"dedup/ledger/p0.parquet": sha}})
    assert key_index.lookup(storage, "dedup", "k2") == "dedup/ledger/p0.parquet"
    assert key_index.lookup(storage, "dedup", "k9") == ""
    meta = key_index.build(storage, None, "dedup", {"dedup/ledger/p0.parquet": sha}, {"dedup/ledger/p0.parquet": 2},
                           in_driver=True)
    assert meta.rows_written == 2 and not (tmp_path / "dedup" / "keys" / "000000.parquet").exists()
    assert key_index.lookup(storage, "dedup", "k2") == "dedup/ledger/p0.parquet"


def test_status_calls_the_shards_stale_when_clip_score_changed_and_not_when_the_tokenizer_did(tmp_path):
    """The shard stage reads clip_score's partitions and never the tokenizer (it runs beside it):
    shards made from older partitions are stale; a retrained tokenizer leaves them current."""
    from infra.storage import Storage
    from pipeline.inspect_run import status_rows

    storage = Storage.local(tmp_path)
    storage.write_json("manifest.json", {})
    prev = ""
    for name in ("source", "ingest", "dedup", "basic", "language", "clip_score", "tokenizer", "shard"):
        marker = {"output_digest": f"{name}-out", "upstream_digest": "clip_score-out" if name == "shard" else prev}
        storage.write_json(f"{name}/_SUCCESS", marker)
        prev = f"{name}-out"
    state = lambda: {r["stage"]: r["state"] for r in status_rows(tmp_path)}   # noqa: E731
    assert state()["shard"] == "done"
    storage.write_json("tokenizer/_SUCCESS", {"output_digest": "tokenizer-new", "upstream_digest": "clip_score-out"})
    assert state()["tokenizer"] == "done" and state()["shard"] == "done"
    storage.write_json("clip_score/_SUCCESS", {"output_digest": "clip_score-new", "upstream_digest": "language-out"})
    storage.write_json("tokenizer/_SUCCESS", {"output_digest": "tokenizer-out", "upstream_digest": "clip_score-new"})
    assert state()["tokenizer"] == "done" and state()["shard"] == "stale"


def test_the_dataset_card_shows_names_from_the_data_as_text():
    """A list file named with backticks broke the card's Markdown and left raw HTML in it."""
    from pipeline.dataset_card import md_code, md_text

    name = "a``b<img src=x onerror=alert(1)>.csv"
    code = md_code(name)
    assert code.startswith("```") and code.endswith("```") and name in code      # a longer fence holds it
    assert md_code("`x") == "`` `x ``"
    text = md_text("x|y <b>z</b> `w` [l](u)")
    assert "<b>" not in text and r"x\|y" in text and r"\`w\`" in text and r"\[l\]" in text


def test_the_dataset_card_says_the_likeness_level_the_run_warned_past():
    """The card's evaluation-set table says the level the dedup stage warned past, from the run's
    stats (a run before it was recorded: the sentence without it), not a copy of the stage's constant."""
    from pipeline.config import load_config
    from pipeline.dataset_card import card
    from stages.dedup.stage import ALIKE_WARN

    manifest = {"artifacts": {"shard": {"shards": [{"samples": 3}]}}, "stages": {"shard": {"output_digest": "d"}}}
    cfg = load_config(None, [])
    sets = {"digits": {"images": 1797, "alike": 0.65, "alike_warn": ALIKE_WARN}}
    counts = {"in": 7, "kept": 3, "dropped": {"eval_duplicate": 4}}
    text = card(manifest, {"dedup": {**counts, "eval_sets": sets, "eval_matches": {"digits": 4}}}, cfg)
    assert f"(past {ALIKE_WARN:.0%}".replace("%", " %") in text and "| digits | 1797 | 4 | 65% |" in text
    sets["digits"].pop("alike_warn")
    text = card(manifest, {"dedup": {**counts, "eval_sets": sets}}, cfg)
    assert "within the dedup threshold." in text and "(past" not in text and "| digits | 1797 | 0 | 65% |" in text


def test_check_reads_the_lists_first_rows_for_hosts_ingest_would_refuse(tmp_path):
    """`check` said "ready to run" with allow_hosts commented on a list whose every URL is on
    loopback (init knew), and let an allow_hosts entry that matches no URL pass unflagged."""
    from pipeline.config import load_config
    from pipeline.init_config import check_hosts

    urls = tmp_path / "list.csv"
    urls.write_text("url,caption\n" + "".join(f"http://127.0.0.1:8000/{i}.jpg,a cat on a mat {i}\n" for i in range(5)))
    base = ["source.kind=urls", f"source.path={urls}"]
    with pytest.raises(UserError, match=r"every URL of the 5 first rows names a private or loopback host "
                                        r"\(127.0.0.1:8000\).*stages.ingest.allow_hosts: \[\"127.0.0.1:8000\"\]"):
        check_hosts(load_config(None, base))
    assert check_hosts(load_config(None, base + ["stages.ingest.allow_hosts=['127.0.0.1:8000']"])) == []
    notes = check_hosts(load_config(None, base + ["stages.ingest.allow_hosts=['127.0.0.1:8000', 'cdn.example:81']"]))
    assert notes == ["stages.ingest.allow_hosts entry cdn.example:81 matches no URL of the first rows (host:port, "
                     "as the URLs spell it)"]


def test_explain_finds_a_list_id_as_the_user_types_it():
    """`explain RUN 1000056.0` (a float id as LAION's files write it) looked up `1000056_0`, a key the
    source never makes: it makes 1000056 (float ids stay integers), and 7_5 of 7.5."""
    from pipeline.inspect_run import _as_keys

    assert _as_keys("1000056.0") == ["1000056", "1000056_0"]
    assert _as_keys("7.5") == ["7_5"]
    assert _as_keys("a/b.c") == ["a_b_c"]
    assert _as_keys("u0123") == ["u0123"]
