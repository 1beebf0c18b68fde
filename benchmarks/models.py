"""Model speed on this machine's CPU.

1. forward + backward examples/s for each family at `tiny` (64 px) and `s16` (224 px), 32k vocabulary,
   64 tokens, batch 8 (tiny) / 2 (s16);
2. zero-shot scoring cost of 10, 100 and 1,000 candidate captions per image: autoregressive scoring
   (one teacher-forced pass per candidate) against parallel scoring (one all-[MASK] pass per image).

    python benchmarks/models.py [--quick]
Results: benchmarks/results/models.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from trainers.models import ModelConfig, build_model  # noqa: E402


def _cfg(family: str, size: str) -> ModelConfig:
    return ModelConfig(family=family, size=size, vocab_size=32000, max_len=64,
                       image_size=64 if size == "tiny" else 224, caption_queries=64 if size == "tiny" else 256)


def train_speed(family: str, size: str, batch: int, iters: int) -> float:
    torch.manual_seed(0)
    cfg = _cfg(family, size)
    model = build_model(cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randn(batch, 3, cfg.image_size, cfg.image_size) if family != "clipcap" else torch.randn(batch, cfg.dim)
    y = torch.randint(3, 32000, (batch, 64))
    y[:, 40] = 1
    y[:, 41:] = 0
    for i in range(iters + 1):
        if i == 1:
            t0 = time.perf_counter()
        loss, _ = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return batch * iters / (time.perf_counter() - t0)


@torch.no_grad()
def scoring(size: str, n_candidates: int, images: int = 2) -> dict:
    torch.manual_seed(0)
    cfg = _cfg("cappa", size)
    model = build_model(cfg).eval()
    x = torch.randn(images, 3, cfg.image_size, cfg.image_size)
    cands = torch.randint(3, 32000, (n_candidates, 8))   # class-name length prompts
    cands[:, 6] = 1
    cands[:, 7] = 0
    out = {}
    for name, fn in (("ar", model.score_ar), ("parallel", model.score_parallel)):
        t0 = time.perf_counter()
        fn(x, cands)
        out[f"{name}_seconds_per_image"] = (time.perf_counter() - t0) / images
    out["speedup"] = out["ar_seconds_per_image"] / out["parallel_seconds_per_image"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {"torch_threads": torch.get_num_threads(), "train_examples_per_s": {}, "scoring": {}}
    for size, batch, iters in (("tiny", 8, 2 if args.quick else 5), ("s16", 2, 1 if args.quick else 2)):
        for fam in ("cap", "cappa", "clip", "siglip", "coca", "clipcap"):
            eps = train_speed(fam, size, batch, iters)
            results["train_examples_per_s"][f"{fam}/{size}"] = round(eps, 2)
            print(f"train {fam:<8}{size:<5} {eps:8.2f} examples/s", flush=True)
    for size in ("tiny", "s16"):
        for n in (10, 100, 1000):
            r = scoring(size, n, images=1 if size == "s16" else 2)
            results["scoring"][f"{size}/{n}"] = {k: round(v, 4) for k, v in r.items()}
            print(f"score {size:<5}{n:>5} candidates: AR {r['ar_seconds_per_image']:.3f}s/image, "
                  f"parallel {r['parallel_seconds_per_image']:.3f}s/image, {r['speedup']:.0f}x", flush=True)
    write_results("models", results)


if __name__ == "__main__":
    main()
