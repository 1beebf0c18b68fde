"""Non-square pictures are judged as pictures, not as the squares a `border` resize pads them into.

img2dataset's default resize fits the long side and pads the rest with white; two different portrait
photos then share most of their pixels and were dropped as near-duplicates of each other. Dedup and
every scorer now see `dataplane.pictures`: the picture without the bars."""
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from infra.media import content_box, decode, unpad
from stages.dataplane import pictures
from stages.dedup.imagehash import describe


def border(img: Image.Image, side: int) -> Image.Image:
    """What img2dataset's `border` mode does: long side to `side`, centred on white (as its resizer)."""
    w, h = img.size
    s = side / max(w, h)
    fitted = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.BICUBIC)
    out = Image.new("RGB", (side, side), (255, 255, 255))
    out.paste(fitted, ((side - fitted.size[0]) // 2, (side - fitted.size[1]) // 2))
    return out


def jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_content_box_is_where_the_fitted_picture_lies():
    assert content_box((64, 64), (300, 200)) == (0, 11, 64, 52)    # 64 x 43 centred, a pixel inside the bars
    assert content_box((64, 64), (200, 300)) == (11, 0, 52, 64)
    assert content_box((64, 64), (300, 300)) is None                # square: nothing padded
    assert content_box((96, 64), (300, 200)) is None                # keep_ratio: not a square
    assert content_box((64, 64), (65, 64)) is None                  # a one-pixel bar: left alone
    assert content_box((64, 64), (0, 0)) is None                    # original size unknown


def test_two_portraits_on_the_same_bars_are_told_apart_and_a_copy_is_not():
    rng = np.random.default_rng(0)
    # smooth pictures (low frequencies, as photos are), darker than the white bars
    a, b = (Image.fromarray(rng.integers(0, 120, (10, 6, 3)).astype(np.uint8)).resize((180, 300), Image.BICUBIC)
            for _ in range(2))
    pa_, pb = (decode(jpeg(border(x, 64))) for x in (a, b))
    padded = describe(np.asarray(pa_))[0] @ describe(np.asarray(pb))[0]
    assert padded > 0.9            # the bars made two different pictures look alike: the bug
    ua, ub = unpad(pa_, 180, 300), unpad(pb, 180, 300)
    assert ua.size[1] == 64 and ua.size[0] < 40
    assert describe(np.asarray(ua))[0] @ describe(np.asarray(ub))[0] < 0.5
    # the same picture, padded or not, is still the same picture
    assert describe(np.asarray(ua))[0] @ describe(np.asarray(a))[0] > 0.97


def test_pictures_crop_only_flat_bars():
    rng = np.random.default_rng(1)
    photo = Image.fromarray(rng.integers(0, 255, (200, 300, 3)).astype(np.uint8))
    padded = jpeg(border(photo, 64))
    # a centre crop of a wide picture is square too, with content where the bars would be
    cropped = jpeg(photo.crop((50, 0, 250, 200)).resize((64, 64)))
    batch = pa.table({"width": [300, 300, None], "height": [200, 200, None]})
    got = pictures(batch, [padded, cropped, b"not an image"])
    assert got[0].size == (64, 41) and got[1].size == (64, 64) and got[2] is None


def _served_until_dedup(tmp_path, rows: list[dict], *settings: str):
    """`rows` (url with the server placeholder, caption) served from tmp_path/site/www on loopback as a
    URL list, run by the real pipeline until dedup into tmp_path/run; -> the config it ran."""
    from pipeline.config import load_config
    from pipeline.runner import run_pipeline
    from stages.source.demo_server import DemoServer
    from stages.source.synthetic import SERVER_PLACEHOLDER

    with DemoServer(tmp_path / "site" / "www") as server:
        urls = [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows]
        path = tmp_path / "list" / "part-00000.parquet"
        path.parent.mkdir()
        pq.write_table(pa.table({"url": urls, "caption": [r["caption"] for r in rows]}), path)
        cfg = load_config(None, ["source.kind=urls", f"source.path={path}", f"stages.ingest.allow_hosts=['{server.netloc}']",
                                 "stages.ingest.samples_per_shard=100", "track_data=false", *settings])
        run_pipeline(cfg, tmp_path / "run", until="dedup", log=lambda m: None)
    return cfg


@pytest.mark.slow
def test_mixed_aspect_pictures_through_ingest_and_dedup_are_all_kept(tmp_path, ray_local):
    """200 distinct pictures in six aspect ratios, 40 % product-like on flat backgrounds, downloaded by
    img2dataset with its default `border` resize: dedup keeps every one."""
    from stages.source.web_shapes import mixed_aspect
    from stages.base import read_ledger

    rows = mixed_aspect(tmp_path / "site", 200, seed=0)
    cfg = _served_until_dedup(tmp_path, rows, "stages.ingest.image_size=64", "stages.dedup.eval_sets=[]")
    assert cfg.stages.ingest.resize_mode == "border"       # the default, padding with white
    stats = json.loads((tmp_path / "run" / "dedup" / "stats.json").read_text())
    ledger = read_ledger(tmp_path / "run", "dedup", ["key", "verdict", "reason", "match_key"]).to_pylist()
    assert len(ledger) == 200
    dropped = [r for r in ledger if r["verdict"] != "kept"]
    assert not dropped, (dropped[:3], stats)
    assert stats["method"]["descriptor"] == "thumb16-unpadded"


@pytest.mark.slow
def test_distinct_products_shot_alike_are_kept_and_their_copies_dropped(tmp_path, ray_local):
    """400 distinct garments photographed alike (Fashion-MNIST's, dark on white) and 12 of them re-hosted
    (resized, JPEG), through img2dataset and the real dedup stage: the 16x16 thumbnail alone joins
    many of the distinct ones; with the detail check (the default) each copy and its original are
    one, and at most 1 % of the other products is dropped."""
    import dataclasses

    from pipeline.runner import run_pipeline
    from stages.base import read_ledger
    from stages.source.web_shapes import product_shots
    from trainers.evaluation.datasets import FASHION_MNIST

    if not FASHION_MNIST.is_file():
        pytest.skip("Debian package dataset-fashion-mnist not installed (make install installs it)")
    rows = product_shots(tmp_path / "site", 400, copies=12, seed=0)
    cfg = _served_until_dedup(tmp_path, rows, "stages.ingest.image_size=128", "stages.dedup.eval_sets=[]")
    name = {r["url"].rsplit("/", 1)[1]: i for i, r in enumerate(rows)}

    def dropped():
        ledger = read_ledger(tmp_path / "run", "dedup", ["key", "url", "verdict", "reason", "match_key"]).to_pylist()
        assert len(ledger) == len(rows)
        row_of = {r["key"]: name[r["url"].rsplit("/", 1)[1]] for r in ledger}
        return {name[r["url"].rsplit("/", 1)[1]]: (r["reason"], row_of[r["match_key"]]) for r in ledger
                if r["verdict"] != "kept"}

    with_detail = dropped()
    pairs = {frozenset((i, r["copy_of"])) for i, r in enumerate(rows) if r["kind"] == "copy"}
    assert pairs <= {frozenset((i, j)) for i, (_, j) in with_detail.items()}, with_detail
    assert all(reason == "near_duplicate" for reason, _ in with_detail.values())
    kept_apart = [i for i, (_, j) in with_detail.items() if frozenset((i, j)) not in pairs]
    assert len(kept_apart) <= 4, kept_apart         # 1 % of the products: two shirts can be that alike
    stats = json.loads((tmp_path / "run" / "dedup" / "stats.json").read_text())
    assert stats["method"]["within_detail_threshold"] == cfg.stages.dedup.within_detail_threshold > 0
    told_apart = stats["pairs"]["told_apart_by_detail"]
    # the thumbnail alone, as before the detail check: distinct products dropped as copies of each other
    off = dataclasses.replace(cfg, stages=dataclasses.replace(
        cfg.stages, dedup=dataclasses.replace(cfg.stages.dedup, within_detail_threshold=0.0)))
    run_pipeline(off, tmp_path / "run", only="dedup", log=lambda m: None)
    alone = dropped()
    distinct = [i for i, (_, j) in alone.items() if frozenset((i, j)) not in pairs]
    print(f"products: {len(distinct)} of 400 dropped by the thumbnail alone, {len(kept_apart)} with the detail check "
          f"({told_apart} pairs told apart); copies joined {len(pairs)} of {len(pairs)}")
    assert len(distinct) >= 5 * max(1, len(kept_apart)) and len(distinct) >= 20 and told_apart >= 20, \
        (len(distinct), told_apart, len(kept_apart))


@pytest.mark.slow   # seconds: kept out of the fast set (its 45 s budget)
def test_the_detail_descriptor_keeps_a_copy_close_and_tells_two_products_apart():
    """Unit: a photo resized to 0.4x and saved as a JPEG of quality 30 stays at detail cosine >= 0.99
    of itself; of Fashion-MNIST's garments whose 16x16 thumbnails are >= 0.97 alike, most are below it."""
    from stages.dedup.config import DedupConfig
    from stages.dedup.imagehash import describe, detail, to_rgb_array
    from trainers.evaluation.datasets import FASHION_MNIST, fashion_mnist_images

    cut = DedupConfig().within_detail_threshold
    photo = _photos()[2]
    small = Image.fromarray(photo).resize((photo.shape[1] * 2 // 5, photo.shape[0] * 2 // 5), Image.BICUBIC)
    buf = io.BytesIO()
    small.save(buf, "JPEG", quality=30)
    again = np.asarray(Image.open(buf).convert("RGB").resize((photo.shape[1], photo.shape[0]), Image.BICUBIC))
    assert float(detail(again) @ detail(photo)) >= cut
    if not FASHION_MNIST.is_file():
        pytest.skip("Debian package dataset-fashion-mnist not installed (make install installs it)")
    shots = [np.asarray(Image.fromarray(255 - a).resize((128, 128), Image.BICUBIC).convert("RGB"))
             for a in fashion_mnist_images()[:600]]
    v = np.stack([describe(s)[0] for s in shots])
    d = np.stack([detail(s) for s in shots])
    i, j = np.nonzero(np.triu(v @ v.T >= 0.97, 1))
    distinct = [(a, b) for a, b in zip(i, j) if not np.array_equal(shots[a], shots[b])]
    assert len(distinct) >= 20
    told_apart = sum(float(d[a] @ d[b]) < cut for a, b in distinct)
    assert told_apart >= 0.8 * len(distinct), (told_apart, len(distinct))


def test_trim_border_cuts_black_bands_and_only_them():
    """Unit: black bands on any side are cut whatever the picture inside; a picture whose four edges
    are not black (a plain light ground included) comes back whole; an all-black one too."""
    from stages.dedup.imagehash import trim_border

    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(8, 60, 2))
        inner = rng.integers(40, 256, (h, w, 3)).astype(np.uint8)
        pads = [int(v) for v in rng.integers(0, 12, 4)]
        barred = np.pad(inner, ((pads[0], pads[1]), (pads[2], pads[3]), (0, 0)), constant_values=int(rng.integers(0, 12)))
        assert np.array_equal(trim_border(barred), inner)
        assert trim_border(inner) is inner
    plain = np.full((32, 48, 3), 250, np.uint8)
    plain[10:20, 10:20] = 0          # black inside, not at an edge: content
    assert trim_border(plain) is plain
    black = np.zeros((32, 32, 3), np.uint8)
    assert trim_border(black) is black


def _photos():
    from skimage import data
    from sklearn.datasets import load_sample_images

    from stages.dedup.imagehash import to_rgb_array

    return list(load_sample_images().images) + [to_rgb_array(getattr(data, name)()) for name in
                                                ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins")]


def framed(photo: np.ndarray, colour: tuple, ratio: float) -> Image.Image:
    """A photo re-hosted inside a frame of one flat colour (a white mount, a page's canvas)."""
    h, w = photo.shape[:2]
    fw = max(w, round(h * ratio)) + 40
    out = Image.new("RGB", (fw, max(h, round(fw / ratio))), colour)
    out.paste(Image.fromarray(photo), ((out.width - w) // 2, (out.height - h) // 2))
    return out


def test_flat_bars_of_any_colour_but_black_are_found_around_a_picture():
    from stages.dedup.imagehash import trim_flat_bars

    photo = _photos()[2]
    for colour in ((255, 255, 255), (240, 240, 235), (30, 60, 120)):
        arr = np.asarray(decode(jpeg(framed(photo, colour, 4 / 3))).convert("RGB"))
        inside = trim_flat_bars(arr)
        assert inside is not None and abs(inside.shape[0] - photo.shape[0]) <= 3 and abs(inside.shape[1] - photo.shape[1]) <= 3
    assert trim_flat_bars(photo) is None                                          # no frame
    assert trim_flat_bars(np.pad(photo, ((20, 20), (0, 0), (0, 0)))) is None       # black bars: trim_border's
    assert trim_flat_bars(np.full((64, 64, 3), 200, np.uint8)) is None             # one colour, nothing inside
    # an object on a plain, lightly textured ground is not a picture in a frame (the demo's small red
    # square on lavender was cut out and matched an evaluation image's corner)
    ground = np.random.default_rng(0).normal((200, 200, 230), 4, (96, 96, 3)).clip(0, 255).astype(np.uint8)
    ground[12:40, 52:80] = (220, 30, 30)
    assert trim_flat_bars(ground) is None
    ground[8:80, 10:88] = np.asarray(Image.fromarray(photo).resize((78, 72)))      # a picture filling most of it
    assert trim_flat_bars(ground).shape[:2] == (70, 76)      # less its first line beside each bar (a blend)


@pytest.mark.slow
def test_an_evaluation_photo_in_a_frame_is_dropped_and_pictures_on_flat_backgrounds_are_not(tmp_path, ray_local):
    """Photos of an evaluation set re-hosted in frames of one flat colour were searched only as a whole
    and never matched; now the picture inside the frame is searched too. 120 distinct pictures, 40 %
    of them products on flat backgrounds (where the frame search finds a picture too), match nothing."""
    from stages.base import read_ledger
    from stages.source.synthetic import SERVER_PLACEHOLDER
    from stages.source.web_shapes import mixed_aspect

    photos = _photos()
    evalset = tmp_path / "eval"
    evalset.mkdir()
    for i, p in enumerate(photos):
        Image.fromarray(p).save(evalset / f"photo{i}.png")
    rows = mixed_aspect(tmp_path / "site", 120, seed=1)
    frames = [((255, 255, 255), 4 / 3), ((240, 240, 235), 1.0), ((30, 60, 120), 16 / 9)]
    for i, p in enumerate(photos):
        colour, ratio = frames[i % len(frames)]
        framed(p, colour, ratio).save(tmp_path / "site" / "www" / "img" / f"framed{i}.jpg", "JPEG", quality=85)
        rows.append({"url": f"{SERVER_PLACEHOLDER}/img/framed{i}.jpg", "caption": f"a framed photo number {i}"})
    _served_until_dedup(tmp_path, rows, "stages.ingest.image_size=128", f"stages.dedup.cache_dir={tmp_path / 'cache'}",
                        f"stages.dedup.eval_sets=[{{name: photos, kind: folder, path: {evalset}}}]")
    ledger = read_ledger(tmp_path / "run", "dedup", ["url", "verdict", "reason", "match_key"]).to_pylist()
    assert len(ledger) == len(rows)
    dropped = {r["url"].rsplit("/", 1)[1]: r for r in ledger if r["verdict"] != "kept"}
    want = {f"framed{i}.jpg": f"photo{i}_png" for i in range(len(photos))}
    assert set(dropped) == set(want), sorted(dropped)
    assert all(dropped[u]["reason"] == "eval_duplicate" and dropped[u]["match_key"] == k for u, k in want.items()), dropped
