"""Unit: the model families behave as the papers say (masks, mixing, losses, decoding, parity)."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from trainers.models import ModelConfig, build_model
from trainers.models.decoding import beam_search, greedy, sequence_logprob
from trainers.models.losses import caption_loss, clip_loss, siglip_loss
from trainers.models.params import PAPER, count

V, L = 50, 8


def tiny(family, **kw):
    base = dict(family=family, size="tiny", vocab_size=V, max_len=L, image_size=16, patch=4, width=32,
                depth=2, heads=2, mlp=64, caption_queries=4, prefix_len=3)
    return ModelConfig(**{**base, **kw})


def randomise_heads(model):
    """Zero-initialised output heads make every logit equal; tests need ones that can differ."""
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod.out_features == V:
            nn.init.normal_(mod.weight, std=0.5)


def labels(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(3, V, (b, L), generator=g)
    lengths = torch.randint(2, L, (b,), generator=g)
    for i, n in enumerate(lengths):
        y[i, n] = 1          # EOS
        y[i, n + 1:] = 0     # pad
    return y


@pytest.fixture()
def cap():
    torch.manual_seed(0)
    m = build_model(tiny("cappa")).eval()
    randomise_heads(m)
    return m


def test_ar_logits_are_causal(cap):
    images = torch.randn(2, 3, 16, 16)
    memory = cap.start(images)
    tokens = labels(2)
    base = cap.step(tokens, memory, None, 0)
    for t in range(L - 1):
        changed = tokens.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 7) % V
        out = cap.step(changed, memory, None, 0)
        assert torch.allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-5)
        assert not torch.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-5)


def test_pa_logits_depend_on_the_image_only(cap):
    images = torch.randn(3, 3, 16, 16)
    pa = torch.ones(3, dtype=torch.bool)
    a = cap(images, labels(3, seed=1), pa)
    b = cap(images, labels(3, seed=2), pa)
    assert torch.allclose(a, b)
    c = cap(torch.randn(3, 3, 16, 16), labels(3, seed=1), pa)
    assert not torch.allclose(a, c, atol=1e-4)


def test_per_example_mixing_equals_separate_runs(cap):
    images, y = torch.randn(6, 3, 16, 16), labels(6)
    pa = torch.tensor([True, False, True, False, False, True])
    mixed = cap(images, y, pa)
    all_pa = cap(images, y, torch.ones(6, dtype=torch.bool))
    all_ar = cap(images, y, torch.zeros(6, dtype=torch.bool))
    assert torch.allclose(mixed[pa], all_pa[pa], atol=1e-5)
    assert torch.allclose(mixed[~pa], all_ar[~pa], atol=1e-5)
    assert not torch.allclose(all_pa, all_ar, atol=1e-3)


def test_pa_probability_per_example():
    m = build_model(tiny("cappa"))
    rows = m.sample_pa_rows(20000, torch.Generator().manual_seed(0))
    assert abs(rows.float().mean().item() - 0.75) < 0.02
    assert not build_model(tiny("cap")).sample_pa_rows(100).any()


@pytest.mark.parametrize("family", ["cap", "cappa", "clip", "siglip", "coca"])
def test_the_loss_draws_with_the_loops_cpu_generator_whatever_device_the_model_is_on(family):
    """CapPa on CUDA failed at step 1: the loop's CPU generator was handed to a draw on the model's
    device, which CUDA refuses. On the meta device (shapes only, no kernels) the same call shows
    where a draw happens: it must consume the CPU generator (the state a checkpoint restores) and
    leave its result on the model's device."""
    m = build_model(tiny(family)).to("meta")
    gen, same = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    images = torch.zeros(6, 3, 16, 16, device="meta")
    labels = torch.ones(6, L, dtype=torch.long, device="meta")
    loss, metrics = m.loss(images, labels, generator=gen)
    assert loss.device.type == "meta"
    if family == "cappa":
        torch.rand(6, generator=same)
        assert metrics["pa_fraction"].device.type == "meta"
    assert torch.equal(gen.get_state(), same.get_state())   # CapPa drew its 6 rows from it; the others none


def test_caption_loss_matches_a_hand_computation():
    torch.manual_seed(1)
    logits, y = torch.randn(3, L, V), labels(3)
    expected = []
    for i in range(3):
        terms = []
        for t in range(L):
            if y[i, t] == 0:
                continue
            row = logits[i, t].double()
            terms.append(-(row[y[i, t]] - math.log(sum(math.exp(v) for v in row.tolist()))))
        expected.append(sum(terms) / len(terms))   # EOS (1) counts, pad (0) does not
    assert caption_loss(logits, y).item() == pytest.approx(float(np.mean(expected)), rel=1e-5)


def _norm(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_clip_and_siglip_losses_match_hand_computation():
    rng = np.random.default_rng(0)
    zi, zt = _norm(rng.normal(size=(5, 4))), _norm(rng.normal(size=(5, 4)))
    scale = math.log(1 / 0.07)
    logits = math.exp(scale) * zi @ zt.T
    def ce(m):
        return np.mean([-(m[i, i] - np.log(np.exp(m[i]).sum())) for i in range(len(m))])
    want = 0.5 * (ce(logits) + ce(logits.T))
    got = clip_loss(torch.tensor(zi), torch.tensor(zt), torch.tensor(scale))
    assert got.item() == pytest.approx(want, rel=1e-6)
    t, b = math.log(10), -10.0
    lg = math.exp(t) * zi @ zt.T + b
    want = -np.mean([sum(math.log(1 / (1 + math.exp(-(1 if i == j else -1) * lg[i, j]))) for j in range(5))
                     for i in range(5)])
    got = siglip_loss(torch.tensor(zi), torch.tensor(zt), torch.tensor(t), torch.tensor(b))
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_logit_scale_is_clamped_at_100():
    z = torch.eye(3)
    big = clip_loss(z, z, torch.tensor(10.0))
    capped = clip_loss(z, z, torch.tensor(math.log(100.0)))
    assert big.item() == pytest.approx(capped.item())


@pytest.mark.parametrize("family", ["cappa", "coca", "clipcap"])
def test_cached_decoding_equals_uncached_and_beam1_equals_greedy(family):
    torch.manual_seed(3)
    m = build_model(tiny(family)).eval()
    randomise_heads(m)
    x = torch.randn(3, 32) if family == "clipcap" else torch.randn(3, 3, 16, 16)
    if family == "clipcap":
        m = build_model(tiny(family, image_embed_dim=32)).eval()
        randomise_heads(m)
    g_cache, g_full = greedy(m, x, L, use_cache=True), greedy(m, x, L, use_cache=False)
    assert torch.equal(g_cache, g_full)
    assert torch.equal(beam_search(m, x, L, beam=1), g_cache)
    b_cache, b_full = beam_search(m, x, L, beam=3), beam_search(m, x, L, beam=3, use_cache=False)
    assert torch.equal(b_cache, b_full)
    assert (g_cache != 0).any()


def test_beam_search_finds_at_least_the_greedy_likelihood(cap):
    images = torch.randn(4, 3, 16, 16)
    def loglik(seqs):
        return torch.stack([sequence_logprob(cap(images[i:i + 1], s[None]), s[None])[0]
                            for i, s in enumerate(seqs)])
    g, b = greedy(cap, images, L), beam_search(cap, images, L, beam=4)
    assert (loglik(b) >= loglik(g) - 1e-4).all()


def test_parallel_and_ar_scoring_match_their_definitions(cap):
    images, cands = torch.randn(2, 3, 16, 16), labels(5, seed=4)
    ar = cap.score_ar(images, cands)
    par = cap.score_parallel(images, cands)
    for i in range(2):
        for c in range(5):
            img, y = images[i:i + 1], cands[c:c + 1]
            want_ar = sequence_logprob(cap(img, y, torch.tensor([False])), y)[0]
            want_pa = sequence_logprob(cap(img, y, torch.tensor([True])), y)[0]
            assert ar[i, c].item() == pytest.approx(want_ar.item(), abs=1e-4)
            assert par[i, c].item() == pytest.approx(want_pa.item(), abs=1e-4)


@pytest.mark.slow   # builds B/16-sized models / loads a language model: not in the fast set
@pytest.mark.parametrize("size,family", sorted(PAPER))
def test_parameter_parity_with_paper_table1(size, family):
    n = count(family, size) / 1e6
    assert abs(n / PAPER[(size, family)] - 1) < 0.02, n


def test_checkpoint_roundtrip_and_mismatch(tmp_path, cap):
    from infra.errors import UserError
    from trainers.models.checkpoint import load_model, save_model

    save_model(cap, cap.cfg, tmp_path / "ck")
    loaded, cfg = load_model(tmp_path / "ck")
    loaded.eval()
    images, y = torch.randn(2, 3, 16, 16), labels(2)
    assert torch.allclose(loaded(images, y), cap(images, y))
    assert cfg == cap.cfg
    save_model(build_model(tiny("clip")), tiny("clip"), tmp_path / "clip")
    (tmp_path / "clip" / "model.json").write_text((tmp_path / "ck" / "model.json").read_text())
    with pytest.raises(UserError, match="do not fit"):
        load_model(tmp_path / "clip")
    with pytest.raises(UserError, match="not a capline model"):
        load_model(tmp_path)


def test_clipcap_predicts_caption_tokens_from_prefix_and_earlier_tokens():
    torch.manual_seed(5)
    m = build_model(tiny("clipcap", image_embed_dim=32)).eval()
    randomise_heads(m)
    z, y = torch.randn(2, 32), labels(2)
    base = m(z, y)
    assert base.shape == (2, L, V)      # one prediction per caption token, none for the prefix
    for t in range(1, L):
        changed = y.clone()
        changed[:, t] = (changed[:, t] + 5) % V
        out = m(z, changed)
        assert torch.allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-5)  # position t predicts label t
    assert not torch.allclose(m(torch.randn(2, 32), y)[:, 0], base[:, 0])  # the prefix carries the image


def test_clipcap_freezing_follows_the_mapper_and_the_encoder_stays_frozen():
    enc = build_model(tiny("cappa"))
    mlp = build_model(tiny("clipcap", image_embed_dim=32), image_encoder=enc)
    assert all(p.requires_grad for p in mlp.lm.parameters())
    assert not any(p.requires_grad for p in enc.parameters())
    trf = build_model(tiny("clipcap", mapper="transformer", mapper_depth=2, image_embed_dim=32))
    assert not any(p.requires_grad for p in trf.lm.parameters())
    assert all(p.requires_grad for p in trf.mapper.parameters())
    loss, _ = mlp.loss(torch.randn(2, 3, 16, 16), labels(2))   # images go through the frozen encoder
    loss.backward()
    assert all(p.grad is None for p in enc.parameters())


@pytest.mark.slow   # seconds: kept out of the fast set (its 45 s budget)
@pytest.mark.parametrize("family", ["cap", "cappa", "clip", "siglip", "coca", "clipcap"])
def test_every_family_runs_on_the_inputs_device(family):
    """GPU readiness without a GPU: on the meta device, any tensor a model makes on the CPU (a mask,
    an arange) meets a meta tensor and fails, as it would on CUDA."""
    with torch.device("meta"):
        m = build_model(tiny(family, **({"image_embed_dim": 32} if family == "clipcap" else {})))
    x = torch.empty(2, 32, device="meta") if family == "clipcap" else torch.empty(2, 3, 16, 16, device="meta")
    y = labels(2).to("meta")
    loss, metrics = m.loss(x, y)
    assert loss.device.type == "meta" and all(v.device.type == "meta" for v in metrics.values())
    if family != "clipcap":
        assert m.image_features(x).shape == (2, 32)
    if family in ("cap", "cappa", "coca", "clipcap"):
        assert greedy(m, x, L).device.type == beam_search(m, x, L, beam=2).device.type == "meta"
        assert m.score_ar(x, y).shape == (2, 2)
    if family in ("cap", "cappa"):
        assert m.score_parallel(x, y).shape == (2, 2)
    if family in ("clip", "siglip", "coca"):
        assert m.score(x, y).shape == (2, 2)


def test_every_dispatch_on_a_family_reads_its_spec():
    """One registry (trainers/families.py): the config's choices, the builders, the training tasks,
    the scorer's families and CapPa's parallel fraction all come from it."""
    import typing

    from stages.filters.scorer import SCORING_FAMILIES
    from trainers.families import SPECS, spec
    from trainers.models import FAMILIES, ModelConfig, build_model
    from trainers.tasks import make_task
    from trainers.train_config import TrainConfig

    assert set(SPECS) == set(FAMILIES) == set(typing.get_args(typing.get_type_hints(ModelConfig)["family"])) \
        == set(typing.get_args(typing.get_type_hints(TrainConfig)["model"]))
    assert SCORING_FAMILIES == ("clip", "siglip", "coca")
    for name, s in SPECS.items():
        assert make_task(ModelConfig(family=name)).__class__.__name__ == s.task
        if not s.needs_encoder:
            m = build_model(ModelConfig(family=name, vocab_size=50, max_len=8, image_size=16, width=32, depth=1,
                                        heads=2, mlp=64, patch=8))
            assert s.embeds_text == hasattr(m, "score") or s.captioner
    assert ModelConfig(family="cappa").pa_prob == 0.75 and ModelConfig(family="cap").pa_prob == 0.0
    with pytest.raises(ValueError, match="unknown model family 'vit'; choose one of cap, cappa"):
        spec("vit")


def test_coca_text_halves_are_as_deep_as_open_clips_configs():
    """open_clip's CoCa ViT-B: 12 unimodal + 12 multimodal text layers beside the 12-layer encoder,
    and no position embedding of the multimodal half's own."""
    import torch

    from trainers.models import build_model
    from trainers.models.config import ModelConfig

    with torch.device("meta"):
        m = build_model(ModelConfig(family="coca", size="b16", vocab_size=32000))
    assert len(m.encoder.blocks) == 12 and len(m.unimodal.blocks) == 12 and len(m.multimodal.blocks) == 12
    assert m.multimodal.pos is None and not any("multimodal.pos" in n for n, _ in m.named_parameters())
    # coca_ViT-L-14: a 1024-wide, 24-layer ViT; 12 + 12 text layers 768 wide, embeddings of 768
    with torch.device("meta"):
        big = build_model(ModelConfig(family="coca", size="l14", vocab_size=32000))
    assert len(big.encoder.blocks) == 24 and len(big.unimodal.blocks) == 12 and len(big.multimodal.blocks) == 12
    assert big.unimodal.embed.weight.shape == (32001, 768) and big.multimodal.head.weight.shape == (32000, 768)
    assert big.cap_pool.attn.k.weight.shape == (768, 1024) and big.cap_pool.probe.shape == (1, 256, 768)
    assert big.image_proj.weight.shape == (768, 1024) and big.text_proj.weight.shape == (768, 768)
    assert big.unimodal.blocks[0].attn.heads == 12


def test_a_coca_text_tower_narrower_than_its_encoder_trains_and_decodes():
    import torch

    from trainers.models import build_model
    from trainers.models.config import ModelConfig

    torch.manual_seed(0)
    m = build_model(ModelConfig(family="coca", size="tiny", vocab_size=50, max_len=8, image_size=16, patch=8,
                                text_width=64, text_heads=2, text_mlp=128, caption_queries=4))
    images, labels = torch.randn(3, 3, 16, 16), torch.randint(3, 50, (3, 8))
    logits, zimg, ztxt = m(images, labels)
    assert logits.shape == (3, 8, 50) and zimg.shape == ztxt.shape == (3, 64)
    loss, _ = m.loss(images, labels)
    loss.backward()
    assert m.cap_pool.attn.k.weight.grad.shape == (64, 128)
    assert m.score(images, labels).shape == (3, 3) and m.score_ar(images, labels).shape == (3, 3)


def test_initialisation_and_biases_are_big_visions():
    """At B/16 width: xavier blocks in the ViT (0.0361 for q, 0.0228 for the MLP, where PyTorch's
    default gives 0.0208 and 0.0104), lecun-normal patch kernel and decoder attention, positions
    N(0, 1/D), biases in the encoder and none in CapPa's decoder blocks."""
    import torch

    from trainers.models import build_model
    from trainers.models.config import ModelConfig

    torch.manual_seed(0)
    m = build_model(ModelConfig(family="cappa", size="b16", depth=1, decoder_depth=1, vocab_size=1000))
    blk = m.encoder.blocks[0]
    assert float(blk.attn.q.weight.detach().std()) == pytest.approx(0.0361, rel=0.03)
    assert float(blk.mlp[0].weight.detach().std()) == pytest.approx(0.0228, rel=0.03)
    assert float(m.encoder.embed.weight.detach().std()) == pytest.approx((1 / (3 * 16 * 16)) ** 0.5, rel=0.03)
    assert float(m.encoder.pos.detach().std()) == pytest.approx(768 ** -0.5, rel=0.03)
    assert float(m.decoder.pos.detach().std()) == pytest.approx(768 ** -0.5, rel=0.03)
    assert float(m.decoder.blocks[0].attn.q.weight.detach().std()) == pytest.approx(768 ** -0.5, rel=0.03)
    assert blk.attn.q.bias is not None and blk.mlp[0].bias is not None and blk.ln1.bias is not None
    assert m.decoder.blocks[0].attn.q.bias is None and m.decoder.blocks[0].mlp[0].bias is None
    assert m.decoder.ln.bias is not None                    # the final LayerNorm keeps flax's default bias


@pytest.mark.slow   # 5 s: three models built
def test_contrastive_projection_heads_start_at_flax_default_init():
    """big_vision's two towers (and CoCa's) project with flax Dense heads at their default init,
    lecun normal: std 1/sqrt(fan_in) (0.0442 at width 512), where PyTorch's default gives 0.0255."""
    import torch

    from trainers.models import build_model
    from trainers.models.config import ModelConfig

    torch.manual_seed(0)
    for family in ("clip", "siglip", "coca"):
        m = build_model(ModelConfig(family=family, size="tiny", width=512, heads=4, mlp=1024, depth=1, decoder_depth=1,
                                    vocab_size=50, max_len=8, image_size=16, patch=8))
        heads = [m.image_proj, m.text_proj] if family == "coca" else [m.image_proj, m.text.proj]
        for head in heads:
            fan_in = head.weight.shape[1]
            assert float(head.weight.detach().std()) == pytest.approx(fan_in ** -0.5, rel=0.03), family
            assert float(head.weight.detach().abs().max()) <= 2 * fan_in ** -0.5 / 0.8796 + 1e-6   # truncated at 2 std


def test_a_checkpoint_from_before_the_final_layernorm_bias_still_loads(tmp_path):
    """Models saved before the decoder's final LayerNorm had a bias load with it at zero (the same
    function); any other missing weight is still refused."""
    import pytest
    import torch
    from safetensors.torch import load_file, save_file

    from infra.errors import UserError
    from trainers.models import build_model
    from trainers.models.checkpoint import load_model, save_model
    from trainers.models.config import ModelConfig

    cfg = ModelConfig(family="cappa", size="tiny", vocab_size=50, max_len=8, image_size=16, patch=8, depth=1)
    save_model(build_model(cfg), cfg, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["decoder.ln.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    model, _ = load_model(tmp_path)
    assert torch.count_nonzero(model.decoder.ln.bias) == 0
    del state["decoder.ln.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="decoder.ln.weight"):
        load_model(tmp_path)
