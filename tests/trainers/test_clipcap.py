"""Unit: ClipCap made real: a transformer mapper learns on a trained local LM, refuses a random
frozen one, and a checkpoint holds everything it needs to caption images."""
import pytest
import torch

from infra.errors import UserError
from trainers.models import build_model
from trainers.models.checkpoint import load_model, save_model

from test_models import L, V, labels, tiny


def _toy(n=64, seed=0):
    """Four 'images' (embeddings), each with its own caption: learnable only through the prefix."""
    g = torch.Generator().manual_seed(seed)
    protos, caps = torch.randn(4, 32, generator=g), labels(4, seed=seed)
    idx = torch.randint(0, 4, (n,), generator=g)
    return protos[idx] + 0.05 * torch.randn(n, 32, generator=g), caps[idx]


def _train(model, steps, lr=3e-3):
    z, y = _toy()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = model.loss(z, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow   # a few seconds of training or many images: not in the fast set
def test_transformer_mapper_learns_on_a_trained_local_lm_and_refuses_a_random_one(tmp_path):
    torch.manual_seed(0)
    mlp = build_model(tiny("clipcap", image_embed_dim=32))       # trains its LM (the "pretrained" one here)
    _train(mlp, 150)
    save_model(mlp, mlp.cfg, tmp_path / "lm")

    random_lm = build_model(tiny("clipcap", mapper="transformer", mapper_depth=2, image_embed_dim=32))
    with pytest.raises(UserError, match="freshly initialised"):
        random_lm.check_trainable()
    assert _train(random_lm, 5)[-1] == pytest.approx(torch.log(torch.tensor(float(V))).item(), abs=1e-3)  # ln V

    torch.manual_seed(1)
    trf = build_model(tiny("clipcap", mapper="transformer", mapper_depth=2, image_embed_dim=32))
    trf.load_lm(tmp_path / "lm")
    trf.check_trainable()
    assert not any(p.requires_grad for p in trf.lm.parameters())
    lm_before = {k: v.clone() for k, v in trf.lm.state_dict().items()}
    losses = _train(trf, 80)
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert all(torch.equal(v, trf.lm.state_dict()[k]) for k, v in lm_before.items())   # the LM stayed frozen


def test_train_config_refuses_the_transformer_mapper_without_an_lm(tmp_path):
    from pipeline.config import load_config

    with pytest.raises(UserError, match="lm_checkpoint"):
        load_config(None, ["train.model=clipcap", "train.image_encoder=/x", "train.model_args={mapper: transformer}"])
    plain = tmp_path / "c.yaml"
    plain.write_text("name: c\ntrain: {model: clipcap, image_encoder: /x, recipe: clipcap}\n")
    cfg = load_config(plain, ["train.optim.lr=0.0001"])
    assert (cfg.train.global_batch, cfg.train.optim.warmup_steps, cfg.train.optim.schedule) == (40, 5000, "linear")
    assert cfg.train.optim.lr == 1e-4            # what the config sets wins over the recipe
    assert (cfg.train.optim.weight_decay, cfg.train.optim.clip) == (0.0, 0.0)   # the reference uses neither


def test_a_frozen_lm_never_trains_with_dropout_and_a_trained_one_does():
    """As the reference's ClipCaptionPrefix: switching the model to train mode (the training loop,
    and again after each sample log) leaves a frozen LM and the image encoder in eval mode."""
    enc = build_model(tiny("clip"))
    frozen = build_model(tiny("clipcap", image_embed_dim=32, mapper="transformer", lm_frozen=True), image_encoder=enc)
    frozen.train()
    assert frozen.mapper.training and not frozen.lm.training and not any(m.training for m in frozen.lm.modules())
    assert not frozen.image_encoder.training
    frozen.eval()
    frozen.train()
    assert not frozen.lm.training
    tuned = build_model(tiny("clipcap", image_embed_dim=32, mapper="mlp"), image_encoder=enc).train()
    assert tuned.lm.training and tuned.mapper.training and not tuned.image_encoder.training


def test_a_clipcap_checkpoint_holds_its_image_encoder(tmp_path):
    torch.manual_seed(2)
    enc = build_model(tiny("clip"))
    cc = build_model(tiny("clipcap", image_embed_dim=32), image_encoder=enc).eval()
    save_model(cc, cc.cfg, tmp_path / "cc")
    again, cfg = load_model(tmp_path / "cc")          # no encoder given: the checkpoint has it
    again.eval()
    images = torch.randn(2, 3, 16, 16)
    assert torch.allclose(again.image_features(images), cc.image_features(images))
    from trainers.models.decoding import greedy

    assert torch.equal(greedy(again, images, L), greedy(cc, images, L))


def test_clipcap_trains_without_an_end_token_and_decodes_up_to_the_first_period():
    """ClipCap's reference appends no end token and stops generating at ".": capline's ClipCap
    family trains on the caption's own tokens and its greedy and beam decoding end at the first
    token ending in "." (kept), where other families end at EOS."""
    from trainers.data import encode_caption
    from trainers.families import spec, stop_ids
    from trainers.models.decoding import beam_search, greedy

    class Pieces:      # a tokenizer: ids 2.. are these pieces
        pieces = ["<pad>", "</s>", "▁a", "▁dog", "▁runs", ".", "▁sits."]

        def get_piece_size(self):
            return len(self.pieces)

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids).replace("▁", " ").strip()

        def encode(self, text):
            return [self.pieces.index("▁" + w) if "▁" + w in self.pieces else self.pieces.index(w)
                    for w in text.replace(".", " .").split()]

    sp = Pieces()
    assert spec("clipcap").stop_text == "." and spec("cap").stop_text is None
    assert stop_ids(sp, ".") == [5, 6] and stop_ids(sp, None) == []
    assert encode_caption(sp, "a dog runs .", 8).tolist() == [2, 3, 4, 5, 1, 0, 0, 0]
    assert encode_caption(sp, "a dog runs .", 8, eos=False).tolist() == [2, 3, 4, 5, 0, 0, 0, 0]

    class Scripted(torch.nn.Module):   # emits "a dog runs . a dog ..." whatever it sees
        script = [2, 3, 4, 5, 2, 3, 4, 1]

        def start(self, images):
            return images.new_zeros(images.shape[0], 1, 4)

        def new_cache(self):
            return None

        def step(self, seqs, memory, cache, t):
            logits = torch.full((memory.shape[0], 1, len(Pieces.pieces)), -5.0)
            pos = max(t, seqs.shape[1] - 1)      # cached: t; uncached: the whole sequence so far
            logits[:, :, self.script[min(pos, len(self.script) - 1)]] = 5.0
            return logits

    images = torch.zeros(2, 3, 4, 4)
    assert greedy(Scripted(), images, 8, stop=stop_ids(sp, "."))[0].tolist() == [2, 3, 4, 5, 0, 0, 0, 0]
    assert greedy(Scripted(), images, 8)[0].tolist() == [2, 3, 4, 5, 2, 3, 4, 1]
    assert beam_search(Scripted(), images, 8, beam=2, use_cache=False, stop=stop_ids(sp, "."))[0].tolist() == [2, 3, 4, 5, 0, 0, 0, 0]
