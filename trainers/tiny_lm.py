"""A small GPT-2 pretrained on captions, saved as a Hugging Face folder, for machines where no
pretrained GPT-2 can be downloaded (this one, CI): ClipCap's `train.lm_path` then has a real
pretrained causal LM to sit on, with its own byte-level BPE tokenizer.

    python -m trainers.tiny_lm RUN_DIR OUT_FOLDER [--steps 300] [--width 128] [--layers 4]

reads the captions of RUN_DIR's final shards. With real GPT-2 weights at hand (a folder written by
`save_pretrained`), point train.lm_path there instead.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path


def pretrain_tiny_gpt2(captions: list[str], out: Path, steps: int = 300, width: int = 128, layers: int = 4,
                       heads: int = 4, vocab: int = 1000, batch: int = 32, seed: int = 0, log=print) -> Path:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    eos = "<|endoftext|>"
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(captions, vocab_size=vocab, min_frequency=1, special_tokens=[eos])
    tok = GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=eos, bos_token=eos, unk_token=eos)
    torch.manual_seed(seed)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=width, n_layer=layers, n_head=heads,
                                    eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))
    ids = [tok.encode(c)[:127] + [tok.eos_token_id] for c in captions]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    for step in range(steps):
        rows = rng.sample(ids, min(batch, len(ids)))
        n = max(map(len, rows))
        x = torch.tensor([r + [tok.eos_token_id] * (n - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
        labels = x.masked_fill(mask == 0, -100)
        loss = lm(x, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % max(1, steps // 5) == 0:
            log(f"tiny_lm: step {step + 1}/{steps}, loss {loss.item():.3f}")
    out = Path(out)
    lm.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_captions(run_dir: Path, limit: int = 20000) -> list[str]:
    import webdataset as wds

    shards = sorted(str(p) for p in (Path(run_dir) / "shard" / "shards").glob("*.tar"))
    if not shards:
        from infra.errors import UserError

        raise UserError(f"{run_dir}: no final shards; run `capline run --until shard` first")
    out = []
    for s in wds.WebDataset(shards, shardshuffle=False):
        out.append(s["txt"].decode())
        if len(out) >= limit:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)
    folder = pretrain_tiny_gpt2(run_captions(a.run_dir), a.out, a.steps, a.width, a.layers)
    print(f"tiny_lm: a GPT-2 of width {a.width}, {a.layers} layers in {folder}; use --set train.lm_path={folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
