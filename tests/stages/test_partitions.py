"""Unit level: how ingest's shards become the later stages' partitions, and how a task holds a
bounded number of images however large its partition is."""
import io
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from infra.storage import Storage
from stages.dataplane import by_location, image_batches
from stages.ingest.stage import IngestConfig, shards_per_partition


def test_partitions_are_fixed_blocks_of_shards_from_the_config_alone():
    assert shards_per_partition(IngestConfig(samples_per_shard=250, compact_rows=1000)) == 4   # the demo: 2 partitions
    assert shards_per_partition(IngestConfig(samples_per_shard=1000)) == 20     # 20,000 rows: 5,000 partitions at 10^8
    assert shards_per_partition(IngestConfig(samples_per_shard=1000, compact_rows=1500)) == 1   # never splits a shard
    # nothing else goes in: not the cluster's CPUs, not the data's size (a grown list keeps its grouping)
    import inspect

    assert list(inspect.signature(shards_per_partition).parameters) == ["cfg"]


def _tar(path, sizes):
    offsets = []
    with open(path, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, n in enumerate(sizes):
            info = tarfile.TarInfo(f"{i:04d}.jpg")
            info.size = n
            tar.addfile(info, io.BytesIO(bytes([i % 256]) * n))
            offsets.append(f.tell() - ((n + 511) // 512) * 512)
    return offsets


def test_image_batches_bound_what_a_task_holds_and_read_each_tar_in_order(tmp_path):
    storage = Storage.local(tmp_path)
    rows = []
    for t in ("b.tar", "a.tar"):
        offs = _tar(tmp_path / t, [1000] * 50)
        rows += [{"key": f"{t}{i:03d}", "tar": t, "offset": o, "size": 1000} for i, o in enumerate(offs)]
    table = by_location(pa.Table.from_pylist(rows[::-1]))
    assert table.column("tar").to_pylist() == ["a.tar"] * 50 + ["b.tar"] * 50
    counter = {}
    got = list(image_batches(storage, table, batch_rows=30, batch_bytes=10**9, counter=counter))
    assert [b.num_rows for b, _ in got] == [30, 30, 30, 10]
    assert all(img == bytes([int(k[-3:]) % 256]) * 1000 for b, imgs in got for k, img in zip(b.column("key").to_pylist(), imgs))
    assert counter["requests"] == 5        # a batch reads each of its tars once: 1 + 2 + 1 + 1
    by_bytes = list(image_batches(storage, table, batch_rows=10**6, batch_bytes=25_000))
    assert [b.num_rows for b, _ in by_bytes] == [25, 25, 25, 25]


def test_range_buckets_written_for_one_count_serve_another(tmp_path):
    """A map file written for 7 buckets (an earlier, smaller run) read as 9 or 3: every row once,
    each in the bucket its hash says, a reducer reading only the row groups its range overlaps."""
    from infra.shuffle import range_buckets, read_range, write_ranges

    storage = Storage.local(tmp_path)
    h = np.random.default_rng(0).integers(0, 2**32, 10_000, dtype=np.uint64).astype(np.uint32)
    table = pa.table({"h": h, "v": np.arange(10_000)})
    write_ranges(storage, "a.parquet", table, "h", 7)
    assert pq.ParquetFile(tmp_path / "a.parquet").metadata.num_row_groups == 7
    for n, most_groups in ((7, 7), (9, 15), (3, 9)):
        counter = {}
        got = [read_range(storage, ["a.parquet"], "h", b, n, table.schema, counter) for b in range(n)]
        assert sorted(v for t in got for v in t.column("v").to_pylist()) == list(range(10_000))
        assert all((range_buckets(t.column("h").to_numpy(), n) == b).all() for b, t in enumerate(got))
        assert counter["groups"] == most_groups




def test_map_groups_gather_small_partitions_into_few_map_tasks_and_bound_each():
    """2,000 partitions of 36 signature rows on 16 CPUs: 16 map tasks of consecutive partitions,
    not 2,000; a budget smaller than that splits further; a partition above the budget stands
    alone; every partition in exactly one group, in order."""
    from infra.shuffle import map_groups

    groups = map_groups([36] * 2000, 2_000_000, 16)
    assert len(groups) == 16
    assert [i for g in groups for i in g] == list(range(2000))
    groups = map_groups([36] * 2000, 1000, 16)
    assert all(36 * len(g) <= 1000 for g in groups) and len(groups) == -(-2000 // (1000 // 36))   # 27 a group
    groups = map_groups([10, 5000, 10, 10], 100, 2)
    assert groups == [[0], [1], [2, 3]]
    assert map_groups([3, 3], 100, 16) == [[0], [1]]
    assert map_groups([], 100, 16) == []
