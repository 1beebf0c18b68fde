"""Keys unique across a URL list's files (stages/source/keys.py): the logic in-process, and a whole
run through the shards with two files that share rows."""
import json
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from infra.errors import UserError
from infra.storage import Storage
from pipeline.config import load_config
from stages.base import read_ledger
from stages.source.stage import _read_file_task
from stages.source.keys import CHECKED, unique_across_files


def _in_process(fn, calls, what, **_):
    """Our own logic, without a cluster: each call in this process, in order."""
    return [fn(*c) for c in calls]


def _shuffle_in_process(map_fn, calls, n_out, reduce_fn, reduce_calls, what, **_):
    """Executor.shuffle's contract without a cluster: every map's pieces, reducer b given the b-th."""
    pieces = [list(map_fn(*c)) for c in calls]
    return [reduce_fn(*reduce_calls[b], *[p[b] for p in pieces]) for b in range(n_out)]


def _files(tmp_path, *contents):
    paths = []
    for i, rows in enumerate(contents):
        p = tmp_path / f"list{i}.csv"
        p.write_text("url,caption\n" + "".join(f"{u},{c}\n" for u, c in rows))
        paths.append(p)
    return paths


def _run(tmp_path, paths, *overrides, rows_per_part=2, keyed=False):
    """`keyed`: each file keyed into a folder of its own, with its BASES table, which the check reads;
    else the check hashes the partitions' keys (files keyed before there were BASES tables)."""
    cfg = load_config(None, ["source.kind=urls", f"source.path={tmp_path}", f"source.rows_per_part={rows_per_part}",
                             *overrides]).source
    storage = Storage.local(tmp_path / "run")
    folders = [f"source/keyed/f{i}" if keyed else None for i in range(len(paths))]
    results = [_read_file_task(storage, str(p), cfg, None, d) for p, d in zip(paths, folders)]
    ctx = SimpleNamespace(run=_in_process, shuffle=_shuffle_in_process, storage=storage)
    hashed_from_keys = []
    storage.read_tables = lambda rels, columns=None, _r=storage.read_tables: (hashed_from_keys.extend(rels), _r(rels, columns))[1]
    out, renamed = unique_across_files(ctx, results, [d and f"{d}/bases.parquet" for d in folders],
                                       own_keys=bool(cfg.key_col))
    if len(paths) > 1:       # BASES tables read where there are any, else the keys hashed
        assert bool(hashed_from_keys) != keyed, hashed_from_keys
    (tmp_path / "run" / "source").mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "source" / "parts.json").write_text(json.dumps([p.to_json() for p in out]))
    return out, renamed, read_ledger(storage, "source").to_pylist()


@pytest.mark.parametrize("keyed", [False, True], ids=["from-keys", "from-bases"])
def test_rows_repeated_across_files_get_keys_as_if_the_files_were_one(tmp_path, keyed):
    a = [("http://x/1.jpg", "one"), ("http://x/2.jpg", "two"), ("http://x/1.jpg", "one")]
    b = [("http://x/3.jpg", "three"), ("http://x/1.jpg", "one"), ("http://x/2.jpg", "two")]
    c = [("http://x/1.jpg", "one")]
    parts, renamed, rows = _run(tmp_path, _files(tmp_path, a, b, c), keyed=keyed)
    if keyed:
        assert (tmp_path / "run" / "source" / "keyed" / "f2" / "bases.parquet").is_file()
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)) == 7                       # every copy a sample, each its own key
    ones = sorted((r["key"], r["detail"]) for r in rows if r["url"] == "http://x/1.jpg")
    base = ones[0][0]
    assert [k for k, _ in ones] == [base, f"{base}_1", f"{base}_2", f"{base}_3"]   # file order, then row order
    by_key = dict(ones)
    # named by line in the file (its header is line 1)
    assert by_key[base] == "list0.csv line 2" and by_key[f"{base}_1"] == "list0.csv line 4"
    assert by_key[f"{base}_2"] == "list1.csv line 3; the same URL and caption as list0.csv line 2"
    assert by_key[f"{base}_3"] == "list2.csv line 2; the same URL and caption as list0.csv line 2"
    assert renamed == 3 and sum(p.n_in for p in parts) == 7


def test_one_file_is_left_as_keyed_rows_made_it(tmp_path):
    parts, renamed, rows = _run(tmp_path, _files(tmp_path, [("http://x/1.jpg", "one"), ("http://x/1.jpg", "one")]))
    assert renamed == 0 and sorted(r["key"][-2:] == "_1" for r in rows) == [False, True]


def test_the_users_own_keys_in_two_files_are_refused_naming_both(tmp_path):
    (tmp_path / "a.csv").write_text("id,url,caption\nk1,http://x/1.jpg,one\nk2,http://x/2.jpg,two\n")
    (tmp_path / "b.csv").write_text("id,url,caption\nk3,http://x/3.jpg,three\nk1,http://x/9.jpg,other\n")
    with pytest.raises(UserError, match=r"1 key_col value\(s\) appear in more than one URL list file "
                                        r"\(a.csv line 2 and b.csv line 3\)"):
        _run(tmp_path, [tmp_path / "a.csv", tmp_path / "b.csv"], "source.key_col=id", keyed=True)


@pytest.mark.slow
def test_two_url_files_sharing_rows_run_to_shards_and_every_copy_has_a_verdict(tmp_path, ray_local):
    from pipeline.runner import run_pipeline
    from stages.source import synthetic
    from stages.source.demo_server import DemoServer
    from stages.source.stage import DefectFractions
    from stages.source.synthetic import SERVER_PLACEHOLDER

    synthetic.generate(tmp_path / "site", 40, 5, 48, 3, {k: 0 for k in vars(DefectFractions())}, 100, 100)
    rows = pq.read_table(tmp_path / "site" / "urls.parquet").to_pylist()
    urls = tmp_path / "urls"
    urls.mkdir()
    with DemoServer(tmp_path / "site" / "www") as server:
        line = [f"{r['url'].replace(SERVER_PLACEHOLDER, server.base_url)},\"{r['caption']}\"" for r in rows]
        (urls / "a.csv").write_text("url,caption\n" + "\n".join(line[:30]) + "\n")
        (urls / "b.csv").write_text("url,caption\n" + "\n".join(line[20:]) + "\n")      # rows 20-29 in both
        cfg = load_config(None, ["source.kind=urls", f"source.path={urls}", f"stages.ingest.allow_hosts=['{server.netloc}']",
                                 "stages.ingest.samples_per_shard=20", "stages.dedup.eval_sets=[]",
                                 "stages.basic.min_image_side=8", "stages.language.enabled=false",
                                 "stages.clip_score.enabled=false", "stages.tokenizer.vocab_size=300",
                                 f"stages.dedup.cache_dir={tmp_path / 'cache'}"])
        summary = run_pipeline(cfg, tmp_path / "run", until="shard", log=lambda m: None)
    assert summary["source"]["in"] == 50 and summary["source"]["repeated_across_files"] == 10
    dedup = read_ledger(tmp_path / "run", "dedup", ["key", "verdict", "reason", "match_key"]).to_pylist()
    repeats = [r for r in dedup if r["verdict"] == "dropped"]
    assert len(dedup) == 50 and len(repeats) == 10                # every copy got a verdict
    assert all(r["reason"] == "exact_duplicate" and r["key"] == r["match_key"] + "_1" for r in repeats)
    assert summary["shard"]["kept"] == 40


def test_an_append_keys_only_the_list_files_it_added(tmp_path, monkeypatch):
    """The source stage takes a file keyed before with the same content and settings as it is: the
    second run (a file added) reads and keys that file alone, and the first files' partitions are
    the same files; a changed file is keyed again, one no longer listed is deleted."""
    from stages.source import keys
    from stages.source.stage import KEYED, RECORDS, SourceStage

    monkeypatch.setattr(keys, "PROBE_FROM", 0)      # the probe at any size (else from 10^6 rows checked)

    urls = tmp_path / "urls"
    urls.mkdir()
    cfg = load_config(None, ["source.kind=urls", f"source.path={urls}", "source.rows_per_part=2"]).source
    storage = Storage.local(tmp_path / "run")
    read = []

    def run(fn, calls, what, **_):
        read.extend(c[1] for c in calls if fn.__name__ == "_read_file_task")
        return _in_process(fn, calls, what)

    ctx = SimpleNamespace(cfg=cfg, storage=storage, run=run, shuffle=_shuffle_in_process, log=lambda m: None,
                          stage_dir=tmp_path / "run" / "source", put=lambda o: o,
                          call=lambda fn, *a, what=None, **_: fn(*a))
    _files(urls, [("http://x/1.jpg", "one"), ("http://x/2.jpg", "two"), ("http://x/3.jpg", "three")],
           [("http://x/4.jpg", "four")])
    first = SourceStage().run(ctx).parts
    assert sorted(p.rsplit("/", 1)[-1] for p in read) == ["list0.csv", "list1.csv"]
    read.clear()
    tables = []
    storage.read_table = lambda rel, columns=None, _r=storage.read_table: (tables.append(rel), _r(rel, columns))[1]
    storage.read_tables = lambda rels, columns=None: [storage.read_table(r, columns) for r in rels]
    records = []
    storage.read_jsons = lambda rels, default=None, _r=storage.read_jsons: (records.extend(rels), _r(rels, default))[1]
    (urls / "list2.csv").write_text("url,caption\nhttp://x/5.jpg,five\nhttp://x/1.jpg,one\n")
    second = SourceStage().run(ctx).parts
    assert [p.rsplit("/", 1)[-1] for p in read] == ["list2.csv"]
    # the first files' records came from the first run's table of them, in one read; only the added
    # file's own record was looked for
    assert tables.count(RECORDS) == 1 and [r.split("/")[-1].split("-")[0] for r in records] == ["list2_csv"]
    # the check across files read the added file's base hashes (the probe, then its rows), the first
    # files' once (their run, against the probe) and, of their partitions, only list0's first (it
    # holds the row list2 repeats), to rename the copy
    bases = sorted(t.split("/")[-2].split("-")[0] for t in tables if t.endswith("bases.parquet"))
    assert bases == ["list2_csv", "list2_csv"], tables     # the first files' through the run the first check kept
    assert len([t for t in tables if t.startswith(keys.RUN_PREFIX)]) == 1, tables
    old = [t for t in tables if "/keyed/list" in t and not t.endswith("bases.parquet") and "list2" not in t]
    assert [t.rsplit("/", 1)[-1] for t in old] == ["list0_csv-00000.parquet"], tables
    assert tables.count(CHECKED) == 1         # what the first run's check covered, read once
    assert [(p.file, p.sha256) for p in second[:len(first)]] == [(p.file, p.sha256) for p in first]
    assert second[-1].n_in == 2 and len({p.part for p in second}) == len(second)
    copies = [r for p in second for r in pq.read_table(storage.path(p.file)).to_pylist() if r["url"] == "http://x/1.jpg"]
    assert sorted(r["key"][-2:] == "_1" for r in copies) == [False, True], copies
    read.clear()
    (urls / "list0.csv").write_text("url,caption\nhttp://x/9.jpg,nine\n")
    (urls / "list1.csv").unlink()
    third = SourceStage().run(ctx).parts
    assert [p.rsplit("/", 1)[-1] for p in read] == ["list0.csv"]
    assert len(storage.list_dirs(KEYED)) == 2 and sum(p.n_in for p in third) == 3
    # the table names the files as they are now (list1's folder deleted, list0's new one keyed)
    named = pq.read_table(storage.path(RECORDS)).column("path").to_pylist()
    assert sorted(f"{KEYED}/{d}.json" for d in storage.list_dirs(KEYED)) == sorted(named)
    read.clear()
    assert [(p.file, p.sha256) for p in SourceStage().run(ctx).parts] == [(p.file, p.sha256) for p in third]
    assert read == []                          # nothing changed: nothing keyed again


def _check(tmp_path, paths, record="source/keyed/across_files.parquet"):
    """The check over `paths`, each file keyed into a folder named by its file (as if by its content),
    remembering what it checked in `record` -> (each key with its detail, the tasks `call` ran and then
    the rows the first shuffle's maps handed on)."""
    cfg = load_config(None, ["source.kind=urls", f"source.path={tmp_path}", "source.rows_per_part=2"]).source
    storage = Storage.local(tmp_path / "run")
    folders = [f"source/keyed/{p.stem}" for p in paths]
    results = [_read_file_task(storage, str(p), cfg, None, d) for p, d in zip(paths, folders)]
    called, moved = [], []

    def shuffle(map_fn, calls, *rest, **kw):       # counts the rows the first shuffle's maps hand on
        if map_fn.__name__ == "_hash_pieces":
            moved.extend(sum(t.num_rows for t in map_fn(*c)) for c in calls)
        return _shuffle_in_process(map_fn, calls, *rest, **kw)

    ctx = SimpleNamespace(run=_in_process, shuffle=shuffle, storage=storage, put=lambda o: o,
                          call=lambda fn, *a, what=None, **_: (called.append(fn.__name__), fn(*a))[1])
    out, renamed = unique_across_files(ctx, results, [f"{d}/bases.parquet" for d in folders], False, record)
    called.append(sum(moved))
    (tmp_path / "run" / "source").mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "source" / "parts.json").write_text(json.dumps([p.to_json() for p in out]))
    rows = read_ledger(storage, "source").to_pylist()
    assert len({r["key"] for r in rows}) == len(rows) == sum(p.n_in for p in out)
    return sorted((r["key"], r["detail"]) for r in rows), called


def _lists(folder, rows: dict, names: str) -> list:
    """The list files `names` (a letter each) in `folder`, each holding rows[letter]."""
    folder.mkdir(exist_ok=True)
    for n in names:
        (folder / f"{n}.csv").write_text("url,caption\n" + "".join(f"{u},{c}\n" for u, c in rows[n]))
    return [folder / f"{n}.csv" for n in names]


def _runs_of(folder) -> list:
    """The runs the record of the last check in `folder`'s line names."""
    record = pq.read_table(folder / "run" / "source" / "keyed" / "across_files.parquet")
    return json.loads(record.schema.metadata[b"runs"])


def _kept_runs(folder) -> list[str]:
    """The run files in `folder`'s line."""
    return sorted(f"source/keyed/{p.name}" for p in (folder / "run" / "source" / "keyed").glob("checked-*"))


def test_an_append_is_checked_against_the_last_check_and_finds_what_checking_every_file_finds(tmp_path, monkeypatch):
    """A check records the files it covered and the copies it found; a run that adds files probes the
    earlier files with the added rows' hashes and must rename exactly as a check of every file does
    (rows repeated among the earlier files, the added files repeating those and each other); a file
    gone, or no record, checks every file again; so does a list of fewer rows than one map reads."""
    from stages.source import keys

    monkeypatch.setattr(keys, "PROBE_FROM", 6)      # the probe from 6 rows checked (else 10^6)
    rows = {"a": [("http://x/1.jpg", "one"), ("http://x/2.jpg", "two"), ("http://x/1.jpg", "one"), ("http://x/3.jpg", "three")],
            "b": [("http://x/3.jpg", "three"), ("http://x/1.jpg", "one"), ("http://x/2.jpg", "two")],
            "c": [("http://x/1.jpg", "one"), ("http://x/5.jpg", "five"), ("http://x/7.jpg", "seven")],
            "d": [("http://x/7.jpg", "seven"), ("http://x/8.jpg", "eight"), ("http://x/2.jpg", "two")],
            "e": [("http://x/9.jpg", "nine")]}
    here, fresh = tmp_path / "line", tmp_path / "fresh"
    here.mkdir()
    fresh.mkdir()

    def lists(folder, names):
        return _lists(folder, rows, names)

    _, called = _check(here, lists(here, "ab"))
    assert called == [7]                                    # no record yet: every file checked, all 7 rows
    record = pq.read_table(here / "run" / "source" / "keyed" / "across_files.parquet")
    assert json.loads(record.schema.metadata[b"files"]) == ["source/keyed/a/bases.parquet", "source/keyed/b/bases.parquet"]
    assert record.num_rows == 7          # 1.jpg in a's two partitions and in b; 2.jpg and 3.jpg in a and in b
    # c added before the others (its copies come first now: a's and b's are renamed), d after them
    appended, called = _check(here, lists(here, "cabd"))
    # the added files' hashes probed the earlier ones: of their 7 rows, the 5 the added files repeat
    # moved on, with the 6 added
    assert called == ["_probe_task", 11]
    full, called = _check(fresh, lists(fresh, "cabd"), record=None)
    assert called == [13] and appended == full              # the same keys, the same details
    # renamed: 1.jpg's copies in a (2) and b; 2.jpg's in b and d; 7.jpg's in d; 3.jpg's in b (which no
    # added row repeats: found by the last check alone)
    assert len([d for _, d in appended if "the same URL and caption as" in d]) == 7
    for f in (here / "a.csv", here / "b.csv"):
        f.unlink()
    gone, called = _check(here, [here / "c.csv", here / "d.csv", *lists(here, "e")])
    full, _ = _check(fresh, [fresh / "c.csv", fresh / "d.csv", *lists(fresh, "e")], record=None)
    assert called == [7] and gone == full                   # a file gone: every file checked again
    monkeypatch.setattr(keys, "PROBE_FROM", 7)
    _, called = _check(here, [here / "c.csv", here / "d.csv", here / "e.csv", *lists(here, "a")])
    assert called == [11]         # 7 rows checked before (c, d, e), not more than PROBE_FROM: all 11 read
    assert len([d for _, d in gone if "the same URL and caption as" in d]) == 1


def test_an_append_reads_the_earlier_files_through_the_runs_the_last_check_kept(tmp_path, monkeypatch):
    """A check's maps keep what they read of several files as one table (a run) that the record
    names; an append reads the earlier files through their runs, a read per run instead of one per
    file, and finds what a check of every file finds; a run gone is read from its files' own tables;
    a check of every file deletes the runs its record no longer names."""
    import shutil

    from stages.source import keys

    monkeypatch.setattr(keys, "PROBE_FROM", 6)      # the probe (and runs kept) from 6 rows (else 10^6)
    rows = {"a": [("http://x/1.jpg", "one"), ("http://x/2.jpg", "two"), ("http://x/1.jpg", "one"), ("http://x/3.jpg", "three")],
            "b": [("http://x/3.jpg", "three"), ("http://x/1.jpg", "one"), ("http://x/2.jpg", "two")],
            "c": [("http://x/1.jpg", "one"), ("http://x/5.jpg", "five")],
            "d": [("http://x/5.jpg", "five"), ("http://x/2.jpg", "two")]}

    def lists(folder, names):
        return _lists(folder, rows, names)

    here, lost, fresh = tmp_path / "line", tmp_path / "lost", tmp_path / "fresh"
    _check(here, lists(here, "ab"))
    ab = keys.run_path(["source/keyed/a/bases.parquet", "source/keyed/b/bases.parquet"])
    assert _runs_of(here) == [[ab, [0, 1]]] and _kept_runs(here) == [ab]
    shutil.copytree(here, lost)
    (lost / "run" / ab).unlink()                     # the same line, its run lost
    read = []
    real = Storage.read_table
    monkeypatch.setattr(Storage, "read_table", lambda self, rel, columns=None: (read.append(rel), real(self, rel, columns))[1])
    appended, _ = _check(here, lists(here, "cabd"))
    earlier = [r for r in read if r == ab or r.endswith(("a/bases.parquet", "b/bases.parquet"))]
    assert earlier == [ab, ab], read                 # one read of the run (twice: the test's shuffle runs each map twice)
    cd = keys.run_path(["source/keyed/c/bases.parquet", "source/keyed/d/bases.parquet"])
    assert _runs_of(here) == [[ab, [1, 2]], [cd, [0, 3]]] and _kept_runs(here) == sorted([ab, cd])   # c and d kept as a run of theirs
    read.clear()
    recovered, _ = _check(lost, lists(lost, "cabd"))
    assert sorted(r.rsplit("/", 2)[-2] for r in read if r.endswith(("a/bases.parquet", "b/bases.parquet"))) == ["a", "a", "b", "b"]
    full, _ = _check(fresh, lists(fresh, "cabd"), record=None)
    assert appended == recovered == full and len([d for _, d in full if "the same URL and caption as" in d]) == 7
    # a file gone: every file checked, its maps keep a run of the files now listed, the others deleted
    (here / "a.csv").unlink()
    _check(here, [here / "c.csv", here / "b.csv", here / "d.csv"])
    cbd = keys.run_path([f"source/keyed/{n}/bases.parquet" for n in "cbd"])
    assert _runs_of(here) == [[cbd, [0, 1, 2]]] and _kept_runs(here) == [cbd]


def test_appends_of_a_file_each_merge_the_small_sources_so_an_append_reads_a_bounded_number(tmp_path, monkeypatch):
    """An append of one file keeps no run of it; the appends after it would read every such file's
    own table, one more each time. Once an append reads MERGE_FROM small sources (files no run holds,
    small runs), its maps keep them as one run, the record names it instead, the runs it replaced are
    deleted; the keys are still what a check of every file gives."""
    from stages.source import keys

    monkeypatch.setattr(keys, "PROBE_FROM", 6)
    monkeypatch.setattr(keys, "MERGE_FROM", 3)
    rows = {"a": [("http://x/1.jpg", "one"), ("http://x/2.jpg", "two"), ("http://x/1.jpg", "one"), ("http://x/3.jpg", "three")],
            "b": [("http://x/3.jpg", "three"), ("http://x/4.jpg", "four"), ("http://x/2.jpg", "two")],
            "c": [("http://x/1.jpg", "one"), ("http://x/5.jpg", "five")],
            "d": [("http://x/5.jpg", "five"), ("http://x/6.jpg", "six")],
            "e": [("http://x/6.jpg", "six"), ("http://x/3.jpg", "three")],
            "f": [("http://x/2.jpg", "two"), ("http://x/7.jpg", "seven")]}

    def lists(folder, names):
        return _lists(folder, rows, names)

    def run_of(names):
        return keys.run_path([f"source/keyed/{n}/bases.parquet" for n in names])

    here, fresh = tmp_path / "line", tmp_path / "fresh"
    read = []
    real = Storage.read_table
    monkeypatch.setattr(Storage, "read_table", lambda self, rel, columns=None: (read.append(rel), real(self, rel, columns))[1])

    def earlier(names):     # the reads of a check, of the runs and BASES tables of `names`' files
        own = [f"source/keyed/{n}/bases.parquet" for n in names]
        return sorted({r for r in read if r in own or r.startswith(keys.RUN_PREFIX)})

    _check(here, lists(here, "ab"))
    assert _runs_of(here) == [[run_of("ab"), [0, 1]]]
    for n in "cd":                  # a file each: no run of it; read as a file no run holds
        _check(here, lists(here, "ab" + ("c" if n == "c" else "cd")))
    assert _runs_of(here) == [[run_of("ab"), [0, 1]]] and _kept_runs(here) == [run_of("ab")]
    read.clear()
    appended, _ = _check(here, lists(here, "abcde"))     # reads ab's run, c and d: 3 small sources, merged
    assert earlier("abcd") == sorted([run_of("ab"), "source/keyed/c/bases.parquet", "source/keyed/d/bases.parquet"]), read
    assert _runs_of(here) == [[run_of("abcd"), [0, 1, 2, 3]]] and _kept_runs(here) == [run_of("abcd")]    # ab's run deleted
    full, _ = _check(fresh, lists(fresh, "abcde"), record=None)
    assert appended == full
    read.clear()
    appended, _ = _check(here, lists(here, "abcdef"))    # the merged run and e: 2 small sources, read as they are
    assert earlier("abcde") == sorted([run_of("abcd"), "source/keyed/e/bases.parquet"]), read
    assert _runs_of(here) == [[run_of("abcd"), [0, 1, 2, 3]]]
    full, _ = _check(fresh, lists(fresh, "abcdef"), record=None)
    assert appended == full and len([d for _, d in full if "the same URL and caption as" in d]) == 7


@pytest.mark.slow
def test_an_append_probed_on_ray_renames_as_checking_every_file_does(tmp_path, ray_local, monkeypatch):
    """The probe on a real cluster (the probe task, its array through Ray's object store to the maps,
    the recorded copies to the reducers): a line of two files, then a third that repeats rows of both,
    gives the keys and details a check of all three files gives in a fresh run folder."""
    from pipeline.runner import run_pipeline
    from stages.source import keys

    def lists(folder, spans):
        folder.mkdir(exist_ok=True)
        for name, rows in spans.items():
            (folder / f"{name}.csv").write_text("url,caption\n" + "".join(f"http://x/{i}.jpg,photo {i}\n" for i in rows))
        return folder

    def source(urls, run):
        cfg = load_config(None, ["source.kind=urls", f"source.path={urls}", "source.rows_per_part=8"])
        summary = run_pipeline(cfg, run, until="source", log=lambda m: None)
        rows = read_ledger(run, "source", ["key", "detail"]).to_pylist()
        return summary["source"]["repeated_across_files"], sorted((r["key"], r["detail"]) for r in rows)

    first, added = {"a": range(0, 30), "b": range(20, 45)}, {"c": [*range(40, 50), *range(0, 5), 25]}
    line = lists(tmp_path / "line", first)
    assert source(line, tmp_path / "run")[0] == 10
    monkeypatch.setattr(keys, "PROBE_FROM", 0)          # the probe at this size (from 10^6 rows otherwise)
    probed = source(lists(line, added), tmp_path / "run")
    assert (tmp_path / "run" / "source" / "keyed" / "across_files.parquet").is_file()
    monkeypatch.setattr(keys, "PROBE_FROM", 10**9)      # every file checked
    full = source(lists(tmp_path / "fresh", {**first, **added}), tmp_path / "fresh-run")
    assert probed == full and probed[0] == 10 + 5 + 5 + 1     # a-b; c-b (40..44); c-a (0..4); 25 in a, b and c
    assert len({k for k, _ in probed[1]}) == len(probed[1]) == 30 + 25 + 16
