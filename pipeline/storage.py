"""Run folders in object storage: `--run-dir s3://bucket/prefix`.

Stages work on local files, so an object-storage run folder is mirrored: capline works in a local
copy (`~/.cache/capline/runs/<bucket>/<prefix>`, or CAPLINE_CACHE) and the bucket holds the durable
run. At start it downloads what the bucket has (finished stages, the manifest), so a run killed on
one machine resumes on another where it stopped; after every finished stage it uploads that
stage's files, `_SUCCESS` last, then the manifest. Training reads its shards from the bucket itself.

Credentials come from the environment (see trainers/remote.py) and are never written anywhere.
Checked before any work: the bucket exists and the credentials are accepted.
"""
from __future__ import annotations

import os
from pathlib import Path

from trainers.errors import UserError
from trainers.remote import filesystem, is_uri

TOP_FILES = ("manifest.json", "config.yaml", "report.html")
SKIP = ("_work", ".capline.lock")


def cache_root() -> Path:
    return Path(os.environ.get("CAPLINE_CACHE", "~/.cache/capline")).expanduser() / "runs"


class RunStore:
    """Where a run lives: a local folder, or a bucket prefix mirrored in a local folder."""

    def __init__(self, where: str):
        self.uri = where if is_uri(where) else None
        if self.uri:
            self.fs, self.root = filesystem(self.uri)
            self.local = cache_root() / self.root
        else:
            self.fs, self.root, self.local = None, None, Path(where)

    def __str__(self) -> str:
        return self.uri or str(self.local)

    # -- checks -------------------------------------------------------------------------------
    def check(self) -> None:
        """A one-line UserError if the bucket is missing or the credentials are refused."""
        if not self.uri:
            return
        import pyarrow.fs as pafs

        bucket = self.root.split("/", 1)[0]
        try:
            info = self.fs.get_file_info(bucket)
            if info.type == pafs.FileType.NotFound:
                raise UserError(f"run folder {self.uri}: the bucket {bucket} does not exist (create it, or check "
                                "AWS_ENDPOINT_URL / the region)")
            self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError as err:
            text = str(err)
            if "ACCESS_DENIED" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text \
                    or "403" in text:
                raise UserError(f"run folder {self.uri}: the storage refused the credentials "
                                "(check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)") from None
            if "NO_SUCH_BUCKET" in text:
                raise UserError(f"run folder {self.uri}: the bucket {bucket} does not exist") from None
            raise UserError(f"run folder {self.uri}: cannot reach the storage ({text.splitlines()[0][:200]})") from None

    # -- mirror -------------------------------------------------------------------------------
    def _remote_files(self, prefix: str) -> dict[str, int]:
        import pyarrow.fs as pafs

        base = f"{self.root}/{prefix}".rstrip("/")
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return {i.path[len(self.root) + 1:]: i.size for i in infos if i.type == pafs.FileType.File}

    def pull(self, log=print) -> int:
        """Download the finished stages and the manifest that the bucket has and the cache lacks. -> files."""
        if not self.uri:
            return 0
        remote = self._remote_files("")
        finished = {rel.split("/", 1)[0] for rel in remote if rel.endswith("/_SUCCESS") and rel.count("/") == 1}
        wanted = [rel for rel in remote if rel in TOP_FILES or rel.split("/", 1)[0] in finished]
        n = 0
        # _SUCCESS last: a stage counts as finished here only once all its files are
        for rel in sorted(wanted, key=lambda r: r.endswith("/_SUCCESS")):
            dst = self.local / rel
            if dst.is_file() and dst.stat().st_size == remote[rel]:
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".part")
            with self.fs.open_input_stream(f"{self.root}/{rel}") as src, open(tmp, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            os.replace(tmp, dst)
            n += 1
        if n:
            log(f"storage: fetched {n} files of {len(finished)} finished stages from {self.uri}")
        return n

    def push(self, rel_dir: str | None = None, log=print) -> int:
        """Upload one stage folder (or only the top files), `_SUCCESS` last, then the manifest."""
        if not self.uri:
            return 0
        local_files = []
        if rel_dir:
            for p in sorted((self.local / rel_dir).rglob("*")):
                rel = p.relative_to(self.local).as_posix()
                if p.is_file() and not any(part in SKIP for part in rel.split("/")) and not p.name.endswith(".tmp"):
                    local_files.append(rel)
        local_files.sort(key=lambda r: r.endswith("/_SUCCESS"))
        local_files += [f for f in TOP_FILES if (self.local / f).is_file()]
        remote = self._remote_files(rel_dir or "") if rel_dir else {}
        n = 0
        for rel in local_files:
            src = self.local / rel
            if rel not in TOP_FILES and remote.get(rel) == src.stat().st_size:
                continue
            with open(src, "rb") as f, self.fs.open_output_stream(f"{self.root}/{rel}") as out:
                while chunk := f.read(1 << 22):
                    out.write(chunk)
            n += 1
        if rel_dir:
            log(f"storage: {rel_dir}: uploaded {n} files to {self.uri}/{rel_dir}")
        return n

    def location(self, rel: str):
        """Where later readers find `rel`: the bucket for an object-storage run, else the local path."""
        return f"{self.uri.rstrip('/')}/{rel}" if self.uri else self.local / rel
