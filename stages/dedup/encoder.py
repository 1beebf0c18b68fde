"""The optional encoder descriptor: a capline model or TorchScript file that embeds images for dedup (`encoder_checkpoint`)."""
from __future__ import annotations

import numpy as np

from infra.errors import UserError
from infra.hashing import hash_file as file_sha256

from .imagehash import to_rgb_array
from .config import torchscript_file


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class EncoderDescriber:
    """Unit image embeddings, no colour check: from a capline checkpoint (GAP of the final tokens), or
    from a TorchScript image model (its output flattened; shapes: (1, 3, S, S) -> (1, D)), loaded
    only if its bytes have the pinned `sha256` (checked where it is loaded: a worker's copy too)."""

    def __init__(self, checkpoint: str, image_size: int = 224, sha256: str | None = None):
        import torch

        self.torch = torch
        script = torchscript_file(checkpoint)
        if script is not None:
            got = file_sha256(script)
            if got != sha256:
                raise UserError(f"stages.dedup.encoder_checkpoint {script}: a TorchScript file (code) whose sha256 "
                                f"{got} is not the pinned stages.dedup.encoder_sha256 ({sha256}); not loaded")
            self.script = torch.jit.load(str(script), map_location="cpu").eval()
            self.size = image_size
        else:
            from trainers.models.checkpoint import load_model

            self.script = None
            self.model, self.cfg = load_model(checkpoint)
            self.model.eval()

    def _pixels(self, image) -> np.ndarray:
        """(3, S, S): shortest side to S (bicubic), centre crop, ImageNet's normalisation."""
        from PIL import Image

        img = Image.fromarray(to_rgb_array(image))
        w, h = img.size
        scale = self.size / min(w, h)
        img = img.resize((max(self.size, round(w * scale)), max(self.size, round(h * scale))), Image.BICUBIC)
        left, top = (img.size[0] - self.size) // 2, (img.size[1] - self.size) // 2
        x = np.asarray(img.crop((left, top, left + self.size, top + self.size)), np.float32).transpose(2, 0, 1) / 255.0
        return ((x - np.reshape(IMAGENET_MEAN, (3, 1, 1))) / np.reshape(IMAGENET_STD, (3, 1, 1))).astype(np.float32)

    def __call__(self, image) -> tuple[np.ndarray, np.ndarray]:
        from infra.media import to_input

        with self.torch.no_grad():
            if self.script is not None:
                out = self.script(self.torch.from_numpy(self._pixels(image))[None])
                f = (out[0] if isinstance(out, (tuple, list)) else out).reshape(-1).float().numpy()
            else:
                x = to_input(to_rgb_array(image), self.cfg.image_size)            # (3, S, S)
                f = self.model.image_features(self.torch.from_numpy(x)[None])[0].numpy()
        return (f / (np.linalg.norm(f) + 1e-6)).astype(np.float32), np.zeros(3, np.float32)
