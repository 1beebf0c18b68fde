"""Training throughput with the real loader (ShardStream + background processes) and model step.

CPU (this machine): examples/s of tiny and S/16 CapPa and CLIP*, and the fraction of step time spent
waiting for data (goal: under 5 %). On a CUDA machine the same script also runs B/16 in bf16 and
reports model FLOPs utilisation (6 x parameters x tokens per example, against the GPU's dense bf16
peak, --peak-tflops, 989 for H100/H200 SXM).

    python benchmarks/train.py [--steps 6] [--loader-workers 1] [--peak-tflops 989]
Results: benchmarks/results/train.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # helpers.write_shard

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from stages.source import synthetic  # noqa: E402
from helpers import write_shard  # noqa: E402
from stages.tokenizer import TokenizerConfig, train_sentencepiece  # noqa: E402
from trainers.data import LoaderState, ShardStream, as_input, list_shards, make_loader  # noqa: E402
from trainers.models import ModelConfig, build_model  # noqa: E402


def make_data(root: Path, size: int, n: int = 512) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    scenes = [synthetic.random_scene(rng) for _ in range(64)]
    caps = [synthetic.caption_en(s) for s in scenes]
    imgs = [synthetic.encode(synthetic.render(s, size)) for s in scenes]
    (root / "shards").mkdir(parents=True)
    for j in range(0, n, 128):
        write_shard(root / "shards" / f"{j // 128:06d}.tar", [
            {"key": f"s{i:05d}", "image": imgs[i % 64], "ext": "jpg", "caption": caps[i % 64], "meta": {}}
            for i in range(j, j + 128)])
    (root / "spm.model").write_bytes(train_sentencepiece(caps * 10, TokenizerConfig(vocab_size=400)))
    return root / "shards", root / "spm.model"


def flops_per_example(model, cfg: ModelConfig) -> float:
    """6 x (encoder params x image tokens + the rest x text tokens): the usual training estimate."""
    enc = sum(p.numel() for p in model.encoder.parameters())
    rest = sum(p.numel() for p in model.parameters()) - enc
    return 6.0 * (enc * (cfg.image_size // cfg.patch_size) ** 2 + rest * cfg.max_len)


def run(family: str, size: str, batch: int, steps: int, loader_workers: int, device: str, data: dict) -> dict:
    image = 64 if size == "tiny" else 224
    shards, spm = data[image]
    cfg = ModelConfig(family=family, size=size, vocab_size=400, max_len=32, image_size=image)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stream = ShardStream(list_shards(shards), str(spm), batch, image, 32, 0, 0, 1, LoaderState())
    it = iter(make_loader(stream, loader_workers))
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    wait = busy = 0.0
    for step in range(steps + 1):
        t0 = time.perf_counter()
        b = next(it)
        t1 = time.perf_counter()
        with amp:
            loss, _ = model.loss(as_input(b["images"].to(device, non_blocking=True)), b["labels"].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step:  # the first step pays for start-up
            wait += t1 - t0
            busy += t2 - t1
    eps = batch * steps / (wait + busy)
    out = {"family": family, "size": size, "batch": batch, "device": device, "examples_per_s": round(eps, 2),
           "data_wait_fraction": round(wait / (wait + busy), 4)}
    if device == "cuda":
        # Two figures: the whole step (what training gets, loader waits included) and the model's
        # own time (what the GPU does once a batch is there): a gap between them is the loader's.
        out["model_tflops"] = round(flops_per_example(model, cfg) * eps / 1e12, 1)
        out["model_tflops_compute_only"] = round(flops_per_example(model, cfg) * batch * steps / busy / 1e12, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--loader-workers", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="capline-bench-train-"))
    data = {64: make_data(tmp / "64", 64), 224: make_data(tmp / "224", 224)}
    plan = [("cappa", "tiny", 32), ("clip", "tiny", 32), ("cappa", "s16", 4), ("clip", "s16", 4)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        plan += [("cappa", "b16", 128), ("clip", "b16", 128)]
    results = []
    for fam, size, batch in plan:
        steps = args.steps if size != "tiny" else 4 * args.steps
        r = run(fam, size, batch, steps, args.loader_workers, device, data)
        if "model_tflops" in r:
            r["mfu"] = round(r["model_tflops"] / args.peak_tflops, 3)
            r["mfu_compute_only"] = round(r["model_tflops_compute_only"] / args.peak_tflops, 3)
        results.append(r)
        print(f"{fam:<6}{size:<5} batch {batch:>4}: {r['examples_per_s']:8.2f} examples/s, data wait "
              f"{100 * r['data_wait_fraction']:.1f}%" + (f", MFU {100 * r['mfu']:.1f}% ({100 * r['mfu_compute_only']:.1f}% of the model's own time)"
                 if "mfu" in r else ""),
              flush=True)
    write_results("train", {"results": results, "goal_data_wait_fraction": 0.05})


if __name__ == "__main__":
    main()
