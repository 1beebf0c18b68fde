"""Downloads as users meet them: capline against img2dataset's own command, same URLs, same machine.

Photos of real sizes and aspect ratios (crops of the scikit-image and scikit-learn sample photos,
longest side 480-1024, aspect 0.56-1.78, JPEG re-encoded to ~36-100 KB) served from memory by a
loopback server process, on one host and on 50 hosts over which the URLs are Zipf-distributed
(the top host holds 10 %, benchmarks/polite.py's shape). Each round, in turn:

- `img2dataset`: its CLI as a user runs it (2 processes, `--thread_count`, 224 px border, 500 per
  shard, sha256), wall time of the whole command;
- `capline`: `capline run --until ingest` from a cold start (Ray started, the source stage, ingest
  on its defaults but for the same threads and shard size): the command's wall time, and the
  ingest stage's own (`ingest/stats.json`);
- the decode + resize + encode limit on 2 processes over the same files: img2dataset's Resizer,
  and capline's one decode (stages/ingest/resize.py), which is what capline's ingest runs.

Every URL is accounted for (kept + recorded failures = URLs) in both. The quality of capline's
reduced decode is measured against a full decode's unencoded resize (PSNR, mean level error), next
to img2dataset's own re-encode's. Goals (issue 63): stage >= 1.2x img2dataset's images/s, command
>= 1.0x, stage >= 75 % of capline's decode limit. Printed and written to results/ingest.json.

    python benchmarks/ingest.py [--urls 8000] [--repeats 2] [--hosts 1,50]
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra import offline  # noqa: E402

offline.apply()

from benchmarks._common import code, write_results  # noqa: E402
from benchmarks.polite import zipf_exponent  # noqa: E402

SIZE, SHARD, THREADS, PROCS, DISTINCT = 224, 500, 16, 2, 240
BIN = Path(sys.executable).parent


def photos(n: int, seed: int = 0) -> list[bytes]:
    """`n` JPEGs cut from the sample photos at real sizes, aspect ratios and file sizes."""
    import numpy as np
    import skimage.data
    from PIL import Image
    from sklearn.datasets import load_sample_images

    bases = [getattr(skimage.data, name)() for name in ("astronaut", "coffee", "chelsea", "rocket", "camera")]
    bases += list(load_sample_images().images)
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        base = Image.fromarray(np.asarray(bases[len(out) % len(bases)])).convert("RGB")
        aspect = rng.uniform(0.56, 1.78)
        w = min(base.width, int(base.height * aspect))
        h = int(w / aspect)
        x, y = rng.randint(0, base.width - w), rng.randint(0, base.height - h)
        longest = rng.randint(480, 1024)
        scale = longest / max(w, h)
        img = base.crop((x, y, x + w, y + h)).resize((max(1, round(w * scale)), max(1, round(h * scale))),
                                                     Image.BICUBIC)
        target = rng.uniform(36_000, 100_000)
        for quality in (95, 90, 85, 80, 75, 70, 60, 50):
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=quality)
            if buf.tell() <= target:
                break
        out.append(buf.getvalue())
    return out


def _serve(hosts: int, images_file: str, ports, ready) -> None:
    """Child process: `hosts` loopback HTTP/1.1 servers; /<i>.jpg is photo i % DISTINCT."""
    import http.server
    import pickle
    import threading

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import reply

    images = pickle.loads(Path(images_file).read_bytes())

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        log_message = lambda self, *a: None  # noqa: E731

        def do_GET(self):
            if self.path == "/robots.txt":
                return reply(self, 404, b"", "text/plain")
            reply(self, 200, images[int(self.path.strip("/").split(".")[0]) % len(images)], "image/jpeg")

    for i in range(hosts):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        srv.daemon_threads = True
        srv.request_queue_size = 256
        ports[i] = srv.server_address[1]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    ready.set()
    threading.Event().wait()


def url_list(path: Path, n: int, ports: list[int]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    s = zipf_exponent(len(ports)) if len(ports) > 1 else 0.0
    weights = [k ** -s for k in range(1, len(ports) + 1)]
    rng = random.Random(1)
    hosts = rng.choices(ports, weights, k=n)
    pq.write_table(pa.table({"url": [f"http://127.0.0.1:{p}/{i}.jpg" for i, p in enumerate(hosts)],
                             "caption": [f"photo number {i}" for i in range(n)]}), path)


def run_img2dataset(urls: Path, out: Path) -> dict:
    import pyarrow.parquet as pq

    t0 = time.time()
    subprocess.run([str(BIN / "img2dataset"), "--url_list", str(urls), "--input_format", "parquet", "--url_col", "url",
                    "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", str(out),
                    "--processes_count", str(PROCS), "--thread_count", str(THREADS), "--image_size", str(SIZE),
                    "--resize_mode", "border", "--number_sample_per_shard", str(SHARD), "--timeout", "10",
                    "--retries", "0", "--extract_exif", "False", "--compute_hash", "sha256",
                    "--distributor", "multiprocessing"], check=True, capture_output=True)
    wall = time.time() - t0
    meta = pq.read_table([str(p) for p in sorted(out.glob("*.parquet"))], columns=["status"]).column("status").to_pylist()
    return {"seconds": round(wall, 2), "urls": len(meta), "kept": meta.count("success")}


def run_capline(urls: Path, run_dir: Path) -> dict:
    from stages.base import read_ledger

    cfg = run_dir.parent / f"{run_dir.name}.yaml"
    cfg.write_text(json.dumps({"name": "bench-ingest", "ray": {"num_cpus": PROCS},
                               "source": {"kind": "urls", "path": str(urls)},
                               "stages": {"ingest": {"allow_hosts": ["127.0.0.1"], "image_size": SIZE,
                                                     "samples_per_shard": SHARD, "thread_count": THREADS,
                                                     "retries": 0, "timeout": 10}}}))
    t0 = time.time()
    subprocess.run([str(BIN / "capline"), "run", str(cfg), "--run-dir", str(run_dir), "--until", "ingest"],
                   check=True, capture_output=True, env={**os.environ, "CAPLINE_NETGUARD": "1"})
    wall = time.time() - t0
    stage = json.loads((run_dir / "ingest" / "stats.json").read_text())["wall_seconds"]
    ledger = read_ledger(run_dir, "ingest", columns=["verdict"]).column("verdict").to_pylist()
    return {"seconds": round(wall, 2), "stage_seconds": round(stage, 2), "urls": len(ledger),
            "kept": sum(v == "kept" for v in ledger)}


def _limit_worker(args) -> int:
    which, images, reps = args
    from stages.ingest.fetch import FetchPolicy, check_image
    from stages.ingest.img2dataset_parts import downloader_classes
    from stages.ingest.resize import resizer_class

    kw = dict(image_size=SIZE, resize_mode="border", resize_only_if_bigger=False, encode_quality=95, encode_format="jpg")
    if which == "img2dataset":
        resize, policy = downloader_classes()[1](**kw), FetchPolicy()
        for _ in range(reps):
            for data in images:
                resize(io.BytesIO(data))
    else:
        resize, policy = resizer_class()(**kw), FetchPolicy(resize=("border", SIZE))
        for _ in range(reps):
            for data in images:
                resize(check_image(data, policy))
    return reps * len(images)


def decode_limit(images: list[bytes], which: str, seconds: float = 8.0) -> float:
    """Images/s decoded, resized and re-encoded on PROCS processes, nothing else done."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(PROCS) as pool:
        pool.map(_limit_worker, [(which, images[:8], 1)] * PROCS)      # imports and warm-up
        reps = max(1, int(seconds * 150 / len(images)))
        t0 = time.time()
        done = sum(pool.map(_limit_worker, [(which, images, reps)] * PROCS))
        return done / (time.time() - t0)


def quality(images: list[bytes]) -> dict:
    """Mean level error and PSNR against a full decode's unencoded resize: capline's output and
    img2dataset's (whose q95 re-encode is the noise floor)."""
    import cv2
    import numpy as np

    from stages.ingest.fetch import FetchPolicy, check_image
    from stages.ingest.img2dataset_parts import downloader_classes
    from stages.ingest.resize import resizer_class

    kw = dict(image_size=SIZE, resize_mode="border", resize_only_if_bigger=False, encode_quality=95, encode_format="jpg")
    Resizer = downloader_classes()[1]
    theirs, ours, ideal_of = Resizer(**kw), resizer_class()(**kw), Resizer(**{**kw, "encode_format": "png",
                                                                                 "encode_quality": 1})
    px = lambda b: cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_UNCHANGED).astype(float)  # noqa: E731
    err = {"img2dataset": [], "capline": []}
    for data in images:
        ideal = px(ideal_of(io.BytesIO(data))[0])
        for name, got in (("img2dataset", theirs(io.BytesIO(data))[0]),
                          ("capline", ours(check_image(data, FetchPolicy(resize=("border", SIZE))))[0])):
            d = px(got) - ideal
            err[name].append((np.abs(d).mean(), 10 * np.log10(255 ** 2 / max((d ** 2).mean(), 1e-9))))
    return {name: {"mean_level_error": round(float(np.mean([e for e, _ in v])), 2),
                   "psnr_db_median": round(float(np.median([p for _, p in v])), 1),
                   "psnr_db_min": round(float(np.min([p for _, p in v])), 1)} for name, v in err.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--urls", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=2, help="rounds; each tool keeps its fastest")
    ap.add_argument("--hosts", default="1,50", help="host counts to run, comma-separated")
    args = ap.parse_args()
    import pickle

    work = Path(tempfile.mkdtemp(prefix="capline-bench-ingest-"))
    images = photos(DISTINCT)
    sizes = sorted(len(b) for b in images)
    (work / "images.pkl").write_bytes(pickle.dumps(images))
    result = {"code": code(), "urls": args.urls, "image_size": SIZE, "shard_size": SHARD, "threads": THREADS,
              "processes": PROCS, "photos": {"distinct": DISTINCT, "kb_median": round(sizes[len(sizes) // 2] / 1000),
                                             "kb_range": [round(sizes[0] / 1000), round(sizes[-1] / 1000)]},
              "goals": {"stage_vs_img2dataset": 1.2, "command_vs_img2dataset": 1.0, "stage_vs_decode_limit": 0.75}}
    limits = {which: round(decode_limit(images, which), 1) for which in ("img2dataset", "capline")}
    result["decode_resize_encode_limit_images_per_s"] = limits
    result["quality_vs_full_decode"] = quality(images[:60])
    print(f"decode+resize+encode limit on {PROCS} processes: img2dataset's {limits['img2dataset']:.0f}/s, "
          f"capline's {limits['capline']:.0f}/s; quality {result['quality_vs_full_decode']}", flush=True)
    ctx = mp.get_context("spawn")
    for hosts in [int(h) for h in args.hosts.split(",")]:
        ports, ready = ctx.Array("i", hosts), ctx.Event()
        server = ctx.Process(target=_serve, args=(hosts, str(work / "images.pkl"), ports, ready), daemon=True)
        server.start()
        try:
            if not ready.wait(60):
                raise SystemExit("the loopback hosts did not start")
            urls = work / f"urls-{hosts}.parquet"
            url_list(urls, args.urls, list(ports))
            rounds = {"img2dataset": [], "capline": []}
            for i in range(args.repeats):
                rounds["img2dataset"].append(run_img2dataset(urls, work / f"i2d-{hosts}-{i}"))
                rounds["capline"].append(run_capline(urls, work / f"cap-{hosts}-{i}"))
                print(f"{hosts} host(s), round {i}: img2dataset {rounds['img2dataset'][-1]}, "
                      f"capline {rounds['capline'][-1]}", flush=True)
                shutil.rmtree(work / f"i2d-{hosts}-{i}", ignore_errors=True)
                shutil.rmtree(work / f"cap-{hosts}-{i}", ignore_errors=True)
        finally:
            server.kill()
        i2d = args.urls / min(r["seconds"] for r in rounds["img2dataset"])
        stage = args.urls / min(r["stage_seconds"] for r in rounds["capline"])
        command = args.urls / min(r["seconds"] for r in rounds["capline"])
        accounted = all(r["urls"] == args.urls for rs in rounds.values() for r in rs)
        entry = {"rounds": rounds, "img2dataset_images_per_s": round(i2d, 1),
                 "capline_stage_images_per_s": round(stage, 1), "capline_command_images_per_s": round(command, 1),
                 "stage_vs_img2dataset": round(stage / i2d, 3), "command_vs_img2dataset": round(command / i2d, 3),
                 "stage_vs_decode_limit": round(stage / limits["capline"], 3), "every_url_accounted_for": accounted}
        result[f"hosts_{hosts}"] = entry
        print(f"{hosts} host(s): img2dataset {i2d:.0f}/s; capline stage {stage:.0f}/s ({stage / i2d:.2f}x, goal 1.2), "
              f"command {command:.0f}/s ({command / i2d:.2f}x, goal 1.0); stage at {stage / limits['capline']:.0%} "
              f"of the decode limit (goal 75 %); every URL accounted for: {accounted}", flush=True)
    write_results("ingest", result)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # spawned processes: the guard is required
    main()
