"""Shard writing and tokenizer training speed.

1. write_shard_table (the writer the shard stage and removals call: USTAR, fixed metadata, the tar,
   its index and ledger partition through the run folder's storage): MB/s and samples/s
   for 20,000 samples of ~4 KB JPEG each, in shards of 5,000;
2. SentencePiece training (unigram, 32k soft limit, one thread, as the tokenizer stage runs it) on
   10^4, 10^5 and 10^6 synthetic captions.

    python benchmarks/shards.py [--max-captions 1000000]
Results: benchmarks/results/shards.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from stages.source import synthetic  # noqa: E402
from stages.tokenizer import TokenizerConfig, train_sentencepiece  # noqa: E402


def shard_speed(n: int = 20_000, per_shard: int = 5_000) -> dict:
    rng = np.random.default_rng(0)
    images = [synthetic.encode(synthetic.render(synthetic.random_scene(rng), 64)) for _ in range(200)]
    import json

    import pyarrow as pa

    from infra.storage import Storage
    from stages.shard.stage import write_shard_table

    rows = pa.table({"key": [f"s{i:07d}" for i in range(n)], "image": [images[i % 200] for i in range(n)],
                     "ext": ["jpg"] * n, "caption": [f"caption number {i}" for i in range(n)],
                     "meta": [json.dumps({"key": f"s{i:07d}", "url": f"http://example.org/{i}.jpg"}) for i in range(n)]})
    storage = Storage.local(Path(tempfile.mkdtemp(prefix="capline-bench-shards-")))
    t0 = time.perf_counter()
    total = 0
    for j in range(0, n, per_shard):
        total += write_shard_table(storage, j // per_shard, rows.slice(j, per_shard)).extra["bytes"]
    dt = time.perf_counter() - t0
    return {"samples": n, "bytes": total, "seconds": round(dt, 3), "mb_per_s": round(total / dt / 1e6, 1),
            "samples_per_s": round(n / dt)}


def captions(n: int) -> list[str]:
    rng = np.random.default_rng(1)
    scenes = [synthetic.random_scene(rng) for _ in range(min(n, 20_000))]
    base = [synthetic.caption_en(s) for s in scenes]
    # vary wording so the corpus is not 20k sentences repeated
    extras = ["a photo of", "an image showing", "clip art of", "a picture with", "", "", ""]
    return [f"{extras[i % 7]} {base[i % len(base)]} number {i % 997}".strip() for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-captions", type=int, default=1_000_000)
    args = ap.parse_args()
    results = {"shard_write": shard_speed(), "tokenizer_training": []}
    w = results["shard_write"]
    print(f"shard write: {w['mb_per_s']} MB/s, {w['samples_per_s']} samples/s", flush=True)
    for n in (10_000, 100_000, 1_000_000):
        if n > args.max_captions:
            continue
        caps = captions(n)
        t0 = time.perf_counter()
        model = train_sentencepiece(caps, TokenizerConfig(vocab_size=32000, max_sentences=n))
        dt = time.perf_counter() - t0
        results["tokenizer_training"].append({"captions": n, "seconds": round(dt, 2), "model_bytes": len(model)})
        print(f"tokenizer: {n} captions in {dt:.1f}s", flush=True)
    write_results("shards", results)


if __name__ == "__main__":
    main()
