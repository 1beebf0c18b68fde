"""Each tiny model family overfits 8 synthetic image-caption pairs on CPU in seconds."""
import numpy as np
import pytest
import torch

from stages.source import synthetic
from trainers.models import ModelConfig, build_model

L = 20
# Loss each family must reach after 300 AdamW steps (measured: cap 0.003, cappa 0.011, clip 0.0002,
# siglip 0.42 from ~10, coca 0.008), with room for numeric noise across machines.
THRESHOLDS = {"cap": 0.05, "cappa": 0.1, "clip": 0.01, "siglip": 1.0, "coca": 0.1}


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    scenes = [synthetic.random_scene(rng) for _ in range(8)]
    caps = [synthetic.caption_en(s) for s in scenes]
    vocab = {w: i + 3 for i, w in enumerate(sorted({w for c in caps for w in c.split()}))}
    y = torch.zeros(8, L, dtype=torch.long)
    for i, c in enumerate(caps):
        ids = [vocab[w] for w in c.split()][: L - 1] + [1]
        y[i, : len(ids)] = torch.tensor(ids)
    imgs = torch.stack([torch.from_numpy(np.asarray(synthetic.render(s, 32))).permute(2, 0, 1).float() / 127.5 - 1
                        for s in scenes])
    return imgs, y, len(vocab) + 3


@pytest.mark.parametrize("family", sorted(THRESHOLDS))
@pytest.mark.slow   # a few seconds of training or many images: not in the fast set
def test_tiny_model_overfits_eight_pairs(family, batch):
    imgs, y, vocab = batch
    torch.manual_seed(0)
    cfg = ModelConfig(family=family, size="tiny", vocab_size=vocab, max_len=L, image_size=32, patch=8,
                      width=64, depth=2, heads=2, mlp=128, caption_queries=8)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    first = None
    for _ in range(300):
        loss, _ = model.loss(imgs, y, generator=gen)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = model.loss(imgs, y, generator=gen)[0].item()
    assert final < THRESHOLDS[family], (first, final)
    assert final < 0.2 * first
