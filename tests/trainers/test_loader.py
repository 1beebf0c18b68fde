"""Unit: the training loader's epoch coverage, resume position, and the optimiser pieces."""
import json

import numpy as np
import pytest
import torch

from stages.source import synthetic
from helpers import write_shard
from stages.tokenizer import TokenizerConfig, train_sentencepiece
from trainers.data import LoaderState, ShardStream, check_readers, list_shards, make_loader, next_state
from infra.errors import UserError
from trainers.optim import lr_factor, param_groups


SIZES = (10, 14, 12, 12)       # uneven shards: a rank's share is cut by samples, not by shards


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """48 samples in 4 shards without capline's index (a user's own WebDataset)."""
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    scenes = [synthetic.random_scene(rng) for _ in range(48)]
    caps = [synthetic.caption_en(s) for s in scenes]
    (root / "shards").mkdir()
    first = np.concatenate([[0], np.cumsum(SIZES)])
    for n in range(4):
        write_shard(root / "shards" / f"{n:06d}.tar", [
            {"key": f"s{i:03d}", "image": synthetic.encode(synthetic.render(scenes[i], 40)), "ext": "jpg",
             "caption": caps[i], "meta": {}} for i in range(first[n], first[n + 1])])
    (root / "spm.model").write_bytes(train_sentencepiece(caps * 5, TokenizerConfig(vocab_size=320)))
    return root


def _stream(data, rank, world, state, batch=4, shuffle=1, resampled=False):
    return ShardStream(list_shards(data / "shards"), str(data / "spm.model"), batch, 32, 16, 0, rank, world,
                       state, keys=True, shuffle=shuffle, resampled=resampled)


def _take(loader_iter, n):
    return [next(loader_iter) for _ in range(n)]


def _epochs(data, world, loader_workers, epochs, **kw):
    """{epoch: [keys of every batch of every rank]} and the batches, over `epochs` whole epochs."""
    per_rank = 48 // world // 4
    seen, batches = {}, []
    for rank in range(world):
        got = _take(iter(make_loader(_stream(data, rank, world, LoaderState(), **kw), loader_workers)),
                    per_rank * epochs)
        assert [(b["epoch"], b["batch"]) for b in got] == [(e, i) for e in range(epochs) for i in range(per_rank)]
        for b in got:
            seen.setdefault(b["epoch"], []).extend(b["keys"])
        batches += got
    return seen, batches


@pytest.mark.slow   # background loader processes: seconds, out of the fast set
def test_every_sample_once_per_epoch_across_3_ranks_x_2_loader_processes_x_2_epochs(data):
    """Ranks read the shards r, r+W, ...: on 4 uneven shards 3 ranks saw some samples never and others
    three times over two epochs. Now each epoch is the shards' samples, each exactly once."""
    everything = [f"s{i:03d}" for i in range(48)]
    seen, batches = _epochs(data, 3, 2, 2, shuffle=7)
    assert sorted(seen[0]) == everything and sorted(seen[1]) == everything
    assert seen[0] != seen[1]                                   # drawn again each epoch
    ep0 = {tuple(b["keys"]) for b in batches if b["epoch"] == 0}
    assert not ep0 & {tuple(b["keys"]) for b in batches if b["epoch"] == 1}
    for b in batches:
        assert b["images"].shape == (4, 3, 32, 32) and b["images"].dtype == torch.uint8
        assert b["labels"].shape == (4, 16)


def test_the_shuffle_window_mixes_samples_that_file_order_keeps_together(data):
    plain, _ = _epochs(data, 1, 0, 1)
    mixed, _ = _epochs(data, 1, 0, 1, shuffle=48)
    assert sorted(mixed[0]) == sorted(plain[0]) and mixed[0] != plain[0]
    # file order: each batch is 4 neighbours of one shard's stream; shuffled over the whole epoch, few are
    neighbours = sum(int(b[1:]) - int(a[1:]) == 1 for a, b in zip(mixed[0], mixed[0][1:]))
    assert neighbours < 10 and sum(int(b[1:]) - int(a[1:]) == 1 for a, b in zip(plain[0], plain[0][1:])) > 30


@pytest.mark.slow   # background loader processes: seconds, out of the fast set
def test_resampled_epochs_draw_shards_with_replacement(data):
    from collections import Counter

    from trainers.data import epoch_shards

    orders = [epoch_shards(4, 0, e, resampled=True) for e in range(3)]
    assert any(len(set(o.tolist())) < 4 for o in orders)        # some shard drawn twice in an epoch
    first = np.concatenate([[0], np.cumsum(SIZES)])
    streams = [Counter(f"s{i:03d}" for s in o for i in range(first[s], first[s + 1])) for o in orders]
    per_rank = [sum(c.values()) // 2 // 4 for c in streams]     # the batches each of 2 ranks gets
    seen = [Counter() for _ in orders]
    for rank in range(2):
        for b in _take(iter(make_loader(_stream(data, rank, 2, LoaderState(), resampled=True), 1)), sum(per_rank)):
            seen[b["epoch"]].update(b["keys"])
    for e in range(3):
        assert sum(seen[e].values()) == 2 * per_rank[e] * 4 and not seen[e] - streams[e]
    assert any(max(c.values()) > 1 for c in seen)               # a sample twice in one epoch


@pytest.mark.slow   # background loader processes: seconds, out of the fast set
def test_resuming_mid_epoch_continues_with_the_next_batch(data):
    straight = _take(iter(make_loader(_stream(data, 1, 2, LoaderState(), shuffle=5), 2)), 10)
    first = _take(iter(make_loader(_stream(data, 1, 2, LoaderState(), shuffle=5), 2)), 3)
    state = next_state(first[-1])
    assert state.to_dict() == {"epoch": 0, "batch": 3}
    rest = _take(iter(make_loader(_stream(data, 1, 2, state, shuffle=5), 1)), 7)   # another loader count too
    assert [b["keys"] for b in first + rest] == [b["keys"] for b in straight]
    assert all(torch.equal(a["labels"], b["labels"]) and torch.equal(a["images"], b["images"])
               for a, b in zip(first + rest, straight))


def test_batches_are_uint8_that_as_input_scales_as_the_one_preprocessing(data):
    from infra.media import to_input
    from infra.tars import tar_samples
    from trainers.data import as_input

    b = next(iter(make_loader(_stream(data, 0, 1, LoaderState()), 0)))
    every = {k: p for shard in list_shards(data / "shards") for k, p in tar_samples(shard, shard)}
    for key, image in zip(b["keys"], as_input(b["images"])):
        assert torch.allclose(image, torch.from_numpy(to_input(every[key]["jpg"], 32)), atol=1e-6)


def test_labels_end_with_eos_and_pad_with_zero(data):
    b = next(iter(make_loader(_stream(data, 0, 1, LoaderState()), 0)))
    for row in b["labels"].tolist():
        n = row.index(1)
        assert all(t == 0 for t in row[n + 1:]) and all(t > 1 for t in row[:n])


def test_too_few_samples_and_no_shards_are_errors(tmp_path):
    with pytest.raises(UserError, match="47 samples for 3 training workers of 16 a batch"):
        check_readers(47, 3, 16)
    check_readers(48, 3, 16)
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
    """The same shards laid out as the shard stage writes them: shards/ with sizes.json and, beside
    it, index/ (key -> offset of the sample's first member)."""
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
    (root / "shards" / "sizes.json").write_text(json.dumps({f"{n:06d}.tar": k for n, k in enumerate(SIZES)}))
    shutil.copy(data / "spm.model", root / "spm.model")
    return root


@pytest.mark.slow   # background loader processes: seconds, out of the fast set
def test_with_the_shard_index_a_batch_is_one_read_per_run_of_neighbours(data, indexed, monkeypatch):
    import infra.storage

    read = []
    real = infra.storage.read_range_of
    monkeypatch.setattr(infra.storage, "read_range_of", lambda p, o, n: read.append((p, n)) or real(p, o, n))
    scanned = _take(iter(_stream(data, 1, 2, LoaderState())), 6)     # no index: the tars' headers scanned once
    read.clear()
    ranged = _take(iter(_stream(indexed, 1, 2, LoaderState())), 6)
    assert [b["keys"] for b in ranged] == [b["keys"] for b in scanned]         # the same batches, in order
    assert all(torch.equal(a["images"], b["images"]) for a, b in zip(ranged, scanned))
    # file order: a batch within one shard is one read; one across two shards two; the bytes of rank 1's
    # half of the epoch, each once
    assert len(read) <= 6 + 2
    shards = list_shards(indexed / "shards")
    assert sum(n for _, n in read) <= sum(p.stat().st_size for p in shards) * 0.6
    both = _take(iter(make_loader(_stream(indexed, 1, 2, LoaderState()), 2)), 6)
    assert [b["keys"] for b in both] == [b["keys"] for b in scanned]


def test_a_process_holds_the_offsets_of_the_shards_it_reads_only(indexed):
    """Every loader process of every rank read every shard's index (40.7 bytes a sample as Python
    ints: 3.8 GiB a process at 10^8); now a process reads the offsets of the shards its batches lie
    in, as int64, a few kept at a time."""
    from trainers.data import epoch_shards, shard_offsets

    shard_offsets.cache_clear()
    _take(iter(_stream(indexed, 0, 2, LoaderState())), 1)          # rank 0's first batch: 4 samples
    shards = list_shards(indexed / "shards")
    first_shard = shards[int(epoch_shards(4, 0, 0)[0])]
    assert shard_offsets.cache_info().currsize == 1
    offsets, _ = shard_offsets(first_shard)
    assert offsets.dtype == np.int64 and len(offsets) == SIZES[int(epoch_shards(4, 0, 0)[0])]
