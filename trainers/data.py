"""WebDataset shards -> training batches, each worker a disjoint part of every epoch, resumable.

Order: a worker (rank r of W) reads the shards r, r+W, r+2W, ... of the epoch's shard order (a
permutation seeded by seed and epoch), samples in file order. Its stream is cut into batches
b = 0, 1, 2, ...; with k background loader processes, process p decodes the g-th batch after the
starting position when g % k == p, so PyTorch's round-robin over processes hands them out as start, start+1, ...
in order, across epoch boundaries too. The loader's position is (epoch, next batch): resuming from it continues with the next
batch, not the start of the epoch. An epoch's last partial batch is dropped (every worker must step
equally often); each sample is otherwise seen exactly once per epoch.

Batch: images (B, 3, S, S) float in [-1, 1] (resized, no crop, no flip), labels (B, L) int64
(SentencePiece ids + EOS, truncated keeping EOS, padded with 0).
"""
from __future__ import annotations

from infra.media import to_input
from infra.tars import tar_samples
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infra.errors import UserError


@dataclass
class LoaderState:
    epoch: int = 0
    batch: int = 0   # the next batch of this epoch

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}


def list_shards(shard_dir) -> list:
    """The shard files of a folder (Paths) or of an object-storage prefix (URIs, read streaming)."""
    from infra.storage import is_uri, list_files

    shards = list_files(shard_dir, ".tar") if is_uri(shard_dir) else sorted(Path(shard_dir).glob("*.tar"))
    if not shards:
        raise UserError(f"no shards (*.tar) in {shard_dir}; run the pipeline's shard stage first")
    return shards


def check_readers(n_shards: int, world: int, loader_workers: int) -> None:
    if n_shards < world:
        raise UserError(f"{n_shards} shards for {world} training workers: every worker needs at least one "
                        "shard; write more shards (stages.shard.min_shards, or a smaller stages.shard.samples_per_shard) "
                        "or use fewer workers")
    del loader_workers  # loader processes split batches, not shards: any number works


def encode_caption(sp, text: str, max_len: int, eos: bool = True) -> np.ndarray:
    """eos: end with EOS (kept when truncated); without, the caption's own tokens only (ClipCap's
    reference trains so, and stops decoding at ".")."""
    ids = sp.encode(text)[: max_len - 1] + [1] if eos else sp.encode(text)[:max_len]
    out = np.zeros(max_len, np.int64)
    out[: len(ids)] = ids
    return out


def decode_image(data: bytes, size: int) -> np.ndarray:
    """(3, size, size) in [-1, 1]: infra/media.py's one preprocessing."""
    return to_input(data, size)


def epoch_shards(shards: list[Path], seed: int, epoch: int, rank: int, world: int) -> list[Path]:
    order = np.random.default_rng([seed, epoch]).permutation(len(shards))
    return [shards[i] for i in order[rank::world]]


def shard_index(shards: list) -> dict | None:
    """shard -> {offsets of its samples' first members, file size}, from capline's index beside the
    shards (`shard/index/NNNNNN.parquet` for `shard/shards/NNNNNN.tar`); None if any shard has none."""
    import pyarrow.parquet as pq

    from infra.storage import file_size, filesystem, is_uri

    out = {}
    for shard in shards:
        s = str(shard)
        folder, _, name = s.rpartition("/shards/")
        rel = f"{folder}/index/{name[:-4]}.parquet" if folder and name.endswith(".tar") else None
        if rel is None:
            return None
        try:
            if is_uri(rel):
                fs, path = filesystem(rel)
                table = pq.read_table(path, columns=["offset"], filesystem=fs)
            else:
                table = pq.read_table(rel, columns=["offset"])
        except (OSError, FileNotFoundError):
            return None
        # int64, not Python ints: 8 bytes a sample where a list took 40.7 (3.8 GiB a process at 10^8)
        out[shard] = {"offsets": table.column("offset").to_numpy().astype(np.int64), "size": file_size(s)}
    return out


def samples_in_range(shard, offset: int, size: int):
    """(key, {extension: bytes}) of the samples whose members lie in [offset, offset + size) of a tar."""
    import io

    from infra.storage import read_range_of

    return tar_samples(io.BytesIO(read_range_of(shard, offset, size)), f"{shard} bytes {offset}..{offset + size}")


def iter_samples(shards: list[Path]):
    """(key, {extension: bytes}) in file order, from capline's final shards (local paths or URIs)."""
    for path in shards:
        yield from tar_samples(path, path)


class ShardStream(torch.utils.data.IterableDataset):
    """Yields whole batches (dicts) for one training worker, from `state` on, forever (epoch after epoch)."""

    def __init__(self, shards: list[Path], tokenizer_path: str, batch_size: int, image_size: int, max_len: int,
                 seed: int, rank: int, world: int, state: LoaderState, keys: bool = False, eos: bool = True):
        self.shards, self.tokenizer_path, self.eos = shards, tokenizer_path, eos
        self.batch_size, self.image_size, self.max_len = batch_size, image_size, max_len
        self.seed, self.rank, self.world, self.state = seed, rank, world, state
        self.keys = keys

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        pid, k = (info.id, info.num_workers) if info else (0, 1)
        if shard_index(self.shards[:1]) is not None:   # capline's shards: read by index, the rank's alone
            yield from self._indexed(pid, k)
            return
        # shards without capline's index (a user's own WebDataset): every loader process streams the
        # rank's shards and keeps its own batches
        epoch, start = self.state.epoch, self.state.batch
        g = 0  # batches handed out since `state`, across epochs: process g % k owns batch g
        while True:
            batch_keys, parts_list, b = [], [], 0
            for key, parts in iter_samples(epoch_shards(self.shards, self.seed, epoch, self.rank, self.world)):
                mine = b >= start and g % k == pid
                batch_keys.append(key if mine else None)
                if mine:
                    parts_list.append(parts)
                if len(batch_keys) == self.batch_size:
                    if mine:
                        yield self._collate(batch_keys, parts_list, epoch, b)
                    if b >= start:
                        g += 1
                    batch_keys, parts_list, b = [], [], b + 1
            epoch, start = epoch + 1, 0

    def _indexed(self, pid: int, k: int):
        """Each loader process reads only the byte ranges of its own batches (batch g since `state` is
        process g % k's), found through the shards' index (key -> offset of its first member); a resumed
        stream starts at its batch, reading nothing before it. The batches are those of the streamed
        path: the rank's epoch shards, concatenated, cut into full batches. Each epoch reads the index
        of the rank's shards of that epoch only: memory and start-up O(the rank's shards), not the
        dataset's."""
        epoch, start = self.state.epoch, self.state.batch
        g = 0
        while True:
            order = epoch_shards(self.shards, self.seed, epoch, self.rank, self.world)
            index = shard_index(order)
            if index is None:
                raise UserError(f"the shard index beside {order[0]} is incomplete (a shard of this epoch has no "
                                "index/NNNNNN.parquet); `capline verify` the run folder")
            counts = [len(index[s]["offsets"]) for s in order]
            first = np.concatenate([[0], np.cumsum(counts)])          # stream position of each shard's first sample
            for b in range(start, int(first[-1]) // self.batch_size):
                if g % k == pid:
                    samples = list(self._read_batch(order, index, first, b * self.batch_size, self.batch_size))
                    yield self._collate([key for key, _ in samples], [p for _, p in samples], epoch, b)
                g += 1
            epoch, start = epoch + 1, 0

    def _read_batch(self, order, index, first, lo: int, n: int):
        """Samples [lo, lo + n) of the epoch's stream, one ranged read per shard they lie in."""
        hi = lo + n
        for s, shard in enumerate(order):
            a, z = max(lo, int(first[s])), min(hi, int(first[s + 1]))
            if a >= z:
                continue
            offsets, size = index[shard]["offsets"], index[shard]["size"]
            begin = int(offsets[a - first[s]])
            end = int(offsets[z - first[s]]) if z - first[s] < len(offsets) else size
            yield from samples_in_range(shard, begin, end - begin)

    def _collate(self, keys, parts_list, epoch, b):
        images = np.stack([decode_image(p["jpg"], self.image_size) for p in parts_list])
        labels = np.stack([encode_caption(self._sp(), p["txt"].decode(), self.max_len, self.eos) for p in parts_list])
        out = {"images": torch.from_numpy(images), "labels": torch.from_numpy(labels),
               "epoch": epoch, "batch": b}
        if self.keys:
            out["keys"] = keys
        return out

    def _sp(self):
        """The tokenizer (SentencePiece file or a Hugging Face LM's folder), opened once in whichever
        process iterates."""
        if not hasattr(self, "_spm"):
            from .tokenizer import open_tokenizer

            self._spm = open_tokenizer(self.tokenizer_path)
        return self._spm


def make_loader(stream: ShardStream, loader_workers: int, pin: bool = False) -> torch.utils.data.DataLoader:
    """`pin`: batches in page-locked memory, so the copy to a GPU runs beside its compute (non_blocking)."""
    return torch.utils.data.DataLoader(stream, batch_size=None, num_workers=loader_workers, pin_memory=pin,
                                       persistent_workers=False, prefetch_factor=4 if loader_workers else None)


def next_state(batch: dict) -> LoaderState:
    return LoaderState(batch["epoch"], batch["batch"] + 1)

