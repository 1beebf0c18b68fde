"""ClipCap on a pretrained causal LM from a local folder (Hugging Face transformers, GPT-2 family), as
the paper builds it. The LM here is a tiny GPT-2 with a byte-level BPE tokenizer, both trained in the
fixture on the demo's captions and saved with save_pretrained: nothing downloads."""
import numpy as np
import pytest
import torch

from stages.source import synthetic
from trainers.models import build_model
from trainers.models.checkpoint import load_model, save_model
from trainers.models.config import ModelConfig
from trainers.models.decoding import greedy
from trainers.models.hf_lm import HFTokenizer

pytestmark = pytest.mark.slow    # trains a small LM first (~10 s) and imports transformers


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2, pretrained on 2,000 demo captions for 150 steps, saved as a local folder."""
    from trainers.tiny_lm import pretrain_tiny_gpt2

    rng = np.random.default_rng(0)
    scenes = [synthetic.random_scene(rng) for _ in range(2000)]
    caps = [synthetic.caption_en(s) for s in scenes]
    folder = pretrain_tiny_gpt2(caps, tmp_path_factory.mktemp("gpt2") / "tiny-gpt2", steps=150, width=64, layers=2,
                                heads=2, vocab=300, log=lambda m: None)
    return folder, scenes, caps


def _batch(tok, caps, max_len=40):
    out = torch.zeros(len(caps), max_len, dtype=torch.long)
    for i, c in enumerate(caps):
        ids = tok.encode(c)[: max_len - 1] + [1]
        out[i, : len(ids)] = torch.tensor(ids)
    return out


def _embeddings(scenes, dim=16):
    """What a frozen image encoder would give: a fixed random projection of each scene's attributes."""
    proj = np.random.default_rng(1).normal(size=(64, dim))
    feats = np.zeros((len(scenes), 64))
    for i, s in enumerate(scenes):
        for j, o in enumerate(s.objects[:2]):
            feats[i, hash((j, o.shape, o.colour, o.size)) % 64] = 1.0
    return torch.tensor(feats @ proj, dtype=torch.float32)


def test_tokens_map_into_capline_ids_and_back(gpt2):
    folder, _, caps = gpt2
    tok = HFTokenizer(folder)
    ids = tok.encode(caps[0])
    assert min(ids) >= 2 and tok.decode(ids + [1, 0, 0]) == caps[0]
    assert tok.get_piece_size() == 300 + 2


def test_frozen_gpt2_with_the_transformer_mapper_learns_the_demo_captions(gpt2, tmp_path):
    folder, scenes, caps = gpt2
    tok = HFTokenizer(folder)
    torch.manual_seed(0)
    cfg = ModelConfig(family="clipcap", vocab_size=tok.get_piece_size(), max_len=40, mapper="transformer",
                      mapper_depth=2, prefix_len=4, image_embed_dim=16, hf_lm=str(folder))
    model = build_model(cfg)
    assert cfg.frozen_lm and not any(p.requires_grad for p in model.lm.parameters())
    lm_before = {k: v.clone() for k, v in model.lm.state_dict().items()}
    z, labels = _embeddings(scenes[:512]), _batch(tok, caps[:512])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(60):
        i = torch.randint(0, 512, (32,))
        loss, _ = model.loss(z[i], labels[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"ClipCap (frozen tiny GPT-2, transformer mapper): loss {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f}")
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert all(torch.equal(lm_before[k], v) for k, v in model.lm.state_dict().items())
    # the checkpoint carries the LM's config and tokenizer, and captions with nothing else at hand
    save_model(model, cfg, tmp_path / "ck")
    assert (tmp_path / "ck" / "hf_lm" / "config.json").is_file() and not (tmp_path / "ck" / "hf_lm" / "model.safetensors").exists()
    loaded, lcfg = load_model(tmp_path / "ck")
    model.eval(), loaded.eval()
    assert torch.allclose(loaded(z[:4], labels[:4]), model(z[:4], labels[:4]), atol=1e-5)
    out = greedy(loaded, z[:2], 20)
    cached, rerun = out, greedy(loaded, z[:2], 20, use_cache=False)
    assert torch.equal(cached, rerun)
    text = HFTokenizer(lcfg.hf_lm).decode([int(t) for t in out[0] if t > 1])
    assert text and all(w.isalpha() for w in text.split())


def test_the_lm_frozen_or_trained_with_either_mapper(gpt2):
    folder, _, _ = gpt2
    for mapper in ("mlp", "transformer"):
        for frozen in (True, False):
            cfg = ModelConfig(family="clipcap", vocab_size=302, max_len=40, mapper=mapper, mapper_depth=1,
                              prefix_len=2, image_embed_dim=16, hf_lm=str(folder), lm_frozen=frozen)
            model = build_model(cfg)
            assert all(p.requires_grad != frozen for p in model.lm.parameters()), (mapper, frozen)
    assert ModelConfig(family="clipcap", mapper="transformer").prefix_length == 40
    assert ModelConfig(family="clipcap", mapper="mlp").prefix_length == 10
