"""A local Hugging Face causal LM (GPT-2 family) as ClipCap's language model, in capline's id space.

Shape key: B batch, T positions, D the LM's width, Vh the LM's vocabulary, V = Vh + 2.

capline's ids: 0 = pad, 1 = EOS, 2 + i = the LM's token i. So captions keep capline's conventions
(padding masked, a sticky EOS), and the LM's logits (B, T, Vh) become (B, T, V): pad never,
EOS = the LM's eos token, 2 + i = token i (its own eos slot left out, so EOS has one id).
Nothing downloads: the folder must hold config.json, the weights and the tokenizer files
(`save_pretrained` of a model and its tokenizer); HF_HUB_OFFLINE is set for every capline process.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from infra.errors import UserError

OFFSET = 2
WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_folder(path: str | Path, setting: str = "train.lm_path") -> Path:
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"{setting} {path}: not a Hugging Face model folder (no config.json); give a folder "
                        "written by save_pretrained of a causal LM (GPT-2 family) and its tokenizer")
    if not any((path / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
        raise UserError(f"{setting} {path}: no tokenizer files beside the model; save the tokenizer there too "
                        "(tokenizer.save_pretrained(folder))")
    return path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class HFTokenizer:
    """The LM's tokenizer with the SentencePiece interface capline's loader and evaluation use."""

    def __init__(self, path: str | Path):
        self.tok = load_tokenizer(path)

    def encode(self, text: str) -> list[int]:
        return [i + OFFSET for i in self.tok.encode(text, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) - OFFSET for i in ids if int(i) >= OFFSET], skip_special_tokens=True)

    def get_piece_size(self) -> int:
        return len(self.tok) + OFFSET


def copy_folder_without_weights(src: str | Path, dst: str | Path) -> None:
    """The LM's config and tokenizer into a checkpoint (its weights are the checkpoint's lm.*)."""
    dst = Path(dst)
    if dst.exists() and dst.resolve() == Path(src).resolve():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in WEIGHTS:
            shutil.copy2(f, dst / f.name)


class HFCausalLM(nn.Module):
    """embed / hidden / head, as capline's TextDecoder offers them to ClipCap."""

    def __init__(self, path: str | Path):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        self.folder = path
        if any((path / f).is_file() for f in WEIGHTS):
            self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        else:           # a capline checkpoint's copy: the weights come with the checkpoint
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path), local_files_only=True))
        cfg = self.model.config
        self.width = cfg.hidden_size if hasattr(cfg, "hidden_size") else cfg.n_embd
        self.lm_vocab = self.model.get_output_embeddings().weight.shape[0]
        eos = cfg.eos_token_id
        if eos is None:
            raise UserError(f"{path}: the LM's config has no eos_token_id; captions need one to end")
        self.eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos)

    def to_lm_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """capline ids (B, T) -> the LM's: EOS -> eos, pad -> eos (never attended to past EOS, never scored)."""
        return torch.where(ids >= OFFSET, ids - OFFSET, torch.full_like(ids, self.eos))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:          # (B, T) -> (B, T, D)
        return self.model.get_input_embeddings()(self.to_lm_ids(ids))

    def hidden(self, x: torch.Tensor, mask=None, cache=None, start: int = 0) -> torch.Tensor:
        """(B, T, D) input embeddings -> (B, T, D), causal (the LM's own mask; `mask` is implied)."""
        return self.model.base_model(inputs_embeds=x).last_hidden_state

    def head(self, h: torch.Tensor) -> torch.Tensor:             # (B, T, D) -> (B, T, V)
        lm = self.model.get_output_embeddings()(h)
        low = torch.finfo(lm.dtype).min
        lm_rest = lm.clone()
        lm_rest[..., self.eos] = low                            # EOS has one id: 1
        return torch.cat([torch.full_like(lm[..., :1], low), lm[..., self.eos:self.eos + 1], lm_rest], dim=-1)
