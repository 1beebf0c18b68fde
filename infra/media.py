"""Image formats capline accepts from untrusted sources (downloads, evaluation sets): PIL format names.
One list, read by the download policy (stages/fetch.py) and the ingest config that narrows it."""

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def to_input(image, size: int):
    """The one image preprocessing: an image (encoded bytes, a PIL image, or a grey or RGB array) as
    every capline model reads it: RGB, resized to size x size (bicubic), float32 in [-1, 1], channels
    first -> (3, size, size). Training, evaluation, the CLIP-score scorer and dedup's encoder all call it."""
    import io

    import numpy as np
    from PIL import Image

    if isinstance(image, (bytes, bytearray, memoryview)):
        img = Image.open(io.BytesIO(bytes(image)))
    elif isinstance(image, Image.Image):
        img = image
    else:
        arr = np.asarray(image)
        if arr.ndim == 2:
            arr = np.stack([arr] * 3, -1)
        img = Image.fromarray(arr.astype(np.uint8))
    img = img.convert("RGB").resize((size, size), Image.BICUBIC)
    return (np.asarray(img, np.float32) / 127.5 - 1.0).transpose(2, 0, 1)
