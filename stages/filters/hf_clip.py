"""A CLIP the user has on disk in Hugging Face format (`transformers`' `save_pretrained` folder: config
.json, model.safetensors, tokenizer files, preprocessor_config.json), as the CLIP-score stage's
scorer (`scorer: hf`). Nothing is downloaded: every load is `local_files_only`.

The score is the cosine of CLIP's *projected* image and text embeddings, as DataComp and LAION
compute it. Images go through the untrusted-input policy (infra/media.py), then CLIP's own
preprocessing: shortest side resized to the model's input size (bicubic), centre crop, normalised
with the folder's mean and std (CLIP's when it names none). `transformers` is an optional extra:
`pip install 'capline[hf]'`.

Shapes: images (B, 3, S, S) float32; tokens (B, L) int64; embeddings (B, D) -> cosine (B,).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from infra.errors import UserError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("stages.clip_score.scorer hf needs the transformers package: pip install 'capline[hf]'") from None
    return transformers


OPEN_CLIP_FILES = ("open_clip_pytorch_model.bin", "open_clip_model.safetensors", "open_clip_config.json")


def _open_clip_hint(path: Path) -> str | None:
    """What to do with an open_clip checkpoint (what most LAION and DataComp users hold)."""
    files = [path] if path.is_file() else sorted(path.iterdir()) if path.is_dir() else []
    if any(f.name in OPEN_CLIP_FILES or (f.suffix in (".pt", ".bin") and "epoch" in f.name) for f in files):
        return ("this looks like an open_clip checkpoint, which scorer: hf does not read; use its Hugging Face "
                "conversion (OpenAI's and LAION's CLIPs are published in both forms), or score the list "
                "elsewhere and use scorer: column on that score")
    return None


def check_hf(folder: str) -> dict:
    """Fail before any work if `folder` is not a local Hugging Face CLIP. -> a description."""
    from .scorer import dir_sha256

    path = Path(folder)
    if not path.exists():
        raise UserError(f"stages.clip_score.checkpoint {folder}: no such folder (a Hugging Face CLIP saved with "
                        "save_pretrained, on this machine: capline downloads nothing)")
    if path.is_file() or not (path / "config.json").is_file():
        hint = _open_clip_hint(path)
        raise UserError(f"stages.clip_score.checkpoint {folder}: not a Hugging Face model folder (no config.json)"
                        + (f"; {hint}" if hint else ""))
    tf = _transformers()
    try:
        cfg = tf.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"stages.clip_score.checkpoint {folder}: its config.json does not load ({err})") from None
    if getattr(cfg, "model_type", "") not in ("clip", "siglip"):
        raise UserError(f"stages.clip_score.checkpoint {folder}: a {cfg.model_type} model, not a CLIP; "
                        "scorer: hf needs a CLIPModel folder")
    if not any(path.glob("*.safetensors")):
        pickled = sorted(f.name for f in path.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        raise UserError(f"stages.clip_score.checkpoint {folder}: no model.safetensors"
                        + (f" ({', '.join(pickled[:2])} is pickled weights, which run code when loaded and are "
                           "not read)" if pickled else "")
                        + "; save the model with save_pretrained(..., safe_serialization=True)")
    if cfg.model_type == "siglip" and not _image_processor_config(path):
        raise UserError(f"stages.clip_score.checkpoint {folder}: a SigLIP without its image normalisation "
                        "(preprocessor_config.json or processor_config.json with image_mean and image_std); it would "
                        "be scored with CLIP's normalisation: save its processor into the folder too")
    if not any((path / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
        raise UserError(f"stages.clip_score.checkpoint {folder}: no tokenizer files next to the model")
    return {"kind": "hf", "path": str(path), "family": cfg.model_type, "sha256": dir_sha256(path)}


def _image_processor_config(folder: Path) -> dict:
    """The image normalisation the folder declares: transformers 4 writes preprocessor_config.json,
    transformers 5 processor_config.json (the image processor's settings under "image_processor").
    Without either, CLIP's own values apply; a SigLIP would then be scored with CLIP's, so say so."""
    import json

    for name in ("preprocessor_config.json", "processor_config.json"):
        f = folder / name
        if f.is_file():
            conf = json.loads(f.read_text())
            conf = conf.get("image_processor", conf) if isinstance(conf, dict) else {}
            if "image_mean" in conf and "image_std" in conf:
                return conf
    return {}


class HFScorer:
    """Loads the folder once; `score(images, captions)` -> cosine per pair (as stages/scorer.Scorer)."""

    CHUNK = 64   # every forward pass has exactly this many rows: a pair's score never depends on its batch

    def __init__(self, folder: str, device: str = "cpu"):
        import torch

        tf = _transformers()
        self.torch = torch
        self.device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        self.model = tf.AutoModel.from_pretrained(folder, local_files_only=True, use_safetensors=True).to(self.device).eval()
        self.tokenizer = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        vision = self.model.config.vision_config
        self.size = int(vision.image_size)
        self.max_len = int(getattr(self.model.config.text_config, "max_position_embeddings", 77))
        conf = _image_processor_config(Path(folder))
        self.mean = np.array(conf.get("image_mean", CLIP_MEAN), np.float32).reshape(3, 1, 1)
        self.std = np.array(conf.get("image_std", CLIP_STD), np.float32).reshape(3, 1, 1)

    def _pixels(self, data) -> np.ndarray:
        """(3, S, S): shortest side to S (bicubic), centre crop, CLIP's normalisation. `data`: encoded
        bytes or a decoded PIL image (the data plane's `pictures`, without a resize's bars)."""
        from PIL import Image

        from infra.media import decode

        img = data.convert("RGB") if isinstance(data, Image.Image) else decode(data)
        w, h = img.size
        scale = self.size / min(w, h)
        img = img.resize((max(self.size, round(w * scale)), max(self.size, round(h * scale))), Image.BICUBIC)
        w, h = img.size
        left, top = (w - self.size) // 2, (h - self.size) // 2
        img = img.crop((left, top, left + self.size, top + self.size))
        x = np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0
        return (x - self.mean) / self.std

    def score(self, images: list, captions: list[str]) -> np.ndarray:
        from .scorer import in_chunks

        torch = self.torch

        def cosines(imgs, caps):
            x = torch.from_numpy(np.stack([self._pixels(b) for b in imgs])).to(self.device)
            t = self.tokenizer(list(caps), padding="max_length", truncation=True, max_length=self.max_len,
                               return_tensors="pt").to(self.device)
            with torch.no_grad():
                im = self.model.get_image_features(pixel_values=x)
                tx = self.model.get_text_features(input_ids=t["input_ids"], attention_mask=t.get("attention_mask"))
                im, tx = getattr(im, "pooler_output", im), getattr(tx, "pooler_output", tx)
                return ((im / im.norm(dim=-1, keepdim=True)) * (tx / tx.norm(dim=-1, keepdim=True))).sum(-1).float().cpu().numpy()

        return in_chunks(images, captions, self.CHUNK, cosines)
