"""Images from untrusted sources, one policy for every reader: downloads, evaluation sets, training
shards. `FORMATS` is the allow-list (PIL format names; never EPS, which runs Ghostscript), read
by the download policy and the ingest config that narrows it. `open_checked` refuses a format off
the list and more than `max_pixels` from the header alone, before anything is decoded; `decode`
also decodes it fully. Both pass the cap per call: PIL's process-wide MAX_IMAGE_PIXELS is never
changed (a download setting must not switch the check off for evaluation in the same process).
A refusal is an `ImageRefused` with a reason (the ledger's name for it) and a one-line detail."""
from __future__ import annotations

import io
import warnings

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
MAX_PIXELS = 50_000_000


class ImageRefused(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _sniff(data: bytes) -> str | None:
    """What a refused file is, by PIL's full list of formats (only to name it in the verdict)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as img:   # identifies; nothing is decoded or run here
                return img.format
    except Exception:  # noqa: BLE001
        return None


def _failure(err: Exception) -> ImageRefused:
    reason = "truncated_image" if "truncated" in str(err).lower() else "undecodable_image"
    return ImageRefused(reason, type(err).__name__ + ": " + str(err)[:120])


def open_checked(data, formats=FORMATS, max_pixels: int = MAX_PIXELS):
    """A PIL image, opened (header read, nothing decoded) only if its format is allowed and its
    size within max_pixels; else ImageRefused."""
    from PIL import Image

    data = bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL warns on big images; the cap below decides
        try:
            img = Image.open(io.BytesIO(data), formats=list(formats))
        except Image.DecompressionBombError as err:   # over PIL's own hard limit (~179M pixels), > any cap
            import re

            found = re.search(r"\((\d+) pixels\)", str(err))
            size = f"{found.group(1)} pixels" if found else "more pixels than PIL opens"
            raise ImageRefused("image_too_large", f"{size} > max_pixels {max_pixels}") from None
        except Exception as err:  # noqa: BLE001 - PIL raises many types for garbage
            fmt = _sniff(data)
            if fmt and fmt not in formats:
                raise ImageRefused("unsupported_format", f"{fmt} (allowed: {', '.join(formats)})") from None
            raise _failure(err) from None
    w, h = img.size
    if w * h > max_pixels:
        raise ImageRefused("image_too_large", f"{w}x{h} pixels > max_pixels {max_pixels}")
    return img


def decode(data, formats=FORMATS, max_pixels: int = MAX_PIXELS):
    """open_checked, then decoded in full (corrupt and truncated files refused): an RGB image."""
    img = open_checked(data, formats, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img.load()
            return img.convert("RGB")
    except Exception as err:  # noqa: BLE001
        raise _failure(err) from None


def to_input(image, size: int):
    """The one image preprocessing: an image (encoded bytes, a PIL image, or a grey or RGB array) as
    every capline model reads it: RGB, resized to size x size (bicubic), float32 in [-1, 1], channels
    first -> (3, size, size). Training, evaluation, the CLIP-score scorer and dedup's encoder all call it."""
    import numpy as np
    from PIL import Image

    if isinstance(image, (bytes, bytearray, memoryview)):
        img = decode(image)
    elif isinstance(image, Image.Image):
        img = image
    else:
        arr = np.asarray(image)
        if arr.ndim == 2:
            arr = np.stack([arr] * 3, -1)
        img = Image.fromarray(arr.astype(np.uint8))
    img = img.convert("RGB").resize((size, size), Image.BICUBIC)
    return (np.asarray(img, np.float32) / 127.5 - 1.0).transpose(2, 0, 1)
