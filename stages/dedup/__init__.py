"""The dedup stage's family: decontaminate against evaluation sets, then remove duplicates within the data.

Its steps, each a module, in the order the stage (`stage.py`) runs them:

1. `eval_sets.py`: each evaluation set in `eval_sets` gets a reference index (described at 28 crops
   by `imagehash.py`, searched through `neardup.py`; built once and cached by content and parameters).
2. `describe.py`: partitions on an actor pool (each actor holds the evaluation indexes' search
   structures and the optional encoder once; the arrays stay one copy per node in the object store)
   read their images through the sample index, describe each once, search the indexes and write
   `described/<key>.desc.parquet`: descriptor, SimHash code, mean colour, pixel and URL+caption
   hashes. Kept across runs by the partition's content and the config alone.
3. `sign.py`: a cheap task per partition makes its signatures for this run's band plan (banded LSH,
   `lsh.py`: bands wider and more of them as N grows, so a band value's group stays small and a pair
   at the threshold is found with the same probability) from those descriptions, sorted into range
   buckets (`signed/<key>.sig.parquet`, kept across runs per band plan).
4. `group.py`: the group shuffle, through Ray's object store: equal pixels or URL+caption make
   `exact_duplicate` pairs; codes that share a band, are within the Hamming radius the cosine
   threshold implies and agree in colour make candidate pairs (exact copies in a large group pair
   with one representative: a placeholder repeated 10^4 times costs linear work).
5. `verify.py`: the candidates' descriptors fetched by partition and sent on by pair bucket (a join
   through the object store); a task per pair bucket checks them by exact cosine and writes the edges.
6. `components.py`: one task joins the edges into clusters (its memory grows with the duplicates, not
   the data): of each cluster the smallest key is kept, the rest name it (`duplicate_of=<key>`).
7. `verdicts.py`: a task per partition writes the verdicts: an evaluation match (`eval_duplicate`,
   and evaluation captions in alt-text, `eval_caption`, through `caption_match.py`), the duplicates,
   removals; the driver sees counts only. `report.py` writes the stage's page.

`config.py` holds the stage's settings, `encoder.py` the optional encoder descriptor (with
`encoder_checkpoint`, encoder embeddings are compared as well, through the same index class), and
`layout.py` the files and schemas the steps hand each other.
"""
from .config import DedupConfig, preflight
from .stage import DedupStage

__all__ = ["DedupConfig", "DedupStage", "preflight"]
