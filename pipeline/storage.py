"""Run folders in object storage: `--run-dir s3://bucket/prefix`.

The bucket is the run folder. Ray tasks, actors and training workers read and write it directly
(stages/dataplane.py: Storage), so a node needs no disk in common with the driver; the runner keeps
each stage's control files there too. The driver keeps a working copy
(`~/.cache/capline/runs/<bucket>/<prefix>`, or CAPLINE_CACHE) of what it writes itself (the
manifest, config, reports, the demo's site) and mirrors it by content:

- `push_stage` uploads the files of a stage the driver wrote whose sha256 differs from what the
  bucket's last `_SUCCESS` recorded; the runner writes `_SUCCESS` (with every file's sha256) last;
- `pull` downloads, for every stage the bucket has finished, what the working copy lacks or holds
  with another checksum, `_SUCCESS` last, refuses object keys that would land outside the working
  copy, checks each file against its recorded sha256 and the stage's output digest, and says which
  stage is inconsistent if one is.

Credentials come from the environment (see infra/storage.py) and are never written anywhere.
Checked before any work: the bucket exists and the credentials are accepted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from infra.hashing import hash_file as file_sha256
from infra.errors import UserError
from infra.storage import filesystem, is_uri

TOP_FILES = ("manifest.json", "config.yaml", "report.html")
CONTROL = ("parts.json", "stats.json", "_STARTED", "_SUCCESS")
SKIP = ("_work", ".capline.lock")


def cache_root() -> Path:
    return Path(os.environ.get("CAPLINE_CACHE", "~/.cache/capline")).expanduser() / "runs"



class RunStore:
    """Where a run lives: a local folder, or a bucket prefix mirrored in a local folder."""

    def __init__(self, where: str):
        self.uri = where if is_uri(where) else None
        if self.uri:
            import urllib.parse

            # as pyarrow decodes it (%2E%2E is '..')
            key = urllib.parse.unquote(self.uri.split("://", 1)[1].split("?", 1)[0])
            if any(p in (".", "..") for p in key.split("/")) or "\\" in key:
                # the working copy is cache_root()/<bucket>/<prefix>: a '..' would put it anywhere on disk
                raise UserError(f"run folder {self.uri}: '.' and '..' are not folder names in a bucket (percent-encoded "
                                "or not); give the run folder's URI without them")
            self.fs, self.root = filesystem(self.uri)
            self.local = cache_root() / self.root
            if not self.local.resolve().is_relative_to(cache_root().resolve()):   # whatever else decodes to it
                raise UserError(f"run folder {self.uri}: its working copy would be outside capline's cache "
                                f"({self.local}); give the run folder's URI without '.' or '..'")
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

    # -- mirror ----------------------------------------------------------------------------------
    def storage(self):
        """The run folder's Storage, made once: opening an S3 filesystem costs ~30 ms, and an append's
        driver asked for it 19 times (a Storage holds no state beyond its filesystem and root)."""
        if getattr(self, "_storage", None) is None:
            from stages.dataplane import Storage

            self._storage = Storage.from_uri(self.uri) if self.uri else Storage.local(self.local)
        return self._storage

    def _inside(self, rel: str) -> Path:
        """The working-copy path of an object key; a key that would land outside it is refused."""
        root = self.local.resolve()
        dst = (root / rel).resolve()
        # a file strictly inside: "", "." or "basic/.." name the working copy itself
        if (rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in rel.split("/"))
                or root not in dst.parents):
            raise UserError(f"storage: {self.uri}: object key {rel!r} would be written outside the working copy "
                            f"{root}; refusing to pull it (someone wrote a hostile key into the bucket)")
        return dst

    def _download(self, storage, rel: str, expect: str | None) -> bool:
        """Fetch one object unless the working copy holds it with the expected checksum. -> fetched."""
        dst = self._inside(rel)
        local = file_sha256(dst) if dst.is_file() else None
        if expect and local == expect:
            return False
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        got = storage.download(rel, tmp)      # streamed: a tar of the full pull may be GBs
        if expect and got != expect:
            tmp.unlink()
            raise UserError(f"storage: {self.uri}/{rel} does not match the sha256 its stage's _SUCCESS recorded; "
                            f"the bucket's copy of stage {rel.split('/', 1)[0]} is inconsistent (rerun it)")
        if local == got:    # a small control file, recorded nowhere: compared once read
            tmp.unlink()
            return False
        os.replace(tmp, dst)
        return True

    def _keep(self, rel: str, data: bytes) -> bool:
        """Write bytes already read (and checked) to the working copy. -> changed."""
        dst = self._inside(rel)
        if dst.is_file() and dst.read_bytes() == data:
            return False
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, dst)
        return True

    def pull(self, log=print, full: bool = False) -> int:
        """Bring the bucket's finished stages into the working copy. The run itself needs only what the
        driver reads (control files, driver-written files); `full` takes every file (for the tools
        that inspect a run locally). Stages side by side, each file one GET (a file that is not
        there is not asked about first): an append's start read 35 files one after another. ->
        files fetched."""
        if not self.uri:
            return 0
        from infra.storage import in_parallel

        storage = self.storage()
        n = sum(in_parallel(lambda rel: self._download_if_any(storage, rel), list(TOP_FILES)))
        got = in_parallel(lambda d: self._pull_stage(storage, d, full), storage.list_dirs(""), at_once=8)
        n += sum(g for g in got if g is not None)
        if n:
            log(f"storage: fetched {n} files of {sum(g is not None for g in got)} finished stages from {self.uri}")
        return n

    def _download_if_any(self, storage, rel: str) -> int:
        try:
            return int(self._download(storage, rel, None))
        except FileNotFoundError:
            return 0

    def _pull_stage(self, storage, stage: str, full: bool) -> int | None:
        """One stage's files, if it finished (its `_SUCCESS` read once: the copy validated below is the
        copy kept, where a re-download could be another). -> files fetched, None if unfinished."""
        from stages.dataplane import parts_from_json

        from .runner import output_digest

        try:
            raw = storage.read_bytes(f"{stage}/_SUCCESS")
        except FileNotFoundError:
            return None
        try:
            marker = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise UserError(f"storage: {self.uri}/{stage}/_SUCCESS is not JSON; rerun the stage") from None
        n = 0
        files = marker.get("files", {})
        wanted = set(marker.get("driver_files", []))
        if full:
            wanted |= set(files) | {r for r in storage.list(stage, recursive=True)
                                    if not any(p in SKIP for p in r.split("/"))}
        for rel in sorted(wanted - {f"{stage}/{c}" for c in CONTROL}):
            n += self._download(storage, rel, files.get(rel))
        for name in CONTROL[:-1]:
            n += self._download_if_any(storage, f"{stage}/{name}")
        parts = parts_from_json(json.loads((self.local / stage / "parts.json").read_text())) \
            if (self.local / stage / "parts.json").is_file() else []
        outputs = marker.get("outputs", {})
        if "files" in marker and (output_digest(parts, outputs, marker.get("chain")) != marker.get("output_digest") or any(
                files.get(p.file) != p.sha256 for p in parts)):
            raise UserError(f"storage: {self.uri}/{stage}: its _SUCCESS does not match its parts.json "
                            "(a stale _SUCCESS, or files rewritten after it); rerun the stage")
        return n + self._keep(f"{stage}/_SUCCESS", raw)   # last: finished here once whole

    def push_stage(self, stage: str, log=print, before: dict | None = None) -> dict[str, str]:
        """Upload the files of `stage` the driver wrote in the working copy (the workers wrote theirs
        to the bucket already), skipping those whose sha256 the bucket's last record (`before`) has.
        -> {path: sha256} of those files, for the stage's `_SUCCESS`."""
        if not self.uri:
            return {}
        storage, before = self.storage(), before or {}
        out, n = {}, 0
        folder = self.local / stage
        for p in sorted(folder.rglob("*")) if folder.is_dir() else ():
            rel = p.relative_to(self.local).as_posix()
            if not p.is_file() or p.name in CONTROL or p.name.endswith((".tmp", ".part")) or \
                    any(part in SKIP for part in rel.split("/")):
                continue
            out[rel] = file_sha256(p)
            if before.get(rel) == out[rel] and storage.exists(rel):
                continue
            storage.write_file(rel, p)
            n += 1
        if n:
            log(f"storage: {stage}: uploaded {n} files the driver wrote to {self.uri}/{stage}")
        return out

    def push_top(self) -> int:
        """Upload the working copy's top files (manifest, config, report)."""
        if not self.uri:
            return 0
        from infra.storage import in_parallel

        storage = self.storage()
        here = [rel for rel in TOP_FILES if (self.local / rel).is_file()]
        in_parallel(lambda rel: storage.write_bytes(rel, (self.local / rel).read_bytes()), here)
        return len(here)
