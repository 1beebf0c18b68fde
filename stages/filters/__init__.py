"""The filter stages: each judges every sample from its own data and records a verdict and reason.

- `basic.py`: image size and shape, caption length, a caption repaired (`captions.py`) or refused.
- `language.py`: the caption's language and the backend's confidence (`langid.py`: fastText's lid.176
  or a model the user names), on an actor pool that loads the model once per actor.
- `clip_score.py`: image-caption agreement by a scorer (`scorer.py`: a bootstrap scorer capline trains
  on the run's own pairs, a column the list carries, or a CLIP on disk, `hf_clip.py`), a fixed
  threshold or the top `keep_fraction`.
"""
from .basic import BasicConfig, BasicStage
from .clip_score import ClipScoreConfig, ClipScoreStage
from .language import LanguageConfig, LanguageStage

__all__ = ["BasicConfig", "BasicStage", "ClipScoreConfig", "ClipScoreStage", "LanguageConfig", "LanguageStage"]
