"""Safe fetching for img2dataset's Downloader.

img2dataset reads whole responses into memory and follows redirects anywhere, and its decoder sees
a decompression bomb only after allocating it. capline's ingest therefore replaces the module's
`download_image` (importing this module does it, in every process that unpickles a
`SafeDownloader`) with one that:

- refuses non-http(s) schemes and hosts that resolve to private, loopback, link-local, multicast,
  reserved or cloud-metadata addresses, at every redirect hop (unless the host:port is allowed);
- stops reading after `max_bytes`;
- reads the image header to refuse more than `max_pixels` before anything is decoded, then
  decodes once to catch corrupt and truncated files (cv2, used by img2dataset's resizer, silently
  fills a truncated JPEG with grey).

Every refusal comes back as an error string `capline:<reason>: <detail>` that img2dataset records
in its per-shard parquet and the ingest stage turns into a ledger reason.
"""
from __future__ import annotations

import io
import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass

from PIL import Image

import img2dataset.downloader as _i2d

METADATA_HOSTS = {"metadata.google.internal", "metadata", "instance-data"}
METADATA_ADDRS = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}


@dataclass(frozen=True)
class FetchPolicy:
    allow_hosts: tuple[str, ...] = ()   # "host:port" or "host" that skip the address check
    max_bytes: int = 20_000_000
    max_pixels: int = 50_000_000


_policy = FetchPolicy()


class Refused(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"capline:{reason}: {detail}")


def check_url(url: str, policy: FetchPolicy) -> None:
    """Raise Refused unless `url` may be fetched under `policy`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise Refused("unsafe_url:scheme", parts.scheme or "no scheme")
    host = parts.hostname
    if not host:
        raise Refused("malformed_url", url[:200])
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise Refused("malformed_url", f"bad port in {url[:200]}") from None
    if f"{host}:{port}" in policy.allow_hosts or host in policy.allow_hosts:
        return
    if host.lower() in METADATA_HOSTS:
        raise Refused("unsafe_url:metadata_address", host)
    try:
        addrs = [ipaddress.ip_address(host)]  # a literal address needs no lookup
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as err:  # OSError: also a network guard refusing the lookup
            raise Refused("dns_error", f"{host}: {err}") from None
        addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    for addr in addrs:
        if addr in METADATA_ADDRS:
            raise Refused("unsafe_url:metadata_address", f"{host} -> {addr}")
        if (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_multicast
                or addr.is_reserved or addr.is_unspecified):
            raise Refused("unsafe_url:private_address", f"{host} -> {addr}")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        check_url(newurl, _policy)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_opener = urllib.request.build_opener(_CheckedRedirects)


def check_image(data: bytes, policy: FetchPolicy) -> None:
    """Refuse images over the pixel cap (from the header alone) and files that do not decode fully."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL warns on big images; we decide ourselves below
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as err:
            raise Refused("image_too_large", str(err)[:120]) from None
        except Exception as err:  # noqa: BLE001 - PIL raises many types for garbage
            raise _decode_failure(err) from None
        w, h = img.size
        if w * h > policy.max_pixels:
            raise Refused("image_too_large", f"{w}x{h} pixels > max_pixels {policy.max_pixels}")
        try:
            img.load()
        except Exception as err:  # noqa: BLE001
            raise _decode_failure(err) from None


def _decode_failure(err: Exception) -> Refused:
    reason = "truncated_image" if "truncated" in str(err).lower() else "undecodable_image"
    return Refused(reason, type(err).__name__ + ": " + str(err)[:120])


def safe_download_image(row, timeout, user_agent_token, disallowed_header_directives):
    """Drop-in for img2dataset.downloader.download_image: same arguments, same return value."""
    key, url = row
    try:
        check_url(url, _policy)
        request = urllib.request.Request(url, headers={"User-Agent": "capline/0.1 (img2dataset)"})
        with _opener.open(request, timeout=timeout) as r:
            if disallowed_header_directives and _i2d.is_disallowed(
                    r.headers, user_agent_token, disallowed_header_directives):
                return key, None, "capline:robots_disallowed: X-Robots-Tag"
            length = r.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > _policy.max_bytes:
                raise Refused("too_many_bytes", f"Content-Length {length} > max_bytes {_policy.max_bytes}")
            data = r.read(_policy.max_bytes + 1)
            if len(data) > _policy.max_bytes:
                raise Refused("too_many_bytes", f"more than max_bytes {_policy.max_bytes}")
            ctype = (r.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        try:
            check_image(data, _policy)
        except Refused as err:
            # Servers mislabel images often, so the type only names the failure, never causes it.
            if "undecodable_image" in str(err) and ctype and not ctype.startswith("image/"):
                raise Refused("not_an_image", f"Content-Type {ctype}") from None
            raise
        return key, io.BytesIO(data), None
    except Refused as err:
        return key, None, str(err)
    except Exception as err:  # noqa: BLE001 - every failure becomes the sample's recorded reason
        return key, None, str(err) or type(err).__name__


class SafeDownloader(_i2d.Downloader):
    """img2dataset's Downloader with capline's fetch policy applied in whichever process runs it."""

    def __init__(self, *args, policy: FetchPolicy, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = policy

    def download_shard(self, row):
        global _policy
        _policy = self.policy
        return super().download_shard(row)


# Replace the module function the Downloader calls (through download_image_with_retry).
_i2d.download_image = safe_download_image


def reason_of(status: str, error: str | None) -> str:
    """Turn img2dataset's status and error text into a short, countable ledger reason."""
    if status == "success":
        return ""
    err = (error or "").strip()
    low = err.lower()
    if err.startswith("capline:"):
        return err[len("capline:"):].split(": ", 1)[0]
    if low.startswith("http error"):
        code = low.split()[2].rstrip(":")
        return f"http_{code}"
    if "timed out" in low or "timeout" in low:
        return "timeout"
    if "connection refused" in low:
        return "connection_refused"
    if "connection reset" in low or "remote end closed" in low:
        return "connection_reset"
    if "name or service not known" in low or "nodename nor servname" in low:
        return "dns_error"
    if "image too small" in low:
        return "image_too_small"
    if "image area too large" in low:
        return "image_too_large"
    if "aspect ratio too large" in low:
        return "aspect_ratio_too_large"
    if "decoding error" in low:
        return "undecodable_image"
    return "download_error"
