"""WebDataset shards -> training batches: exact epochs over every rank and loader process, a
shuffle window, a resampled mode, and a position that resumes at any batch.

Epoch e's stream is the shards, in an order drawn from (seed, e), concatenated: sample positions
0 .. N-1. The order is a permutation, or in resampled mode shards drawn with replacement (open_clip's
`--dataset-resampled`). Rank r of W takes the contiguous block [r*n, (r+1)*n), n = N // W, and cuts
it into n // B batches of B: every rank steps equally often whatever the shards' sizes, and in an
epoch each sample lies in at most one batch of one rank (the cut drops fewer than W*B, a different
few each epoch, since the order is drawn again). Inside its block a rank shuffles the positions in
windows of `shuffle` samples (a permutation seeded by seed, epoch, rank and window): a shuffle buffer
that is the same again on resume. Loader process p of k decodes the g-th batch after the starting
position when g % k == p, so PyTorch's round-robin over processes hands them out in order, across
epochs too. The position (epoch, next batch) is all a resume needs.

A batch's samples are found through capline's index beside the shards (`index/NNNNNN.parquet`: key
-> offset of its first member; a shard without one is scanned once) and read as one ranged read per
run of neighbours. A process holds the sample count of every shard (8 bytes a shard), the current
window's permutation and the offsets of the last few shards it read: O(its window), not O(dataset).

Batch: images (B, 3, S, S) uint8 (resized, no crop, no flip; `as_input` makes them the model's
float [-1, 1] where they are used, on the GPU), labels (B, L) int64 (SentencePiece ids + EOS,
truncated keeping EOS, padded with 0).
"""
from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infra.errors import UserError
from infra.media import to_input, to_pixels
from infra.tars import tar_samples


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


def check_readers(samples: int, world: int, batch: int) -> None:
    if samples // world < batch:
        raise UserError(f"{samples} samples for {world} training workers of {batch} a batch: an epoch must give "
                        "every worker at least one batch; lower train.global_batch (or train.micro_batch) or "
                        "train.num_workers, or build more data")


def encode_caption(sp, text: str, max_len: int, eos: bool = True) -> np.ndarray:
    """eos: end with EOS (kept when truncated); without, the caption's own tokens only (ClipCap's
    reference trains so, and stops decoding at ".")."""
    ids = sp.encode(text)[: max_len - 1] + [1] if eos else sp.encode(text)[:max_len]
    out = np.zeros(max_len, np.int64)
    out[: len(ids)] = ids
    return out


def decode_image(data: bytes, size: int) -> np.ndarray:
    """(3, size, size) float32 in [-1, 1]: infra/media.py's one preprocessing."""
    return to_input(data, size)


def as_input(images: torch.Tensor) -> torch.Tensor:
    """A batch's uint8 images -> the float [-1, 1] every model reads (`to_input`'s scale), done where
    the batch is used: a quarter of the bytes cross processes and the copy to the GPU."""
    return images.float().div_(127.5).sub_(1.0)


def epoch_shards(n_shards: int, seed: int, epoch: int, resampled: bool = False) -> np.ndarray:
    """The epoch's shard order (indices): a permutation, or drawn with replacement."""
    rng = np.random.default_rng([seed, epoch])
    return rng.integers(0, n_shards, n_shards) if resampled else rng.permutation(n_shards)


def _index_of(shard) -> str | None:
    s = str(shard)
    folder, _, name = s.rpartition("/shards/")
    return f"{folder}/index/{name[:-4]}.parquet" if folder and name.endswith(".tar") else None


@functools.lru_cache(maxsize=16)
def shard_offsets(shard) -> tuple[np.ndarray, int]:
    """(offsets of the samples' first members as int64, file size) of one shard: from capline's index
    beside it, else by reading the tar's headers once (a WebDataset of the user's own)."""
    import pyarrow.parquet as pq

    from infra.storage import file_size, filesystem, is_uri

    size = file_size(str(shard))
    rel = _index_of(shard)
    try:
        if rel is None:
            raise FileNotFoundError(shard)
        if is_uri(rel):
            fs, path = filesystem(rel)
            table = pq.read_table(path, columns=["offset"], filesystem=fs)
        else:
            table = pq.read_table(rel, columns=["offset"])
        return table.column("offset").to_numpy().astype(np.int64), size
    except (OSError, FileNotFoundError):
        pass
    import tarfile

    from infra.storage import open_input
    from infra.tars import sample_key, tar_members

    firsts: dict = {}
    with open_input(str(shard)) as f, tarfile.open(fileobj=f, mode="r|") as tar:    # headers, streamed
        for m in tar_members(tar, shard):
            firsts.setdefault(sample_key(m.name)[0], m.offset)
    return np.fromiter(firsts.values(), np.int64, len(firsts)), size


def shard_counts(shards: list) -> np.ndarray:
    """Samples in each shard: from the `sizes.json` beside them (capline writes it, open_clip reads
    it) when it names them all, else from each shard's offsets."""
    from infra.storage import open_input

    folder = str(shards[0]).rpartition("/")[0]
    try:
        with open_input(f"{folder}/sizes.json") as f:
            listed = json.loads(f.read())
        names = [str(s).rpartition("/")[2] for s in shards]
        if all(str(s).rpartition("/")[0] == folder for s in shards) and all(n in listed for n in names):
            return np.array([int(listed[n]) for n in names], np.int64)
    except (OSError, FileNotFoundError, ValueError):
        pass
    return np.array([len(shard_offsets(s)[0]) for s in shards], np.int64)


class ShardStream(torch.utils.data.IterableDataset):
    """Yields whole batches (dicts) for one training worker, from `state` on, forever (epoch after epoch).
    shuffle: samples in a shuffle window (1: the stream's own order); resampled: shards drawn with
    replacement each epoch."""

    def __init__(self, shards: list[Path], tokenizer_path: str, batch_size: int, image_size: int, max_len: int,
                 seed: int, rank: int, world: int, state: LoaderState, keys: bool = False, eos: bool = True,
                 shuffle: int = 1, resampled: bool = False):
        self.shards, self.tokenizer_path, self.eos = shards, tokenizer_path, eos
        self.batch_size, self.image_size, self.max_len = batch_size, image_size, max_len
        self.seed, self.rank, self.world, self.state = seed, rank, world, state
        self.keys, self.shuffle, self.resampled = keys, max(1, shuffle), resampled

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        pid, k = (info.id, info.num_workers) if info else (0, 1)
        counts = shard_counts(self.shards)
        epoch, start = self.state.epoch, self.state.batch
        g = 0   # batches handed out since `state`, across epochs: process g % k owns batch g
        while True:
            order = epoch_shards(len(self.shards), self.seed, epoch, self.resampled)
            first = np.concatenate([[0], np.cumsum(counts[order])])   # stream position of each shard's first sample
            block = int(first[-1]) // self.world
            check_readers(int(first[-1]), self.world, self.batch_size)
            for b in range(start, block // self.batch_size):
                if g % k == pid:
                    pos = self.rank * block + self._shuffled(epoch, block, b)
                    samples = self._read(order, first, pos)
                    yield self._collate([key for key, _ in samples], [p for _, p in samples], epoch, b)
                g += 1
            epoch, start = epoch + 1, 0

    def _shuffled(self, epoch: int, block: int, b: int) -> np.ndarray:
        """Batch b's positions in the rank's block: positions b*B .. (b+1)*B - 1 of the block after each
        window of `shuffle` positions is permuted."""
        q = np.arange(b * self.batch_size, (b + 1) * self.batch_size)
        w = q // self.shuffle
        out = np.empty_like(q)
        for win in np.unique(w):
            lo = int(win) * self.shuffle
            out[w == win] = lo + self._window(epoch, int(win), min(self.shuffle, block - lo))[q[w == win] - lo]
        return out

    def _window(self, epoch: int, win: int, size: int) -> np.ndarray:
        if self.shuffle == 1:
            return np.zeros(1, np.int64)
        key = (epoch, win)
        if getattr(self, "_perm_key", None) != key:
            self._perm_key = key
            self._perm = np.random.default_rng([self.seed, epoch, self.rank, win, 17]).permutation(size)
        return self._perm

    def _read(self, order, first, pos: np.ndarray) -> list:
        """The samples at stream positions `pos`, in that order: one ranged read per run of
        neighbouring samples of one shard."""
        slot = np.searchsorted(first, pos, side="right") - 1          # which shard of the order
        local = pos - first[slot]
        got: dict = {}
        by = np.lexsort((local, slot))
        i = 0
        while i < len(by):
            s, a = int(slot[by[i]]), int(local[by[i]])
            j = i
            while j + 1 < len(by) and slot[by[j + 1]] == s and local[by[j + 1]] == local[by[j]] + 1:
                j += 1
            z = int(local[by[j]]) + 1
            shard = self.shards[int(order[s])]
            offsets, size = shard_offsets(shard)
            begin, end = int(offsets[a]), int(offsets[z]) if z < len(offsets) else size
            for n, sample in enumerate(samples_in_range(shard, begin, end - begin)):
                got[(s, a + n)] = sample
            i = j + 1
        return [got[(int(s), int(n))] for s, n in zip(slot, local)]

    def _collate(self, keys, parts_list, epoch, b):
        images = np.stack([to_pixels(p["jpg"], self.image_size) for p in parts_list])
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


def samples_in_range(shard, offset: int, size: int):
    """(key, {extension: bytes}) of the samples whose members lie in [offset, offset + size) of a tar."""
    from infra.storage import read_range_of

    return tar_samples(io.BytesIO(read_range_of(shard, offset, size)), f"{shard} bytes {offset}..{offset + size}")


def make_loader(stream: ShardStream, loader_workers: int, pin: bool = False) -> torch.utils.data.DataLoader:
    """`pin`: batches in page-locked memory, so the copy to a GPU runs beside its compute (non_blocking)."""
    return torch.utils.data.DataLoader(stream, batch_size=None, num_workers=loader_workers, pin_memory=pin,
                                       persistent_workers=False, prefetch_factor=4 if loader_workers else None)


def next_state(batch: dict) -> LoaderState:
    return LoaderState(batch["epoch"], batch["batch"] + 1)
