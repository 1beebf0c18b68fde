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


@pytest.mark.slow
def test_mixed_aspect_pictures_through_ingest_and_dedup_are_all_kept(tmp_path, ray_local):
    """200 distinct pictures in six aspect ratios, 40 % product-like on flat backgrounds, downloaded by
    img2dataset with its default `border` resize: dedup keeps every one."""
    from pipeline.config import load_config
    from pipeline.runner import run_pipeline
    from stages.source.demo_server import DemoServer
    from stages.source.synthetic import SERVER_PLACEHOLDER
    from stages.source.web_shapes import mixed_aspect
    from stages.base import read_ledger

    rows = mixed_aspect(tmp_path / "site", 200, seed=0)
    with DemoServer(tmp_path / "site" / "www") as server:
        urls = [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows]
        path = tmp_path / "list" / "part-00000.parquet"
        path.parent.mkdir()
        pq.write_table(pa.table({"url": urls, "caption": [r["caption"] for r in rows]}), path)
        cfg = load_config(None, ["source.kind=urls", f"source.path={path}",
                                 f"stages.ingest.allow_hosts=['{server.netloc}']", "stages.ingest.image_size=64",
                                 "stages.ingest.samples_per_shard=100", "stages.dedup.eval_sets=[]",
                                 "track_data=false"])
        assert cfg.stages.ingest.resize_mode == "border"       # the default, padding with white
        run_pipeline(cfg, tmp_path / "run", until="dedup", log=lambda m: None)
    stats = json.loads((tmp_path / "run" / "dedup" / "stats.json").read_text())
    ledger = read_ledger(tmp_path / "run", "dedup", ["key", "verdict", "reason", "match_key"]).to_pylist()
    assert len(ledger) == 200
    dropped = [r for r in ledger if r["verdict"] != "kept"]
    assert not dropped, (dropped[:3], stats)
    assert stats["method"]["descriptor"] == "thumb16-unpadded"
