"""img2dataset's resize, the same pixels out, each image decoded once and only as large as it needs.

img2dataset's Resizer decodes every image with OpenCV, builds two albumentations transforms per
image (their construction and validation cost more than the resize itself: 4.6 ms an image of
512x384 -> 224, of which ~2.6 ms is albumentations), and swaps the process's stdout/stderr around
each call. capline's fetcher had already decoded the image once with PIL to refuse truncated files
(which OpenCV fills with grey). Here:

- the fetcher's decode is the only one (`decode_for_resize`): PIL and OpenCV use the same
  libjpeg-turbo and give the same pixels (tests/stages/test_resize.py), so the array goes on to the
  resize instead of being thrown away;
- a JPEG at least four times the size it is resized to is decoded reduced, by libjpeg's DCT
  scaling (PIL's `draft`: 1/2, 1/4 or 1/8), to no less than twice that size, as PIL's own
  `thumbnail` does (its `reducing_gap` of 2): the resize then starts from a smaller image and still
  averages >= 2 pixels into each. Reducing closer to the target shifts edges by up to a pixel (a
  DCT-scaled 961-pixel row is 241 blocks of 4 in all) and costs sharp photos ~6 dB of PSNR; at 2x
  the pixels differ from a full decode's within JPEG noise (`benchmarks/ingest.py` measures it);
- the resize, crop and pad are the cv2 calls albumentations makes, with its sizes and rounding, so
  an image not decoded reduced comes out byte-identical to img2dataset's.

Shapes: the fetcher's pixels are (H, W) grey or (H, W, 3) RGB, as PIL decodes them; cv2's own
decode gives BGR. Resizing, cropping and padding white are the same in either channel order, so
PIL's RGB turns BGR only on the 224 px result, just before encoding (reversing the channels of the
full decode instead cost 3.4 ms an image, more than the decode).
"""
from __future__ import annotations

import io
import weakref

import numpy as np

from .img2dataset_parts import downloader_classes

BORDERS = ("border", "keep_ratio_largest")     # the longest side to image_size (border then pads)
SMALLEST = ("keep_ratio", "center_crop")       # the shortest side to image_size (center_crop then crops)
_ONE_THREAD = False
REDUCING_GAP = 2     # a reduced decode stays >= this many times the resize's size (PIL's thumbnail default)


def target_size(w: int, h: int, mode: str, size: int) -> tuple[int, int] | None:
    """(width, height) an image of w x h is resized to before any crop or pad; None: not resized."""
    if mode in BORDERS:
        scale = size / max(w, h)
    elif mode in SMALLEST:
        scale = size / min(w, h)
    else:
        return None
    return max(1, round(w * scale)), max(1, round(h * scale))


class Decoded(io.BytesIO):
    """A download's bytes with the pixels decoded from them (`pixels`), and (`original`) the image's
    own width and height (a reduced decode is smaller). The pixel budget the decode took is given
    back when the download is dropped, after its resize."""

    def __init__(self, data: bytes, pixels: np.ndarray, original: tuple[int, int], release=None):
        super().__init__(data)
        self.pixels, self.original = pixels, original
        if release is not None:
            weakref.finalize(self, release)


def decode_for_resize(img, resize: tuple[str, int] | None) -> np.ndarray | None:
    """Decode an opened PIL image (`img`, header read) fully, raising as PIL does on a truncated or
    corrupt file; a JPEG reduced by DCT scaling where `resize` (mode, size) leaves it >= 4x too
    large (REDUCING_GAP). -> the pixels (grey or RGB), or None where cv2's own decode is kept
    (formats other than JPEG, and JPEG modes other than RGB and L, whose conversions differ)."""
    fast = img.format == "JPEG" and img.mode in ("RGB", "L")
    if fast and resize is not None:
        want = target_size(*img.size, *resize)
        if want is not None and want[0] * REDUCING_GAP * 2 <= img.size[0] and want[1] * REDUCING_GAP * 2 <= img.size[1]:
            # the largest DCT reduction that keeps both sides >= REDUCING_GAP x the resize's
            img.draft(img.mode, (want[0] * REDUCING_GAP, want[1] * REDUCING_GAP))
    img.load()
    return np.asarray(img) if fast else None


def resizer_class():
    """img2dataset's Resizer with the one-decode path (a class built on first use: img2dataset loads lazily)."""
    _, Resizer = downloader_classes()

    class OneDecodeResizer(Resizer):
        """Same arguments and outputs as img2dataset's Resizer; blurring (never asked by capline) and
        skip_reencode / disable_all_reencoding go to it unchanged."""

        def __call__(self, img_stream, blurring_bbox_list=None):
            if blurring_bbox_list is not None or self.skip_reencode or self.disable_all_reencoding:
                return super().__call__(img_stream, blurring_bbox_list)
            try:
                return self._resize(img_stream)
            except Exception as err:  # noqa: BLE001 - img2dataset's contract: the error as text
                return None, None, None, None, None, str(err)

        def _resize(self, img_stream):
            import cv2

            global _ONE_THREAD
            if not _ONE_THREAD:      # once per process: cv2.setNumThreads costs 0.7 ms a call
                cv2.setNumThreads(1)
                _ONE_THREAD = True
            pixels = getattr(img_stream, "pixels", None)
            rgb = pixels is not None and pixels.ndim == 3
            if pixels is not None:
                img, (ow, oh) = pixels, img_stream.original
            else:
                img_stream.seek(0)
                from img2dataset.resizer import SuppressStdoutStderr

                with SuppressStdoutStderr():     # libpng and libwebp warn on stderr about common files
                    img = cv2.imdecode(np.frombuffer(img_stream.read(), np.uint8), cv2.IMREAD_UNCHANGED)
                if img is None:
                    raise ValueError("Image decoding error")
                if img.ndim == 3 and img.shape[-1] == 4:    # alpha matted on white, as img2dataset does
                    alpha = img[:, :, 3, np.newaxis]
                    img = np.rint((alpha / 255 * img[..., :3] + 255 - alpha).clip(0, 255)).astype(np.uint8)
                oh, ow = img.shape[:2]
            if min(ow, oh) < self.min_image_size:      # img2dataset's own checks, its words
                return None, None, None, None, None, "image too small"
            if ow * oh > self.max_image_area:
                return None, None, None, None, None, "image area too large"
            if max(ow, oh) / min(ow, oh) > self.max_aspect_ratio:
                return None, None, None, None, None, "aspect ratio too large"
            mode = self.resize_mode.name
            want = target_size(ow, oh, mode, self.image_size)
            grows = want is not None and (max if mode in BORDERS else min)(ow, oh) <= self.image_size
            if want is not None and not (self.resize_only_if_bigger and grows):
                if want != (img.shape[1], img.shape[0]):
                    img = cv2.resize(img, want, interpolation=self.upscale_interpolation if grows
                                     else self.downscale_interpolation)
                h, w = img.shape[:2]
                s = self.image_size
                if mode == "center_crop":
                    top, left = (h - s) // 2, (w - s) // 2
                    img = img[max(top, 0):max(top, 0) + s, max(left, 0):max(left, 0) + s]
                elif mode == "border" and (h < s or w < s):
                    top, left = int(max(s - h, 0) / 2.0), int(max(s - w, 0) / 2.0)
                    img = cv2.copyMakeBorder(img, top, max(s - h, 0) - top, left, max(s - w, 0) - left,
                                             cv2.BORDER_CONSTANT, value=[255, 255, 255])
            height, width = img.shape[:2]
            if rgb:
                img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
            encoded = cv2.imencode(f".{self.encode_format}", img, params=self.encode_params)[1].tobytes()
            return encoded, width, height, ow, oh, None

    return OneDecodeResizer
