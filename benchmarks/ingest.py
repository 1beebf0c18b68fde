"""Ingest throughput: capline's ingest stage against img2dataset run alone, same URLs, same machine.

Both download the same clean URL list from one loopback server, resize to the same size and write
WebDataset shards with the same shard size, thread count and process count. capline's figure is
its ingest stage's wall time (Ray already running: a cluster is started once per pipeline run);
img2dataset's is its `download()` call. Goal: ratio (capline / img2dataset images/s) >= 0.9.

    python benchmarks/ingest.py [--samples 4000] [--repeats 2]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra import offline  # noqa: E402

offline.apply()

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks._common import write_results  # noqa: E402

SIZE, SHARD, THREADS, PROCS = 64, 500, 16, 2


def make_site(root: Path, n: int) -> Path:
    from stages.source import synthetic
    from stages.source.stage import DefectFractions

    none = {k: 0 for k in vars(DefectFractions())}
    synthetic.generate(root, n, 5, 96, 0, none, 100, 100)
    return root


def run_img2dataset(url_list: Path, out: Path) -> float:
    from img2dataset import download

    t0 = time.time()
    download(url_list=str(url_list), input_format="parquet", url_col="url", caption_col="caption",
             output_format="webdataset", output_folder=str(out), processes_count=PROCS,
             thread_count=THREADS, image_size=SIZE, resize_mode="border",
             number_sample_per_shard=SHARD, timeout=10, retries=0, extract_exif=False,
             compute_hash="sha256", distributor="multiprocessing")
    return time.time() - t0


def run_capline(url_list: Path, run_dir: Path, netloc: str) -> float:
    import json

    from pipeline.config import load_config
    from pipeline.runner import run_pipeline

    cfg = load_config(None, [
        "source.kind=urls", f"source.path={url_list}", f"stages.ingest.allow_hosts=['{netloc}']",
        f"stages.ingest.image_size={SIZE}", f"stages.ingest.samples_per_shard={SHARD}",
        f"stages.ingest.thread_count={THREADS}", "stages.ingest.retries=0", "stages.ingest.timeout=10"])
    run_pipeline(cfg, run_dir, until="ingest", log=lambda m: None)
    return json.loads((run_dir / "ingest" / "stats.json").read_text())["wall_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from infra.ray_runtime import RayConfig, ray_session
    from stages.source.demo_server import DemoServer
    from stages.source.synthetic import SERVER_PLACEHOLDER

    work = Path(tempfile.mkdtemp(prefix="capline-bench-ingest-"))
    site = make_site(work / "site", args.samples)
    rows = pq.read_table(site / "urls.parquet").to_pylist()
    i2d_times, cap_times = [], []
    with DemoServer(site / "www") as server, ray_session(RayConfig(num_cpus=PROCS, object_store_memory_mb=256),
                                                         log=lambda m: None):
        url_list = work / "urls.parquet"
        pq.write_table(pa.table({"url": [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows],
                                 "caption": [r["caption"] for r in rows]}), url_list)
        for i in range(args.repeats):
            i2d_times.append(run_img2dataset(url_list, work / f"i2d{i}"))
            cap_times.append(run_capline(url_list, work / f"cap{i}", server.netloc))
            print(f"repeat {i}: img2dataset {i2d_times[-1]:.1f}s, capline ingest {cap_times[-1]:.1f}s", flush=True)
    n = args.samples
    i2d, cap = n / min(i2d_times), n / min(cap_times)
    result = {"samples": n, "image_size": SIZE, "shard_size": SHARD, "threads_per_process": THREADS,
              "processes": PROCS, "img2dataset_seconds": i2d_times, "capline_ingest_seconds": cap_times,
              "img2dataset_images_per_s": round(i2d, 1), "capline_images_per_s": round(cap, 1),
              "ratio": round(cap / i2d, 3), "goal_ratio": 0.9}
    print(f"img2dataset alone: {i2d:.0f} images/s; capline ingest: {cap:.0f} images/s; "
          f"ratio {cap / i2d:.2f} (goal >= 0.9)")
    write_results("ingest", result)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # img2dataset spawns processes: the guard is required
    main()
