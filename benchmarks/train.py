"""Training: capline's Ray Train path beside a plain-PyTorch DDP loop, and the loader's speed and memory.

    python benchmarks/train.py [--steps 60] [--workers 2] [--skip-side-by-side]
Results: benchmarks/results/train.json (the issue's goals beside each figure)

1. Loader decode: 256 px JPEG photos (scikit-learn's, cut and re-encoded at quality 90) into 224 px
   batches, the loader in this process: images per CPU-second. Beside it PIL's bicubic resize, which
   the loader ran before (the issue measured 338 on its machine). Goal >= 2x 338.
2. Loader memory at 10^8 samples: a shard list of 10^4 shards x 10^4 samples (their sizes.json), the
   shards a process's first batches read written for real: tracemalloc's peak while it reads them.
   Goal: O(the shards it reads), not O(dataset).
3. Side by side on the same run folder's shards (a tiny CapPa, 2 workers, one loader process each):
   `capline train` (Ray Train, MLflow, checkpoints) and a plain DDP loop (torch.multiprocessing,
   gloo, the same loader, model and AdamW). Steady samples/s (median over the steps after the 5th),
   seconds from the command's start to step 1 (and a bare `ray.init()`'s), peak PSS of each process
   tree. Goals: ratio >= 0.98, step 1 <= 5 s beyond Ray's start, memory <= 1.5x the plain loop's.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # helpers.write_shard

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from helpers import write_shard  # noqa: E402
from stages.source import synthetic  # noqa: E402
from stages.tokenizer import TokenizerConfig, train_sentencepiece  # noqa: E402
from trainers.data import LoaderState, ShardStream, as_input, list_shards, make_loader  # noqa: E402
from trainers.models import ModelConfig, build_model  # noqa: E402

ISSUE_DECODE = 338      # images per CPU-second at 224 from 256 px, measured by the issue


def photos(n: int = 64, side: int = 256) -> list[bytes]:
    from PIL import Image
    from sklearn.datasets import load_sample_images

    out = []
    for a in load_sample_images().images:           # two 427 x 640 photos
        for y in range(0, a.shape[0] - side, 20):
            for x in range(0, a.shape[1] - side, 48):
                b = io.BytesIO()
                Image.fromarray(a[y:y + side, x:x + side]).save(b, "JPEG", quality=90)
                out.append(b.getvalue())
    return out[:n]


def decode_speed() -> dict:
    from PIL import Image

    from infra.media import to_pixels

    imgs = photos()

    def rate(f, rounds=8):
        for d in imgs:          # warm: the first pass pays for lazy set-up (OpenCV's, PIL's plugins)
            f(d)
        t0 = time.process_time()
        for _ in range(rounds):
            for d in imgs:
                f(d)
        return round(rounds * len(imgs) / (time.process_time() - t0))

    capline = rate(lambda d: to_pixels(d, 224))
    pil = rate(lambda d: np.asarray(Image.open(io.BytesIO(d)).convert("RGB").resize((224, 224), Image.BICUBIC)))
    return {"images_per_cpu_s": capline, "pil_bicubic_images_per_cpu_s": pil, "issue_before": ISSUE_DECODE,
            "goal": 2 * ISSUE_DECODE, "met": capline >= 2 * ISSUE_DECODE}


def loader_memory(tmp: Path, shards: int = 10_000, per_shard: int = 10_000, batches: int = 8) -> dict:
    """tracemalloc's peak of a process reading its first batches of a 10^8-sample shard list."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainers.data import epoch_shards, shard_offsets

    root = tmp / "memory"
    (root / "shards").mkdir(parents=True)
    (root / "index").mkdir()
    names = [f"{i:06d}.tar" for i in range(shards)]
    (root / "shards" / "sizes.json").write_text(json.dumps({n: per_shard for n in names}))
    paths = [root / "shards" / n for n in names]
    for p in paths:
        p.touch()                       # listed; only the read ones need content
    img = photos(1, 64)[0]
    # rank 0 of 2 starts at the head of the epoch's order: its first batches lie in the first shards
    for i in epoch_shards(shards, 0, 0)[:2]:
        samples = [{"key": f"{i:06d}{j:05d}", "image": img, "ext": "jpg", "caption": "a photo", "meta": {}}
                   for j in range(per_shard)]
        write_shard(paths[i], samples)
        import tarfile

        with tarfile.open(paths[i]) as tar:
            firsts: dict = {}
            for m in tar:
                firsts.setdefault(m.name.split(".")[0], m.offset)
        pq.write_table(pa.table({"offset": pa.array(list(firsts.values()), pa.int64())}),
                       root / "index" / f"{i:06d}.parquet")
    rng = np.random.default_rng(0)
    caps = [synthetic.caption_en(synthetic.random_scene(rng)) for _ in range(64)]
    (root / "spm.model").write_bytes(train_sentencepiece(caps * 5, TokenizerConfig(vocab_size=320)))
    shard_offsets.cache_clear()
    stream = ShardStream(paths, str(root / "spm.model"), 256, 64, 16, 0, 0, 2, LoaderState(), shuffle=10_000)
    tracemalloc.start()
    it = iter(stream)
    for _ in range(batches):
        next(it)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"shards": shards, "samples": shards * per_shard, "batches_read": batches, "batch": 256,
            "shards_whose_offsets_are_held": shard_offsets.cache_info().currsize,
            "peak_mib": round(peak / 2**20, 1), "before_projected_gib_at_1e8": 3.8}


# ---- side by side ------------------------------------------------------------------------------

DATA = ["source.num_samples=600", "source.eval_size=20", "source.slow_seconds=3", "stages.ingest.timeout=2",
        "stages.shard.samples_per_shard=100", "train.model_args={width: 64, depth: 2, heads: 2, mlp: 128, patch: 8}",
        "train.image_size=64", "train.max_len=24", "train.global_batch=32", "train.num_workers=2",
        "train.loader_workers=1", "train.optim.warmup_steps=5", "stages.clip_score.bootstrap.steps=30",
        "train.checkpoint_every=1000", "train.model=cappa"]


def _tree_pss(pid: int, stop: threading.Event, out: list) -> None:
    import psutil

    peak = 0
    while not stop.wait(0.3):
        try:
            procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            break
        total = 0
        for p in procs:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        peak = max(peak, total)
    out.append(peak)


def _timed(cmd: list[str], env=None) -> tuple[float, int, float, list]:
    """(start time, peak PSS of the process tree, seconds, [(arrival time, output line)]) of a command."""
    stop, peak = threading.Event(), []
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = threading.Thread(target=_tree_pss, args=(proc.pid, stop, peak))
    watch.start()
    lines = [(time.time(), line.rstrip()) for line in proc.stdout]
    proc.wait()
    stop.set()
    watch.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])}... failed ({proc.returncode}):\n" + "\n".join(l for _, l in lines[-40:]))
    return t0, (peak or [0])[0], time.time() - t0, lines


def _steady(stamps: list[float], batch: int) -> float:
    """Samples per second over the steps after the 5th, from each step's end time."""
    dts = np.diff(np.array(stamps[5:]))
    return float(batch / np.median(dts))


def plain_rank(rank: int, world: int, port: int, run: str, steps: int, out: str) -> None:
    """One rank of the plain loop: the same loader, model and optimiser as capline's workers."""
    import torch.distributed as dist

    from pipeline.config import load_config
    from trainers.data import LoaderState, ShardStream, as_input, list_shards, make_loader
    from trainers.optim import build_optimizer
    from trainers.run import model_config
    from trainers.tasks import LossModule, make_task
    from trainers.tokenizer import open_tokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    tc = load_config(None, DATA).train
    spm = Path(run) / "tokenizer" / "spm.model"
    mc = model_config(tc, open_tokenizer(spm).get_piece_size())
    torch.manual_seed(rank)
    model = make_task(mc).build().train()
    ddp = torch.nn.parallel.DistributedDataParallel(LossModule(model))
    opt = build_optimizer(model, tc.optim)
    stream = ShardStream(list_shards(Path(run) / "shard" / "shards"), str(spm), tc.per_worker_batch(tc.num_workers), mc.image_size,
                         mc.max_len, 0, rank, world, LoaderState(), shuffle=tc.shuffle_buffer)
    batches = iter(make_loader(stream, tc.loader_workers))
    gen = torch.Generator().manual_seed(rank)
    stamps = []
    for _ in range(steps):
        b = next(batches)
        loss, _ = ddp(as_input(b["images"]), b["labels"], generator=gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.optim.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.time())
    if rank == 0:
        Path(out).write_text(json.dumps(stamps))
    dist.barrier()
    dist.destroy_process_group()


def side_by_side(tmp: Path, steps: int) -> dict:
    import socket

    from mlflow.tracking import MlflowClient

    run = tmp / "run"
    print("side by side: building a run folder's shards ...", flush=True)
    capline = str(Path(sys.executable).with_name("capline"))
    sets = [a for d in DATA for a in ("--set", d)]
    subprocess.run([capline, "run", "--run-dir", str(run), *sets, "--set", "train.steps=0"], check=True,
                   capture_output=True)
    sets += ["--set", f"train.steps={steps}"]
    t0, peak_capline, wall_capline, lines = _timed([capline, "train", "--run-dir", str(run), *sets])
    # Ray's start as capline does it: from its "ray: starting" line to the next one
    at = next(i for i, (_, line) in enumerate(lines) if line.startswith("ray: starting"))
    ray_start = lines[at + 1][0] - lines[at][0]
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    runs = client.search_runs(client.get_experiment_by_name("capline").experiment_id,
                              filter_string="attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
    hist = sorted((m.step, m.timestamp / 1000) for m in client.get_metric_history(runs[0].info.run_id, "loss"))
    stamps_capline = [t for _, t in hist]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / "plain.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            "import torch.multiprocessing as mp; from train import plain_rank; "
            f"mp.spawn(plain_rank, args=(2, {port}, {str(run)!r}, {steps}, {str(out)!r}), nprocs=2, join=True)")
    p0, peak_plain, wall_plain, _ = _timed([sys.executable, "-c", code])
    stamps_plain = json.loads(out.read_text())
    batch = 32
    ratio = _steady(stamps_capline, batch) / _steady(stamps_plain, batch)
    return {
        "steps": steps, "global_batch": batch, "workers": 2,
        "capline": {"steady_samples_per_s": round(_steady(stamps_capline, batch), 1),
                    "seconds_to_step_1": round(stamps_capline[0] - t0, 1), "peak_pss_gib": round(peak_capline / 2**30, 2),
                    "wall_s": round(wall_capline, 1)},
        "plain_pytorch": {"steady_samples_per_s": round(_steady(stamps_plain, batch), 1),
                          "seconds_to_step_1": round(stamps_plain[0] - p0, 1), "peak_pss_gib": round(peak_plain / 2**30, 2),
                          "wall_s": round(wall_plain, 1)},
        "ray_init_s": round(ray_start, 1),
        "throughput_ratio": round(ratio, 3), "goal_throughput_ratio": 0.98,
        "step_1_beyond_ray_s": round(stamps_capline[0] - t0 - ray_start, 1), "goal_step_1_beyond_ray_s": 5,
        "memory_ratio": round(peak_capline / max(peak_plain, 1), 2), "goal_memory_ratio": 1.5,
    }


# ---- model step throughput (on CUDA: B/16 in bf16 and its MFU) ---------------------------------

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




def throughput(loader_workers: int, steps: int, peak_tflops: float) -> list:
    from trainers.models import ModelConfig  # noqa: F401

    tmp = Path(tempfile.mkdtemp(prefix="capline-bench-step-"))
    data = {64: make_data(tmp / "64", 64), 224: make_data(tmp / "224", 224)}
    plan = [("cappa", "tiny", 32), ("clip", "tiny", 32)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        plan += [("cappa", "b16", 128), ("clip", "b16", 128)]
    results = []
    for fam, size, batch in plan:
        r = run(fam, size, batch, steps if size != "tiny" else 4 * steps, loader_workers, device, data)
        if "model_tflops" in r:
            r["mfu"] = round(r["model_tflops"] / peak_tflops, 3)
            r["mfu_compute_only"] = round(r["model_tflops_compute_only"] / peak_tflops, 3)
        results.append(r)
        print(f"{fam:<6}{size:<5} batch {batch:>4}: {r['examples_per_s']:8.2f} examples/s, data wait "
              f"{100 * r['data_wait_fraction']:.1f}%" + (f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip-side-by-side", action="store_true")
    ap.add_argument("--throughput", action="store_true", help="also the model step's examples/s (MFU on CUDA)")
    ap.add_argument("--loader-workers", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200 SXM: 989)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="capline-bench-train-"))
    results = {"decode": decode_speed()}
    print("decode:", results["decode"], flush=True)
    results["loader_memory"] = loader_memory(tmp)
    print("loader memory:", results["loader_memory"], flush=True)
    if not args.skip_side_by_side:
        results["side_by_side"] = side_by_side(tmp, args.steps)
        print("side by side:", json.dumps(results["side_by_side"], indent=1), flush=True)
    if args.throughput:
        results["throughput"] = throughput(args.loader_workers, min(args.steps, 10), args.peak_tflops)
    write_results("train", results)


if __name__ == "__main__":
    main()
