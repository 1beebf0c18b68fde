"""One task object per objective, so the training loop is written once.

A task builds the model, wraps it so DDP sees the loss as the forward pass, counts tokens, and
(for models that write) produces sample captions.
"""
from __future__ import annotations

import torch
from torch import nn

from .models import ModelConfig, build_model


class LossModule(nn.Module):
    """forward(images, labels) -> (loss, metrics): DDP must see the whole loss as one forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images, labels, generator=None):
        return self.model.loss(images, labels, generator=generator)


class Task:
    objective = ""
    writes = False

    def __init__(self, model_cfg: ModelConfig, image_encoder: str | None = None, lm: str | None = None):
        self.model_cfg, self.image_encoder, self.lm = model_cfg, image_encoder, lm

    def build(self) -> nn.Module:
        return build_model(self.model_cfg)

    def tokens(self, labels: torch.Tensor) -> int:
        return int((labels != 0).sum())

    @torch.no_grad()
    def samples(self, model: nn.Module, images: torch.Tensor, sp) -> list[str]:
        from .families import spec, stop_ids
        from .models.decoding import greedy

        model.eval()
        ids = greedy(model, images, self.model_cfg.max_len, stop=stop_ids(sp, spec(self.model_cfg.family).stop_text))
        model.train()
        return [sp.decode([int(t) for t in row if t > 1]) for row in ids]


class CaptioningTask(Task):
    objective, writes = "captioning", True


class ContrastiveTask(Task):
    objective = "contrastive"


class CoCaTask(Task):
    objective, writes = "coca", True


class PrefixCaptioningTask(Task):
    objective, writes = "prefix_captioning", True

    def build(self) -> nn.Module:
        from .models.checkpoint import load_model

        encoder, enc_cfg = load_model(self.image_encoder)
        cfg = ModelConfig(**{**self.model_cfg.__dict__, "image_embed_dim": image_embedding_dim(enc_cfg)})
        self.model_cfg = cfg
        model = build_model(cfg, image_encoder=encoder)
        if self.lm:
            model.load_lm(self.lm)
        model.check_trainable()
        return model


def image_embedding_dim(encoder_cfg) -> int:
    """What ClipCap's mapper reads: a contrastive encoder's projected embedding (CLIP's encode_image),
    else the pooled features."""
    from .families import spec

    return encoder_cfg.out_dim if spec(encoder_cfg.family).embeds_text else encoder_cfg.dim


def make_task(model_cfg: ModelConfig, image_encoder: str | None = None, lm: str | None = None) -> Task:
    from .families import spec

    return globals()[spec(model_cfg.family).task](model_cfg, image_encoder, lm)
