"""Hostile inputs against every reader of untrusted files, under one policy: an image opener
(downloads, evaluation sets, training shards), the tar reader (evaluation and dataset tars) and the
evaluation sets' own files (COCO captions, word-order pairs, Parquet). Each one ends in a one-line
verdict naming what was refused, within seconds and without memory growing: never a crash (another
exception type), a hang or a file read from outside the set. The parameter count here is the
"hostile inputs tried" figure of the closing note."""
import bz2
import functools
import gzip
import io
import json
import lzma
import os
import resource
import signal
import struct
import tarfile
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import stages.ingest.fetch  # noqa: F401 - loaded first (img2dataset's imports weigh ~300 MB); it used to
#                                   set PIL's MAX_IMAGE_PIXELS = None for the whole process
from infra.errors import UserError
from infra.media import ImageRefused, decode
from infra.tars import tar_samples
from trainers.evaluation.config import CaptionSet, ClassificationSet, WordOrderSet
from trainers.evaluation.datasets import load_captions, load_classification, load_wordorder


@pytest.fixture(autouse=True)
def no_hang_no_bloat():
    """Each input gets 20 s and 300 MB of new peak memory: a hang or a bomb fails the test."""
    def hung(*_):
        raise TimeoutError("a hostile input hung the reader")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 300, f"peak memory grew {grown_mb:.0f} MB"


# ---- images ---------------------------------------------------------------------------------------

def _png_header(w, h, body=b""):
    """A valid PNG of w x h grey pixels whose compressed body is tiny (zlib of zeros)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = body or zlib.compress(b"\x00" * (w + 1) * min(h, 64), 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


def _encoded(fmt, size=(8, 8), **kw):
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, fmt, **kw)
    return buf.getvalue()


def _with_dims(data: bytes, old: bytes, new: bytes) -> bytes:
    assert old in data
    return data.replace(old, new, 1)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png_with(extra: list[bytes], idat: bytes | None = None, w: int = 8, h: int = 8) -> bytes:
    """An 8x8 RGB PNG with `extra` chunks before its pixels (or `idat` as them)."""
    raw = idat if idat is not None else zlib.compress(b"\x00" * (w * 3 + 1) * h)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + b"".join(extra)
            + _chunk(b"IDAT", raw) + _chunk(b"IEND", b""))


def _bad_crc() -> bytes:
    data = bytearray(_encoded("PNG"))
    data[29] ^= 0xFF                       # IHDR's checksum
    return bytes(data)


def _frames(fmt: str, n: int) -> bytes:
    buf = io.BytesIO()
    first, *rest = [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(n)]
    first.save(buf, fmt, save_all=True, append_images=rest)
    return buf.getvalue()


def _png_ihdr(w: int, h: int, colour: int = 0, depth: int = 8, idat: bytes | None = None) -> bytes:
    """A PNG of whatever header we like, its pixels a few zero rows."""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 9 * 8) if idat is None else idat) + _chunk(b"IEND", b""))


def _tiff_60000() -> bytes:
    """An 8x8 TIFF whose ImageWidth and ImageLength tags say 60000."""
    tif = _encoded("TIFF")
    for tag in (256, 257):
        tif = _with_dims(tif, struct.pack("<HHII", tag, 4, 1, 8), struct.pack("<HHII", tag, 4, 1, 60000))
    return tif


def _mode(fmt: str, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (8, 8)).save(buf, fmt)
    return buf.getvalue()


# the costly inputs are built when their test runs, never at import: every test process collects this
# module (building them all there took 7 s of the fast set's collection)
@functools.cache
def _text_bomb() -> bytes:
    return zlib.compress(b"A" * (200 << 20), 9)       # 200 MB of text in 200 KB


def _built(data):
    return data() if callable(data) else data

IMAGES = {
    "png_bomb_14000x14000": (_png_header(14000, 14000), "image_too_large"),
    "png_bad_crc": (_bad_crc(), "undecodable_image"),
    "png_ztxt_text_bomb": (lambda: _png_with([_chunk(b"zTXt", b"k\x00\x00" + _text_bomb())]), "undecodable_image"),
    "png_itxt_text_bomb": (lambda: _png_with([_chunk(b"iTXt", b"k\x00\x01\x00\x00\x00" + _text_bomb())]), "undecodable_image"),
    "png_iccp_profile_bomb": (lambda: _png_with([_chunk(b"iCCP", b"p\x00\x00" + zlib.compress(b"\x00" * (200 << 20), 9))]),
                              "undecodable_image"),
    "png_zero_width": (_png_header(0, 8), "undecodable_image"),
    "png_behind_html": (b"<html>" + _encoded("PNG"), "undecodable_image"),
    "gzip_of_a_png": (gzip.compress(_encoded("PNG")), "undecodable_image"),
    "webp_truncated": (_encoded("WEBP")[:30], "undecodable_image"),
    "jpeg_without_its_end": (_encoded("JPEG", (64, 64))[:-2], "truncated_image"),
    "jpeg_progressive_truncated": (_encoded("JPEG", (64, 64), progressive=True)[:300], "truncated_image"),
    "xbm_source_text": (b"#define a_width 8\n#define a_height 8\nstatic char a_bits[] = {0};\n", "undecodable_image"),
    "ppm_60000x60000_header": (b"P6\n60000 60000\n255\n" + b"\x00" * 100, "undecodable_image"),
    "psd_magic": (b"8BPS" + b"\x00" * 100, "undecodable_image"),
    "utf16_html_page": ("<html>nope</html>".encode("utf-16"), "undecodable_image"),
    "png_over_pil_hard_limit": (_png_header(60000, 60000), "image_too_large"),
    "gif_logical_screen_65535": (_with_dims(_encoded("GIF"), b"\x08\x00\x08\x00", b"\xff\xff\xff\xff"), "image_too_large"),
    "bmp_huge_header": (_with_dims(_encoded("BMP"), struct.pack("<ii", 8, 8), struct.pack("<ii", 60000, 60000)),
                        "image_too_large"),
    "jpeg_huge_header": (_with_dims(_encoded("JPEG"), b"\x00\x08\x00\x08", b"\xff\xf0\xff\xf0"), "image_too_large"),
    "eps_runs_ghostscript": (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n", "unsupported_format"),
    "ico_not_allowed": (_encoded("ICO", (16, 16)), "unsupported_format"),
    "pdf": (b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF", "undecodable_image"),
    "svg_text": (b"<svg xmlns='http://www.w3.org/2000/svg' width='9e9' height='9e9'/>", "undecodable_image"),
    "truncated_jpeg": (_encoded("JPEG", (64, 64))[:200], "truncated_image"),
    "truncated_png": (_encoded("PNG", (64, 64))[:60], "truncated_image"),
    "garbage": (os.urandom(4096), "undecodable_image"),
    "empty": (b"", "undecodable_image"),
    "one_byte": (b"\xff", "undecodable_image"),
    "html_error_page": (b"<html><body>404 Not Found</body></html>", "undecodable_image"),
    "tiff_60000x60000_tags": (_tiff_60000(), "image_too_large"),
    "tiff_truncated": (_encoded("TIFF")[:60], "undecodable_image"),
    "png_1_by_2147483647": (_png_ihdr(1, 2**31 - 1), "image_too_large"),
    "png_bit_depth_3": (_png_ihdr(8, 8, depth=3), "undecodable_image"),
    "png_pixels_not_zlib": (_png_ihdr(8, 8, idat=bytes(range(50))), "undecodable_image"),
    "jpeg_0x0_header": (_with_dims(_encoded("JPEG"), b"\x00\x08\x00\x08", b"\x00\x00\x00\x00"), "undecodable_image"),
    "gif_truncated": (_encoded("GIF", (64, 64))[:40], "truncated_image"),
    "tga_not_allowed": (_encoded("TGA"), "unsupported_format"),
    "pcx_not_allowed": (_encoded("PCX"), "unsupported_format"),
    "sgi_not_allowed": (_encoded("SGI"), "unsupported_format"),
    "pil_im_not_allowed": (_encoded("IM"), "unsupported_format"),
    "dds_not_allowed": (_mode("DDS", "RGBA"), "unsupported_format"),
}


@pytest.mark.parametrize("name", IMAGES)
def test_image_inputs_are_refused_with_a_reason(name):
    data, reason = IMAGES[name]
    data = _built(data)
    with pytest.raises(ImageRefused) as err:
        decode(data)
    assert err.value.reason in (reason, "undecodable_image", "truncated_image") and "\n" not in str(err.value)
    if reason in ("image_too_large", "unsupported_format"):
        assert err.value.reason == reason, err.value
    assert Image.MAX_IMAGE_PIXELS is not None      # never switched off for the whole process


# inputs that are pictures after all, built to cost a reader: each decodes to its first frame at its
# own small size, within the fixture's seconds and memory
BOUNDED = {
    "png_pixels_inflating_to_300_mb": (lambda: _png_with([], idat=zlib.compress(b"\x00" * (300 << 20), 9)), (8, 8)),
    "gif_of_300_frames": (_frames("GIF", 300), (8, 8)),
    "apng_of_50_frames": (_frames("PNG", 50), (8, 8)),
    "tiff_of_300_pages": (_frames("TIFF", 300), (8, 8)),
    "webp_of_100_frames": (_frames("WEBP", 100), (8, 8)),
    "cmyk_jpeg": (_mode("JPEG", "CMYK"), (8, 8)),
    "png_16_bit_grey": (_mode("PNG", "I;16"), (8, 8)),
    "png_grey_with_alpha": (_mode("PNG", "LA"), (8, 8)),
    "jpeg_with_html_after_its_end": (_encoded("JPEG") + b"<html>an error page glued on</html>", (8, 8)),
}


@pytest.mark.parametrize("name", BOUNDED)
def test_costly_but_real_pictures_decode_their_first_frame_within_bounds(name):
    data, size = BOUNDED[name]
    data = _built(data)
    img = decode(data)
    assert img.size == size and getattr(img, "n_frames", 1) == 1 and img.mode == "RGB"


def test_importing_the_downloader_leaves_pils_limit_alone():
    assert Image.MAX_IMAGE_PIXELS == 89478485


# ---- tars -----------------------------------------------------------------------------------------

def _tar(*members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name, data=b"x", kind=tarfile.REGTYPE, **kw):
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, (len(data) if kind == tarfile.REGTYPE else 0)
    for k, v in kw.items():
        setattr(info, k, v)
    return info, (data if kind == tarfile.REGTYPE else None)


def _negative_size() -> bytes:
    good = bytearray(_tar(_member("a.jpg", b"x" * 10), _member("a.txt", b"cap")))
    field = bytearray(b"\xff" * 12)                  # base-256: -1
    good[124:136] = field
    good[148:156] = b" " * 8                         # the checksum over the new header
    good[148:155] = f"{sum(good[:512]):06o}\0".encode()
    return bytes(good)


def _pax_negative_size() -> bytes:
    # the same walk backwards through a pax header's "size" record
    info, _ = _member("a.jpg", b"")
    info.pax_headers = {"size": "-1000"}
    return info.tobuf(format=tarfile.PAX_FORMAT) + bytes(2048)


def _sparse() -> bytes:
    info, _ = _member("big.jpg", b"")
    info.type = tarfile.GNUTYPE_SPARSE
    raw = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    return bytes(raw) + bytes(1024)


TARS = {
    "gzip_named_tar": (gzip.compress(_tar(_member("a.jpg", b"\x00" * 200_000))), "not an uncompressed tar"),
    "bzip2_named_tar": (bz2.compress(_tar(_member("a.jpg"))), "not an uncompressed tar"),
    "xz_named_tar": (lzma.compress(_tar(_member("a.jpg"))), "not an uncompressed tar"),
    "negative_size_cve_2025_8194": (_negative_size(), "negative size|not a valid tar|not an uncompressed tar"),
    "pax_negative_size": (_pax_negative_size(), "negative size|not a valid tar|not an uncompressed tar"),
    "symlink_to_etc_shadow": (_tar(_member("a.jpg", kind=tarfile.SYMTYPE, linkname="/etc/shadow")), "is a link"),
    "hardlink": (_tar(_member("a.txt", b"c"), _member("a.jpg", kind=tarfile.LNKTYPE, linkname="a.txt")), "is a link"),
    "sparse_member": (_sparse(), "sparse member"),
    "fifo_member": (_tar(_member("a.jpg", kind=tarfile.FIFOTYPE)), "device or special file"),
    "char_device": (_tar(_member("a.jpg", kind=tarfile.CHRTYPE, devmajor=1, devminor=5)), "device or special file"),
    "member_over_the_size_cap": (None, "over the"),
    "truncated_mid_member": (_tar(_member("a.jpg", b"y" * 5000))[:1500], "truncated|not a valid tar"),
    "random_bytes": (os.urandom(3000), "not an uncompressed tar"),
}


def _huge_member_header() -> bytes:
    info, _ = _member("a.jpg", b"")
    info.size = 2**40                                # declared a terabyte; only the header is there
    return info.tobuf(format=tarfile.GNU_FORMAT) + bytes(1024)


@pytest.mark.parametrize("name", TARS)
def test_tar_inputs_are_refused_naming_the_file(name, tmp_path):
    data, expected = TARS[name]
    if data is None:
        data = _huge_member_header()
    path = tmp_path / f"{name}.tar"
    path.write_bytes(data)
    with pytest.raises(UserError) as err:
        list(tar_samples(str(path), f"evaluation set e: {path}"))
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    assert any(e in message for e in expected.split("|")), message


@pytest.mark.parametrize("mtime", [0, 1796093490])    # the second: a gzip header that passes a tar checksum
def test_a_caption_set_of_a_gzip_named_tar_is_refused_not_inflated(tmp_path, mtime):
    (tmp_path / "s.tar").write_bytes(gzip.compress(bytes(50_000_000), mtime=mtime))   # 50 MB of zeros, ~50 KB on disk
    with pytest.raises(UserError, match="not an uncompressed tar"):
        load_captions(CaptionSet(name="c", kind="webdataset", path=str(tmp_path / "s.tar")), tmp_path)


# ---- evaluation sets' own files ---------------------------------------------------------------------

def _coco(tmp_path, file_name, extra_setup=None):
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    (images / "ok.png").write_bytes(_encoded("PNG"))
    if extra_setup:
        extra_setup(images)
    doc = {"images": [{"id": 1, "file_name": file_name}], "annotations": [{"image_id": 1, "caption": "a thing"}]}
    (tmp_path / "captions.json").write_text(json.dumps(doc))
    return CaptionSet(name="coco", kind="coco", path=str(tmp_path / "captions.json"), images=str(images))


def _outside(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(_encoded("PNG"))
    return secret


COCO = {
    "absolute_path": (lambda t: str(_outside(t)), "points outside"),
    "dot_dot": (lambda t: (_outside(t), "../secret.png")[1], "points outside"),
    "deep_dot_dot": (lambda t: "a/../../../../../../etc/passwd", "points outside"),
    "nul_in_name": (lambda t: "ok.png\x00.jpg", "is not a relative path"),
    "number_not_a_name": (lambda t: 7, "is not a relative path"),
    "empty_name": (lambda t: "", "is not a relative path"),
    "missing_file": (lambda t: "nope.png", "No such file|does not exist|nope.png"),
    "png_bomb_in_the_set": (lambda t: "bomb.png", "image_too_large"),
    "symlink_to_a_system_file": (lambda t: "link.png", "is a symlink"),
    "fifo_that_would_block": (lambda t: "pipe.png", "not a regular file"),
}


def _setup(name):
    def make(images):
        if name == "png_bomb_in_the_set":
            (images / "bomb.png").write_bytes(_png_header(14000, 14000))
        if name == "symlink_to_a_system_file":
            os.symlink("/etc/passwd", images / "link.png")
        if name == "fifo_that_would_block":
            os.mkfifo(images / "pipe.png")
    return make


@pytest.mark.parametrize("name", COCO)
def test_coco_file_names_stay_inside_the_set_and_images_obey_the_policy(name, tmp_path):
    make, expected = COCO[name]
    s = _coco(tmp_path, make(tmp_path), _setup(name))
    with pytest.raises((UserError, FileNotFoundError)) as err:
        load_captions(s, tmp_path)
    assert any(e in str(err.value) for e in expected.split("|")), err.value
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("doc", ["[1, 2]", "{\"images\": 5}", "not json", "{\"images\": [{\"id\": 1}]}"])
def test_malformed_coco_files_are_named(doc, tmp_path):
    (tmp_path / "c.json").write_text(doc)
    with pytest.raises(UserError, match="is not a COCO captions file"):
        load_captions(CaptionSet(name="c", kind="coco", path=str(tmp_path / "c.json"), images=str(tmp_path)), tmp_path)


def test_word_order_pairs_cannot_read_outside_their_folder(tmp_path):
    _outside(tmp_path)
    sub = tmp_path / "set"
    sub.mkdir()
    (sub / "pairs.jsonl").write_text(json.dumps({"image": "../secret.png", "caption": "a b c d",
                                                  "negatives": {"x": "d c b a"}}) + "\n")
    with pytest.raises(UserError, match="points outside"):
        load_wordorder(WordOrderSet(name="w", kind="pairs", path=str(sub / "pairs.jsonl")), tmp_path, {})


def test_parquet_image_paths_cannot_read_outside_their_folder(tmp_path):
    _outside(tmp_path)
    sub = tmp_path / "set"
    sub.mkdir()
    pq.write_table(pa.table({"image": ["../secret.png"], "label": ["a"]}), sub / "s.parquet")
    with pytest.raises(UserError, match="points outside"):
        load_classification(ClassificationSet(name="p", kind="parquet", path=str(sub / "s.parquet")), tmp_path)


# ---- URL lists and evaluation Parquet: one reader, measured before it decodes ------------------------

def _source(tmp_path, path, *extra):
    from pipeline.config import load_config

    return load_config(None, ["source.kind=urls", f"source.path={path}", *extra]).source


def _read_list(tmp_path, path, *extra):
    from infra.storage import Storage
    from stages.base import read_ledger
    from stages.source.stage import _read_file_task

    storage = Storage.local(tmp_path / "run")
    parts = _read_file_task(storage, str(path), _source(tmp_path, path, *extra))
    (tmp_path / "run" / "source").mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "source" / "parts.json").write_text(json.dumps([p.to_json() for p in parts]))
    return read_ledger(storage, "source").to_pylist()


def test_a_gzip_bomb_url_list_is_refused_before_it_is_read(tmp_path):
    """~200 KB of gzip that is 200 MB of text (the 852 KB .gz that took 4.47 GB): measured while
    decompressing, a pass that keeps nothing, and refused naming the setting."""
    path = tmp_path / "bomb.csv.gz"
    line = b"http://x.example/a.jpg," + b"a" * 1000 + b"\n"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b"url,caption\n")
        block = line * 1000
        for _ in range(200):
            f.write(block)
    assert path.stat().st_size < 3 << 20
    with pytest.raises(UserError, match=r"bomb.csv.gz: .*bytes on disk \(a compression bomb\?\); raise source.max_list_bytes"):
        _read_list(tmp_path, path)


def test_a_parquet_dictionary_bomb_is_refused_before_it_is_decoded(tmp_path):
    """One 1 MB caption repeated 6,000 times, dictionary-encoded: a few KB on disk, 6 GB decoded
    (the 83 KB list and the ~1 KB evaluation set that ended in a bare MemoryError)."""
    def repeated(value, n=6000):     # the bomb itself, never decoded here either
        return pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array([value]))

    table = pa.table({"url": repeated("http://x.example/a.jpg"), "caption": repeated("x" * 1_000_000),
                      "image": repeated(b"\x89PNG" * 250_000)})
    path = tmp_path / "bomb.parquet"
    pq.write_table(table, path, compression="zstd")
    del table
    _refused_as_a_bomb(tmp_path, path, "image")


def _refused_as_a_bomb(tmp_path, path, image_col):
    """A small Parquet file refused by name, before decoding, as a URL list and as an evaluation set."""
    assert path.stat().st_size < 1 << 20
    with pytest.raises(UserError, match=rf"source.path: .*{path.name} holds more than .* bytes of values once decoded"):
        _read_list(tmp_path, path)
    with pytest.raises(UserError, match=rf"evaluation set e: .*{path.name} holds more than .* dictionary bomb"):
        load_classification(ClassificationSet(name="e", kind="parquet", path=str(path), image_col=image_col,
                                              label_col="caption"), tmp_path)


def test_one_field_over_the_cap_sets_its_row_aside_not_the_list(tmp_path):
    """A 1.5 MiB caption (over source.max_field_bytes, 1 MiB): its row is set aside with its line as
    malformed_row:field_too_large, the others read (one such field made the whole list unreadable:
    pyarrow's 1 MiB block); with a smaller cap, the same."""
    path = tmp_path / "long.csv"
    path.write_text("url,caption\nhttp://x.example/1.jpg,one\nhttp://x.example/2.jpg," + "b" * (3 << 19)
                    + "\nhttp://x.example/3.jpg,three\n")
    rows = {r["detail"].split(":")[0]: r for r in _read_list(tmp_path, path)}
    assert rows["long.csv line 3"]["reason"] == "malformed_row:field_too_large"
    assert "source.max_field_bytes" in rows["long.csv line 3"]["detail"]
    assert [rows[f"long.csv line {n}"]["verdict"] for n in (2, 4)] == ["kept", "kept"]
    small = {r["detail"].split(":")[0]: r for r in _read_list(tmp_path / "small", path, "source.max_field_bytes=65536")}
    assert [small[f"long.csv line {n}"]["reason"] for n in (2, 3, 4)] == ["", "malformed_row:field_too_large", ""]


@pytest.mark.slow   # 1.6-5.5 s: kept out of the fast set (under a minute)
def test_a_large_text_list_is_keyed_a_batch_at_a_time(tmp_path):
    """300,000 rows of gzip text: read and keyed in batches, written a partition at a time, in
    bounded memory (the fixture: < 300 MB of new peak), every row a sample."""
    path = tmp_path / "big.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("url,caption\n")
        for i in range(300_000):
            f.write(f"http://x.example/{i}.jpg,caption number {i} of a long list\n")
    from infra.storage import Storage
    from stages.source.stage import _read_file_task

    parts = _read_file_task(Storage.local(tmp_path / "run"), str(path), _source(tmp_path, path, "source.rows_per_part=50000"))
    assert [p.n_in for p in parts] == [50_000] * 6
    keys = pa.concat_tables(pq.read_table(tmp_path / "run" / p.file, columns=["key"]) for p in parts).column("key")
    assert len(keys) == len(keys.unique()) == 300_000


@pytest.mark.parametrize("shape", ["list", "struct", "repeats"])
def test_a_dictionary_bomb_in_a_nested_column_is_refused_before_it_is_decoded(tmp_path, shape):
    """A 1 MB string repeated 6,000 times inside list<string> or struct<string> (the flat check read
    top-level text columns only: ArrowMemoryError), and one row's list of 9 million empty strings (a
    few KB of run-length encoding, 72 MB of offsets once read: past the 64 MiB any file may become)."""
    if shape == "repeats":
        import numpy as np

        inner = pa.DictionaryArray.from_arrays(pa.array(np.zeros(9_000_000, np.int32)), pa.array([""]))
        column = pa.ListArray.from_arrays(pa.array([0, 9_000_000], pa.int32()), inner)
        url = pa.array(["http://x.example/a.jpg"])
    else:
        inner = pa.DictionaryArray.from_arrays(pa.array([0] * 6000, pa.int32()), pa.array(["x" * 1_000_000]))
        if shape == "list":
            column = pa.ListArray.from_arrays(pa.array([0, 3000, 6000], pa.int32()), inner)
        else:
            column = pa.StructArray.from_arrays([inner], ["text"])
        url = pa.array(["http://x.example/a.jpg"] * len(column))
    path = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"url": url, "caption": column}), path, compression="zstd")
    _refused_as_a_bomb(tmp_path, path, "url")


def test_an_ordinary_nested_column_passes_the_bomb_check(tmp_path):
    from infra.bombs import check_parquet

    path = tmp_path / "tags.parquet"
    pq.write_table(pa.table({"url": ["http://x.example/1.jpg", "http://x.example/2.jpg"],
                             "tags": [["cat", "sofa"], ["dog"]], "meta": [{"w": 1, "src": "a"}, {"w": 2, "src": "bb"}]}), path)
    assert check_parquet(path, "list", "raise it") == len("http://x.example/1.jpg") * 2 + 3 + 4 + 3 + 1 + 2


# ---- config files: a run folder's own config.yaml comes from wherever the folder did ----------------

def _laughs(levels: int = 8) -> str:
    """"Billion laughs": each level ten aliases of the one before, 10^8 values from ~600 bytes, in a
    free-form mapping (train.model_args) that the key checks do not look into before the config's
    digest writes it out."""
    lines = ["train:", "  model_args:", "    l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


CONFIGS = {
    "yaml_billion_laughs": (_laughs(), "expands to more than 100,000 values"),
    "yaml_python_object_tag": ("source: !!python/object/apply:os.system ['touch /tmp/capline-pwned']\n",
                               "not valid YAML (could not determine a constructor"),
    "yaml_custom_tag": ("seed: !custom 3\n", "not valid YAML"),
    "yaml_nested_20000_deep": ("source: " + "[" * 20000 + "]" * 20000 + "\n", "nested too deeply"),
    "latin1_bytes": (b"source:\n  kind: demo  # caf\xe9\n", "not UTF-8 text (byte 27"),
    "binary_garbage": (bytes(range(256)) * 8, "not UTF-8 text"),
    "a_key_given_twice": ("seed: 1\nseed: 2\n", "key 'seed' is given twice"),
    "a_5000_digit_number": ("seed: " + "9" * 5000 + "\n", "a number of thousands of digits"),
    "over_one_mib": ("k" * (2 << 20) + ": 1\n", "more than the 1 MiB a config may be"),
    "a_list_not_a_mapping": ("- source\n- stages\n", "expected a mapping at the top level"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_hostile_config_files_are_refused_in_one_line(name, tmp_path):
    from pipeline.config import load_config

    text, expected = CONFIGS[name]
    path = tmp_path / "config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError) as err:
        load_config(path)
    assert expected in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value), err.value
    assert not os.path.exists("/tmp/capline-pwned")


def test_a_hostile_set_value_is_refused_naming_its_key():
    from pipeline.config import load_config

    with pytest.raises(UserError, match=r"config key 'seed': cannot parse value .*nested too deeply"):
        load_config(None, ["seed=" + "[" * 20000 + "]" * 20000])


# ---- more URL lists: each refused in one line naming the file, or read with every row accounted for --

def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


_ONE_ROW = _parquet_bytes(pa.table({"url": ["http://x.example/1.jpg"], "caption": ["a"]}))

REFUSED_LISTS = {
    "jsonl_nested_100000_deep.jsonl": (b'{"url": "http://x.example/1.jpg", "caption": ' + b"[" * 100_000 + b"]" * 100_000
                                       + b"}\n", "nests JSON more than 1000 levels"),
    "utf16.csv": ("url,caption\nhttp://x.example/1.jpg,a\n".encode("utf-16"), "its header is not UTF-8"),
    "truncated.parquet": (_ONE_ROW[: len(_ONE_ROW) // 2], "is not a readable Parquet file"),
    "a_csv_named.parquet": (b"url,caption\nhttp://x.example/1.jpg,a\n", "is not a readable Parquet file"),
    "empty.parquet": (b"", "is not a readable Parquet file (Parquet file size is 0 bytes)"),
    "bomb.csv.bz2": (lambda: bz2.compress(b"url,caption\n" + (b"http://x.example/a.jpg," + b"a" * 1000 + b"\n") * 100_000),
                     "(a compression bomb?); raise source.max_list_bytes"),
    "bomb.jsonl.zst": (lambda: pa.compress(b'{"url": "http://x.example/a.jpg", "caption": "' + b"a" * 100_000_000 + b'"}\n',
                                   "zstd", asbytes=True), "(a compression bomb?); raise source.max_list_bytes"),
    "list.csv.xz": (lzma.compress(b"url,caption\nhttp://x.example/1.jpg,a\n"),
                    "cannot tell the format from '.xz'; set source.format"),
}


@pytest.mark.parametrize("name", REFUSED_LISTS)
def test_hostile_url_lists_are_refused_naming_the_file(name, tmp_path):
    data, expected = REFUSED_LISTS[name]
    data = _built(data)
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(UserError) as err:
        _read_list(tmp_path, path, "source.max_list_bytes=50000000")
    assert expected in str(err.value) and name in str(err.value) and "\n" not in str(err.value), err.value


READ_LISTS = {
    "nul_bytes_in_a_caption.tsv": (b"url\tcaption\nhttp://x.example/1.jpg\ta\x00b\nhttp://x.example/2.jpg\tok\n", 2),
    "bom_and_crlf.csv": (b"\xef\xbb\xbfurl,caption\r\nhttp://x.example/1.jpg,a\r\nhttp://x.example/2.jpg,b\r\n", 2),
    "a_100_kb_url.csv": (b"url,caption\nhttp://x.example/" + b"a" * 100_000 + b".jpg,a\nhttp://x.example/ok.jpg,b\n", 2),
}


@pytest.mark.parametrize("name", READ_LISTS)
def test_odd_but_readable_url_lists_keep_every_row(name, tmp_path):
    data, n = READ_LISTS[name]
    path = tmp_path / name
    path.write_bytes(data)
    rows = _read_list(tmp_path, path)
    assert len(rows) == n and all(r["verdict"] == "kept" for r in rows), rows


def test_json_nesting_is_counted_per_line_and_across_chunks():
    from infra.bombs import json_depths

    assert json_depths(b'{"a": [[1]]}\n[]\n') == (3, 0)
    deepest, carried = json_depths(b'{"a": [[[')           # a line cut by the reader's chunk
    assert (deepest, carried) == (4, 4) and json_depths(b"]]]}\n[", carried) == (3, 1)
