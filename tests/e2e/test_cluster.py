"""A real two-node Ray cluster on loopback whose nodes share no filesystem: `ray start --head`, a
second node started in its own mount namespace with an empty tmpfs over the driver's folder, the run
folder in S3 (moto on loopback), `capline run --address` on it, work seen on both nodes, a driver
killed mid-ingest and resumed from an empty working copy, and every process stopped by pid."""
import json
import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ROOT, CountingProxy, bucket_keys, capline, cluster_tag, free_port, kill_driver, moto_s3, ray_pids, stop_pids

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")
BUCKET = "capline-cluster"


@contextmanager
def two_node_cluster(hidden: Path, node_env: dict):
    """A head node, and a second node in its own mount namespace with an empty tmpfs over `hidden`
    (the folder holding the driver's files): that node's workers see the code and the system, not
    the driver's disk. Yields (address, pid of the second node's raylet); stops both by pid."""
    port, dash = free_port(), free_port()
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--object-store-memory", str(200 * 2**20),
              "--disable-usage-stats"]
    # the nodes get the guard but none of capline's quiet switches, as a user's shell would:
    # capline must pass them to its workers itself
    from infra.offline import QUIET_ENV

    # and the bucket's credentials, as a cluster's nodes have them (an instance role, or the environment)
    env, tag = cluster_tag({**{k: v for k, v in os.environ.items() if k not in QUIET_ENV}, **node_env})
    started = set()
    try:
        head = subprocess.run([RAY, "start", "--head", "--port", str(port), "--dashboard-host", "127.0.0.1",
                               "--dashboard-port", str(dash), *common],
                              capture_output=True, text=True, timeout=120, env=env)
        assert head.returncode == 0, head.stdout + head.stderr
        head_pids = ray_pids(tag)
        join = " ".join(shlex.quote(a) for a in [RAY, "start", "--address", f"127.0.0.1:{port}", *common])
        second = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                 f"mount -t tmpfs none {shlex.quote(str(hidden))} && exec {join}"],
                                capture_output=True, text=True, timeout=120, env=env)
        assert second.returncode == 0, second.stdout + second.stderr
        started = ray_pids(tag)
        raylets = [p for p in started - head_pids if "raylet" in " ".join(psutil.Process(p).cmdline())]
        assert raylets, "the second node's raylet did not start"
        yield f"127.0.0.1:{port}", raylets[0]
    finally:
        stop_pids(started | ray_pids(tag))
        # `ray start --head` records itself for plain ray.init() calls to join; it is gone now
        current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()
        assert not ray_pids(tag), "the cluster's processes outlived the stop"


@contextmanager
def site_server(root: Path, delay: float, log: Path):
    """tests/site_server.py in its own process: the URL list's images, slowly, every request logged."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("site_server.py")), str(root),
                             "--delay", str(delay), "--log", str(log)], stdout=subprocess.PIPE, text=True)
    try:
        yield f"127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_no_shared_filesystem_two_nodes_s3_and_a_kill_mid_ingest(tmp_path):
    """The run folder in S3, the second node blind to the driver's disk, a URL list served by its own
    process. A driver killed mid-ingest is resumed from an empty working copy: only the shards
    not yet in the bucket download again; then the data path and a short training finish on both
    nodes, reading the shards from the bucket. The credentials are written nowhere; status and
    explain on the bucket read summaries and rows, not tars."""
    from infra.mlflow.serve import start, stop
    from stages.source import synthetic
    from stages.source.stage import DefectFractions
    from stages.source.synthetic import SERVER_PLACEHOLDER

    driver = tmp_path / "driver"          # everything of the driver's: working copies, URL list, caches
    (driver / "urls").mkdir(parents=True)
    fr = {k: 0 for k in vars(DefectFractions())}
    synthetic.generate(tmp_path / "site", 240, 10, 48, 11, fr, 100, 100)
    rows = pq.read_table(tmp_path / "site" / "urls.parquet").to_pylist()
    requests = tmp_path / "requests.txt"
    s3_env = moto_s3(BUCKET)
    env, client = next(s3_env)
    mlflow, mlflow_url = start(tmp_path / "mlflow", free_port(), log_file=tmp_path / "mlflow.log")
    try:
        with site_server(tmp_path / "site" / "www", 0.1, requests) as netloc, two_node_cluster(driver, env) as (address, raylet):
            lines = ["url,caption"] + [f"{r['url'].replace(SERVER_PLACEHOLDER, 'http://' + netloc)},\"{r['caption']}\""
                                       for r in rows]
            (driver / "urls" / "list.csv").write_text("\n".join(lines) + "\n")
            # the second node really cannot see it (/proc/PID/root is that process's view of the tree)
            assert not Path(f"/proc/{raylet}/root{driver}/urls/list.csv").exists()
            assert Path(f"/proc/{raylet}/root{ROOT}/pyproject.toml").exists()
            uri = f"s3://{BUCKET}/runs/cluster"
            args = ["run", "--address", address, "--run-dir", uri,
                    "--set", "source.kind=urls", "--set", f"source.path={driver / 'urls' / 'list.csv'}",
                    "--set", f"stages.ingest.allow_hosts=['{netloc}']", "--set", "stages.ingest.samples_per_shard=30",
                    "--set", "stages.ingest.thread_count=4", "--set", "stages.tokenizer.vocab_size=400",
                    "--set", "stages.dedup.eval_sets=[]", "--set", f"stages.dedup.cache_dir={driver / 'eval-index'}",
                    "--set", "stages.basic.min_image_side=16", "--set", "stages.language.min_confidence=0.1",
                    # the bootstrap scorer keeps its default 2 CPUs: on these 1-CPU nodes the executor fits
                    # the request to the largest node (it used to wait forever for a node of 2)
                    "--set", "stages.clip_score.bootstrap.steps=20",
                    "--set", "stages.dedup.cpus_per_worker=0.5", "--set", "stages.clip_score.cpus_per_worker=0.5",
                    "--set", "stages.shard.samples_per_shard=60", "--set", "train.steps=10",
                    "--set", "train.num_workers=2", "--set", "train.checkpoint_every=5", "--set", "train.sample_every=0",
                    "--until", "train"]
            run_env = {**os.environ, **env, "MLFLOW_TRACKING_URI": mlflow_url}

            # machine A: killed once two shards are in the bucket
            log_a = open(tmp_path / "a.log", "w")
            proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, stdout=log_a,
                                    stderr=subprocess.STDOUT, env={**run_env, "CAPLINE_CACHE": str(driver / "wc-a")})
            deadline = time.time() + 600
            while len(_results(client)) < 2:
                assert proc.poll() is None, (tmp_path / "a.log").read_text()[-3000:]
                assert time.time() < deadline, "no shard finished"
                time.sleep(0.3)
            kill_driver(proc)
            done = _results(client)
            assert 2 <= len(done) < 8, done
            finished_urls = set()
            for key in done:   # what those shards fetched: never again
                ledger = key.replace("/results/", "/ledger/").replace(".json", ".parquet")
                body = client.get_object(Bucket=BUCKET, Key=ledger)["Body"].read()
                finished_urls |= {u.split(netloc, 1)[1] for u in pq.read_table(pa.BufferReader(body)).column("url").to_pylist()}
            seen_before = len(requests.read_text().splitlines())

            # machine B: an empty working copy
            out = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=900, env={**run_env, "CAPLINE_CACHE": str(driver / "wc-b")})
            assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
            reused = re.search(r"ingest: (\d+) shards downloaded before, reused; (\d+) to download", out.stdout)
            assert reused and int(reused[1]) >= len(done) and int(reused[1]) + int(reused[2]) == 8, out.stdout[-3000:]
            again = set(requests.read_text().splitlines()[seen_before:])
            assert again and not again & finished_urls, sorted(again & finished_urls)[:5]

            def stats(stage):
                return json.loads(client.get_object(Bucket=BUCKET, Key=f"runs/cluster/{stage}/stats.json")["Body"].read())

            ingest, train = stats("ingest"), stats("train")
            print("ingest nodes", ingest["nodes"], "train nodes", train["nodes"])
            assert len(ingest["nodes"]) == 2, ingest["nodes"]          # download tasks ran on both nodes
            assert len(train["nodes"]) == 2, train["nodes"]            # one training worker on each
            assert train["step"] == 10
            scorer = [t for t in stats("clip_score")["tasks"] if t["what"] == "clip_score bootstrap scorer"]
            assert scorer and scorer[0]["cpus_per_task"] == 1        # 2 asked, the largest node has 1
            keys = set(bucket_keys(client, BUCKET, "runs/cluster/"))
            for stage in ("source", "ingest", "dedup", "basic", "language", "clip_score", "tokenizer", "shard", "train"):
                assert f"runs/cluster/{stage}/_SUCCESS" in keys, stage
            assert any(k.startswith("runs/cluster/shard/shards/") and k.endswith(".tar") for k in keys)
            assert any("/checkpoint_" in k and k.startswith("runs/cluster/train/ray/") for k in keys)
            assert {"runs/cluster/train/model/model.safetensors", "runs/cluster/train/final.json"} <= keys
            # the working copy holds what the driver wrote, not what the workers did
            assert not list((driver / "wc-b").rglob("*.tar")) and not list((driver / "wc-b").rglob("ledger"))
            assert "storage: fetched" in out.stdout                                   # B began from the bucket
            assert f"train: workers read the 4 shards from {uri}/shard/shards" in out.stdout, out.stdout[-2000:]
            assert {"runs/cluster/manifest.json", "runs/cluster/report.html"} <= keys
            manifest = json.loads(client.get_object(Bucket=BUCKET, Key="runs/cluster/manifest.json")["Body"].read())
            assert manifest["stages"]["train"]["output_digest"]
            # the credentials were never written: not in logs, working copies or the bucket
            secret, key_id = env["AWS_SECRET_ACCESS_KEY"].encode(), env["AWS_ACCESS_KEY_ID"].encode()
            texts = [(tmp_path / "a.log").read_bytes(), out.stdout.encode(), out.stderr.encode()]
            texts += [p.read_bytes() for p in driver.rglob("*") if p.is_file()]
            texts += [client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys]
            assert not any(secret in t or key_id in t for t in texts)
        _status_and_explain_read_summaries_in_place(env, client, uri, tmp_path)
    finally:
        stop(mlflow)
        s3_env.close()


def _status_and_explain_read_summaries_in_place(env: dict, client, uri: str, tmp_path: Path) -> None:
    """On the finished run in the bucket, from a third machine: `capline status` reads each stage's
    control files in place, `explain` one sample's rows; neither downloads a tar (status, no ledger)."""
    import io

    proxy = CountingProxy(("127.0.0.1", int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])), 0).start()
    try:
        fresh = {**env, "AWS_ENDPOINT_URL": proxy.endpoint, "CAPLINE_CACHE": str(tmp_path / "machine-c")}
        status = capline("status", uri, "--json", env=fresh)
        assert status.returncode == 0, status.stderr
        rows = {r["stage"]: r for r in json.loads(status.stdout)}
        assert rows["shard"]["state"] == "done" and rows["shard"]["kept"] > 0
        assert not proxy.gets(".tar") and not proxy.gets(".parquet"), proxy.gets()
        assert len(proxy.gets()) <= 4 * len(rows), len(proxy.gets())      # a few small objects per stage
        key = next(k for k in bucket_keys(client, BUCKET, "runs/cluster/shard/index/") if k.endswith(".parquet"))
        sample = pq.read_table(io.BytesIO(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())).column("key")[0].as_py()
        before = len(proxy.gets())
        explain = capline("explain", uri, sample, env=fresh)
        assert explain.returncode == 0 and "shard" in explain.stdout, explain.stderr
        assert not proxy.gets(".tar"), proxy.gets(".tar")
        # through each stage's key index: its one index file, then the one ledger file holding the key
        read = {p.split("?")[0] for p in proxy.gets()[before:] if p.split("?")[0].endswith(".parquet")}
        stages = {p.split("/runs/cluster/")[1].split("/")[0] for p in read}
        assert all(sum(1 for p in read if f"/runs/cluster/{st}/keys/" in p) == 1 for st in stages), sorted(read)
        assert all(sum(1 for p in read if f"/runs/cluster/{st}/" in p and "/keys/" not in p) <= 1 for st in stages), \
            sorted(read)
        assert not (tmp_path / "machine-c").exists() or not list((tmp_path / "machine-c").rglob("*.tar"))
    finally:
        proxy.shutdown()


def _results(client) -> list[str]:
    return [k for k in bucket_keys(client, BUCKET, "runs/cluster/ingest/parts/") if "/results/" in k and k.endswith(".json")]


def test_capline_ray_start_gives_the_node_quiet_switches_and_token_auth(tmp_path):
    """A head started with `capline ray start`, from a shell with none of capline's settings: its
    processes carry the quiet switches, the guard's PYTHONPATH and token auth; stopped by pid."""
    from infra.offline import PROCENV_DIR, QUIET_ENV

    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV and not k.startswith("RAY_AUTH")}
    env["CAPLINE_CACHE"] = str(tmp_path / "cache")
    env["HOME"] = str(tmp_path / "home")      # no ~/.ray/auth_token of the user's to prefer
    env, tag = cluster_tag(env)
    port, dash = free_port(), free_port()
    started = set()
    try:
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "ray", "start", "--head", "--port", str(port),
                              "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--dashboard-host", "127.0.0.1",
                              "--dashboard-port", str(dash), "--object-store-memory", str(100 * 2**20)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        token = tmp_path / "cache" / "ray_auth_token"
        assert f"token auth: token, token {token}" in out.stdout
        started = ray_pids(tag)
        raylet = next(p for p in started if "raylet" in " ".join(psutil.Process(p).cmdline()))
        node_env = psutil.Process(raylet).environ()
        assert {k: node_env.get(k) for k in QUIET_ENV} == QUIET_ENV
        assert node_env["RAY_AUTH_MODE"] == "token" and node_env["RAY_AUTH_TOKEN_PATH"] == str(token)
        assert str(PROCENV_DIR) in node_env["PYTHONPATH"].split(os.pathsep)
        code = f"import ray; ray.init(address='127.0.0.1:{port}'); print('JOINED')"
        joined = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
        assert "JOINED" in joined.stdout, joined.stderr[-1500:]
    finally:
        stop_pids(started | ray_pids(tag))
        current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()
