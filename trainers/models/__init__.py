"""Model families: Cap, CapPa, CLIP*, SigLIP, CoCa, ClipCap. `build_model(cfg)` makes any of them."""
from __future__ import annotations

from .config import FAMILIES, SIZES, ModelConfig


def build_model(cfg: ModelConfig, image_encoder=None):
    from .captioner import Captioner
    from .clipcap import ClipCap
    from .coca import CoCa
    from .contrastive import TwoTower

    if cfg.family in ("cap", "cappa"):
        return Captioner(cfg)
    if cfg.family in ("clip", "siglip"):
        return TwoTower(cfg)
    if cfg.family == "coca":
        return CoCa(cfg)
    if cfg.family == "clipcap":
        return ClipCap(cfg, image_encoder)
    raise ValueError(f"unknown model family {cfg.family!r}; choose one of {', '.join(FAMILIES)}")


__all__ = ["FAMILIES", "SIZES", "ModelConfig", "build_model"]
