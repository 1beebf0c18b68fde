"""Unit: the training loader's epoch coverage, resume position, and the optimiser pieces."""
import numpy as np
import pytest
import torch

from stages.source import synthetic
from helpers import write_shard
from stages.tokenizer import TokenizerConfig, train_sentencepiece
from trainers.data import LoaderState, ShardStream, check_readers, list_shards, make_loader, next_state
from infra.errors import UserError
from trainers.optim import lr_factor, param_groups


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    scenes = [synthetic.random_scene(rng) for _ in range(48)]
    caps = [synthetic.caption_en(s) for s in scenes]
    (root / "shards").mkdir()
    for n in range(4):
        write_shard(root / "shards" / f"{n:06d}.tar", [
            {"key": f"s{i:03d}", "image": synthetic.encode(synthetic.render(scenes[i], 32)), "ext": "jpg",
             "caption": caps[i], "meta": {}} for i in range(n * 12, n * 12 + 12)])
    (root / "spm.model").write_bytes(train_sentencepiece(caps * 5, TokenizerConfig(vocab_size=320)))
    return root


def _stream(data, rank, world, state, batch=4):
    return ShardStream(list_shards(data / "shards"), str(data / "spm.model"), batch, 32, 16, 0, rank, world,
                       state, keys=True)


def _take(loader_iter, n):
    return [next(loader_iter) for _ in range(n)]


def test_every_sample_once_per_epoch_across_2_workers_x_2_loader_processes(data):
    seen = []
    for rank in range(2):
        it = iter(make_loader(_stream(data, rank, 2, LoaderState()), loader_workers=2))
        batches = _take(it, 6)                  # 2 shards x 12 samples / batch 4 = one epoch
        assert [b["batch"] for b in batches] == list(range(6)) and {b["epoch"] for b in batches} == {0}
        assert next(it)["epoch"] == 1
        for b in batches:
            assert b["images"].shape == (4, 3, 32, 32) and b["labels"].shape == (4, 16)
            assert float(b["images"].min()) >= -1 and float(b["images"].max()) <= 1
            seen += b["keys"]
    assert sorted(seen) == [f"s{i:03d}" for i in range(48)]


def test_resuming_mid_epoch_continues_with_the_next_batch(data):
    straight = _take(iter(make_loader(_stream(data, 1, 2, LoaderState()), 2)), 10)
    first = _take(iter(make_loader(_stream(data, 1, 2, LoaderState()), 2)), 3)
    state = next_state(first[-1])
    assert state.to_dict() == {"epoch": 0, "batch": 3}
    rest = _take(iter(make_loader(_stream(data, 1, 2, state), 2)), 7)
    assert [b["keys"] for b in first + rest] == [b["keys"] for b in straight]
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(first + rest, straight))


def test_labels_end_with_eos_and_pad_with_zero(data):
    b = next(iter(make_loader(_stream(data, 0, 1, LoaderState()), 0)))
    for row in b["labels"].tolist():
        n = row.index(1)
        assert all(t == 0 for t in row[n + 1:]) and all(t > 1 for t in row[:n])


def test_too_few_shards_and_no_shards_are_errors(tmp_path):
    with pytest.raises(UserError, match="3 shards for 4 training workers"):
        check_readers(3, 4, 2)
    with pytest.raises(UserError, match="no shards"):
        list_shards(tmp_path)


def test_schedule_and_decay_groups():
    assert lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100) == pytest.approx(0.5)
    assert lr_factor(100, 10, 100) == pytest.approx(0.0)
    from trainers.models import ModelConfig, build_model

    m = build_model(ModelConfig(family="cappa", size="tiny", vocab_size=50, max_len=8, image_size=16, patch=4,
                                width=32, depth=2, heads=2, mlp=64))
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"])
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert "decoder.embed.weight" in skipped and "encoder.pos" in skipped
    assert any(n.endswith("ln1.weight") for n in skipped)
    decayed = {names[id(p)] for p in decay["params"]}
    assert "decoder.head.weight" in decayed
    assert "encoder.embed.weight" in decayed        # big_vision decays every kernel, the patch embedding's too


@pytest.fixture(scope="module")
def indexed(data, tmp_path_factory):
    """The same shards laid out as the shard stage writes them: shards/ and, beside it, index/ (key ->
    offset of the sample's first member)."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq
    import tarfile

    root = tmp_path_factory.mktemp("indexed")
    shutil.copytree(data / "shards", root / "shards")
    (root / "index").mkdir()
    for tar_path in sorted((root / "shards").glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            firsts = {}
            for m in tar.getmembers():
                firsts.setdefault(m.name.split(".")[0], m.offset)
        pq.write_table(pa.table({"key": list(firsts), "offset": pa.array(list(firsts.values()), pa.int64())}),
                       root / "index" / f"{tar_path.stem}.parquet")
    shutil.copy(data / "spm.model", root / "spm.model")
    return root


def test_with_the_shard_index_each_loader_process_reads_only_its_batches(data, indexed, monkeypatch):
    import infra.storage

    read = []
    real = infra.storage.read_range_of
    monkeypatch.setattr(infra.storage, "read_range_of", lambda p, o, n: read.append(n) or real(p, o, n))
    streamed = _take(iter(make_loader(_stream(data, 1, 2, LoaderState()), 0)), 9)
    ranged_stream = _stream(indexed, 1, 2, LoaderState())
    ranged = _take(iter(ranged_stream), 9)        # in this process: the monkeypatched reader sees every read
    assert [b["keys"] for b in ranged] == [b["keys"] for b in streamed]        # the same batches, in order
    assert all(torch.equal(a["images"], b["images"]) and torch.equal(a["labels"], b["labels"])
               for a, b in zip(ranged, streamed))
    from trainers.data import epoch_shards

    mine = epoch_shards(list_shards(indexed / "shards"), 0, 0, 1, 2)   # rank 1's shards in epoch 0
    assert len(read) == 9                                               # a batch within one shard: one read
    assert sum(read[:6]) <= sum(p.stat().st_size for p in mine)         # the epoch's bytes, each once
    # two loader processes: each takes its own batches, together the same sequence
    both = _take(iter(make_loader(_stream(indexed, 1, 2, LoaderState()), 2)), 9)
    assert [b["keys"] for b in both] == [b["keys"] for b in streamed]
    # a resumed stream starts at its batch
    resumed = _take(iter(make_loader(_stream(indexed, 1, 2, LoaderState(0, 4)), 2)), 3)
    assert [b["keys"] for b in resumed] == [b["keys"] for b in streamed[4:7]]


def test_a_rank_reads_the_index_of_its_own_shards_only(indexed, monkeypatch):
    """Every loader process of every rank read every shard's index (40.7 bytes a sample as Python
    ints: 3.8 GiB a process at 10^8): now each epoch reads the rank's shards' indexes, as int64."""
    import numpy as np

    import trainers.data as data_mod
    from trainers.data import epoch_shards

    asked = []
    real = data_mod.shard_index

    def recording(shards):
        got = real(shards)
        asked.append((list(shards), got))
        return got

    monkeypatch.setattr(data_mod, "shard_index", recording)
    _take(iter(_stream(indexed, 1, 2, LoaderState())), 2)
    shards = list_shards(indexed / "shards")
    mine = epoch_shards(shards, 0, 0, 1, 2)
    read = [s for got, _ in asked for s in got]
    assert set(read) <= set(mine) | {shards[0]} and len(asked[-1][0]) == len(mine) < len(shards)
    assert all(v["offsets"].dtype == np.int64 for _, got in asked for v in got.values())
