"""What the dedup steps hand each other: their files, folders and schemas."""
from __future__ import annotations

from typing import NamedTuple

import pyarrow as pa


class Pair(NamedTuple):
    """Two samples a bucket found alike (a < b), with the partitions that hold them."""
    a: str
    part_a: str
    b: str
    part_b: str
    kind: str       # exact_duplicate | near_duplicate (a candidate until verified)

PIXELS, URL_CAPTION = 0, 1   # sig_kind of the exact signatures; band b is 2 + b

PAIR_DIR, EDGE_DIR, DECISIONS = "dedup/_work/pairs", "dedup/_work/edges", "dedup/_work/decisions.parquet"

WANTED_DIR = "dedup/_work/wanted"

# the dataset line's edges (every exact pair and verified near pair of the partitions it holds), kept
# across runs (DedupStage.preserve): `line.json` names the file and each partition's signatures it was
# found from, so an append searches only the groups its new partitions touch (stage.py: incremental)
LINE_EDGES = "dedup/edges"
LINE_EDGES_RECORD = f"{LINE_EDGES}/line.json"

# a near candidate's side: its descriptor is wanted by a pair bucket; fetched by the task of its partition's group
WANTED_SCHEMA = pa.schema([("key", pa.string()), ("part", pa.string()), ("pair_bucket", pa.int32()),
                           ("fetch_bucket", pa.int32())])

VEC_SCHEMA = pa.schema([("key", pa.string()), ("vec", pa.binary()), ("pair_bucket", pa.int32())])

PAIR_SCHEMA = pa.schema([("a", pa.string()), ("part_a", pa.string()), ("b", pa.string()), ("part_b", pa.string()),
                         ("kind", pa.string()), ("pair_bucket", pa.int32())])

EDGE_SCHEMA = pa.schema([("a", pa.string()), ("part_a", pa.string()), ("b", pa.string()), ("part_b", pa.string()),
                         ("kind", pa.string()), ("cosine", pa.float64())])

DECISION_SCHEMA = pa.schema([("key", pa.string()), ("reason", pa.string()), ("score", pa.float64()),
                             ("root", pa.string()), ("part", pa.int32())])

# a signature is (sig_kind, sig_hi, sig_lo): 16 bytes of a pixel or URL+caption hash, or a band's value
SIG_SCHEMA = pa.schema([("sig_kind", pa.int16()), ("sig_hi", pa.uint64()), ("sig_lo", pa.uint64()),
                        ("key", pa.string()), ("part", pa.string()), ("code", pa.binary()),
                        ("mean", pa.list_(pa.float32(), 3)), ("h32", pa.uint32())])
