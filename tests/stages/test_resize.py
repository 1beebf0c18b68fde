"""The one-decode resize against img2dataset's own Resizer: the same bytes where nothing is decoded
reduced, the same sizes and near pixels where a JPEG is; the fetcher's decode is what it hands on."""
from __future__ import annotations

import functools
import io

import numpy as np
import pytest
from PIL import Image

from stages.ingest.fetch import FetchPolicy, PixelBudget, Refused, check_image
from stages.ingest.img2dataset_parts import downloader_classes
from stages.ingest.resize import Decoded, resizer_class


def _photo(w: int, h: int, mode: str = "RGB") -> Image.Image:
    import skimage.data

    img = Image.fromarray(skimage.data.astronaut()).resize((w, h), Image.BICUBIC)
    return img.convert(mode)


def _encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


@functools.lru_cache(maxsize=None)
def _case(w: int, h: int, mode: str, fmt: str) -> bytes:
    """A test image's file, made once per module (every resize mode reads the same ones)."""
    return _encoded(_photo(w, h, mode), fmt)


CASES = [((512, 384), "RGB", "JPEG"), ((300, 451), "RGB", "JPEG"), ((200, 150), "L", "JPEG"),
         ((97, 61), "RGB", "JPEG"), ((640, 480), "RGBA", "PNG"), ((333, 250), "P", "PNG"),
         ((260, 260), "LA", "PNG"), ((400, 300), "CMYK", "JPEG"), ((225, 500), "RGB", "WEBP")]
MODES = ["border", "keep_ratio", "center_crop", "no", "keep_ratio_largest"]


def _both(mode: str, size: int = 224, fmt: str = "jpg"):
    _, Resizer = downloader_classes()
    args = dict(image_size=size, resize_mode=mode, resize_only_if_bigger=False, encode_quality=95 if fmt == "jpg" else 6,
                encode_format=fmt)
    return Resizer(**args), resizer_class()(**args)


@pytest.mark.parametrize("mode", MODES)
def test_bytes_equal_img2dataset_whatever_the_format_mode_and_size(mode):
    theirs, ours = _both(mode)
    for (w, h), pil_mode, fmt in CASES:
        data = _case(w, h, pil_mode, fmt)
        want = theirs(io.BytesIO(data))
        assert want[-1] is None, (w, h, pil_mode, fmt, want[-1])
        # cv2's own decode (what a download a URL repeats, or a format PIL is not trusted for, gets)
        assert ours(io.BytesIO(data)) == want, (w, h, pil_mode, fmt)
        # the fetcher's decode, never reduced: the same bytes out
        assert ours(check_image(data, FetchPolicy(resize=None))) == want, (w, h, pil_mode, fmt)


def test_png_out_and_upscaling_equal_img2dataset():
    theirs, ours = _both("border", size=320, fmt="png")
    for (w, h), pil_mode, fmt in CASES[:4]:
        data = _case(w, h, pil_mode, fmt)
        assert ours(check_image(data, FetchPolicy(resize=None))) == theirs(io.BytesIO(data))


@pytest.mark.parametrize("mode", ["border", "center_crop"])
def test_a_jpeg_four_times_too_large_is_decoded_reduced_to_the_same_size_and_near_pixels(mode):
    theirs, ours = _both(mode)
    data = _encoded(_photo(1600, 1000), "JPEG")
    stream = check_image(data, FetchPolicy(resize=(mode, 224)))
    assert isinstance(stream, Decoded) and stream.original == (1600, 1000)
    assert stream.pixels.shape[:2] == (500, 800)     # DCT-scaled 1/2, never below 2x the resize's size
    small = check_image(_encoded(_photo(800, 600), "JPEG"), FetchPolicy(resize=(mode, 224)))
    assert small.pixels.shape[:2] == (600, 800)      # under 4x: decoded whole, byte-identical output
    got, want = ours(stream), theirs(io.BytesIO(data))
    assert got[1:] == want[1:]                          # width, height, original size, no error
    a, b = (np.asarray(Image.open(io.BytesIO(x)), dtype=float) for x in (got[0], want[0]))
    # within JPEG noise: img2dataset's own q95 re-encode is 1.1-2.3 levels from its unencoded resize
    # (benchmarks/ingest.py measures both against that resize on real photos)
    assert np.abs(a - b).mean() < 3.0 and 10 * np.log10(255 ** 2 / ((a - b) ** 2).mean()) > 32
    assert stream.getvalue() == data                    # the bytes hashed are the download's own


def test_truncated_and_corrupt_files_are_refused_by_the_one_decode():
    data = _encoded(_photo(800, 600), "JPEG")
    for bad in (data[: len(data) // 2], data[:300]):
        with pytest.raises(Refused, match="truncated_image|undecodable_image"):
            check_image(bad, FetchPolicy(resize=("border", 224)))


def test_held_pixels_count_in_the_budget_until_the_download_is_dropped():
    import gc

    budget = PixelBudget(10_000_000)
    data = _encoded(_photo(1600, 1000), "JPEG")
    stream = check_image(data, FetchPolicy(resize=("border", 224)), budget)
    held = stream.pixels.shape[0] * stream.pixels.shape[1]
    assert budget.used == held and held < 1600 * 1000
    del stream
    gc.collect()
    assert budget.used == 0
    png = check_image(_encoded(_photo(300, 200, "RGBA"), "PNG"), FetchPolicy(resize=("border", 224)), budget)
    assert not isinstance(png, Decoded) and budget.used == 0   # cv2 decodes it again: nothing held
