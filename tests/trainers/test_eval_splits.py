"""#36: evaluation sets whole by default, a limit explicit and recorded, official splits read from
every format (train/test folders, a split column, fashion-MNIST's files, a Karpathy-style JSON),
few-shot shots drawn from train and scored on test, only the images a probe uses read."""
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from infra.errors import UserError
from trainers.evaluation.config import CaptionSet, ClassificationSet
from trainers.evaluation.datasets import labelled_set, load_captions


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (value, value, value)).save(buf, "PNG")
    return buf.getvalue()


def _folder(root, split, classes=("cat", "dog", "owl"), per=4):
    for c in classes:
        (root / split / c).mkdir(parents=True)
        for i in range(per):
            (root / split / c / f"{i}.png").write_bytes(_png(10 * i))


def test_a_folder_with_train_and_test_is_read_as_its_official_split(tmp_path):
    _folder(tmp_path, "train", per=6)
    _folder(tmp_path, "test", per=3)
    data = labelled_set(ClassificationSet(name="f", kind="folder", path=str(tmp_path)), tmp_path)
    assert data.split.count("train") == 18 and data.split.count("test") == 9
    assert data.selected == list(range(27))
    d = data.describe()
    assert d == {"split": "official", "images": {"test": 9, "train": 18}, "of": {"test": 9, "train": 18},
                 "limit": None, "classes": 3}
    # without train/ and test/: one pool, held out by eval.holdout
    flat = tmp_path / "flat"
    _folder(flat, "x")
    data = labelled_set(ClassificationSet(name="g", kind="folder", path=str(flat / "x")), tmp_path)
    assert data.split is None and data.describe()["split"] == "eval.holdout of each class"


def test_a_limit_keeps_every_class_in_each_split_and_is_recorded(tmp_path):
    labels = ["a"] * 50 + ["b"] * 5 + ["c"] * 45 + ["a"] * 20 + ["b"] * 20
    split = ["train"] * 100 + ["test"] * 40
    pq.write_table(pa.table({"image": [_png(i % 200) for i in range(140)], "label": labels, "part": split}),
                   tmp_path / "s.parquet")
    s = ClassificationSet(name="p", kind="parquet", path=str(tmp_path / "s.parquet"), split_col="part", limit=12)
    data = labelled_set(s, tmp_path)
    kept = data.selected
    assert sum(split[i] == "train" for i in kept) == 12 and sum(split[i] == "test" for i in kept) == 12
    train_classes = sorted(labels[i] for i in kept if split[i] == "train")
    assert train_classes == ["a"] * 4 + ["b"] * 4 + ["c"] * 4          # classes in turn, not the first rows
    assert data.describe()["images"] == {"test": 12, "train": 12} and data.describe()["of"] == {"test": 40, "train": 100}
    assert data.describe()["limit"] == 12
    assert labelled_set(s, tmp_path).selected == kept                   # seeded: the same every time
    with pytest.raises(UserError, match="split_col 'label' must hold train and test rows"):
        labelled_set(ClassificationSet(name="p", kind="parquet", path=str(tmp_path / "s.parquet"), split_col="label"),
                     tmp_path)


def test_fashion_mnist_is_its_official_60000_train_and_10000_test_and_reads_images_on_demand():
    s = ClassificationSet(name="fm", kind="builtin", path="fashion_mnist")
    data = labelled_set(s, None)
    assert data.split.count("train") == 60000 and data.split.count("test") == 10000
    assert data.describe()["limit"] is None and len(data.selected) == 70000
    first_test = data.split.index("test")
    img = data.image(first_test)
    from trainers.evaluation.datasets import fashion_mnist_images

    assert np.array_equal(np.asarray(img)[:, :, 0], fashion_mnist_images("t10k")[0])


def test_a_karpathy_json_gives_the_named_split_and_says_which_splits_it_has(tmp_path):
    (tmp_path / "val2014").mkdir()
    images = []
    for n, split in enumerate(["train", "test", "val", "test", "restval"]):
        name = f"COCO_val2014_{n:012d}.jpg"
        Image.new("RGB", (8, 8), (n * 40, 0, 0)).save(tmp_path / "val2014" / name, "JPEG")
        images.append({"filepath": "val2014", "filename": name, "split": split, "cocoid": 100 + n,
                       "sentences": [{"raw": f"A picture number {n}.", "tokens": []}, {"raw": "Another one."}]})
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    s = CaptionSet(name="k", kind="karpathy", path=str(tmp_path / "dataset_coco.json"), images=str(tmp_path))
    rows = load_captions(s, tmp_path)
    assert [r[0] for r in rows] == ["101", "103"] and rows[0][2] == ["A picture number 1.", "Another one."]
    assert len(load_captions(CaptionSet(**{**vars(s), "split": "val"}), tmp_path)) == 1
    assert len(load_captions(CaptionSet(**{**vars(s), "limit": 1}), tmp_path)) == 1
    with pytest.raises(UserError, match=r"no images of split 'minival' .*it has restval, test, train, val.*split"):
        load_captions(CaptionSet(**{**vars(s), "split": "minival"}), tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"images": [{"filename": "x.jpg"}]}))
    with pytest.raises(UserError, match="not a Karpathy-style captions file"):
        load_captions(CaptionSet(**{**vars(s), "path": str(tmp_path / "bad.json")}), tmp_path)


def test_sets_are_whole_by_default():
    assert ClassificationSet().limit is None and CaptionSet().limit is None


def test_few_shot_draws_from_train_scores_on_test_and_reads_only_those_images(tmp_path, monkeypatch):
    """The probe on a real (tiny, untrained) model: shots only from train, accuracy over every test
    image, images outside the draws and the test split never read; the result names the split."""
    import torch

    import trainers.evaluation.datasets as datasets
    from trainers.evaluation.config import EvalConfig, MapProbe
    from trainers.evaluation.run import _fewshot
    from trainers.models import ModelConfig, build_model

    _folder(tmp_path, "train", per=40)
    _folder(tmp_path, "test", per=5)
    reads = []
    real = datasets.labelled_set

    def counting(s, run_dir):
        data = real(s, run_dir)
        inner = data.read
        data.read = lambda i: (reads.append(i), inner(i))[1]
        return data

    monkeypatch.setattr(datasets, "labelled_set", counting)
    torch.manual_seed(0)
    cfg = ModelConfig(family="cappa", size="tiny", vocab_size=64, max_len=8, image_size=16, patch=4, width=32,
                      depth=1, heads=2, mlp=64, caption_queries=4, prefix_len=3)
    model = build_model(cfg).eval()
    ec = EvalConfig(fewshot=[], shots=[1, 5], seeds=2, map_probe=MapProbe(steps=0))
    results = {"skipped": [], "sets": {}}
    said = []
    _fewshot(model, cfg, [ClassificationSet(name="f", kind="folder", path=str(tmp_path))], ec, (1, 5), True,
             results, tmp_path, said.append)
    data = real(ClassificationSet(name="f", kind="folder", path=str(tmp_path)), tmp_path)
    test = {i for i, s in enumerate(data.split) if s == "test"}
    assert test <= set(reads)                                 # every test image scored
    drawn = set(reads) - test
    assert drawn and all(data.split[i] == "train" for i in drawn)
    assert len(drawn) <= 3 * (1 + 5) * 2                       # the shots of 2 seeds, not the 120 train images
    assert results["sets"]["fewshot"]["f"]["split"] == "official" and results["sets"]["fewshot"]["f"]["test_images"] == 15
    assert set(results["fewshot"]["f"]) == {1, 5}
    assert any("f: test 15, train 120 images (official split), 3 classes; the whole set" in line for line in said)


def _vg(tmp_path, kind):
    (tmp_path / "images").mkdir(exist_ok=True)
    img = Image.new("RGB", (40, 30), (0, 0, 0))
    img.paste((255, 0, 0), (10, 5, 20, 25))
    img.save(tmp_path / "images" / "2344.jpg", "JPEG")
    key, value = ("relation_name", ["on", "under", "on"]) if kind == "vg_relation" else ("attributes", [["red", "small"]] * 3)
    rows = [{"image_id": "2344", "image_path": "2344.jpg", "bbox_x": 10, "bbox_y": 5, "bbox_w": 10, "bbox_h": 20,
             "true_caption": f"the cup is {i} the table", "false_caption": f"the table is {i} the cup", key: v}
            for i, v in enumerate(value)]
    (tmp_path / f"{kind}.json").write_text(json.dumps(rows))


def test_aros_vg_relation_and_attribution_are_read_as_published_and_cropped_to_their_box(tmp_path):
    from trainers.evaluation.config import WordOrderSet
    from trainers.evaluation.datasets import load_wordorder

    _vg(tmp_path, "vg_relation")
    s = WordOrderSet(name="vgr", kind="vg_relation", path=str(tmp_path / "vg_relation.json"), images=str(tmp_path / "images"))
    cases = load_wordorder(s, tmp_path, {})
    assert [n for _, _, n in cases] == [{"on": "the table is 0 the cup"}, {"under": "the table is 1 the cup"},
                                        {"on": "the table is 2 the cup"}]
    img = cases[0][0]
    assert img.size == (10, 20) and np.asarray(img).mean(axis=(0, 1))[0] > 200    # the red box, not the whole image
    assert len(load_wordorder(WordOrderSet(**{**vars(s), "limit": 2}), tmp_path, {})) == 2
    _vg(tmp_path, "vg_attribution")
    s = WordOrderSet(name="vga", kind="vg_attribution", path=str(tmp_path / "vg_attribution.json"), images=str(tmp_path / "images"))
    assert {c for _, _, n in load_wordorder(s, tmp_path, {}) for c in n} == {"attribute"}
    (tmp_path / "bad.json").write_text(json.dumps([{"image_path": "2344.jpg"}]))
    with pytest.raises(UserError, match="not ARO's vg_attribution format"):
        load_wordorder(WordOrderSet(**{**vars(s), "path": str(tmp_path / "bad.json")}), tmp_path, {})


def test_sugarcrepe_files_are_read_as_published_one_category_each(tmp_path):
    from trainers.evaluation.config import WordOrderSet
    from trainers.evaluation.datasets import load_wordorder

    (tmp_path / "val2017").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "val2017" / "000000000139.jpg", "JPEG")
    (tmp_path / "sc").mkdir()
    for cat in ("swap_obj", "add_att"):
        (tmp_path / "sc" / f"{cat}.json").write_text(json.dumps(
            {"0": {"filename": "000000000139.jpg", "caption": "a dog on a sofa", "negative_caption": f"{cat} text"},
             "1": {"filename": "000000000139.jpg", "caption": "two cats", "negative_caption": f"{cat} more"}}))
    s = WordOrderSet(name="sc", kind="sugarcrepe", path=str(tmp_path / "sc"), images=str(tmp_path / "val2017"))
    cases = load_wordorder(s, tmp_path, {})
    assert [(t, n) for _, t, n in cases] == [("a dog on a sofa", {"add_att": "add_att text"}), ("two cats", {"add_att": "add_att more"}),
                                             ("a dog on a sofa", {"swap_obj": "swap_obj text"}), ("two cats", {"swap_obj": "swap_obj more"})]
    (tmp_path / "sc" / "broken.json").write_text(json.dumps({"0": {"filename": "x.jpg"}}))
    with pytest.raises(UserError, match="not SugarCrepe's format"):
        load_wordorder(s, tmp_path, {})


def test_zero_shot_class_names_and_templates_come_from_files(tmp_path):
    from trainers.evaluation.datasets import prompt_texts

    labels = ["n02", "n01", "n03"]
    (tmp_path / "names.txt").write_text("tench\ngoldfish\ngreat white shark\n")
    (tmp_path / "templates.txt").write_text("a photo of a {}.\na bad photo of the {}.\n")
    s = ClassificationSet(name="in", kind="folder", path="x", class_names=str(tmp_path / "names.txt"),
                          templates_file=str(tmp_path / "templates.txt"))
    names, templates = prompt_texts(s, labels, tmp_path)
    assert names == {"n01": "tench", "n02": "goldfish", "n03": "great white shark"}
    assert templates == ["a photo of a {}.", "a bad photo of the {}."]
    (tmp_path / "names.json").write_text(json.dumps({"n01": "tench", "n02": "goldfish"}))
    with pytest.raises(UserError, match="names no class for label\\(s\\) n03"):
        prompt_texts(ClassificationSet(**{**vars(s), "class_names": str(tmp_path / "names.json")}), labels, tmp_path)
    (tmp_path / "t.txt").write_text("no placeholder\n")
    with pytest.raises(UserError, match="every template needs a \\{\\}"):
        prompt_texts(ClassificationSet(**{**vars(s), "templates_file": str(tmp_path / "t.txt")}), labels, tmp_path)
    # no files, no templates: bare class names, as big_vision scores them
    assert prompt_texts(ClassificationSet(name="d"), ["a", "b"], tmp_path) == ({"a": "a", "b": "b"}, ["{}"])


def test_big_vision_preprocessing_squashes_then_crops_and_is_named_in_the_results():
    """big_vision's few-shot preprocessing on a wide image: squashed to size*256/224 (all of it in
    the frame, the sides narrowed), then the central size x size: the red sides still show at the
    crop's edges, where the largest centred square would show green only; captioning squashes."""
    from trainers.evaluation.run import PREPROCESSING, _prep

    arr = np.zeros((32, 96, 3), np.uint8)
    arr[:, :, 0] = 255
    arr[:, 32:64] = (0, 255, 0)
    img = Image.fromarray(arr)
    bv = _prep([img], 224, crop=True, mode="big_vision")[0]
    assert bv.shape == (3, 224, 224)
    # squashed to 256 wide, the green third is columns ~85-170; cropped from 16, green spans ~69-154
    assert float(bv[0, :, 2].mean()) > 0.9 and float(bv[1, :, 112].mean()) > 0.9
    square = _prep([img], 224, crop=True, mode="square_crop")[0]
    assert float(square[0].max()) < -0.9                      # the centred square: no red at all
    whole = _prep([img], 224, mode="big_vision")[0]
    assert float(whole[0, :, 2].mean()) > 0.9 and float(whole[1, :, 112].mean()) > 0.9
    assert set(PREPROCESSING["big_vision"]) == {"fewshot", "zeroshot", "captioning", "wordorder"}
    from trainers.evaluation.config import EvalConfig

    assert EvalConfig().preprocess == "big_vision"


def test_the_paper_table_names_its_preprocessing_splits_and_sizes():
    from trainers.evaluation.experiment import _protocol
    from trainers.evaluation.run import PREPROCESSING

    ev = {"preprocessing": {"name": "big_vision", **PREPROCESSING["big_vision"]},
          "sets": {"fewshot": {"fashion_mnist": {"split": "official", "images": {"test": 2000, "train": 2000},
                                                 "of": {"test": 10000, "train": 60000}, "limit": 2000, "classes": 10}},
                   "captioning": {"coco": {"images": 5000, "limit": None, "split": "test"}},
                   "wordorder": {"vgr": {"kind": "vg_relation", "cases": 23937, "limit": None}}}}
    text = _protocol([("Cap", 1.0, 2.0, ev)])
    assert "Preprocessing: big_vision (fewshot: squash to size*256/224, central crop to size, bilinear;" in text
    assert "- fewshot fashion_mnist: test 2000 of 10000, train 2000 of 60000 images, official split, 10 classes, limit 2000 per split" in text
    assert "- captioning coco: 5000 images, split test, whole" in text and "- wordorder vgr: 23937 cases, whole" in text
    assert _protocol([("Cap", 1.0, 2.0, {})]) == ""


def test_the_map_probe_can_read_the_whole_train_split(tmp_path):
    """map_probe.shots null: the paper's probe on a frozen encoder trains on the whole train split
    (a tenth of each class held out for validation), scored on the test split."""
    import torch

    from trainers.evaluation.config import EvalConfig, MapProbe
    from trainers.evaluation.run import _fewshot, _whole_pool
    from trainers.models import ModelConfig, build_model

    y = np.repeat(np.arange(3), 20)
    pool = np.arange(0, 60, 2)                          # 10 of each class
    tr, val = _whole_pool(y, pool, 0)
    assert len(val) == 3 and set(y[val]) == {0, 1, 2} and sorted(np.concatenate([tr, val])) == list(pool)
    _folder(tmp_path, "train", per=12)
    _folder(tmp_path, "test", per=3)
    torch.manual_seed(0)
    cfg = ModelConfig(family="cappa", size="tiny", vocab_size=64, max_len=8, image_size=16, patch=4, width=32,
                      depth=1, heads=2, mlp=64, caption_queries=4, prefix_len=3)
    ec = EvalConfig(fewshot=[], shots=[1], seeds=1, map_probe=MapProbe(steps=4, shots=None, sweep=False))
    results = {"skipped": [], "sets": {}}
    _fewshot(build_model(cfg).eval(), cfg, [ClassificationSet(name="f", kind="folder", path=str(tmp_path))], ec, (1,),
             True, results, tmp_path, lambda m: None)
    assert list(results["fewshot_map"]["f"]) == ["all"] and len(results["fewshot_map"]["f"]["all"]["runs"]) == 1
    assert not results["skipped"]


def test_shots_asked_on_the_command_line_leave_out_a_map_probe_they_do_not_name(tmp_path):
    """`capline eval --shots 1,5` ran the MAP-head 10-shot probe too, silently and for minutes. Asked
    shots that do not name the probe's own leave it out with the reason; ones that do run it, saying
    each draw as it goes, with the time left from the second on."""
    import torch

    from trainers.evaluation.config import EvalConfig, MapProbe
    from trainers.evaluation.run import _fewshot
    from trainers.models import ModelConfig, build_model

    _folder(tmp_path, "train", per=6)
    _folder(tmp_path, "test", per=2)
    torch.manual_seed(0)
    cfg = ModelConfig(family="cappa", size="tiny", vocab_size=64, max_len=8, image_size=16, patch=4, width=32,
                      depth=1, heads=2, mlp=64, caption_queries=4, prefix_len=3)
    model = build_model(cfg).eval()
    ec = EvalConfig(fewshot=[], shots=[1, 2], seeds=2, map_probe=MapProbe(steps=3, shots=2, sweep=False))
    sets = [ClassificationSet(name="f", kind="folder", path=str(tmp_path))]
    for asked, shots, runs in ((True, (1,), False), (True, (1, 2), True), (False, (1,), True)):
        results, said = {"skipped": [], "sets": {}}, []
        _fewshot(model, cfg, sets, ec, shots, True, results, tmp_path, said.append, asked=asked)
        draws = [m for m in said if "MAP-head probe, draw" in m]
        assert bool(results["fewshot_map"]) == runs and len(draws) == (2 if runs else 0), (asked, shots, said)
        assert runs or results["skipped"] == ["MAP-head probe on f: its 2-shot probe (eval.map_probe.shots) is not "
                                              "among --shots 1"]
        assert not runs or ("draw 1/2 (1 learning rate(s) x 3 steps)" in draws[0] and "s left)" in draws[1])
