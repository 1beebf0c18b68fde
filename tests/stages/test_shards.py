"""Unit: tokenizer determinism and ids, byte-reproducible shard writing, verify on tampered runs."""
import pytest
import json
import tarfile

import sentencepiece as spm

from helpers import write_shard
from infra.hashing import order_key
from stages.tokenizer import TokenizerConfig, train_sentencepiece
from helpers import capline


def _captions(n=400):
    from stages.source import synthetic
    import numpy as np

    rng = np.random.default_rng(0)
    caps = [synthetic.caption_en(synthetic.random_scene(rng)) for _ in range(n)]
    return caps + ["ein großer roter Kreis über einem kleinen Quadrat", "un cercle rouge à gauche"]


def test_tokenizer_is_deterministic_with_fixed_special_ids():
    cfg = TokenizerConfig(vocab_size=600)
    a, b = train_sentencepiece(_captions(), cfg), train_sentencepiece(_captions(), cfg)
    assert a == b
    sp = spm.SentencePieceProcessor(model_proto=a)
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
    ids = sp.encode("a large red circle 🙂 ñ")
    assert 2 not in ids                      # byte fallback: nothing is unknown
    assert sp.decode(ids) == "a large red circle 🙂 ñ"
    assert sp.decode(sp.encode("A LARGE Red")) == "a large red"   # lower-cased by config


def test_tokenizer_threads_decide_the_model_bytes_and_are_a_setting():
    """SentencePiece's model depends on its thread count: the same threads give the same bytes, so
    `threads` is a setting in the stage's fingerprint, never taken from the cluster."""
    from infra.errors import ConfigError
    from pipeline.config import load_config
    from stages.tokenizer import TokenizerStage

    two = TokenizerConfig(vocab_size=600, threads=2)
    assert train_sentencepiece(_captions(), two) == train_sentencepiece(_captions(), two)
    fingerprint = lambda *extra: TokenizerStage().fingerprint(load_config(None, list(extra)))   # noqa: E731
    assert fingerprint("stages.tokenizer.threads=2") != fingerprint()
    with pytest.raises(ConfigError, match="stages.tokenizer.threads"):
        load_config(None, ["stages.tokenizer.threads=0"])


def test_bpe_by_config_and_order_is_seeded():
    sp = spm.SentencePieceProcessor(model_proto=train_sentencepiece(_captions(), TokenizerConfig(vocab_size=600, model_type="bpe")))
    assert sp.get_piece_size() > 259
    keys = [f"s{i:04d}" for i in range(50)]
    assert sorted(keys, key=lambda k: order_key(0, k)) != sorted(keys, key=lambda k: order_key(1, k))
    assert sorted(keys, key=lambda k: order_key(0, k)) == sorted(reversed(keys), key=lambda k: order_key(0, k))


def _samples():
    return [{"key": f"k{i}", "image": bytes([i]) * 100, "ext": "jpg", "caption": f"caption {i}",
             "meta": {"key": f"k{i}", "url": f"http://x/{i}.jpg"}} for i in range(5)]


def test_shards_are_byte_identical_and_well_formed(tmp_path):
    """The writer the shard stage and removals call (write_shard_table), twice on the same samples."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from infra.storage import Storage
    from stages.shard.stage import write_shard_table

    rows = pa.Table.from_pylist([{**s, "meta": json.dumps(s["meta"], sort_keys=True)} for s in _samples()])
    for run in ("a", "b"):
        result = write_shard_table(Storage.local(tmp_path / run), 0, rows)
        assert result.extra["samples"] == 5
    a, b = (tmp_path / run / "shard" / "shards" / "000000.tar" for run in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()
    with tarfile.open(a) as tar:
        members = tar.getmembers()
        assert [m.name for m in members[:3]] == ["k0.jpg", "k0.txt", "k0.json"]
        assert all(m.mtime == 0 and m.uid == 0 and m.mode == 0o444 for m in members)
    index = pq.read_table(tmp_path / "a" / "shard" / "index" / "000000.parquet").to_pylist()
    with open(a, "rb") as f:  # the index's offsets point at each sample's first header
        for row in index:
            f.seek(row["offset"])
            assert f.read(512)[:len(row["key"]) + 4] == f"{row['key']}.jpg".encode()


def _fake_run(tmp_path):
    """A run folder as the shard stage leaves it, built with the real writer."""
    import hashlib

    run = tmp_path / "run"
    (run / "shard" / "shards").mkdir(parents=True)
    shards = []
    for n in range(2):
        p = run / "shard" / "shards" / f"{n:06d}.tar"
        write_shard(p, _samples()[n * 2:n * 2 + 2])
        data = p.read_bytes()
        shards.append({"name": p.name, "samples": 2, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (run / "shard" / "shards" / "sizes.json").write_text(json.dumps({s["name"]: 2 for s in shards}))
    (run / "manifest.json").write_text(json.dumps({"artifacts": {"shard": {"shards": shards}}}))
    return run


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_verify_names_a_tampered_manifest_and_a_truncated_shard(tmp_path):
    run = _fake_run(tmp_path)
    ok = capline("verify", str(run))
    assert ok.returncode == 0 and "2 shards match" in ok.stdout
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["artifacts"]["shard"]["shards"][1]["sha256"] = "0" * 64
    (run / "manifest.json").write_text(json.dumps(manifest))
    bad = capline("verify", str(run))
    assert bad.returncode == 1 and "shard 000001.tar: checksum differs" in bad.stdout
    run2 = _fake_run(tmp_path / "second")
    p = run2 / "shard" / "shards" / "000000.tar"
    p.write_bytes(p.read_bytes()[:700])
    bad = capline("verify", str(run2))
    assert bad.returncode == 1 and "000000.tar" in bad.stdout and "truncated" in bad.stdout
    assert "000001.tar" not in bad.stdout


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_compare_two_runs_names_the_differing_samples(tmp_path):
    a, b = _fake_run(tmp_path / "a"), _fake_run(tmp_path / "b")
    same = capline("verify", str(a), str(b))
    assert same.returncode == 0 and "identical" in same.stdout
    samples = _samples()
    samples[3]["caption"] = "another caption"
    samples[2]["meta"]["url"] = "http://y/2.jpg"            # a json field: verify names it and both values
    import hashlib

    p = b / "shard" / "shards" / "000001.tar"
    write_shard(p, samples[2:4])
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["artifacts"]["shard"]["shards"][1].update(bytes=p.stat().st_size, sha256=hashlib.sha256(p.read_bytes()).hexdigest())
    (b / "manifest.json").write_text(json.dumps(manifest))
    diff = capline("verify", str(a), str(b))
    assert diff.returncode == 1
    assert "k3: txt differ" in diff.stdout
    assert "k2: json differ (json: url 'http://x/2.jpg' -> 'http://y/2.jpg')" in diff.stdout, diff.stdout


def test_an_append_refuses_a_lost_line_record_and_a_missing_published_shard(tmp_path):
    """Deleting shard/line/line.json made the next append rewrite every published shard and drop
    published samples (exit 0); a deleted published shard went unnoticed. Both are refused, naming
    what to do."""
    import json
    from types import SimpleNamespace

    from infra.errors import UserError
    from infra.storage import Storage
    from stages.shard.stage import ShardConfig, ShardStage

    storage = Storage.local(tmp_path)
    ctx = SimpleNamespace(storage=storage, cfg=ShardConfig(append=True), log=lambda m: None)
    storage.write_bytes("shard/shards/000000.tar", b"t0")
    storage.write_bytes("shard/shards/000001.tar", b"t1")
    storage.write_json("shard/line/line.json", {"shards": [{"name": "000000.tar"}, {"name": "000001.tar"}], "runs": []})
    storage.write_bytes("shard/line/published/p0.parquet", b"x")
    assert ShardStage()._line(ctx)["shards"][1]["name"] == "000001.tar"        # whole: the line goes on
    (tmp_path / "shard" / "shards" / "000001.tar").unlink()
    with pytest.raises(UserError, match=r"published shard\(s\) 000001.tar are missing"):
        ShardStage()._line(ctx)
    (tmp_path / "shard" / "line" / "line.json").write_text("{torn")
    with pytest.raises(UserError, match="line.json is missing or unreadable, but the dataset line's published records"):
        ShardStage()._line(ctx)
    (tmp_path / "shard" / "line" / "line.json").unlink()
    with pytest.raises(UserError, match="restore line.json, or set stages.shard.append: false"):
        ShardStage()._line(ctx)
    assert json.loads(json.dumps(ShardStage()._line(SimpleNamespace(**{**vars(ctx), "cfg": ShardConfig()})))) is None


@pytest.mark.parametrize("record", [{"shards": [{"name": "../../x.tar"}], "runs": []},
                                    {"shards": [{"name": "000000.tar"}, {"name": "000000.tar"}], "runs": []},
                                    {"shards": "000000.tar", "runs": []}, ["000000.tar"],
                                    {"shards": [{"name": "000000.tar"}]}])
def test_a_crafted_line_record_is_refused(tmp_path, record):
    from types import SimpleNamespace

    from infra.errors import UserError
    from infra.storage import Storage
    from stages.shard.stage import ShardConfig, ShardStage

    storage = Storage.local(tmp_path)
    storage.write_bytes("shard/shards/000000.tar", b"t0")
    storage.write_json("shard/line/line.json", record)
    ctx = SimpleNamespace(storage=storage, cfg=ShardConfig(append=True), log=lambda m: None)
    with pytest.raises(UserError, match="is not a dataset line's record"):
        ShardStage()._line(ctx)


def test_new_shards_of_a_line_never_take_a_listed_number():
    from stages.shard.stage import next_shard

    assert next_shard([]) == 0
    assert next_shard([{"name": "000000.tar"}, {"name": "000001.tar"}]) == 2
    assert next_shard([{"name": "000000.tar"}, {"name": "000005.tar"}]) == 6     # len() would give 2
