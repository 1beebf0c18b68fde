"""Image formats capline accepts from untrusted sources (downloads, evaluation sets): PIL format names.
One list, read by the download policy (stages/fetch.py) and the ingest config that narrows it."""

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
