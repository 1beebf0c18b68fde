"""`scorer: hf`: a CLIP in Hugging Face format, from a local folder, as the CLIP-score filter. The tests
build a tiny CLIP and its tokenizer here and save them with `save_pretrained`; nothing downloads."""
import hashlib
import io

import numpy as np
import pytest
from PIL import Image

transformers = pytest.importorskip("transformers")


def tiny_clip(folder, captions=("a red square", "a blue circle", "a green triangle on grass")):
    """A CLIPModel of a few thousand parameters and a BPE tokenizer trained on `captions`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(list(captions) * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=[
        "<pad>", "<unk>", "<|startoftext|>", "<|endoftext|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                bos_token="<|startoftext|>", eos_token="<|endoftext|>")
    cfg = transformers.CLIPConfig(
        text_config={"vocab_size": tok.get_vocab_size(), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16,
                     "eos_token_id": tok.token_to_id("<|endoftext|>"), "pad_token_id": 0},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        projection_dim=16)
    transformers.CLIPModel(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def _png(color, size=(40, 30)):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.slow   # a few seconds of training or many images: not in the fast set
def test_a_local_hf_clip_scores_pairs_and_is_checked_first(tmp_path):
    from infra.errors import UserError
    from stages.filters.hf_clip import HFScorer, check_hf

    folder = tiny_clip(tmp_path / "clip")
    info = check_hf(str(folder))
    assert info["kind"] == "hf" and info["family"] == "clip" and len(info["sha256"]) == 64
    scorer = HFScorer(str(folder))
    images, caps = [_png((200, 0, 0)), _png((0, 0, 200))], ["a red square", "a blue circle"]
    s = scorer.score(images, caps)
    assert s.shape == (2,) and np.all(np.abs(s) <= 1.0)
    # the same pair scores the same whatever else is in its batch
    assert scorer.score(images[:1], caps[:1])[0] == s[0]
    # CLIP's projected embeddings: the cosine the model's own logits are built from
    import torch

    t = scorer.tokenizer(caps, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    x = torch.from_numpy(np.stack([scorer._pixels(b) for b in images]))
    with torch.no_grad():
        out = scorer.model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], pixel_values=x)
    expected = (out.logits_per_image.diagonal() / scorer.model.logit_scale.exp()).detach().numpy()
    assert np.allclose(s, expected, atol=1e-5)
    (tmp_path / "notclip").mkdir()
    with pytest.raises(UserError, match="not a Hugging Face model folder"):
        check_hf(str(tmp_path / "notclip"))
    pickled = tmp_path / "pickled"
    import shutil

    shutil.copytree(folder, pickled)
    for f in pickled.glob("*.safetensors"):
        f.rename(f.with_name("pytorch_model.bin"))          # what an older save_pretrained wrote
    with pytest.raises(UserError, match="no model.safetensors .pytorch_model.bin is pickled weights"):
        check_hf(str(pickled))
    with pytest.raises(UserError, match="no such folder .*capline downloads nothing"):
        check_hf(str(tmp_path / "absent"))
    (tmp_path / "oc").mkdir()
    (tmp_path / "oc" / "open_clip_pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="looks like an open_clip checkpoint.*scorer: column"):
        check_hf(str(tmp_path / "oc"))


def test_the_image_normalisation_comes_from_either_processor_file(tmp_path):
    """transformers 5 writes processor_config.json (settings under image_processor), 4 wrote
    preprocessor_config.json: a SigLIP's own mean and std are used from either."""
    import json

    from stages.filters.hf_clip import _image_processor_config

    siglip = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (tmp_path / "v5").mkdir()
    (tmp_path / "v5" / "processor_config.json").write_text(json.dumps({"image_processor": siglip}))
    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "preprocessor_config.json").write_text(json.dumps(siglip))
    (tmp_path / "none").mkdir()
    for folder in ("v5", "v4"):
        got = _image_processor_config(tmp_path / folder)
        assert (got["image_mean"], got["image_std"]) == (siglip["image_mean"], siglip["image_std"]), folder
    assert _image_processor_config(tmp_path / "none") == {}


@pytest.mark.slow
def test_hf_scorer_in_the_pipeline_gives_the_same_shards_twice(tmp_path, ray_local):
    from pipeline.config import load_config
    from pipeline.runner import run_pipeline

    from helpers import free_port

    folder = tiny_clip(tmp_path / "clip")
    port = free_port()     # one port for both runs: the URLs (in each sample's json) are the same
    shards = []
    for name in ("a", "b"):
        cfg = load_config(None, ["source.num_samples=120", "source.eval_size=20", "source.slow_seconds=2",
                                 "stages.ingest.timeout=1", "stages.ingest.samples_per_shard=40",
                                 "stages.dedup.eval_sets=[]", "stages.tokenizer.vocab_size=300",
                                 "stages.clip_score.scorer=hf", f"stages.clip_score.checkpoint={folder}",
                                 "stages.clip_score.keep_fraction=0.5", "track_data=false",
                                 f"source.serve_port={port}"])
        summary = run_pipeline(cfg, tmp_path / name, until="shard", log=lambda m: None)
        assert summary["clip_score"]["scorer"]["kind"] == "hf"
        assert summary["clip_score"]["kept"] == -(-summary["clip_score"]["in"] // 2)
        shards.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in sorted((tmp_path / name / "shard" / "shards").glob("*.tar"))})
    assert shards[0] and shards[0] == shards[1]
