"""The one way to open a caption tokenizer: the run's SentencePiece model (a file), or a Hugging
Face LM's own tokenizer (its folder, for ClipCap on a pretrained LM). Both give capline's ids
(0 pad, 1 EOS) through encode / decode / get_piece_size."""
from __future__ import annotations

from pathlib import Path


def open_tokenizer(path: str | Path):
    path = Path(path)
    if path.is_dir():
        from trainers.models.hf_lm import HFTokenizer

        return HFTokenizer(path)
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(path))
