"""capline's PTB tokenization against CoreNLP 3.4.1's PTBTokenizer (the Java jar pycocoevalcap ships),
as pycocoevalcap runs it (`-preserveLines -lowerCase`, then its punctuation filter).

    python benchmarks/ptb_agreement.py

Lines: every caption of the shared COCO file (tests/trainers/data/coco-val-captions.txt) and a set
of tricky ones (accents, curly quotes, contractions, multi-word splits, dashes, currency, trailing
periods). Printed and written to benchmarks/results/ptb_agreement.json: how many match, per set,
and the first differences. Needs `java` on the PATH.
"""
from __future__ import annotations

import glob
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import write_results  # noqa: E402
from trainers.evaluation.textmetrics import PUNCTUATIONS, ptb_tokenize  # noqa: E402

TRICKY = [
    "A café in São Paulo.", "The naïve señor's piñata.", "\u201cA dog\u201d on a \u2018mat\u2019.",
    "It\u2019s a dog\u2019s toy.", "We're gonna eat, cannot stop.", "Gotta wanna lemme see.", "Don\u2019t stop.",
    "A résumé of Zoë.", "Straße in München.", "It is 5 °C and 10\u00a2.", "An \u201cice-cream\u201d cone\u2026",
    "A man \u2019s hat.", "Déjà vu \u2014 again.", "Co-op and naïveté.", "The dogs' bowls.", "I'd've gone.",
    "A 3d tv.", "Ñandú.", "£5 and €3 and ¥2.", "A \u2013 b and 10\u201320.", "A\u2014b.", "A man 's hat.",
    "The 'best' dog.", "GONNA Cannot.", "A dog\u2018s bowl.", "Naïve\u2019s.", "A cat\u2019s.",
    "\u201cQuoted\u201d.", "½ cup.", "Cafés\u2019 tables.", "L\u2019eau.", "It's \u2018ok\u2019.",
    "A man on a skateboard.", "Two dogs play.", "The U.S. flag.", "A sign says STOP...", "Gimme that.",
    "A crème brûlée on a plate.", "Jalapeño pizza.", "A Pokémon toy.", "An Ångström ruler.",
    "'Tis the season.", "Rock \u2019n\u2019 roll.", "Y'all come.",
]


def java_tokens(jar: str, lines: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "lines.txt"
        src.write_text("\n".join(lines) + "\n", encoding="utf-8")
        out = subprocess.run(["java", "-cp", jar, "edu.stanford.nlp.process.PTBTokenizer", "-preserveLines",
                              "-lowerCase", "-encoding", "utf-8", str(src)], capture_output=True, text=True,
                             timeout=600, encoding="utf-8").stdout.splitlines()
    return [" ".join(w for w in ln.rstrip().split(" ") if w not in PUNCTUATIONS) for ln in out]


def main() -> None:
    jar = next((j for d in importlib.util.find_spec("pycocoevalcap.tokenizer").submodule_search_locations
                for j in glob.glob(f"{d}/*.jar")), None)
    if not (shutil.which("java") and jar):
        raise SystemExit("needs java on the PATH and pycocoevalcap's CoreNLP jar")
    coco = (ROOT / "tests" / "trainers" / "data" / "coco-val-captions.txt").read_text(encoding="utf-8").splitlines()
    results = {}
    for name, lines in (("coco_val_captions", coco), ("tricky", TRICKY)):
        java = java_tokens(jar, lines)
        assert len(java) == len(lines), (name, len(java), len(lines))
        ours = [ptb_tokenize(t) for t in lines]
        diff = [{"text": t, "java": j, "capline": o} for t, j, o in zip(lines, java, ours) if j != o]
        results[name] = {"lines": len(lines), "identical": len(lines) - len(diff), "differences": diff[:20]}
        print(f"{name}: {len(lines) - len(diff)}/{len(lines)} identical to CoreNLP 3.4.1 after pycocoevalcap's filter")
        for d in diff[:8]:
            print(f"  {d['text']!r}: java {d['java']!r}, capline {d['capline']!r}")
    write_results("ptb_agreement", results)


if __name__ == "__main__":
    main()
