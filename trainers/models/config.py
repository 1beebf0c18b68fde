"""Model configuration: one dataclass for every family; named sizes are data, not code.

Sizes follow the ViT naming of the paper (S/16, M/16, B/16, L/14); `tiny` is for tests and the
demo. Any field of a size can be overridden (width, depth, ...), so new sizes need no code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from infra.configtools import join, require

SIZES = {
    #        width depth heads  mlp  patch
    "tiny": (128, 4, 4, 512, 8),
    "s16": (384, 12, 6, 1536, 16),
    "m16": (512, 12, 8, 2048, 16),
    "b16": (768, 12, 12, 3072, 16),
    "l14": (1024, 24, 16, 4096, 14),
}

# CoCa's text tower where open_clip's config makes it narrower than the encoder: coca_ViT-L-14 has
# a 1024-wide, 24-layer ViT and 12 + 12 text layers 768 wide (12 heads); other sizes: as the encoder
COCA_TEXT = {
    #        width heads  mlp depth (each half)
    "l14": (768, 12, 3072, 12),
}

# the one list of model families (trainers/families.py registers each; config fields are typed by it)
Family = Literal["cap", "cappa", "clip", "siglip", "coca", "clipcap"]
FAMILIES: tuple[str, ...] = get_args(Family)
PAD_ID, EOS_ID = 0, 1


# share of a family's examples trained with parallel prediction (CapPa: the paper's 0.75). The family
# registry (trainers/families.py) declares it from here, so the model config imports no registry
# (the registry imports the models).
PARALLEL_FRACTION = {"cappa": 0.75}


@dataclass
class ModelConfig:
    family: Family = "cappa"
    size: Literal["tiny", "s16", "m16", "b16", "l14"] = "tiny"
    vocab_size: int = 32000
    max_len: int = 64
    image_size: int = 224
    # overrides of the named size (null: take the size's value)
    width: int | None = None
    depth: int | None = None
    heads: int | None = None
    mlp: int | None = None
    patch: int | None = None
    decoder_depth: int | None = None     # captioners: default half the encoder depth
    bias: bool = False                   # text side: biases in attention, MLP, LayerNorm (CapPa's decoder_bias off)
    encoder_bias: bool = True            # the ViT's biases, as big_vision's ViT has them
    pool: Literal["gap", "map"] = "gap"  # contrastive towers and the probe's image features
    masked_pred_prob: float | None = None  # CapPa: 0.75, Cap: 0
    embed_dim: int | None = None         # contrastive embedding (default: width)
    # CoCa
    caption_queries: int = 256           # attentional pooler queries the decoder cross-attends to
    text_width: int | None = None        # CoCa's text halves (null: COCA_TEXT for the size, else the encoder's)
    text_heads: int | None = None
    text_mlp: int | None = None
    contrastive_weight: float = 1.0
    caption_weight: float = 2.0
    # ClipCap
    prefix_len: int | None = None        # null: the reference's 10 (mlp mapper) or 40 (transformer mapper)
    mapper: Literal["mlp", "transformer"] = "mlp"
    mapper_depth: int = 8
    lm_frozen: bool | None = None        # null: the paper's pairing (transformer mapper: frozen, mlp: fine-tuned)
    hf_lm: str | None = None             # a local Hugging Face causal LM folder (GPT-2 family) as the LM
    image_embed_dim: int | None = None   # the frozen encoder's embedding size (default: width)

    def validate(self, prefix: str = "") -> None:
        require(self.vocab_size >= 4, join(prefix, "vocab_size"), f"must be >= 4, got {self.vocab_size}")
        require(self.max_len >= 2, join(prefix, "max_len"), f"must be >= 2, got {self.max_len}")
        require(self.image_size % self.patch_size == 0, join(prefix, "image_size"),
                f"{self.image_size} is not a multiple of the patch size {self.patch_size}")
        require(self.dim % self.num_heads == 0, join(prefix, "heads"),
                f"width {self.dim} is not divisible by {self.num_heads} heads")
        p = self.pa_prob
        require(0.0 <= p <= 1.0, join(prefix, "masked_pred_prob"), f"must be in [0, 1], got {p}")
        require(self.prefix_len is None or self.prefix_len >= 1, join(prefix, "prefix_len"), "must be >= 1 or null")
        if self.family == "coca":
            tw, th, _, _ = self.coca_text()
            require(tw % th == 0, join(prefix, "text_heads"), f"text width {tw} is not divisible by {th} heads")

    # resolved values
    @property
    def dim(self) -> int:
        return self.width or SIZES[self.size][0]

    @property
    def num_layers(self) -> int:
        return self.depth or SIZES[self.size][1]

    @property
    def num_heads(self) -> int:
        return self.heads or SIZES[self.size][2]

    @property
    def mlp_dim(self) -> int:
        return self.mlp or SIZES[self.size][3]

    @property
    def patch_size(self) -> int:
        return self.patch or SIZES[self.size][4]

    def coca_text(self) -> tuple[int, int, int, int]:
        """CoCa's text tower: (width, heads, MLP width, layers of each half)."""
        w, h, m, n = COCA_TEXT.get(self.size, (self.dim, self.num_heads, self.mlp_dim, self.num_layers))
        if self.width is not None and self.size in COCA_TEXT and self.text_width is None:
            w, h, m = self.dim, self.num_heads, self.mlp_dim      # a width override keeps one width for all
        return (self.text_width or w, self.text_heads or h, self.text_mlp or m, self.decoder_depth or n)

    @property
    def dec_layers(self) -> int:
        return self.decoder_depth or max(1, self.num_layers // 2)

    @property
    def pa_prob(self) -> float:
        if self.masked_pred_prob is not None:
            return self.masked_pred_prob
        return PARALLEL_FRACTION.get(self.family, 0.0)

    @property
    def out_dim(self) -> int:
        if self.embed_dim is None and self.family == "coca":
            return self.coca_text()[0]          # open_clip's CoCa embeds in its text width (768 at L/14)
        return self.embed_dim or self.dim

    @property
    def frozen_lm(self) -> bool:
        return self.mapper == "transformer" if self.lm_frozen is None else self.lm_frozen

    @property
    def prefix_length(self) -> int:
        return self.prefix_len or (40 if self.mapper == "transformer" else 10)

    @property
    def mask_id(self) -> int:
        """The extra input id ([MASK] for CapPa, [CLS] for CoCa): embedding tables have V + 1 rows."""
        return self.vocab_size
