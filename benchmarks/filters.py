"""Filter throughput on this machine's CPU, one process.

- Language ID: captions/s for each backend (fastText lid.176.ftz, langid) on 20,000 captions: the
  demo's English and foreign captions and, when Debian's openclipart-svg is installed, real titles.
- CLIP scoring: image-caption pairs/s for a scorer at the bootstrap size (48 px, width 64) and at
  S/16 (224 px, width 384), JPEG decoding and tokenisation included, as the stage's actors do it.

    python benchmarks/filters.py
Results: benchmarks/results/filters.json
"""
from __future__ import annotations

import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from stages.source import synthetic  # noqa: E402


def captions(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    langs = list(synthetic._LANG)
    for i in range(n // 2):
        sc = synthetic.random_scene(rng)
        out.append(synthetic.caption_en(sc) if i % 3 else synthetic.caption_foreign(sc, langs[i % 4]))
    root = Path("/usr/share/openclipart/svg")
    if root.is_dir():
        from stages.source.openclipart import caption_of

        for f in sorted(root.rglob("*.svg"))[: n - len(out)]:
            try:
                out.append(caption_of(f.read_bytes()))
            except Exception:  # noqa: BLE001 - a benchmark input, not a verdict
                pass
    while len(out) < n:
        out.append(out[len(out) % (n // 2)])
    return out


def bench_language(texts: list[str]) -> dict:
    from stages.filters.langid import load_backend

    res = {}
    for name in ("fasttext", "langid"):
        t0 = time.perf_counter()
        lid = load_backend(name)
        load = time.perf_counter() - t0
        t0 = time.perf_counter()
        for t in texts:
            lid.predict(t)
        dt = time.perf_counter() - t0
        res[name] = {"captions_per_s": round(len(texts) / dt), "load_s": round(load, 3)}
        print(f"language {name}: {len(texts) / dt:,.0f} captions/s (model load {load:.2f} s)")
    return res


def bench_scorer(name: str, size: str, image_size: int, model_args: dict, n: int, batch: int) -> dict:
    from stages.filters.scorer import Scorer
    from stages.tokenizer import TokenizerConfig, train_sentencepiece
    from trainers.models import ModelConfig, build_model
    from trainers.models.checkpoint import save_model

    rng = np.random.default_rng(0)
    scenes = [synthetic.random_scene(rng) for _ in range(n)]
    caps = [synthetic.caption_en(s) for s in scenes]
    jpgs = []
    for s in scenes:
        buf = io.BytesIO()
        synthetic.render(s, image_size).save(buf, "JPEG", quality=90)
        jpgs.append(buf.getvalue())
    with tempfile.TemporaryDirectory() as d:
        spm = train_sentencepiece(caps * 3, TokenizerConfig(vocab_size=300))
        import sentencepiece

        vocab = sentencepiece.SentencePieceProcessor(model_proto=spm).get_piece_size()
        cfg = ModelConfig(family="clip", size=size, vocab_size=vocab, max_len=24, image_size=image_size, **model_args)
        save_model(build_model(cfg), cfg, d)
        (Path(d) / "spm.model").write_bytes(spm)
        scorer = Scorer(d, device="cpu")
        scorer.score(jpgs[:batch], caps[:batch])   # warm-up
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            scorer.score(jpgs[i:i + batch], caps[i:i + batch])
        dt = time.perf_counter() - t0
    params = sum(p.numel() for p in scorer.model.parameters())
    print(f"scorer {name}: {n / dt:,.1f} pairs/s ({params / 1e6:.1f}M parameters, {image_size} px, batch {batch})")
    return {"pairs_per_s": round(n / dt, 2), "params_m": round(params / 1e6, 2), "image_size": image_size,
            "batch": batch, "pairs": n}


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    texts = captions(20000)
    results = {"language": bench_language(texts), "threads": torch.get_num_threads()}
    results["scorer"] = {
        "bootstrap_tiny": bench_scorer("bootstrap tiny", "tiny", 48,
                                       {"width": 64, "depth": 2, "heads": 2, "mlp": 256, "patch": 8}, 4096, 256),
        "s16": bench_scorer("S/16", "s16", 224, {}, 128, 32),
    }
    write_results("filters", results)


if __name__ == "__main__":
    main()
