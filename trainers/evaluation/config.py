"""The `eval:` config section: which datasets each evaluation runs on, and the budgets of the
evaluations that train something (LiT decoder, LiT text tower, MAP-head probe).

Paths are absolute or relative to the run folder (the demo's held-out split is
`source/eval/...`, written by the source stage as ordinary files of these kinds).

    eval:
      fewshot:      [{name, kind: builtin|folder|parquet, path, image_col, label_col, split_col, limit}]
      captioning:   [{name, kind: coco|karpathy|webdataset, path, images, split, limit}]
      zeroshot:     [{name, kind: builtin|folder|parquet, path, label_col, templates}]
      wordorder:    [{name, kind: pairs|aro|vg_relation|vg_attribution|sugarcrepe, path | from, images}]
      shots: [1, 5, 10, 25]
      lit_decoder: {steps, batch_size, lr}     # a fresh decoder on the frozen encoder, every family
      lit: {steps, batch_size, lr}             # a text tower against the frozen encoder (Cap/CapPa)
      map_probe: {steps, lr, shots, sweep}     # a MAP head + linear layer on frozen tokens
      holdout: 0.5                             # share of each few-shot class held out as the test split
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from infra.configtools import join, require

BUILTIN_CLASSIFICATION = ("digits", "fashion_mnist")


@dataclass
class ClassificationSet:
    """Images with class labels: a few-shot probe set, or a zero-shot set with prompt templates."""
    name: str = ""
    kind: Literal["builtin", "folder", "parquet"] = "builtin"
    path: str = ""                 # builtin: digits | fashion_mnist; folder: class subfolders; parquet file
    image_col: str = "image"       # parquet: image bytes, or a path relative to the file
    label_col: str = "label"
    # the official split: parquet, a column of "train"/"test"; folder, train/ and test/ subfolders
    # (found by themselves); builtin fashion_mnist, its train and t10k files. Shots are drawn from
    # train and scored on test; a set without one holds out eval.holdout of each class
    split_col: str = ""
    limit: int | None = None       # null: the whole set; n: n images of each split, every class kept (seeded)
    # zero-shot only: each class's prompts; the default, its bare name, is what big_vision scores
    templates: list[str] = field(default_factory=lambda: ["{}"])
    # zero-shot, from files: class_names, a .json object {label: name} or a .txt of one name per line
    # in the labels' sorted order (ImageNet's 1,000 names beside its wnid folders); templates_file, a
    # .txt of one template per line or a .json list, each with a {} (CLIP's 80 templates)
    class_names: str = ""
    templates_file: str = ""

    def validate(self, prefix: str) -> None:
        require(bool(self.name), join(prefix, "name"), "every evaluation set needs a name")
        if self.kind == "builtin":
            require(self.path in BUILTIN_CLASSIFICATION, join(prefix, "path"),
                    f"builtin set {self.path!r} unknown; choose one of {', '.join(BUILTIN_CLASSIFICATION)}")
        else:
            require(bool(self.path), join(prefix, "path"), f"kind {self.kind} needs a path")
        require(bool(self.templates) and all("{}" in t for t in self.templates), join(prefix, "templates"),
                "each template needs a {} for the class name, e.g. 'a photo of a {}.'")
        require(self.limit is None or self.limit >= 2, join(prefix, "limit"), "must be >= 2 or null (the whole set)")
        require(not self.split_col or self.kind == "parquet", join(prefix, "split_col"),
                "only a parquet set names its split column; a folder set has train/ and test/ subfolders")


@dataclass
class CaptionSet:
    """`coco`: a COCO captions JSON and its image folder; `karpathy`: a Karpathy-style JSON
    (dataset_coco.json: images with filepath, filename, split, sentences[].raw), the images of
    `split` only; `webdataset`: .tar shards with .txt captions."""
    name: str = ""
    kind: Literal["coco", "karpathy", "webdataset"] = "coco"
    path: str = ""                 # the captions JSON; webdataset: a .tar, a folder of them or a glob
    images: str = ""               # coco, karpathy: the folder the JSON's image names are relative to
    split: str = "test"            # karpathy: the split scored (train, restval, val, test)
    limit: int | None = None       # null: the whole set; n: its first n images

    def validate(self, prefix: str) -> None:
        require(bool(self.name), join(prefix, "name"), "every evaluation set needs a name")
        require(bool(self.path), join(prefix, "path"), f"kind {self.kind} needs a path")
        require(self.kind == "webdataset" or bool(self.images), join(prefix, "images"),
                f"a {self.kind} captions file needs the folder of its images (images: ...)")
        require(self.limit is None or self.limit >= 1, join(prefix, "limit"), "must be >= 1 or null (the whole set)")


@dataclass
class WordOrderSet:
    """`pairs`: a JSON-lines file of {image, caption, negatives: {category: text}} (image relative to
    the file); `aro`: ARO's four order perturbations of every reference caption of the captioning set
    named in `from` (trainers/evaluation/aro.py); `vg_relation`, `vg_attribution`: ARO's
    visual_genome_relation.json / visual_genome_attribution.json as published (a list of {image_path,
    bbox_x, bbox_y, bbox_w, bbox_h, true_caption, false_caption, relation_name | attributes}, the image
    cropped to its box), `images` their folder; `sugarcrepe`: SugarCrepe's JSON files as published
    ({id: {filename, caption, negative_caption}}, one file per category: add_att.json, swap_obj.json,
    ...), `path` a folder of them or one file, `images` the COCO val2017 folder."""
    name: str = ""
    kind: Literal["pairs", "aro", "vg_relation", "vg_attribution", "sugarcrepe"] = "aro"
    path: str = ""
    source: str = ""               # aro: the captioning set to perturb
    images: str = ""               # vg_relation, vg_attribution, sugarcrepe: the images' folder
    limit: int | None = None       # null: every case; n: the first n (of each file, for sugarcrepe)

    def validate(self, prefix: str) -> None:
        require(bool(self.name), join(prefix, "name"), "every evaluation set needs a name")
        if self.kind == "pairs":
            require(bool(self.path), join(prefix, "path"), "kind pairs needs a path to a JSON-lines file")
        elif self.kind == "aro":
            require(bool(self.source), join(prefix, "source"), "kind aro needs source: <a captioning set's name>")
        else:
            require(bool(self.path), join(prefix, "path"), f"kind {self.kind} needs a path to its JSON file(s)")
            require(bool(self.images), join(prefix, "images"), f"kind {self.kind} needs the folder of its images")
        require(self.limit is None or self.limit >= 1, join(prefix, "limit"), "must be >= 1 or null (every case)")


@dataclass
class Budget:
    steps: int = 300
    batch_size: int = 32
    lr: float = 1e-3

    def validate(self, prefix: str) -> None:
        require(self.steps >= 0, join(prefix, "steps"), "must be >= 0 (0: skip this evaluation)")
        require(self.batch_size >= 1, join(prefix, "batch_size"), "must be >= 1")
        require(self.lr > 0, join(prefix, "lr"), "must be > 0")


@dataclass
class MapProbe:
    steps: int = 100               # training steps of the MAP-head probe
    lr: float = 3e-3               # its learning rate
    # examples per class it is trained on; null: the whole train split (the paper's probe on a frozen
    # encoder), a tenth of each class held out for validation
    shots: int | None = 10
    sweep: bool = True             # also lr/3 and 3*lr, each read at steps/2 and steps; best on validation

    def validate(self, prefix: str) -> None:
        require(self.steps >= 0, join(prefix, "steps"), "must be >= 0 (0: skip the MAP-head probe)")
        require(self.shots is None or self.shots >= 1, join(prefix, "shots"), "must be >= 1, or null (the whole train split)")
        require(self.lr > 0, join(prefix, "lr"), "must be > 0")


def _default_fewshot() -> list[ClassificationSet]:
    return [ClassificationSet(name="digits", kind="builtin", path="digits"),
            # a laptop's default names its limit (printed and recorded with the result): 2,000 of each split
            ClassificationSet(name="fashion_mnist", kind="builtin", path="fashion_mnist", limit=2000)]


@dataclass
class EvalConfig:
    fewshot: list[ClassificationSet] = field(default_factory=_default_fewshot)  # few-shot linear probe sets: {name, kind: builtin|folder|parquet, path, image_col, label_col}
    captioning: list[CaptionSet] = field(default_factory=list)  # captioning sets (CIDEr, BLEU-4, ROUGE-L): {name, kind: coco|webdataset, path, images}
    zeroshot: list[ClassificationSet] = field(default_factory=list)  # zero-shot classification sets: {name, kind, path, label_col, templates}
    wordorder: list[WordOrderSet] = field(default_factory=list)  # word-order sets (ARO-style): {name, kind: pairs|aro, path | from}
    shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])  # examples per class of the few-shot probes
    seeds: int = 3  # probe repeats over seeded example draws (mean and spread reported)
    eos: bool = True               # zero-shot prompts end in EOS, as big_vision scores them
    # big_vision: classification images squashed to size*256/224 then centrally cropped to size,
    # captioning, word order and zero-shot squashed to size, all bilinear (the paper's evaluation);
    # square_crop: the largest centred square (classification) or the whole image, bicubic
    preprocess: Literal["big_vision", "square_crop"] = "big_vision"
    lit_decoder: Budget = field(default_factory=Budget)
    lit: Budget = field(default_factory=lambda: Budget(steps=300, batch_size=64))
    map_probe: MapProbe = field(default_factory=MapProbe)
    holdout: float = 0.5           # share of each class held out as the test split of a set without an official one

    def validate(self, prefix: str) -> None:
        require(0 < self.holdout < 1, join(prefix, "holdout"), f"a share between 0 and 1, got {self.holdout}")
        require(bool(self.shots) and all(k >= 1 for k in self.shots), join(prefix, "shots"),
                "a list of shot counts >= 1, e.g. [1, 5, 10, 25]")
        require(self.seeds >= 1, join(prefix, "seeds"), "must be >= 1")
        names = [s.name for s in self.captioning]
        for i, w in enumerate(self.wordorder):
            require(w.kind != "aro" or w.source in names, join(prefix, f"wordorder[{i}].source"),
                    f"{w.source!r} is not a captioning set of eval.captioning ({', '.join(names) or 'none'})")
        for kind in ("fewshot", "captioning", "zeroshot", "wordorder"):
            seen = [s.name for s in getattr(self, kind)]
            dup = sorted({n for n in seen if seen.count(n) > 1})
            require(not dup, join(prefix, kind), f"set names must be unique; {', '.join(dup)} repeats")
