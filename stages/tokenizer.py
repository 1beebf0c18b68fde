"""The tokenizer stage: train a SentencePiece model on the kept captions.

Captions are sampled deterministically (the `max_sentences` keys first in sha256(seed:key) order),
training runs single-threaded, so the same captions and config give the same model bytes.
Ids: pad 0 (also the decoders' BOS), EOS 1, unknown 2, no BOS; byte fallback on, so nothing is ever
unknown. `vocab_size` is a soft limit (a small corpus cannot fill 32k pieces): the model's real size
is in stats.json and the manifest. Every sample is kept; this stage only learns from them.
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Literal


from trainers.configtools import join, require

from .base import Ledger, Stage, StageContext, StageResult
from .captions import caption_map


@dataclass
class TokenizerConfig:
    vocab_size: int = 32000
    model_type: Literal["unigram", "bpe"] = "unigram"
    lowercase: bool = True
    normalization: Literal["nmt_nfkc", "nfkc", "identity"] = "nmt_nfkc"
    max_sentences: int = 2_000_000
    character_coverage: float = 0.9995

    def validate(self, prefix: str) -> None:
        require(self.vocab_size >= 300, join(prefix, "vocab_size"),
                f"must be >= 300 (256 byte pieces + specials), got {self.vocab_size}")
        require(self.max_sentences >= 10, join(prefix, "max_sentences"), "must be >= 10")
        require(0.9 <= self.character_coverage <= 1.0, join(prefix, "character_coverage"), "must be in [0.9, 1]")


def order_key(seed: int, key: str) -> str:
    """The deterministic order capline samples and shuffles by: independent of arrival order."""
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def train_sentencepiece(captions: list[str], cfg: TokenizerConfig) -> bytes:
    import sentencepiece as spm

    rule = cfg.normalization + ("_cf" if cfg.lowercase and cfg.normalization != "identity" else "")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(captions), model_writer=buf, vocab_size=cfg.vocab_size,
        model_type=cfg.model_type, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True,
        normalization_rule_name=rule, hard_vocab_limit=False, num_threads=1,
        shuffle_input_sentence=False, character_coverage=cfg.character_coverage, minloglevel=2)
    return buf.getvalue()


class TokenizerStage(Stage):
    name = "tokenizer"

    def section(self, config) -> TokenizerConfig:
        return config.stages.tokenizer

    def run(self, ctx: StageContext) -> StageResult:
        import sentencepiece as spm

        cfg: TokenizerConfig = ctx.config.stages.tokenizer
        caption_of = caption_map(ctx.upstream)
        ledger = Ledger(self.name)
        keys = sorted(ctx.upstream_kept or [], key=lambda k: order_key(ctx.config.seed, k))
        for k in keys:
            ledger.keep(k)
        sample = [caption_of[k] for k in keys[: cfg.max_sentences]]
        if not sample:
            raise RuntimeError("tokenizer: no captions left to train on; every sample was dropped upstream")
        model = train_sentencepiece(sample, cfg)
        (ctx.stage_dir / "spm.model").write_bytes(model)
        sp = spm.SentencePieceProcessor(model_proto=model)
        lengths = [len(ids) + 1 for ids in sp.encode(sample[:2000])]  # + EOS
        ctx.log(f"tokenizer: trained a {cfg.model_type} model of {sp.get_piece_size()} pieces on {len(sample)} captions")
        digest = hashlib.sha256(model).hexdigest()
        return StageResult(ledger, {
            "vocab_size": sp.get_piece_size(), "requested_vocab_size": cfg.vocab_size, "trained_on": len(sample),
            "sha256": digest, "mean_tokens": sum(lengths) / len(lengths), "max_tokens": max(lengths)},
            artifacts={"model": "tokenizer/spm.model", "sha256": digest, "vocab_size": sp.get_piece_size()})
