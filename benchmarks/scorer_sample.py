"""The bootstrap scorer's sample read on its own: `stages.clip_score` trains its scorer on up to
`bootstrap.max_samples` (20,000) pairs drawn in seeded order from the whole run, so at scale they lie
one or two to a tar across ~18,000 ingest tars. The training task reads their images with
`dataplane.read_images` (infra/tars.read_members: each tar once, ranged GETs, 16 tars at once).

    python benchmarks/scorer_sample.py [--tars 18000] [--samples 20000] [--latency-ms 25] [--serial 300]

The tars sit on S3 (moto's real server) behind the loopback proxy that adds `--latency-ms` to every
request. Printed and written to benchmarks/results/scorer_sample.json: the sample's wall seconds,
its requests (GETs per tar: goal 1), images per second; and the same read one tar after another
(as the issue measured it) on `--serial` tars, projected to all of them.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _common import write_results  # noqa: E402

BUCKET = "capline-sample"


def _tars(n_tars: int, image_bytes: int, seed: int = 0):
    """n_tars tars of a few samples each; the sample's rows spread over them like a seeded draw."""
    import numpy as np

    from infra.tars import SampleTarWriter

    rng = np.random.default_rng(seed)
    per_tar = 8
    for t in range(n_tars):
        buf = io.BytesIO()
        with SampleTarWriter(buf) as w:
            for i in range(per_tar):
                w.add(f"{t:06d}{i:02d}", [("jpg", rng.bytes(image_bytes)), ("txt", b"a caption")])
        data = buf.getvalue()
        members = [(m.offset_data, m.size) for m in tarfile.open(fileobj=io.BytesIO(data)) if m.name.endswith(".jpg")]
        yield f"t/{t:06d}.tar", data, members


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tars", type=int, default=18000)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--image-kb", type=int, default=12)
    p.add_argument("--latency-ms", type=float, default=25)
    p.add_argument("--serial", type=int, default=300, help="tars read one after another, for the comparison")
    args = p.parse_args()

    import numpy as np

    from helpers import s3_behind_proxy

    with s3_behind_proxy(BUCKET, args.latency_ms / 1000) as (env, client, proxy):
        t0 = time.time()
        index = []
        for key, data, members in _tars(args.tars, args.image_kb * 1024):
            client.put_object(Bucket=BUCKET, Key=f"run/{key}", Body=data)
            index.append((key, members))
        print(f"wrote {args.tars} tars in {time.time() - t0:.0f} s")
        rng = np.random.default_rng(1)
        # every tar holds at least one sampled image, the rest of the sample falls anywhere
        rows = [(key, *members[rng.integers(len(members))]) for key, members in index]
        while len(rows) < args.samples:
            key, members = index[rng.integers(len(index))]
            rows.append((key, *members[rng.integers(len(members))]))
        rows = rows[: args.samples]
        os.environ.update(env)        # the tars were written to moto directly, the reads go through the proxy
        from infra.storage import Storage
        from infra.tars import read_members

        storage = Storage.from_uri(f"s3://{BUCKET}/run")
        tars, offsets, sizes = (list(c) for c in zip(*rows))
        read_members(storage, tars[-1:], offsets[-1:], sizes[-1:])     # the S3 client set up, not timed
        first = len(proxy.entries)
        t0 = time.time()
        got = read_members(storage, tars, offsets, sizes)
        wall = time.time() - t0
        requests = len(proxy.entries) - first
        assert all(g is not None and len(g) == s for g, s in zip(got, sizes))
        distinct = len(set(tars))
        # one tar after another, as a loop over the rows would read them
        serial_tars = sorted(set(tars))[: args.serial]
        pick = [i for i, t in enumerate(tars) if t in set(serial_tars)]
        t0 = time.time()
        for t in serial_tars:
            rows_t = [i for i in pick if tars[i] == t]
            read_members(storage, [t] * len(rows_t), [offsets[i] for i in rows_t], [sizes[i] for i in rows_t])
        serial = time.time() - t0
        out = {"tars": distinct, "samples": len(rows), "image_bytes": args.image_kb * 1024,
               "latency_ms": args.latency_ms, "wall_seconds": round(wall, 2), "requests": requests,
               "gets_per_tar": round(requests / distinct, 3), "images_per_second": round(len(rows) / wall),
               "serial": {"tars": len(serial_tars), "seconds": round(serial, 2),
                          "projected_seconds_for_all": round(serial / len(serial_tars) * distinct, 1)}}
        print(f"scorer sample: {len(rows)} images from {distinct} tars behind {args.latency_ms:g} ms: "
              f"{wall:.1f} s ({out['images_per_second']} images/s), {requests} requests "
              f"({out['gets_per_tar']} per tar); one tar after another: {serial:.1f} s for {len(serial_tars)} "
              f"tars, {out['serial']['projected_seconds_for_all']:.0f} s projected for all")
        write_results("scorer_sample", out)


if __name__ == "__main__":
    main()
