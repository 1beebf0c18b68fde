"""The model families, one spec each: what every dispatch on a family reads.

A spec says how to build the model, which training task (objective and loss) trains it, and what
it can be evaluated on: whether it writes captions itself, whether it is a captioner (scores class
names by likelihood, gets a LiT text tower for zero-shot), whether it has a joint image-text
embedding (zero-shot by cosine, a CLIP-score scorer), whether it trains on a frozen encoder of
another run, and whether a LiT decoder is trained on its features for captioning. Adding a family
is its model module and one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .models.config import FAMILIES, PARALLEL_FRACTION


@dataclass(frozen=True)
class FamilySpec:
    name: str
    build: Callable                 # (ModelConfig, image_encoder) -> nn.Module
    task: str                       # trainers/tasks.py: the Task class that trains it
    writes: bool                    # decodes captions of its own
    captioner: bool                 # Cap/CapPa: likelihood scoring, a LiT text tower for zero-shot
    embeds_text: bool               # a joint image-text embedding: cosine zero-shot, CLIP-score scoring
    needs_encoder: bool = False     # trains on the frozen image encoder of another run (ClipCap)
    lit_decoder: bool = True        # a LiT decoder is trained on its features for captioning
    parallel_fraction: float = 0.0  # share of examples trained with parallel prediction (CapPa: 0.75)
    pooled_by_head: bool = False    # its image features are its own pooling (GAP or MAP head), not the mean
    # a caption ends at the first token ending in this text, trained without an end token (ClipCap's
    # reference stops at "."); None: at EOS, trained with one
    stop_text: str | None = None
    title: str = ""                 # as the paper's tables name it


def stop_ids(sp, text: str | None) -> list[int]:
    """The ids of a tokenizer (capline's: 0 pad, 1 EOS) whose piece ends in `text`: a caption of a
    family with a stop text ends at the first of them."""
    if not text:
        return []
    return [i for i in range(2, sp.get_piece_size()) if sp.decode([i]).endswith(text)]


def _captioner(cfg, image_encoder=None):
    from .models.captioner import Captioner

    return Captioner(cfg)


def _two_tower(cfg, image_encoder=None):
    from .models.contrastive import TwoTower

    return TwoTower(cfg)


def _coca(cfg, image_encoder=None):
    from .models.coca import CoCa

    return CoCa(cfg)


def _clipcap(cfg, image_encoder=None):
    from .models.clipcap import ClipCap

    return ClipCap(cfg, image_encoder)


SPECS: dict[str, FamilySpec] = {s.name: s for s in (
    FamilySpec("cap", _captioner, "CaptioningTask", title="Cap", writes=True, captioner=True, embeds_text=False),
    FamilySpec("cappa", _captioner, "CaptioningTask", title="CapPa", writes=True, captioner=True, embeds_text=False,
               parallel_fraction=PARALLEL_FRACTION["cappa"]),
    FamilySpec("clip", _two_tower, "ContrastiveTask", title="CLIP*", writes=False, captioner=False, embeds_text=True,
               pooled_by_head=True),
    FamilySpec("siglip", _two_tower, "ContrastiveTask", title="SigLIP", writes=False, captioner=False, embeds_text=True,
               pooled_by_head=True),
    FamilySpec("coca", _coca, "CoCaTask", title="CoCa", writes=True, captioner=False, embeds_text=True),
    FamilySpec("clipcap", _clipcap, "PrefixCaptioningTask", title="ClipCap", writes=True, captioner=False, embeds_text=False,
               needs_encoder=True, lit_decoder=False, stop_text="."),
)}


assert tuple(SPECS) == FAMILIES, "trainers/models/config.py's Family and the registry name the same families"


def spec(family: str) -> FamilySpec:
    try:
        return SPECS[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(SPECS)}") from None


def with_text_embedding() -> tuple[str, ...]:
    return tuple(n for n, s in SPECS.items() if s.embeds_text)
