"""What the dedup steps hand each other: their files, folders and schemas."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pyarrow as pa


class Pair(NamedTuple):
    """Two samples a bucket found alike (a < b), with the partitions that hold them."""
    a: str
    part_a: str
    b: str
    part_b: str
    kind: str       # exact_duplicate | near_duplicate (a candidate until verified)

@dataclass(frozen=True)
class Signed:
    """What one partition's sign step wrote (its signatures are in `<out>.sig.parquet`); its record
    is this as JSON. `as_`: the prefix it was written under, said to this run only by a describe
    task that signed too (a later run's plan, or a file deleted since, is the sign step's to judge)."""
    part: str
    signed: int             # signature rows' samples: decodable, no evaluation match
    as_: str | None = None

    def to_json(self) -> dict:
        return {"part": self.part, "signed": self.signed}

    @classmethod
    def from_json(cls, d: dict) -> "Signed":
        return cls(d["part"], int(d["signed"]))


@dataclass(frozen=True)
class Described:
    """What one partition's describe step wrote (its descriptors are in `<out>.desc.parquet`); its
    record is this as JSON, without `signed` (the signatures made in the same task, this run's)."""
    part: str
    described: int
    undecodable: int
    signed: Signed | None = None

    def to_json(self) -> dict:
        return {"part": self.part, "described": self.described, "undecodable": self.undecodable}

    @classmethod
    def from_json(cls, d: dict) -> "Described":
        return cls(d["part"], int(d["described"]), int(d["undecodable"]))


@dataclass(frozen=True)
class Grouped:
    """What one group task found (its pairs and wanted descriptors are in its files)."""
    pairs: int
    wanted: int
    largest_group: int     # the most codes one band value held, compared in full
    rows: int              # signature rows in its bucket


@dataclass(frozen=True)
class Verified:
    """What one verify task decided of its pair bucket (its edges are in its file)."""
    exact: int
    candidates: int
    near: int
    edges: int
    told_apart: int = 0     # candidates at the thumbnail's threshold whose detail told them apart


@dataclass(frozen=True)
class Clusters:
    """The components task's decisions as counts (the decisions themselves are in DECISIONS)."""
    duplicates: int
    per_part: dict          # partition -> its dropped samples
    shown: dict             # reason -> the first few drops (key, cosine, kept key, their partitions)
    digests: dict           # partition -> a digest of its decisions (what reuse of its verdicts keys on)
    published_kept: int     # published samples kept beside the sample their cluster keeps
    edges: int = 0
    edges_carried: int = 0  # of the edges, those carried from the dataset line's


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

VEC_SCHEMA = pa.schema([("key", pa.string()), ("vec", pa.binary()), ("detail", pa.binary()), ("pair_bucket", pa.int32())])

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
