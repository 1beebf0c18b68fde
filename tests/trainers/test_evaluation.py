"""Unit: the evaluation pieces reproduce independent implementations and pass sanity scorers."""
import numpy as np
import pytest

from stages.source import synthetic
from infra.errors import UserError
from trainers.evaluation.fewshot import few_shot_split, probe, ridge_fit_predict
from trainers.evaluation.textmetrics import caption_scores, tokenize
from stages.source.synthetic import hard_negatives, heldout_wordorder
from trainers.evaluation.wordorder import word_order_eval


def test_probe_on_raw_digit_pixels_matches_scikit_learn_ridge():
    from sklearn.datasets import load_digits
    from sklearn.linear_model import Ridge

    x, y = load_digits(return_X_y=True)
    for seed in range(3):
        tr, te = few_shot_split(y, 10, seed)
        ours = ridge_fit_predict(x[tr], y[tr], x[te], 10)
        mean, std = x[tr].mean(0), x[tr].std(0) + 1e-8
        feats = lambda a: np.concatenate([(a - mean) / std, np.ones((len(a), 1))], 1)  # noqa: E731
        ref = Ridge(alpha=2.0 ** 10, fit_intercept=False).fit(feats(x[tr]), 2 * np.eye(10)[y[tr]] - 1)
        theirs = ref.predict(feats(x[te])).argmax(1)
        assert (ours == theirs).all()
        assert (ours == y[te]).mean() > 0.5                         # raw pixels, 10-shot: well above chance
    result = probe(x.astype(np.float32), y, shots=(1, 10), seeds=(0, 1, 2))
    assert result[10]["mean"] > result[1]["mean"] and len(result[10]["runs"]) == 3


def test_too_few_examples_per_class_is_an_error():
    with pytest.raises(UserError, match="class 1 has 20 examples to draw from; 25-shot needs at least 25"):
        few_shot_split(np.array([0] * 30 + [1] * 20), 25, 0)


def test_few_shot_tests_on_one_held_out_split_never_drawn_from():
    from trainers.evaluation.fewshot import holdout_split

    y = np.repeat(np.arange(4), 40)
    pool, test = holdout_split(y, 0.5)
    assert len(test) == 80 and np.array_equal(np.unique(y[test], return_counts=True)[1], [20] * 4)
    assert np.array_equal(holdout_split(y, 0.5)[1], test)              # fixed: the same for every call
    from trainers.evaluation.fewshot import fewest_in

    def pool_sizes(y, share):
        return fewest_in(y, holdout_split(y, share)[0])

    odd = np.array([0] * 10 + [1] * 2 + [2])       # class 2 has one image: all of it is test, none to draw
    assert pool_sizes(odd, 0.5) == 0 and pool_sizes(odd[:12], 0.5) == 1
    for k in (1, 10):
        for seed in range(3):
            tr, rest = few_shot_split(y, k, seed, pool)
            assert not set(tr) & set(test) and not set(rest) & set(test) and len(tr) == 4 * k


@pytest.mark.slow   # 1.6-5.5 s: kept out of the fast set (under a minute)
def test_map_probe_sweep_picks_its_setting_on_validation():
    import torch

    from trainers.evaluation.lit import map_probe
    from trainers.models import ModelConfig

    torch.manual_seed(0)
    def tokens(labels):          # class c: token 0 carries +3 on feature c
        t = torch.randn(len(labels), 4, 8) * 0.3
        t[torch.arange(len(labels)), 0, torch.from_numpy(labels)] += 3.0
        return t

    ytr, yval, yte = np.repeat(np.arange(3), 5), np.repeat(np.arange(3), 5), np.repeat(np.arange(3), 30)
    cfg = ModelConfig(family="cappa", width=8, heads=2, mlp=16)
    out = map_probe((tokens(ytr), ytr), (tokens(yval), yval), (tokens(yte), yte), cfg, 40, [1e-9, 1e-2], seed=0)
    assert out["lr"] == 1e-2 and out["steps"] in (20, 40) and out["accuracy"] > 0.9


def test_cider_ranks_perfect_above_shuffled_and_matches_pycocoevalcap():
    from pycocoevalcap.cider.cider import Cider

    rng = np.random.default_rng(0)
    caps = [synthetic.caption_en(synthetic.random_scene(rng)) for _ in range(40)]
    refs = {str(i): [c, c.replace("a ", "one ", 1)] for i, c in enumerate(caps)}
    perfect = {str(i): c for i, c in enumerate(caps)}
    shuffled = {str(i): caps[(i + 7) % 40] for i in range(40)}
    good, bad = caption_scores(refs, perfect), caption_scores(refs, shuffled)
    assert good["cider"] > bad["cider"] + 100 and good["bleu4"] > bad["bleu4"]
    direct, _ = Cider().compute_score({k: [tokenize(r) for r in v] for k, v in refs.items()},
                                      {k: [tokenize(v)] for k, v in perfect.items()})
    assert good["cider"] == pytest.approx(100 * direct)      # the papers' scale: 117.5, not 1.175


def _scenes(n=200):
    rng = np.random.default_rng(3)
    return [synthetic.random_scene(rng) for _ in range(n)]


def test_word_order_sanity_scorers():
    scenes = _scenes()
    truth = {i: synthetic.caption_en(s) for i, s in enumerate(scenes)}

    def bag_of_words(i, caps):
        vocab = set(truth[i].split())
        return [-len(set(c.split()) ^ vocab) for c in caps]

    def oracle(i, caps):
        return [1.0 if c == truth[i] else 0.0 for c in caps]

    cases = heldout_wordorder(scenes)
    idx = [i for i, _, _ in cases]
    by_case = lambda f: lambda j, caps: f(idx[j], caps)  # noqa: E731 - case j is scene idx[j]
    pairs = [(t, n) for _, t, n in cases]
    bow, ora = word_order_eval(pairs, by_case(bag_of_words)), word_order_eval(pairs, by_case(oracle))
    assert bow["pairwise"]["relation_order"]["accuracy"] == 0.5 and bow["pairwise"]["relation_order"]["n"] > 50
    assert all(v["accuracy"] == 1.0 for v in ora["pairwise"].values()) and ora["precision_at_1"]["accuracy"] == 1.0
    assert set(ora["pairwise"]) == {"relation_order", "attribute_swap", "added_object"}


def test_hard_negatives_change_only_what_they_claim():
    a = synthetic.Obj("circle", "red", "large", 0.2, 0.5)
    b = synthetic.Obj("square", "blue", "small", 0.8, 0.5)
    negs = hard_negatives(synthetic.Scene((a, b), (220, 220, 220), 0))
    assert negs["relation_order"] == "a small blue square to the left of a large red circle"
    assert negs["attribute_swap"] == "a large blue circle to the left of a small red square"
    assert negs["added_object"].startswith("a large red circle to the left of a small blue square and a large")
    sc = synthetic.Scene((a, b), (1, 2, 3), 4, (0.5, 9.0))
    assert synthetic.scene_from_json(synthetic.scene_to_json(sc)) == sc


@pytest.mark.parametrize("family", ["cap", "cappa", "clip", "siglip", "coca"])
def test_features_from_tokens_are_the_models_image_features(family):
    """The probes run the encoder once and pool its tokens: the same features image_features gives."""
    import torch

    from test_models import tiny
    from trainers.evaluation.lit import encoder_of, features_from_tokens
    from trainers.models import build_model

    torch.manual_seed(0)
    m = build_model(tiny(family, **({"pool": "map"} if family == "clip" else {}))).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(features_from_tokens(m, encoder_of(m)(x)), m.image_features(x), atol=1e-6)


def test_zero_shot_averages_a_class_prompts_as_clip_does():
    """Class A: three prompts that all sit near the image. Class B: one prompt equal to the image, two
    far from it. The best single prompt is B's; the averaged class embedding is A's (CLIP's prompt
    ensembling; taking the max prompt would answer B)."""
    import torch
    import torch.nn.functional as F

    from trainers.evaluation.run import _prompt_ensemble

    img = F.normalize(torch.tensor([[1.0, 0.2]]), dim=-1)
    prompts = F.normalize(torch.tensor([[1.0, 0.3], [1.0, 0.3], [1.0, 0.3],     # class A
                                        [1.0, 0.2], [0.0, 1.0], [-0.2, 1.0]]), dim=-1)   # class B

    class Towers:
        def embed_image(self, x):
            return img.expand(len(x), -1)

        def embed_text(self, ids):
            return prompts[ids[:, 0]]

    cands = torch.arange(6)[:, None]
    scores = _prompt_ensemble(Towers(), torch.zeros(1, 3, 4, 4), cands, 2, torch.device("cpu"))
    assert scores.shape == (1, 2) and scores.argmax(1).item() == 0
    assert (img @ prompts.T).argmax().item() == 3       # the single best prompt is class B's


def test_probe_images_are_resized_and_centrally_cropped_not_squashed():
    """A wide image, green in its centre square and red at the sides: the probes see only green."""
    from PIL import Image

    from trainers.evaluation.run import _prep

    arr = np.zeros((32, 96, 3), np.uint8)
    arr[:, :, 0] = 255
    arr[:, 32:64] = (0, 255, 0)
    for image in (Image.fromarray(arr), arr):
        x = _prep([image], 16, crop=True)[0]
        assert x.shape == (3, 16, 16)
        assert float(x[1].min()) > 0.9 and float(x[0].max()) < -0.9       # all green, no red
    squashed = _prep([Image.fromarray(arr)], 16)[0]
    assert float(squashed[0].max()) > 0.9                                  # captioning keeps the whole frame
