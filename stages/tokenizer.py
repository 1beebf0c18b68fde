"""The tokenizer stage: train a SentencePiece model on the kept captions.

Captions are sampled deterministically (the `max_sentences` keys first in sha256(seed:key) order,
found by a threshold on that hash in a task per partition, never by sorting every key: the sampler
the bootstrap scorer shares, `dataplane.first_in_seeded_order`), training runs
in one Ray task with `threads` threads (and as many CPUs). SentencePiece's model depends on its
thread count (measured: 1 and 2 threads give different bytes, 2 and 2 the same), so `threads` is a
setting that decides the result, never the cluster's size: the same captions and config give the
same model bytes.
Ids: pad 0 (also the decoders' BOS), EOS 1, unknown 2, no BOS; byte fallback on, so nothing is ever
unknown. `vocab_size` is a soft limit (a small corpus cannot fill 32k pieces): the model's real size
is in stats.json and the manifest. Every sample is kept; this stage only learns from them.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, fields
from typing import Literal


from infra.configtools import join, require

from infra.hashing import order_key  # noqa: F401 - the tests import it from here too

from .base import Sink, StageContext, StageResult
from .dataplane import first_in_seeded_order


@dataclass
class TokenizerConfig:
    vocab_size: int = 32000  # SentencePiece pieces to learn (a soft limit: fewer if the captions support fewer)
    model_type: Literal["unigram", "bpe"] = "unigram"  # SentencePiece's algorithm (unigram or bpe)
    lowercase: bool = True  # lowercase captions before training and encoding
    normalization: Literal["nmt_nfkc", "nfkc", "identity"] = "nmt_nfkc"  # SentencePiece's normalisation rule (nmt_nfkc, ...)
    max_sentences: int = 2_000_000  # captions sampled, by seeded order key, to train on
    threads: int = 1  # SentencePiece's training threads (the task asks for as many CPUs); the model's bytes depend on it
    character_coverage: float = 0.9995  # share of characters the vocabulary covers (rare ones map to unknown)
    # keep the model the first run of this run folder trained for every later (scheduled) run: a
    # dataset line's fixed vocabulary, so models trained on its earlier shards stay compatible;
    # false trains anew on the captions as they are now
    reuse: bool = False

    def validate(self, prefix: str) -> None:
        require(self.vocab_size >= 300, join(prefix, "vocab_size"),
                f"must be >= 300 (256 byte pieces + specials), got {self.vocab_size}")
        require(self.max_sentences >= 10, join(prefix, "max_sentences"), "must be >= 10")
        require(0.9 <= self.character_coverage <= 1.0, join(prefix, "character_coverage"), "must be in [0.9, 1]")
        require(1 <= self.threads <= 256, join(prefix, "threads"), f"must be in [1, 256], got {self.threads}")


def train_sentencepiece(captions: list[str], cfg: TokenizerConfig) -> bytes:
    import sentencepiece as spm

    rule = cfg.normalization + ("_cf" if cfg.lowercase and cfg.normalization != "identity" else "")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(captions), model_writer=buf, vocab_size=cfg.vocab_size,
        model_type=cfg.model_type, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True,
        normalization_rule_name=rule, hard_vocab_limit=False, num_threads=cfg.threads,
        shuffle_input_sentence=False, character_coverage=cfg.character_coverage, minloglevel=2)
    return buf.getvalue()


@dataclass(frozen=True)
class Trained:
    """The tokenizer as trained (or kept from the dataset line): its stats, and what it consumed."""
    vocab_size: int
    trained_on: int
    sha256: str
    mean_tokens: float
    max_tokens: int
    consumed: tuple = (0, "0")    # (samples, key-set checksum) of the upstream partitions

    def stats(self) -> dict:
        """As stats.json and the line's info.json say it (without `consumed`)."""
        return {f: getattr(self, f) for f in STATS}

    @classmethod
    def from_stats(cls, info: dict, consumed: tuple) -> "Trained":
        return cls(**{f: info[f] for f in STATS}, consumed=consumed)


STATS = tuple(f.name for f in fields(Trained) if f.name != "consumed")


def _train_task(storage, captions: list[str], cfg: TokenizerConfig, consumed: tuple) -> Trained:
    """Ray task: train on the sampled captions, write spm.model to the run folder."""
    import sentencepiece as spm

    model = train_sentencepiece(captions, cfg)
    sha = storage.write_bytes("tokenizer/spm.model", model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    lengths = [len(ids) + 1 for ids in sp.encode(captions[:2000])]  # + EOS
    return Trained(sp.get_piece_size(), len(captions), sha, sum(lengths) / len(lengths), max(lengths), consumed)


def _consumed(ctx) -> tuple:
    """What the stage consumed: the upstream partitions' kept counts and key-set checksums from their
    summaries (the upstream checked them when it wrote them)."""
    from .dataplane import add_sums

    upstream = ctx.upstream or []
    return sum(u.kept for u in upstream), add_sums(*(u.kept_sum for u in upstream))


def _keep(ctx) -> Trained:
    """The dataset line's model as this run's (two requests on the driver): an append reads no
    partition here."""
    info = ctx.storage.read_json(f"{LINE}/info.json")
    ctx.storage.write_bytes("tokenizer/spm.model", ctx.storage.read_bytes(f"{LINE}/spm.model"))
    return Trained.from_stats(info, _consumed(ctx))


LINE = "tokenizer/line"      # the model kept for later runs (reuse)


class TokenizerStage(Sink):
    name = "tokenizer"
    config_key, config_class = "tokenizer", TokenizerConfig
    preserve = ("line",)

    def run(self, ctx: StageContext) -> StageResult:
        cfg: TokenizerConfig = ctx.cfg
        if cfg.reuse and ctx.storage.exists(f"{LINE}/info.json"):
            info = _keep(ctx)
            ctx.log(f"tokenizer: the model of this dataset line ({info.sha256[:12]}, {info.vocab_size} pieces), "
                    "not trained again (stages.tokenizer.reuse; set it false to retrain)")
        else:
            rows = first_in_seeded_order(ctx, min(ctx.n_in, cfg.max_sentences), ctx.n_in, ["caption"], "tokenizer sample")
            if not rows:
                raise RuntimeError("tokenizer: no captions left to train on; every sample was dropped upstream")
            info = ctx.call(_train_task, ctx.storage, [r["caption"] or "" for r in rows], cfg, _consumed(ctx),
                            what="tokenizer", num_cpus=cfg.threads, setting="stages.tokenizer.threads")
            ctx.log(f"tokenizer: trained a {cfg.model_type} model of {info.vocab_size} pieces on "
                    f"{info.trained_on} captions")
            if cfg.reuse:
                ctx.storage.write_bytes(f"{LINE}/spm.model", ctx.storage.read_bytes("tokenizer/spm.model"))
                ctx.storage.write_json(f"{LINE}/info.json", info.stats())
        return StageResult([], {**info.stats(), "requested_vocab_size": cfg.vocab_size},
                           artifacts={"model": "tokenizer/spm.model", "sha256": info.sha256,
                                      "vocab_size": info.vocab_size},
                           files={"tokenizer/spm.model": info.sha256}, consumed=info.consumed)
