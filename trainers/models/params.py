"""Parameter counts from instantiated models (on the meta device: no memory), against paper Table 1."""
from __future__ import annotations

import torch

from . import build_model
from .config import ModelConfig

# Tschannen et al. 2023, Table 1 (32k vocabulary, 224 px, 64 tokens): millions of parameters.
PAPER = {("b16", "cap"): 192, ("b16", "clip"): 197, ("l14", "cap"): 570, ("l14", "clip"): 640}


def count(family: str, size: str, vocab_size: int = 32000, image_size: int = 224, max_len: int = 64) -> int:
    cfg = ModelConfig(family=family, size=size, vocab_size=vocab_size, image_size=image_size, max_len=max_len)
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def table(families=("cap", "cappa", "clip", "siglip", "coca"), sizes=("tiny", "s16", "m16", "b16", "l14")) -> list[dict]:
    rows = []
    for size in sizes:
        for fam in families:
            n = count(fam, size, image_size=64 if size == "tiny" else 224)
            paper = PAPER.get((size, fam))
            rows.append({"size": size, "family": fam, "params_m": n / 1e6, "paper_m": paper,
                         "deviation": None if paper is None else n / 1e6 / paper - 1})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'size':<6}{'family':<8}{'params (M)':>12}{'paper (M)':>11}{'deviation':>11}"]
    for r in rows:
        paper = "" if r["paper_m"] is None else f"{r['paper_m']}"
        dev = "" if r["deviation"] is None else f"{100 * r['deviation']:+.2f}%"
        lines.append(f"{r['size']:<6}{r['family']:<8}{r['params_m']:>12.1f}{paper:>11}{dev:>11}")
    return "\n".join(lines)
