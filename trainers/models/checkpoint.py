"""Model checkpoints: a safetensors state dict plus a JSON model config, nothing executable.

    <dir>/model.safetensors   weights (no optimizer state)
    <dir>/model.json          {"format": "capline-model/1", "config": {...ModelConfig...},
                               "image_encoder": {...its ModelConfig...}}   (ClipCap only)

A ClipCap checkpoint holds its frozen image model too (`image_encoder.*` weights and config), so
it captions images with nothing else at hand; with a Hugging Face LM, also that LM's config and
tokenizer in <dir>/hf_lm (its weights are the checkpoint's `lm.*`).

Loading needs neither the trainer nor pickle; anything read with torch.load elsewhere in capline
uses weights_only=True.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from infra.configtools import build
from infra.errors import UserError

from . import build_model
from .config import ModelConfig

FORMAT = "capline-model/1"


def state_for_saving(model) -> dict:
    """The state dict as safetensors takes it: tensors that share memory (a Hugging Face LM's tied input
    and output embeddings) are written once each, as copies, and tied again by loading into both."""
    seen, state = set(), {}
    for k, v in model.state_dict().items():
        v = v.detach()
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        state[k] = (v.clone() if ptr in seen else v).contiguous().cpu()
        seen.add(ptr)
    return state


def save_model(model, cfg: ModelConfig, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = state_for_saving(model)
    save_file(state, str(directory / "model.safetensors"))
    lm_folder = getattr(getattr(model, "lm", None), "folder", None)
    if cfg.hf_lm and lm_folder is not None:
        # a Hugging Face LM's config and tokenizer travel inside the checkpoint; its weights are lm.*
        from .hf_lm import copy_folder_without_weights

        copy_folder_without_weights(lm_folder, directory / "hf_lm")
        cfg = dataclasses.replace(cfg, hf_lm="hf_lm")
    meta = {"format": FORMAT, "config": dataclasses.asdict(cfg)}
    inner = getattr(model, "image_encoder", None)
    if inner is not None:
        meta["image_encoder"] = dataclasses.asdict(inner.cfg)
    (directory / "model.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return directory


def load_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "model.json"
    if not path.is_file():
        raise UserError(f"{directory}: not a capline model checkpoint (no model.json)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    cfg = build(ModelConfig, meta["config"], "model")
    if cfg.hf_lm and not Path(cfg.hf_lm).is_absolute():
        cfg = dataclasses.replace(cfg, hf_lm=str(Path(directory).resolve() / cfg.hf_lm))
    return cfg


OLD_MISSING = {"decoder.ln.bias", "unimodal.ln.bias", "multimodal.ln.bias", "lm.ln.bias"}


def load_model(directory: str | Path, image_encoder=None):
    cfg = load_config(directory)
    meta = json.loads((Path(directory) / "model.json").read_text())
    if image_encoder is None and meta.get("image_encoder"):
        image_encoder = build_model(build(ModelConfig, meta["image_encoder"], "image_encoder"))
    model = build_model(cfg, image_encoder)
    state = load_file(str(Path(directory) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a model saved before the decoders' final LayerNorm had a bias: the bias stays at its zero
    # init, which is the LayerNorm that model was
    missing = [m for m in missing if m not in OLD_MISSING]
    if missing or unexpected:
        raise UserError(f"{directory}: weights do not fit the config (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    return model, cfg
