"""Model families: Cap, CapPa, CLIP*, SigLIP, CoCa, ClipCap. `build_model(cfg)` makes any of them."""
from __future__ import annotations

from .config import FAMILIES, SIZES, ModelConfig


def build_model(cfg: ModelConfig, image_encoder=None):
    from trainers.families import spec

    return spec(cfg.family).build(cfg, image_encoder)


__all__ = ["FAMILIES", "SIZES", "ModelConfig", "build_model"]
