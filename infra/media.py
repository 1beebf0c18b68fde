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


def decode(data, formats=FORMATS, max_pixels: int = MAX_PIXELS, draft: tuple | None = None):
    """open_checked, then decoded in full (corrupt and truncated files refused): an RGB image.
    draft (w, h): a JPEG at least twice that on both sides is decoded at the largest DCT reduction
    that keeps it at least that large (a fraction of the work)."""
    img = open_checked(data, formats, max_pixels)
    if draft and img.format == "JPEG" and img.size[0] >= 2 * draft[0] and img.size[1] >= 2 * draft[1]:
        img.draft("RGB", draft)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img.load()
            return img.convert("RGB")
    except Exception as err:  # noqa: BLE001
        raise _failure(err) from None


def to_pixels(image, size: int, resample: str = "bicubic"):
    """The one image preprocessing: an image (encoded bytes, a PIL image, or a grey or RGB array) as
    every capline model reads it: RGB, resized to size x size, uint8, channels first -> (3, size, size).
    Training, evaluation, the CLIP-score scorer and dedup's encoder all read it (through `to_input`,
    or, in training, as uint8 batches scaled on the GPU). The resize is OpenCV's (2.5x PIL's bicubic
    for the same work): bicubic (or bilinear, as big_vision's evaluation resizes) while the image
    shrinks by under 2x, pixel-area averaging beyond, which is what keeps a large downscale from
    aliasing (PIL's antialiased filters widen their support for it). A JPEG 4x the size or more is
    decoded at a reduced scale first, to no less than twice the size (PIL's `draft`)."""
    import numpy as np
    from PIL import Image

    if isinstance(image, (bytes, bytearray, memoryview)):
        arr = np.asarray(decode(image, draft=(2 * size, 2 * size)))
    elif isinstance(image, Image.Image):
        arr = np.asarray(image.convert("RGB"))
    else:
        arr = np.asarray(image).astype(np.uint8)
        if arr.ndim == 2:
            arr = np.stack([arr] * 3, -1)
        elif arr.shape[-1] != 3:        # grey with a channel axis, RGBA: as PIL converts them
            arr = np.asarray(Image.fromarray(arr.squeeze(-1) if arr.shape[-1] == 1 else arr).convert("RGB"))
    return _resize(arr, size, resample).transpose(2, 0, 1)


def to_input(image, size: int, resample: str = "bicubic"):
    """`to_pixels` as float32 in [-1, 1] -> (3, size, size)."""
    import numpy as np

    return to_pixels(image, size, resample).astype(np.float32) / 127.5 - 1.0


def _resize(arr, size: int, resample: str):
    import cv2

    global _CV2_THREADS_SET
    if not _CV2_THREADS_SET:    # one thread: loader processes and tasks are the parallelism
        cv2.setNumThreads(1)
        _CV2_THREADS_SET = True
    h, w = arr.shape[:2]
    if (h, w) == (size, size):
        return arr
    if max(h, w) >= 2 * size:
        flag = cv2.INTER_AREA
    else:
        flag = {"bicubic": cv2.INTER_CUBIC, "bilinear": cv2.INTER_LINEAR}[resample]
    return cv2.resize(arr, (size, size), interpolation=flag)


_CV2_THREADS_SET = False


# img2dataset's `border` resize fits the long side to S and pads the rest of an S x S square with one
# colour: two different portrait photos then share most of their pixels (the bars), and a descriptor
# or scorer reading the whole square calls them alike. The ledger keeps each image's original size,
# so the picture's own region can be recovered whatever resize mode ingest ran.
PAD_TOLERANCE = 24      # a bar pixel differs from the bar's colour by at most this (JPEG noise)
PAD_MIN = 2             # bars thinner than this are left alone: nothing to gain, a guess to lose


def content_box(stored: tuple[int, int], original: tuple[int, int]) -> tuple[int, int, int, int] | None:
    """Where a picture of `original` (w, h) lies in a square `stored` (S, S) image that fitted its
    long side and centred it, as (left, top, right, bottom), one pixel inside the edge the resize
    blended; None where nothing would have been padded (not square, same aspect, unknown size)."""
    (sw, sh), (ow, oh) = stored, original
    if not (sw and sh and ow and oh) or sw != sh or ow == oh:
        return None
    if ow > oh:
        cw, ch = sw, max(1, round(oh * sh / ow))
    else:
        cw, ch = max(1, round(ow * sw / oh)), sh
    left, top = (sw - cw) // 2, (sh - ch) // 2
    if max(sw - cw, sh - ch) < 2 * PAD_MIN:
        return None
    inset_x, inset_y = (1 if cw < sw else 0), (1 if ch < sh else 0)
    return left + inset_x, top + inset_y, left + cw - inset_x, top + ch - inset_y


def unpad(image, width: int | None, height: int | None):
    """The picture without the bars a `border` resize added: `image` (PIL) cropped to `content_box`
    when the region outside it is one flat colour (a centre crop or a kept ratio has no such bars,
    and is returned whole). `width`, `height`: the original size the sample index recorded."""
    import numpy as np

    box = content_box(image.size, (width or 0, height or 0))
    if box is None:
        return image
    arr = np.asarray(image.convert("RGB"), np.int16)
    left, top, right, bottom = box
    # the bars, less the pixel row or column beside the picture that the resize blended
    bars = np.concatenate([arr[:max(0, top - 1)].reshape(-1, 3), arr[bottom + 1:].reshape(-1, 3),
                           arr[:, :max(0, left - 1)].reshape(-1, 3), arr[:, right + 1:].reshape(-1, 3)])
    if not len(bars):
        return image
    colour = np.median(bars, axis=0)
    if np.mean(np.abs(bars - colour).max(-1) <= PAD_TOLERANCE) < 0.98:
        return image         # not bars: the resize mode kept content there
    return image.crop(box)
