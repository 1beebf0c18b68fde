"""SentencePiece training at scale: the tokenizer stage's wall with 1 thread and with the task's CPUs.

    python benchmarks/tokenizer.py [--captions 1000000] [--threads 1 2] [--vocab 32000]

Captions: the 4,000 real COCO captions in tests/trainers/data, each varied by a seeded word swap
and a number so that `--captions` distinct sentences exist (SentencePiece sees real English word
statistics, not random text). Each thread count trains the stage's own `train_sentencepiece` with
the stage's defaults; printed and written to benchmarks/results/tokenizer.json: wall seconds,
pieces, whether two runs at one thread count give the same bytes (the model depends on the thread
count, so `stages.tokenizer.threads` is a setting, not the cluster's size).
"""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import write_results  # noqa: E402


def captions(n: int) -> list[str]:
    base = (ROOT / "tests" / "trainers" / "data" / "coco-val-captions.txt").read_text().splitlines()
    rng = random.Random(0)
    out = []
    for i in range(n):
        words = base[i % len(base)].split()
        if len(words) > 3:
            a, b = rng.randrange(len(words)), rng.randrange(len(words))
            words[a], words[b] = words[b], words[a]
        out.append(" ".join(words) + f" {i // len(base)}")
    return out


def main() -> None:
    from stages.tokenizer import TokenizerConfig, train_sentencepiece

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--captions", type=int, default=1_000_000)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    caps = captions(args.captions)
    runs = {}
    for t in args.threads:
        cfg = TokenizerConfig(vocab_size=args.vocab, threads=t)
        t0 = time.perf_counter()
        model = train_sentencepiece(caps, cfg)
        wall = time.perf_counter() - t0
        import sentencepiece as spm

        pieces = spm.SentencePieceProcessor(model_proto=model).get_piece_size()
        runs[str(t)] = {"wall_seconds": round(wall, 1), "pieces": pieces, "sha256": hashlib.sha256(model).hexdigest()}
        print(f"{args.captions:,} captions, {t} thread(s): {wall:.1f} s, {pieces} pieces", flush=True)
    if len(args.threads) > 1:
        again = train_sentencepiece(caps, TokenizerConfig(vocab_size=args.vocab, threads=args.threads[-1]))
        same = hashlib.sha256(again).hexdigest() == runs[str(args.threads[-1])]["sha256"]
        print(f"two runs at {args.threads[-1]} threads give the same bytes: {same}; 1 thread and "
              f"{args.threads[-1]}: {'same' if runs[str(args.threads[0])]['sha256'] == runs[str(args.threads[-1])]['sha256'] else 'different'} bytes")
        runs["repeat_same_bytes"] = same
    write_results("tokenizer", {"captions": args.captions, "vocab_size": args.vocab, "runs": runs})


if __name__ == "__main__":
    main()
