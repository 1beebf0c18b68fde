"""Evaluation cost on this machine's CPU, per 1,000 images, for a tiny CapPa (64 px, 32 tokens,
a 1,000-piece vocabulary): feature extraction + few-shot ridge probe, greedy and beam-4 captioning,
word order (4 captions per scene, AR scoring), and zero-shot with 10, 100 and 1,000 classes scored
autoregressively (one teacher-forced pass per class) against one parallel-prediction pass.
Measured on a sample of images and scaled to 1,000.

    python benchmarks/eval.py
Results: benchmarks/results/eval.json
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from stages.source import synthetic  # noqa: E402
from trainers.evaluation.fewshot import probe  # noqa: E402
from trainers.models import ModelConfig, build_model  # noqa: E402
from trainers.models.decoding import beam_search, greedy  # noqa: E402


def per_1000(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000 / n


def main() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(family="cappa", size="tiny", vocab_size=1000, max_len=32, image_size=64,
                      width=96, depth=4, heads=4, mlp=384, patch=8)
    model = build_model(cfg).eval()
    rng = np.random.default_rng(0)
    scenes = [synthetic.random_scene(rng) for _ in range(256)]
    x = torch.from_numpy(np.stack([np.asarray(synthetic.render(s, 64), np.float32).transpose(2, 0, 1) / 127.5 - 1
                                   for s in scenes]))
    labels = np.array([s.objects[0].shape for s in scenes])
    out = {"model": "cappa tiny (width 96, depth 4), vocab 1000", "seconds_per_1000_images": {}}
    r = out["seconds_per_1000_images"]
    with torch.no_grad():
        r["fewshot_features_and_probe"] = per_1000(lambda: probe(model.image_features(x).numpy(), labels,
                                                                 shots=(1, 5, 10, 25)), len(x))
        r["captioning_greedy"] = per_1000(lambda: greedy(model, x[:64], 32), 64)
        r["captioning_beam4"] = per_1000(lambda: beam_search(model, x[:32], 32, beam=4), 32)
        cands4 = torch.randint(3, 1000, (4, 20))
        r["wordorder_4_captions"] = per_1000(lambda: model.score_ar(x[:64], cands4), 64)
        for n in (10, 100, 1000):
            cands = torch.randint(3, 1000, (n, 8))
            imgs = x[: max(2, 64 // max(1, n // 10))]
            r[f"zeroshot_ar_{n}_classes"] = per_1000(lambda: model.score_ar(imgs, cands), len(imgs))
            r[f"zeroshot_parallel_{n}_classes"] = per_1000(lambda: model.score_parallel(x[:64], cands), 64)
    for k, v in r.items():
        print(f"{k:<34} {v:9.2f} s per 1000 images")
    write_results("eval", out)


if __name__ == "__main__":
    main()
