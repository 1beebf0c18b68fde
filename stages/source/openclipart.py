"""The openclipart source: Debian's `openclipart-svg` (8,121 public-domain clip-art SVGs) as a URL list.

Each SVG carries the metadata its author wrote: a title (`dc:title`) and keywords (`dc:subject`).
They make real, noisy alt-text: "Mostriciattolo, insect" (Italian), "Part of the Flat Icon
Collection (Wed Aug 25 23:29:46 2004), action, computer", author names as titles. The package also
lists some drawings twice (663 symlinks into other categories): real duplicates for dedup.

The source stage renders each SVG with cairosvg (longest side `render_size`, on white) into
`source/www/img/`, and the ingest stage downloads them with img2dataset from a loopback server, as
it would from the web. An SVG that cannot be parsed or rendered is dropped here with the reason
`svg_unreadable` / `render_failed:<error>`; nothing is skipped silently.
"""
from __future__ import annotations

import hashlib
import io
import xml.etree.ElementTree as ET
from pathlib import Path

from infra.errors import UserError

DEFAULT_ROOT = "/usr/share/openclipart/svg"
_DC = "{http://purl.org/dc/elements/1.1/}"
_RDF = "{http://www.w3.org/1999/02/22-rdf-syntax-ns#}"


def svg_root(path: str | None) -> Path:
    root = Path(path or DEFAULT_ROOT)
    if not root.is_dir():
        raise UserError(f"source.kind openclipart: no SVG folder at {root}; install the Debian package "
                        "(sudo apt-get install openclipart-svg; `make demo` and `make test` do it when run "
                        "as root) or set source.path to a folder of SVG files")
    return root


def list_svgs(root: Path) -> list[str]:
    """Relative paths of every SVG under root (symlinks included: the package's own duplicates), sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.svg") if p.is_file())


def tree_digest(root: Path, files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f}\t{(root / f).stat().st_size}\n".encode())
    return h.hexdigest()


def svg_key(relpath: str) -> str:
    return "oc" + hashlib.sha1(relpath.encode()).hexdigest()[:16]


def caption_of(svg: bytes) -> str:
    """The drawing's title and keywords as its author wrote them, joined as alt-text."""
    root = ET.fromstring(svg)
    titles = [t.text.strip() for t in root.iter(f"{_DC}title") if t.text and t.text.strip()]
    keywords = []
    for subject in root.iter(f"{_DC}subject"):
        for li in subject.iter(f"{_RDF}li"):
            if li.text and li.text.strip() and li.text.strip() not in keywords:
                keywords.append(li.text.strip())
    title = titles[0] if titles else ""
    return ", ".join([title, *keywords]) if title else ", ".join(keywords)


def render_png(svg: bytes, size: int) -> bytes:
    import cairosvg
    from PIL import Image

    png = cairosvg.svg2png(bytestring=svg, unsafe=False)
    img = Image.open(io.BytesIO(png))
    img.load()
    w, h = img.size
    scale = size / max(w, h)
    if max(w, h) < size // 2:   # icons drawn at 16-48 px: render again at the size, not upscale pixels
        png = cairosvg.svg2png(bytestring=svg, output_width=max(1, round(w * scale)),
                               output_height=max(1, round(h * scale)), unsafe=False)
        img = Image.open(io.BytesIO(png))
    elif scale < 1:
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.LANCZOS)
    rgba = img.convert("RGBA")
    canvas = Image.new("RGB", rgba.size, (255, 255, 255))
    canvas.paste(rgba, mask=rgba.split()[3])
    buf = io.BytesIO()
    canvas.save(buf, "PNG", optimize=False)
    return buf.getvalue()


def convert(root: str, relpaths: list[str], out_dir: str, size: int) -> list[dict]:
    """Render a batch; -> one row per file: key, relpath, caption, file name or failure reason."""
    rows = []
    for rel in relpaths:
        key = svg_key(rel)
        row = {"key": key, "relpath": rel, "caption": "", "file": "", "reason": "", "detail": ""}
        try:
            svg = (Path(root) / rel).read_bytes()
            row["caption"] = caption_of(svg)
        except (OSError, ET.ParseError, ValueError) as err:
            row.update(reason="svg_unreadable", detail=f"{type(err).__name__}: {err}"[:300])
            rows.append(row)
            continue
        try:
            png = render_png(svg, size)
        except Exception as err:  # noqa: BLE001 - cairosvg raises many kinds; each is this file's verdict
            row.update(reason=f"render_failed:{type(err).__name__}", detail=str(err)[:300])
            rows.append(row)
            continue
        name = f"{key}.png"
        (Path(out_dir) / name).write_bytes(png)
        row["file"] = name
        rows.append(row)
    return rows


def build(root: Path, files: list[str], out_dir: Path, size: int, run, chunk: int = 100) -> list[dict]:
    """Render every file in tasks (`run`: the stage's executor; chunks of `chunk`), in file order.
    Resumable: rendered files stay."""
    out_dir.mkdir(parents=True, exist_ok=True)
    calls = [(str(root), files[i:i + chunk], str(out_dir), size) for i in range(0, len(files), chunk)]
    return [row for rows in run(convert, calls, "source: rendering SVGs", num_cpus=1, unit="chunks") for row in rows]
