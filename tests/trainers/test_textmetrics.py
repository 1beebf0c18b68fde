"""Captions tokenized as the COCO caption evaluation does (Stanford PTBTokenizer, then
pycocoevalcap's punctuation filter), checked against the Java tokenizer itself where Java is here."""
import glob
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from trainers.evaluation.textmetrics import PUNCTUATIONS, caption_scores, ptb_tokenize, ptb_tokens

# What CoreNLP 3.4.1's PTBTokenizer -preserveLines -lowerCase prints for each (run once by hand; the
# test below runs it again wherever Java is installed).
TRICKY = {
    "A man's dog doesn't like the cat's toy.": "a man 's dog does n't like the cat 's toy .",
    "They're sitting at a black-and-white table, eating 3.5 slices of pizza!":
        "they 're sitting at a black-and-white table , eating 3.5 slices of pizza !",
    "The U.S. flag flies over Mr. Smith's house on 5th St.": "the u.s. flag flies over mr. smith 's house on 5th st.",
    "A \"vintage\" car (red) parked near a sign that says 'STOP'...":
        "a `` vintage '' car -lrb- red -rrb- parked near a sign that says ` stop ' ...",
    "A 1,000-piece puzzle & a cup of coffee -- on the table; nice: right?":
        "a 1,000-piece puzzle & a cup of coffee -- on the table ; nice : right ?",
    "An and/or sign with 50% off at 10:30 and a $5 price*": "an and/or sign with 50 % off at 10:30 and a $ 5 price *",
    "I'm here, we've been there, you'll see, he'd go.": "i 'm here , we 've been there , you 'll see , he 'd go .",
    "A dog's  tail -- wagging   ... happily.": "a dog 's tail -- wagging ... happily .",
    "A woman in a t-shirt holds a 2x4 board next to her kids' bikes.":
        "a woman in a t-shirt holds a 2x4 board next to her kids ' bikes .",
    "The cat--sleeping--lies on the sofa`s edge.": "the cat -- sleeping -- lies on the sofa ` s edge .",
    # letters of any script, curly quotes, multi-word splits, normalised characters (CoreNLP 3.4.1, by hand)
    "The naïve señor's piñata in São Paulo.": "the naïve señor 's piñata in são paulo .",
    "\u201cA dog\u201d on a \u2018mat\u2019, it\u2019s a dog\u2019s toy; don\u2019t stop":
        "`` a dog '' on a ` mat ' , it 's a dog 's toy ; do n't stop",
    "We're gonna eat, cannot stop; gotta wanna lemme see": "we 're gon na eat , can not stop ; got ta wan na lem me see",
    "Déjà vu \u2014 again\u2026 £5 and €3, 10\u00a2, ½ cup": "déjà vu -- again ... # 5 and $ 3 , 10 cents , 1/2 cup",
    "A kitchen stove.and white cabinets near 22 3/4 st. and \"lincoln av e.\" 'Tis y'all":
        "a kitchen stove.and white cabinets near 22\u00a03/4 st. and `` lincoln av e. '' 't is y' all",
}
JAR = next((j for d in importlib.util.find_spec("pycocoevalcap.tokenizer").submodule_search_locations
            for j in glob.glob(f"{d}/*.jar")), None)


def test_tricky_captions_tokenize_as_ptb_does():
    for text, java in TRICKY.items():
        assert " ".join(ptb_tokens(text)) == java, text
    # what the scorers see: the regex this replaced split hyphens and contractions apart
    assert ptb_tokenize("A black-and-white cat's toy.") == "a black-and-white cat 's toy"
    assert ptb_tokenize("A car (red).") == "a car -lrb- red -rrb-"        # lower-cased: pycocoevalcap keeps them


@pytest.mark.slow   # starts a JVM and reads 1,500 SVG files
@pytest.mark.skipif(not (shutil.which("java") and JAR), reason="needs Java for pycocoevalcap's own tokenizer")
def test_agreement_with_the_java_tokenizer(tmp_path):
    lines = list(TRICKY)
    for f in sorted(glob.glob("/usr/share/openclipart/svg/**/*.svg", recursive=True))[:1500]:
        head = Path(f).read_text(errors="replace")[:20000]
        for tag in ("dc:title", "dc:description"):
            m = re.search(rf"<{tag}>(.*?)</{tag}>", head, re.S)
            if m and 3 < len(text := " ".join(m.group(1).split())) < 200 and text.isascii() and "<" not in text \
                    and "&" not in text:
                lines.append(text)
    src = tmp_path / "captions.txt"
    src.write_text("\n".join(lines) + "\n")
    out = subprocess.run(["java", "-cp", JAR, "edu.stanford.nlp.process.PTBTokenizer", "-preserveLines", "-lowerCase",
                          str(src)], capture_output=True, text=True, timeout=120).stdout.splitlines()
    java = [" ".join(w for w in ln.rstrip().split(" ") if w not in PUNCTUATIONS) for ln in out]
    ours = [ptb_tokenize(t) for t in lines]
    same = sum(a == b for a, b in zip(ours, java))
    print(f"PTB tokenization: {same}/{len(lines)} captions identical to CoreNLP 3.4.1's after pycocoevalcap's filter")
    assert len(java) == len(lines) and same / len(lines) >= 0.995


def test_cider_is_on_the_papers_scale():
    refs = {"1": ["a red circle above a blue square", "a red circle over a blue square"],
            "2": ["two green triangles", "a pair of green triangles"]}
    perfect = caption_scores(refs, {"1": "a red circle above a blue square", "2": "two green triangles"})
    assert 100 < perfect["cider"] < 1000 and 0 < perfect["bleu4"] <= 100
