"""Which `stages.language.min_confidence` for short alt-text? Measured, not guessed.

English: openclipart drawings' titles as their authors wrote them (Debian openclipart-svg; titles
alone are the short alt-text that gets dropped: "clip art of analogue clock"). Not English: the
first line of short Debian fortunes (fortunes-de, -es, -it, -br, -pl, -cs), 3 to 10 words. For
each threshold, with `languages: [en]`: the share of English dropped (false drops) and the share
of other languages dropped (recall). Writes benchmarks/results/language.json.

    .venv/bin/python benchmarks/language_threshold.py
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORTUNES = Path("/usr/share/games/fortunes")
FOREIGN = {"de": "de", "es": "es", "it": "it", "brasil": "pt", "pl": "pl", "cs": "cs"}
THRESHOLDS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


def english_titles(limit: int = 3000) -> list[str]:
    import xml.etree.ElementTree as ET

    from stages.source.openclipart import _DC, list_svgs, svg_root

    root = svg_root(None)
    files = list_svgs(root)
    random.Random(0).shuffle(files)
    out = []
    for f in files:
        try:
            tree = ET.fromstring((root / f).read_bytes())
        except ET.ParseError:
            continue
        title = next((t.text.strip() for t in tree.iter(f"{_DC}title") if t.text and t.text.strip()), "")
        if 2 <= len(title.split()) <= 10:
            out.append(title)
        if len(out) >= limit:
            break
    return out


def foreign_lines(per_language: int = 400) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, code in FOREIGN.items():
        paths = [p for p in (FORTUNES / name).rglob("*") if p.is_file() and p.suffix != ".dat"] \
            if (FORTUNES / name).is_dir() else [FORTUNES / name]
        lines = []
        for p in sorted(paths):
            raw = p.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            for entry in text.split("\n%\n"):
                first = entry.strip().splitlines()[0].strip() if entry.strip() else ""
                if 3 <= len(first.split()) <= 10 and not first.startswith(("--", "\t")):
                    lines.append(first)
        random.Random(0).shuffle(lines)
        if lines:
            out[code] = lines[:per_language]
    return out


def main() -> int:
    from stages.filters.language import decide, load_backend

    lid = load_backend("fasttext")
    english = english_titles()
    foreign = foreign_lines()
    if not english or not foreign:
        print("needs Debian openclipart-svg and fortunes-de/-es/-it/-br/-pl/-cs (apt-get install them)")
        return 1
    p_en = [lid.predict(t) for t in english]
    p_fx = {code: [lid.predict(t) for t in lines] for code, lines in foreign.items()}
    rows = []
    for th in THRESHOLDS:
        en_drop = sum(bool(decide(p, ["en"], th)[0]) for p in p_en) / len(p_en)
        per = {code: sum(bool(decide(p, ["en"], th)[0]) for p in ps) / len(ps) for code, ps in p_fx.items()}
        recall = sum(per.values()) / len(per)
        rows.append({"min_confidence": th, "english_dropped": round(en_drop, 4), "other_dropped": round(recall, 4),
                     "other_dropped_by_language": {k: round(v, 4) for k, v in per.items()}})
        print(f"min_confidence {th:<5} English dropped {100 * en_drop:5.1f}%   other languages dropped "
              f"{100 * recall:5.1f}%  ({', '.join(f'{k} {100 * v:.0f}%' for k, v in per.items())})")
    out = ROOT / "benchmarks" / "results" / "language.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"english": {"source": "openclipart-svg titles", "n": len(english)},
                               "other": {k: len(v) for k, v in foreign.items()}, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
