"""S3 objects at one request each, retried inside: what `Storage` does on an s3:// run folder.

pyarrow's S3 filesystem acts as if a bucket had folders: every write PUTs an empty marker per folder
level, then uploads in three requests (multipart), every read HEADs first, and a delete re-creates
its parent's marker. Thousands of tasks finishing together then PUT the same few marker keys, past
S3's 3,500 writes per second per prefix, and get 503 SlowDown. Here an object is one request:

- `put`: one PutObject (multipart only past `MULTIPART_BYTES`, S3's single-PUT limit is 5 GB);
- `get`: one GetObject, ranged where asked; no HEAD (a missing key is the GET's 404);
- `delete`: DeleteObjects, up to 1,000 keys a request;
- `list`: ListObjectsV2, 1,000 keys a request.

Every request is retried on SlowDown, 500/502/503/504, throttling, resets and timeouts, with
exponential backoff and full jitter (sleep uniform in [0, min(cap, base * 2^attempt)]) until
`RETRY_SECONDS` of waiting are spent: a burst of SlowDowns is outlasted rather than turned into a
failed Ray task. botocore's own retries are off so that this is the one policy (and counted).
Credentials and endpoint come from the environment, as for pyarrow (infra/storage.py).
"""
from __future__ import annotations

import os
import random
import threading
import time

MULTIPART_BYTES = 4 << 30          # below this an upload is one PUT (S3 allows 5 GB)
DELETE_BATCH = 1000                # S3's most keys per DeleteObjects
RETRY_BASE, RETRY_CAP = 0.1, 10.0  # seconds: first backoff ceiling, largest single wait
RETRY_SECONDS = float(os.environ.get("CAPLINE_STORAGE_RETRY_SECONDS", "180"))   # waiting, per request
RETRY_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeTooSkewed",
               "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
               "500", "502", "503", "504"}

# what this process's requests met (a benchmark or a task's result reads it)
COUNTS: dict[str, int] = {"requests": 0, "retries": 0, "slowdowns": 0}
_lock = threading.Lock()
_clients: dict = {}


def _count(name: str, n: int = 1) -> None:
    with _lock:
        COUNTS[name] = COUNTS.get(name, 0) + n


def client():
    """One boto3 S3 client per process (clients are thread-safe, not picklable: a Ray task makes its
    own), with botocore's retries off and a pool for parallel reads."""
    key = (os.getpid(), os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_DEFAULT_REGION"))
    if key not in _clients:
        import boto3
        from botocore.config import Config

        _clients[key] = boto3.session.Session().client("s3", config=Config(
            retries={"max_attempts": 1, "mode": "standard"}, max_pool_connections=32,
            connect_timeout=10, read_timeout=60))
    return _clients[key]


def _retryable(err: Exception) -> str | None:
    """The name of a transient fault, or None for one that retrying cannot fix."""
    from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, ReadTimeoutError
    from botocore.exceptions import ResponseStreamingError

    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = str(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return code if code in RETRY_CODES else (status if status in RETRY_CODES else None)
    if isinstance(err, (BotoConnectionError, ReadTimeoutError, ResponseStreamingError, ConnectionError, TimeoutError)):
        return type(err).__name__
    return None


def call(what: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` (one request, and reading its body), retried as this module says."""
    waited, attempt = 0.0, 0
    while True:
        _count("requests")
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - sorted into transient and final below
            fault = _retryable(err)
            if fault is None:
                raise
            if fault in ("SlowDown", "503"):
                _count("slowdowns")
            pause = random.uniform(0, min(RETRY_CAP, RETRY_BASE * 2 ** attempt))
            if waited + pause > RETRY_SECONDS:
                raise OSError(f"storage: {what}: still {fault} after {attempt + 1} attempts over {waited:.0f} s "
                              "(the store is refusing requests; raise CAPLINE_STORAGE_RETRY_SECONDS or lower "
                              "the tasks in flight)") from None
            _count("retries")
            time.sleep(pause)
            waited += pause
            attempt += 1


def split(path: str) -> tuple[str, str]:
    """'bucket/key/...' (a pyarrow S3 path) -> (bucket, key)."""
    bucket, _, key = path.partition("/")
    return bucket, key


def put(path: str, body, size: int | None = None) -> None:
    """One PutObject of `body` (bytes, or a seekable file of `size` bytes; past MULTIPART_BYTES a
    multipart upload, the only way S3 takes it)."""
    bucket, key = split(path)
    c = client()
    if size is not None and size > MULTIPART_BYTES:
        from boto3.s3.transfer import TransferConfig

        call(f"upload {path}", lambda: (body.seek(0), c.upload_fileobj(body, bucket, key, Config=TransferConfig(
            multipart_threshold=MULTIPART_BYTES, multipart_chunksize=256 << 20))))
        return

    def once():
        if hasattr(body, "seek"):
            body.seek(0)
        c.put_object(Bucket=bucket, Key=key, Body=body)

    call(f"write {path}", once)


def get(path: str, offset: int | None = None, size: int | None = None) -> bytes:
    """The object's bytes (or `size` from `offset`): one GetObject; FileNotFoundError if missing."""
    bucket, key = split(path)
    c = client()
    extra = {"Range": f"bytes={offset}-{offset + size - 1}"} if offset is not None and size else {}
    if offset is not None and not size:
        return b""

    def once():
        try:
            return c.get_object(Bucket=bucket, Key=key, **extra)["Body"].read()
        except c.exceptions.NoSuchKey:
            raise FileNotFoundError(f"{path}: no such object") from None

    return call(f"read {path}", once)


def download(path: str, local_path, chunk: int = 1 << 22):
    """Stream an object into a local file; -> sha256 hex of its bytes."""
    import hashlib

    bucket, key = split(path)
    c = client()

    def once():
        h = hashlib.sha256()
        try:
            body = c.get_object(Bucket=bucket, Key=key)["Body"]
        except c.exceptions.NoSuchKey:
            raise FileNotFoundError(f"{path}: no such object") from None
        with open(local_path, "wb") as out:
            for piece in body.iter_chunks(chunk):
                h.update(piece)
                out.write(piece)
        return h.hexdigest()

    return call(f"read {path}", once)


def head(path: str) -> int | None:
    """The object's size, or None if there is none: one HeadObject."""
    from botocore.exceptions import ClientError

    bucket, key = split(path)

    def once():
        try:
            return int(client().head_object(Bucket=bucket, Key=key)["ContentLength"])
        except ClientError as err:
            if str(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")) == "404":
                return None
            raise

    return call(f"look at {path}", once)


def listing(path: str, recursive: bool) -> tuple[list[tuple[str, int]], list[str]]:
    """-> ([(path, size)] of the objects under `path`/ (directly, unless recursive), [names of the
    'folders' directly under it]). Keys ending in '/' (folder markers earlier versions wrote) skipped."""
    bucket, key = split(path.rstrip("/"))
    prefix = f"{key}/" if key else ""
    files, dirs, token = [], [], None
    while True:
        kw = {"Bucket": bucket, "Prefix": prefix, **({} if recursive else {"Delimiter": "/"}),
              **({"ContinuationToken": token} if token else {})}
        try:
            page = call(f"list {path}", lambda: client().list_objects_v2(**kw))
        except Exception as err:  # noqa: BLE001
            if "NoSuchBucket" in str(err):
                return [], []
            raise
        files += [(f"{bucket}/{o['Key']}", int(o["Size"])) for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        dirs += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        if not page.get("IsTruncated"):
            return files, dirs
        token = page["NextContinuationToken"]


def delete(paths: list[str]) -> None:
    """Delete objects (missing ones are no error), DELETE_BATCH keys a request, per bucket."""
    by_bucket: dict[str, list[str]] = {}
    for p in paths:
        b, k = split(p)
        by_bucket.setdefault(b, []).append(k)
    for bucket, keys in by_bucket.items():
        for i in range(0, len(keys), DELETE_BATCH):
            batch = {"Objects": [{"Key": k} for k in keys[i:i + DELETE_BATCH]], "Quiet": True}
            got = call(f"delete {len(batch['Objects'])} objects in {bucket}", _delete_batch, bucket, batch)
            errors = [e for e in got.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise OSError(f"storage: could not delete {bucket}/{errors[0]['Key']}: {errors[0].get('Code')} "
                              f"({len(errors)} keys refused)")


def _delete_batch(bucket: str, batch: dict) -> dict:
    """One DeleteObjects; a key refused with a transient code (a 200 whose body lists SlowDown for
    some keys) makes the whole batch a fault to retry: deleting again is harmless."""
    from botocore.exceptions import ClientError

    got = client().delete_objects(Bucket=bucket, Delete=batch)
    transient = [e for e in got.get("Errors", []) if e.get("Code") in RETRY_CODES]
    if transient:
        raise ClientError({"Error": {"Code": transient[0]["Code"], "Message": "some keys refused"}}, "DeleteObjects")
    return got
