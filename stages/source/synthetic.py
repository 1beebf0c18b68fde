"""The demo source's data: seeded captioned scenes, planted defects, a held-out evaluation split.

Scenes hold 1-3 objects (shape, colour, size, position) on a textured background; captions describe
them in English with a spatial relation ("a large red circle to the left of a small blue square").
Defects are planted at fixed fractions and recorded in `_ground_truth.parquet`, which exists to
*measure* stages against; no stage may read it.

Files land in `www/` (served by stages/source/demo_server.py); the URL list uses the `{DEMO_SERVER}`
placeholder, which ingest replaces with the live loopback address, so the list itself (and every
digest over it) does not depend on the port.
"""
from __future__ import annotations

import io
import json
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

SERVER_PLACEHOLDER = "{DEMO_SERVER}"

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (235, 210, 40), "purple": (140, 60, 180), "orange": (245, 140, 30),
}
SIZES = {"small": 0.13, "large": 0.24}

# Defect kinds and what the ingest stage must make of them (None: it downloads fine and later
# stages must judge it).
DEFECTS = (
    "mismatched_caption", "non_english", "eval_near_copy", "http_404", "http_500", "timeout",
    "corrupt", "truncated", "non_image", "tiny", "empty_caption", "huge_pixels", "huge_bytes",
    "repeat_row", "train_near_copy", "eval_caption",
)
# evaluation captions this long or longer count as a leak when alt-text holds one (shorter ones, "a
# small red circle", are what every caption says): stages.dedup.caption_min_words' default
HELDOUT_CAPTION_WORDS = 6
ALT_TEXT_AROUND = ("Photo of {}, free stock image", "{} | wallpaper download", "Illustration: {}. Royalty-free")

_LANG = {
    "de": {"a": "ein", "small": "kleiner", "large": "großer", "red": "roter", "green": "grüner",
           "blue": "blauer", "yellow": "gelber", "purple": "lila", "orange": "oranger",
           "circle": "Kreis", "square": "Quadrat", "triangle": "Dreieck",
           "left of": "links von", "right of": "rechts von", "above": "über", "below": "unter",
           "and": "und", "with": "mit", "order": "adj"},
    "es": {"a": "un", "small": "pequeño", "large": "grande", "red": "rojo", "green": "verde",
           "blue": "azul", "yellow": "amarillo", "purple": "morado", "orange": "naranja",
           "circle": "círculo", "square": "cuadrado", "triangle": "triángulo",
           "left of": "a la izquierda de", "right of": "a la derecha de", "above": "encima de",
           "below": "debajo de", "and": "y", "with": "con", "order": "noun"},
    "fr": {"a": "un", "small": "petit", "large": "grand", "red": "rouge", "green": "vert",
           "blue": "bleu", "yellow": "jaune", "purple": "violet", "orange": "orange",
           "circle": "cercle", "square": "carré", "triangle": "triangle",
           "left of": "à gauche de", "right of": "à droite de", "above": "au-dessus de",
           "below": "en dessous de", "and": "et", "with": "avec", "order": "noun"},
    "it": {"a": "un", "small": "piccolo", "large": "grande", "red": "rosso", "green": "verde",
           "blue": "blu", "yellow": "giallo", "purple": "viola", "orange": "arancione",
           "circle": "cerchio", "square": "quadrato", "triangle": "triangolo",
           "left of": "a sinistra di", "right of": "a destra di", "above": "sopra", "below": "sotto",
           "and": "e", "with": "con", "order": "noun"},
}


@dataclass(frozen=True)
class Obj:
    shape: str
    colour: str
    size: str
    x: float  # centre, in [0, 1]
    y: float


@dataclass(frozen=True)
class Scene:
    objects: tuple[Obj, ...]
    background: tuple[int, int, int]
    texture_seed: int
    gradient: tuple[float, float] = (0.0, 10.0)  # direction (radians) and strength of the backdrop


def scene_to_json(scene: Scene) -> str:
    import json

    return json.dumps({"objects": [vars(o) for o in scene.objects], "background": scene.background,
                       "texture_seed": scene.texture_seed, "gradient": scene.gradient})


def scene_from_json(text: str) -> Scene:
    import json

    d = json.loads(text)
    return Scene(tuple(Obj(**o) for o in d["objects"]), tuple(d["background"]), d["texture_seed"],
                 tuple(d["gradient"]))


def _relation(a: Obj, b: Obj) -> str:
    dx, dy = b.x - a.x, b.y - a.y
    if abs(dx) >= abs(dy):
        return "left of" if dx > 0 else "right of"
    return "above" if dy > 0 else "below"


def random_scene(rng: np.random.Generator) -> Scene:
    n = int(rng.choice([1, 2, 2, 3, 3]))
    objs: list[Obj] = []
    attempts = 0
    while len(objs) < n and attempts < 200:
        attempts += 1
        size = str(rng.choice(list(SIZES)))
        r = SIZES[size]
        x, y = rng.uniform(r, 1 - r, size=2)
        if any(math.hypot(x - o.x, y - o.y) < r + SIZES[o.size] + 0.04 for o in objs):
            continue
        objs.append(Obj(str(rng.choice(SHAPES)), str(rng.choice(list(COLOURS))), size, float(x), float(y)))
    bg = tuple(int(v) for v in rng.integers(185, 250, size=3))
    gradient = (float(rng.uniform(0, 2 * math.pi)), float(rng.uniform(5, 30)))
    return Scene(tuple(objs), bg, int(rng.integers(0, 2**31)), gradient)


def _phrase(o: Obj) -> str:
    return f"a {o.size} {o.colour} {o.shape}"


def caption_en(scene: Scene) -> str:
    objs = scene.objects
    text = _phrase(objs[0])
    if len(objs) >= 2:
        text += f" {_relation(objs[0], objs[1])} {_phrase(objs[1])}"
        text = text.replace("left of", "to the left of").replace("right of", "to the right of")
    if len(objs) == 3:
        text += f" and {_phrase(objs[2])}"
    return text


def caption_foreign(scene: Scene, lang: str) -> str:
    d = _LANG[lang]

    def phrase(o: Obj) -> str:
        if d["order"] == "adj":
            return f"{d['a']} {d[o.size]} {d[o.colour]} {d[o.shape]}"
        return f"{d['a']} {d[o.shape]} {d[o.colour]} {d[o.size]}"

    objs = scene.objects
    text = phrase(objs[0])
    if len(objs) >= 2:
        text += f" {d[_relation(objs[0], objs[1])]} {phrase(objs[1])}"
    if len(objs) == 3:
        text += f" {d['and']} {phrase(objs[2])}"
    return text


def render(scene: Scene, size: int) -> Image.Image:
    rng = np.random.default_rng(scene.texture_seed)
    base = np.array(scene.background, dtype=np.float32)
    noise = rng.normal(0, 6, size=(size, size, 1)).astype(np.float32)
    angle, strength = scene.gradient
    ramp = np.linspace(-1, 1, size, dtype=np.float32)
    grad = (strength * (np.cos(angle) * ramp[None, :] + np.sin(angle) * ramp[:, None]))[:, :, None]
    img = Image.fromarray(np.clip(base + noise + grad, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for o in scene.objects:
        r = SIZES[o.size] * size
        cx, cy = o.x * size, o.y * size
        col = COLOURS[o.colour]
        if o.shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=col)
        elif o.shape == "square":
            s = r * 0.9
            draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=col)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.85), (cx + r, cy + r * 0.85)], fill=col)
    return img


def encode(img: Image.Image, fmt: str = "JPEG", quality: int = 92) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.convert("RGB").save(buf, "JPEG", quality=quality)
    else:
        img.save(buf, fmt)
    return buf.getvalue()


def near_copy(img: Image.Image, rng: np.random.Generator) -> tuple[bytes, str]:
    """A resized, re-encoded or cropped copy of an evaluation image."""
    kind = str(rng.choice(["resize", "reencode", "crop"]))
    w, h = img.size
    if kind == "resize":
        f = float(rng.uniform(0.6, 1.6))
        out = img.resize((max(8, int(w * f)), max(8, int(h * f))), Image.BICUBIC)
        return encode(out, "JPEG", 90), kind
    if kind == "reencode":
        return encode(img, "JPEG", int(rng.integers(35, 70))), kind
    c = float(rng.uniform(0.04, 0.10))
    out = img.crop((int(w * c), int(h * c), w - int(w * c), h - int(h * c)))
    return encode(out, "JPEG", 90), kind


def png_bomb(width: int, height: int) -> bytes:
    """A valid grayscale PNG of width x height zero pixels, compressed to a few hundred KB.

    Written row by row so making it costs no width*height allocation; decoding it whole would.
    """
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    comp = zlib.compressobj(9)
    row = b"\x00" * (width + 1)  # filter byte + pixels
    parts = [comp.compress(row) for _ in range(height)]
    parts.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


def _assign_defects(n: int, fractions: dict[str, float], rng: np.random.Generator) -> list[str | None]:
    order = rng.permutation(n)
    out: list[str | None] = [None] * n
    pos = 0
    for defect in DEFECTS:
        frac = fractions.get(defect, 0.0)
        count = int(frac) if frac >= 1 else int(round(frac * n))  # >= 1 means an absolute count
        for i in order[pos:pos + count]:
            out[int(i)] = defect
        pos += count
    if pos > n:
        raise ValueError(f"defect fractions add up to more than the {n} samples")
    return out


def hard_negatives(scene: Scene) -> dict[str, str]:
    """The held-out word-order cases (ARO / SugarCrepe style) for a scene of two or more objects: the
    two object phrases swapped around the relation, their colours swapped, an absent object added."""
    a, b = scene.objects[0], scene.objects[1]
    swapped_order = caption_en(Scene((b, a) + scene.objects[2:], scene.background, scene.texture_seed))
    # keep the relation of the true scene, with the phrases exchanged
    true = caption_en(scene)
    pa, pb = f"a {a.size} {a.colour} {a.shape}", f"a {b.size} {b.colour} {b.shape}"
    relation_swap = true.replace(pa, "\0").replace(pb, pa).replace("\0", pb) if pa != pb else swapped_order
    a2 = Obj(a.shape, b.colour, a.size, a.x, a.y)
    b2 = Obj(b.shape, a.colour, b.size, b.x, b.y)
    attribute_swap = caption_en(Scene((a2, b2) + scene.objects[2:], scene.background, scene.texture_seed))
    present = {(o.shape, o.colour) for o in scene.objects}
    extra = next((s, c) for c in COLOURS for s in SHAPES if (s, c) not in present)
    added = true + f" and a {sorted(SIZES)[0]} {extra[1]} {extra[0]}"
    return {"relation_order": relation_swap, "attribute_swap": attribute_swap, "added_object": added}


def heldout_wordorder(scenes: list[Scene]) -> list[tuple[int, str, dict[str, str]]]:
    """(scene index, true caption, hard negatives) for scenes with two objects of different colours."""
    out = []
    for i, sc in enumerate(scenes):
        if len(sc.objects) < 2 or sc.objects[0].colour == sc.objects[1].colour:
            continue
        out.append((i, caption_en(sc), hard_negatives(sc)))
    return out


def generate(out_dir: Path, num_samples: int, eval_size: int, image_size: int, seed: int,
             fractions: dict[str, float], huge_pixels: int, huge_bytes: int) -> dict:
    """Write www/, urls.parquet, _ground_truth.parquet and eval/ under out_dir. Returns counts."""
    rng = np.random.default_rng(seed)
    eval_rng = np.random.default_rng([seed, 1])
    www = out_dir / "www"
    (www / "img").mkdir(parents=True, exist_ok=True)
    eval_dir = out_dir / "eval"
    (eval_dir / "images").mkdir(parents=True, exist_ok=True)

    # Held-out evaluation split: its own seed stream, never served.
    eval_scenes = [random_scene(eval_rng) for _ in range(eval_size)]
    eval_rows = {"id": [], "path": [], "caption": [], "shape": [], "colour": [], "count": [], "scene": []}
    eval_images = []
    for i, sc in enumerate(eval_scenes):
        img = render(sc, image_size)
        eval_images.append(img)
        name = f"eval{i:05d}.png"
        img.save(eval_dir / "images" / name)
        eval_rows["id"].append(f"eval{i:05d}")
        eval_rows["path"].append(f"images/{name}")
        eval_rows["caption"].append(caption_en(sc))
        eval_rows["shape"].append(sc.objects[0].shape)
        eval_rows["colour"].append(sc.objects[0].colour)
        eval_rows["count"].append(len(sc.objects))
        eval_rows["scene"].append(scene_to_json(sc))
    pq.write_table(pa.table(eval_rows), eval_dir / "eval.parquet")
    # the same split as ordinary evaluation datasets (trainers/evaluation/datasets.py reads them):
    # COCO-format captions, a Parquet of labels (eval.parquet, images by path), word-order pairs
    coco = {"images": [{"id": i, "file_name": p} for i, p in zip(eval_rows["id"], eval_rows["path"])],
            "annotations": [{"id": n, "image_id": i, "caption": c}
                            for n, (i, c) in enumerate(zip(eval_rows["id"], eval_rows["caption"]))]}
    (eval_dir / "captions.json").write_text(json.dumps(coco, indent=0))
    with open(eval_dir / "wordorder.jsonl", "w") as f:
        for i, true, negs in heldout_wordorder(eval_scenes):
            f.write(json.dumps({"image": eval_rows["path"][i], "caption": true, "negatives": negs}) + "\n")

    scenes = [random_scene(rng) for _ in range(num_samples)]
    defects = _assign_defects(num_samples, fractions, rng)
    # evaluation captions planted in alt-text draw from their own stream: the other defects' draws
    # stay what they were
    cap_rng = np.random.default_rng([seed, 2])
    heldout = [(f" {c} ", eval_rows["id"][e]) for e, c in enumerate(eval_rows["caption"])
               if len(c.split()) >= HELDOUT_CAPTION_WORDS]
    langs = list(_LANG)
    urls, captions, keys = [], [], []
    gt = {"key": [], "defect": [], "detail": [], "true_caption": []}
    for i, (sc, defect) in enumerate(zip(scenes, defects)):
        key = f"s{i:07d}"
        name = f"{key}.jpg"
        route = "img"
        true_caption = caption_en(sc)
        caption = true_caption
        detail = ""
        payload = encode(render(sc, image_size), "JPEG", 92)
        if defect == "eval_caption" and not heldout:   # a split too small to have a long caption
            defect = None
        if defect == "mismatched_caption":
            j = int((i + 1 + rng.integers(0, num_samples - 1)) % num_samples)
            caption = caption_en(scenes[j])
            detail = f"caption of s{j:07d}"
        elif defect == "non_english":
            lang = langs[i % len(langs)]
            caption = caption_foreign(sc, lang)
            detail = lang
        elif defect == "eval_near_copy":
            e = int(rng.integers(0, eval_size))
            payload, how = near_copy(eval_images[e], rng)
            caption = eval_rows["caption"][e]
            detail = f"{eval_rows['id'][e]}:{how}"
        elif defect == "eval_caption":
            # a clean picture whose alt-text holds a held-out caption: as it is, re-cased, or
            # inside longer text
            c, e = heldout[int(cap_rng.integers(0, len(heldout)))]
            c, how = c.strip(), ("exact", "re-cased", "inside longer text")[i % 3]
            caption = (c if how == "exact" else (c.upper() if i % 2 else c.title()) if how == "re-cased"
                       else ALT_TEXT_AROUND[i % len(ALT_TEXT_AROUND)].format(c))
            detail = f"{e}:{how}"
        elif defect in ("http_404", "http_500"):
            route = f"status/{defect[-3:]}"
        elif defect == "timeout":
            route = "slow"
        elif defect == "corrupt":
            payload = rng.integers(0, 256, size=2048, dtype=np.uint8).tobytes()
        elif defect == "truncated":
            payload = payload[: len(payload) // 2]
        elif defect == "non_image":
            payload = b"<html><body><h1>Not found</h1><p>This page moved.</p></body></html>" * 4
        elif defect == "tiny":
            payload = encode(render(sc, 6), "PNG")
            name = f"{key}.png"
        elif defect == "empty_caption":
            caption = str(rng.choice(["", "   ", "\t"]))
        elif defect == "huge_pixels":
            payload = png_bomb(huge_pixels, huge_pixels)
            name = f"{key}.png"
            detail = f"{huge_pixels}x{huge_pixels}"
        elif defect == "huge_bytes":
            noise = rng.integers(0, 256, size=(huge_bytes // 3 // 1000 + 1, 1000, 3), dtype=np.uint8)
            payload = encode(Image.fromarray(noise), "PNG")
            name = f"{key}.png"
            detail = f"{len(payload)} bytes"
        elif defect in ("repeat_row", "train_near_copy"):
            # a copy of an earlier clean sample: the very same row, or its image re-encoded
            j = int(rng.integers(0, i)) if i else 0
            while j and defects[j] is not None:
                j -= 1
            caption = captions[j] if j < len(captions) else caption
            detail = f"copy of s{j:07d}"
            if defect == "repeat_row" and j < len(urls):
                keys.append(key)
                urls.append(urls[j])
                captions.append(caption)
                for col, val in (("key", key), ("defect", defect), ("detail", detail), ("true_caption", caption)):
                    gt[col].append(val)
                continue
            payload = encode(render(scenes[j], image_size), "JPEG", int(rng.integers(60, 85)))
        (www / "img" / name).write_bytes(payload)
        keys.append(key)
        urls.append(f"{SERVER_PLACEHOLDER}/{route}/{name}")
        captions.append(caption)
        if defect is None:
            # the grammar is small: a clean caption can hold a held-out caption by chance, which is
            # a leak all the same (~0.7 % of the demo's), recorded as one
            e = next((e for c, e in heldout if c in f" {caption} "), None)
            if e is not None:
                defect, detail = "eval_caption", f"{e}:by chance"
        gt["key"].append(key)
        gt["defect"].append(defect or "clean")
        gt["detail"].append(detail)
        gt["true_caption"].append(true_caption)
    pq.write_table(pa.table({"key": keys, "url": urls, "caption": captions, "partition": ["demo"] * len(keys)}),
                   out_dir / "urls.parquet")
    pq.write_table(pa.table(gt), out_dir / "_ground_truth.parquet")
    counts: dict[str, int] = {}
    for d in gt["defect"]:
        counts[d] = counts.get(d, 0) + 1
    return counts
