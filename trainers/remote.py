"""Paths that may be object-storage URIs (`s3://bucket/key`, through pyarrow.fs).

Credentials and endpoint come from the usual environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL for S3-compatible stores); capline never
takes them as arguments, so they never reach a config, a manifest or a log.
"""
from __future__ import annotations

from pathlib import Path

SCHEMES = ("s3://", "gs://")


def is_uri(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


def filesystem(uri: str):
    """-> (pyarrow FileSystem, path inside it)."""
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(uri)


def join(base, *parts: str):
    return "/".join([str(base).rstrip("/"), *parts]) if is_uri(base) else Path(base).joinpath(*parts)


def list_files(uri: str, suffix: str = "") -> list[str]:
    import pyarrow.fs as pafs

    fs, root = filesystem(uri)
    scheme = uri.split("://", 1)[0] + "://"
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=False, allow_not_found=True))
    return sorted(scheme + i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))


def open_input(path):
    """A readable binary stream for a local path or a URI (sequential reads only for URIs)."""
    if is_uri(path):
        fs, p = filesystem(path)
        return fs.open_input_stream(p)
    return open(path, "rb")
