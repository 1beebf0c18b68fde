"""Export a trained vision encoder to stand alone: `encoder.safetensors` + `encoder.json`.

Keys (ViT, see trainers/models/vit.py; D width, P patch, N patches, F MLP size):
  embed.weight (D, 3, P, P), embed.bias (D,)     patch embedding (a strided convolution)
  pos (1, N, D)                                   learned position embeddings
  blocks.{i}.ln1.weight (D,)                      pre-attention LayerNorm (eps 1e-6; .bias if bias)
  blocks.{i}.attn.{q,k,v,out}.weight (D, D)       attention projections (heads in encoder.json)
  blocks.{i}.ln2.weight (D,)                      pre-MLP LayerNorm
  blocks.{i}.mlp.0.weight (F, D), blocks.{i}.mlp.2.weight (D, F)   MLP, GELU (tanh) between
  ln.weight (D,)                                  final LayerNorm; its output are the image tokens
  map.* (only with pool: map)                     the MAP head
Inputs: RGB resized to image_size, scaled to [-1, 1], channels first.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file


def export_encoder(model, cfg, directory: Path) -> Path:
    """The model's ViT; for ClipCap, the frozen image model's (with that model's config)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    inner = getattr(model, "image_encoder", None)
    if inner is not None:
        model, cfg = inner, inner.cfg
    encoder = model.encoder
    state = {k: v.detach().contiguous().cpu() for k, v in encoder.state_dict().items()}
    save_file(state, str(directory / "encoder.safetensors"))
    (directory / "encoder.json").write_text(json.dumps({
        "format": "capline-vit/1", "family": cfg.family, "image_size": cfg.image_size, "patch": cfg.patch_size,
        "width": cfg.dim, "depth": cfg.num_layers, "heads": cfg.num_heads, "mlp": cfg.mlp_dim, "bias": cfg.bias,
        "pool": encoder.pool, "layer_norm_eps": 1e-6, "gelu": "tanh", "input_range": [-1, 1],
        "tokens_after_final_layer_norm": True}, indent=2))
    return directory
