"""Run the registered stages in order, each at most once per input; the driver plans and counts.

For each stage: its input digest is the hash of its fingerprint (config section, seed, inputs) and
the previous stage's output digest. If `_SUCCESS` holds that digest, the stage is skipped. Otherwise
it runs: `_STARTED` records the digest first (a folder started under another digest is wiped; under
the same one its partial work is resumed), then the stage's workers write their partitions and
return counts and key-set checksums, which the runner checks (stages/dataplane.py: check_parts)
before it writes `parts.json`, `stats.json` and, last, `_SUCCESS` with the output digest: a hash of
the checksums the writers recorded, so nothing is read back to hash it.

The runner treats every stage alike: the stages are `stages.registry.STAGES`, and what happens
beside them (the demo audit, the MLflow data-build run) are observers called after each stage.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import shutil
import time
from pathlib import Path

from stages.base import Stage, StageContext
from stages.dataplane import PartResult, Storage, check_parts, parts_from_json
from stages.registry import STAGES
from stages.shard.removals import half_done
from infra.errors import UserError

from .config import RunConfig, save_config
from .executor import Executor
from .manifest import Manifest, write_json_atomic
from .observers import OBSERVERS

CONTROL_FILES = {"_SUCCESS", "_STARTED", "stats.json", "parts.json"}


def stage_names(stages: list[Stage] | None = None) -> list[str]:
    return [s.name for s in (stages or STAGES)]


def output_digest(parts: list[PartResult], files: dict[str, str], chain: str | None = None) -> str:
    """From what the writers recorded: each partition's file and sha256, and the stage's other files.
    `chain` (a sink's input digest): a sink writes few files or none, so what it was made from is part
    of what it made (a model trained on other shards is another output even if no file says so)."""
    h = hashlib.sha256()
    if chain:
        h.update(f"chain\0{chain}\n".encode())
    entries = sorted([(p.file, p.sha256) for p in parts] + list(files.items()))
    for rel, sha in entries:
        h.update(f"{rel}\0{sha}\n".encode())
    return h.hexdigest()


def read_marker(stage_dir: Path, name: str = "_SUCCESS") -> dict | None:
    path = stage_dir / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


class Controls:
    """A stage's control files (`_STARTED`, `parts.json`, `stats.json`, `_SUCCESS`) in the run
    folder's storage, where every machine reads them, mirrored into the driver's working copy for
    the tools that read a run locally (status, report). For a local run folder both are one file."""

    def __init__(self, storage: Storage, run_dir: Path):
        self.storage, self.run_dir = storage, run_dir
        self.mirror = not storage.is_folder(run_dir)

    def read(self, stage: str, name: str):
        return self.storage.read_json(f"{stage}/{name}")

    def read_all(self, stage: str, names: tuple[str, ...], listing: bool = False) -> list:
        """`read` of each, side by side (each read waits on an object store's latency); `listing`: and
        the stage folder's entries (`Storage.entries`), last, for a wipe that is likely to follow."""
        from infra.storage import in_parallel

        reads = [functools.partial(self.read, stage, n) for n in names]
        return in_parallel(lambda f: f(), reads + ([functools.partial(self.storage.entries, stage)] if listing else []))

    def write_all(self, stage: str, objs: dict[str, object]) -> None:
        """`write` of each, side by side."""
        from infra.storage import in_parallel

        in_parallel(lambda item: self.write(stage, *item), list(objs.items()))

    def write(self, stage: str, name: str, obj) -> None:
        self.storage.write_json(f"{stage}/{name}", obj)
        self.write_local(stage, name, obj)

    def write_local(self, stage: str, name: str, obj) -> None:
        if self.mirror:
            (self.run_dir / stage).mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.run_dir / stage / name, obj)

    def remove(self, stage: str, name: str, stored: bool = True) -> None:
        """A control file gone (`stored`: from the storage too, one request; else the local copy only)."""
        if stored:
            self.storage.delete_files([f"{stage}/{name}"])
        (self.run_dir / stage / name).unlink(missing_ok=True)

    def wipe(self, stage: str, keep: tuple[str, ...], entries: tuple | None = None) -> None:
        """Remove a stage's files made from other inputs (its control files too), except its
        content-addressed caches. `entries`: its folder's listing, if read already."""
        if self.mirror:   # the storage's copy; for a local run folder it is the folder below
            files, dirs = entries if entries is not None else self.storage.entries(stage)
            self.storage.delete_files(files)
            self.storage.delete_all([f"{stage}/{d}" for d in dirs if d not in keep])
        local = self.run_dir / stage
        for child in local.iterdir() if local.exists() else ():
            if child.name not in keep:
                shutil.rmtree(child) if child.is_dir() else child.unlink()


def input_fingerprints(cfg: RunConfig, stages: list[Stage] | None = None) -> dict:
    """Each stage's fingerprint of the inputs it reads from outside the run (the source's files)."""
    out = {}
    for stage in stages or STAGES:
        fp = getattr(stage, "input_fingerprint", None)
        if fp is not None:
            out[stage.name] = fp(cfg)
    return out


def preflight(cfg: RunConfig, stages: list[Stage] | None = None) -> None:
    """Every stage's checks that need no cluster, before one starts: bad inputs fail in a second."""
    for stage in stages or STAGES:
        stage.preflight(cfg)


# what capline itself puts at the top of a run folder, besides its stages' folders
RUN_FOLDER_NAMES = {"manifest.json", "config.yaml", "report.html", "mlflow.db", "mlartifacts", "mlruns",
                    ".capline.lock", "drift", "eval", "train"}


def check_run_folder(run_dir: Path, stages: list[Stage] | None = None) -> None:
    """A run folder is new, empty, or capline's (a manifest, or only names capline writes): a stage
    clears its own folder before it runs, so a folder of the user's given as --run-dir would lose
    whatever sits in subfolders named like stages."""
    if not run_dir.is_dir():
        return
    if (run_dir / "manifest.json").is_file():
        if _capline_manifest(run_dir / "manifest.json"):
            return
        # any folder with a manifest.json counted, and a user's source/ went with the run's
        raise UserError(f"run folder {run_dir} holds a manifest.json that is not a capline run's (no config, stages "
                        "and packages in it): give a new or empty --run-dir (a run clears the folders of its stages)")
    ours = RUN_FOLDER_NAMES | {s.name for s in (stages or STAGES)}
    foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in ours)
    if foreign:
        raise UserError(f"run folder {run_dir} holds files that are not a capline run's ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}) and no manifest.json: give a new or empty --run-dir "
                        "(a run clears the folders of its stages)")


def _capline_manifest(path: Path) -> bool:
    """Whether a manifest.json is one capline wrote (what Manifest.open always puts in it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(isinstance(data.get(k), dict) for k in ("config", "stages", "packages"))


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / cfg.name


def select(until: str | None, only: str | None, stages: list[Stage] | None = None) -> set[str]:
    names = stage_names(stages)
    for flag, value in (("--until", until), ("--only", only)):
        if value is not None and value not in names:
            raise UserError(f"{flag} {value}: no such stage; stages are {', '.join(names)}")
    if only:
        return {only}
    if until:
        return set(names[: names.index(until) + 1])
    return set(names)


def trains(until: str | None, only: str | None, stages: list[Stage] | None = None) -> bool:
    """Whether the selected stages run Ray Train."""
    wanted = select(until, only, stages)
    return any(s.trains for s in stages or STAGES if s.name in wanted)


def check_before(cfg: RunConfig, storage: Storage, only: str, stages: list[Stage] | None = None) -> None:
    """For `--only STAGE` (and `capline train`): every stage before it finished with this config, read
    from the markers alone, so a wrong config or an unfinished run is said before a lock or a cluster."""
    prev = judged = ""
    sinks: list[str] = []
    for stage in stages or STAGES:
        if stage.name == only:
            return
        read, also = stage_inputs(stage, prev, judged, sinks)
        in_digest = input_digest(stage.fingerprint(cfg), read, judged, also)
        marker = storage.read_json(f"{stage.name}/_SUCCESS")
        if marker is None:
            raise UserError(f"--only {only}: stage {stage.name} before it has not finished; "
                            f"run `capline run --until {stage.name}` first")
        if marker.get("input_digest") != in_digest:
            raise UserError(f"--only {only}: stage {stage.name} finished with another config or input than this "
                            f"one; rerun the earlier stages (`capline run --until {stage.name}`), or use the run's "
                            "own config (leave out CONFIG and give --run-dir)")
        prev = marker["output_digest"]
        if stage.kind != "sink":
            judged, sinks = prev, []
        else:
            sinks.append(prev)


def input_digest(fingerprint: str, prev_digest: str, judged_digest: str, sinks: tuple = ()) -> str:
    """A stage's input: its fingerprint, the output it reads (`stage_inputs`) and, for a stage after
    a sink (training after the shard stage), the last judge's output it reads too, or a sink that
    wrote the same bytes would hide new samples from it. `sinks`: the outputs of the other sinks
    since that judge (the tokenizer's, for training): a new tokenizer that leaves the shards
    byte-identical still retrains the model."""
    judged = "" if judged_digest == prev_digest else f"\0{judged_digest}"
    also = "".join(f"\1{d}" for d in sinks)
    return hashlib.sha256((fingerprint + prev_digest + judged + also).encode()).hexdigest()


def _other_sinks(sinks: list[str], prev_digest: str) -> tuple:
    return tuple(d for d in sinks if d != prev_digest)


def stage_inputs(stage: Stage, prev_digest: str, judged_digest: str, sinks: list[str]) -> tuple[str, tuple]:
    """(the output a stage reads, the other sinks' outputs it reads too). A sink that reads no sink
    before it (Stage.reads_sinks_before false: the shard stage) reads the last judge's alone."""
    if stage.kind == "sink" and not stage.reads_sinks_before:
        return judged_digest, ()
    return prev_digest, _other_sinks(sinks, prev_digest)


def _beside(stage: Stage | None, wanted: set[str]) -> bool:
    """`stage` may run while the sink before it still runs: it reads nothing that sink writes."""
    return stage is not None and stage.kind == "sink" and not stage.reads_sinks_before and stage.name in wanted


def run_pipeline(cfg: RunConfig, run_dir: Path, until: str | None = None, only: str | None = None,
                 log=print, stages: list[Stage] | None = None, store=None, observers=None) -> dict:
    """Run (or resume) the selected stages. Returns {stage: stats}."""
    stages = stages or STAGES
    observers = OBSERVERS if observers is None else observers
    wanted = select(until, only, stages)
    check_run_folder(run_dir, stages)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    manifest = Manifest.open(run_dir, cfg.to_dict(), cfg.digest(), cfg.seed, input_fingerprints(cfg, stages))
    # what this command asked for (a rebuild runs what the original ran, no more)
    manifest.data["selected"] = {"until": until, "only": only, "stages": [s.name for s in stages if s.name in wanted]}
    # workers read and write the run folder's storage itself: a bucket for an s3:// run folder
    storage = Storage.from_uri(store.uri) if store is not None and store.uri else Storage.local(run_dir)
    if (stop := half_done(storage, storage.uri())) is not None:
        raise UserError(f"{stop}, then run again")   # what it took out would be placed again as new
    controls = Controls(storage, run_dir)
    executor = Executor(log=log)
    warming = None     # the shuffles' warm-up thread, once a data stage runs
    state = {"prev": "", "judged": "", "upstream": None}
    sinks: list[str] = []          # the outputs of the sinks since the last judge
    summary = {}

    def settle(stage: Stage, marker: dict, parts, ran: bool, artifacts) -> bool:
        """What follows a stage, run or skipped, in stage order: the manifest, what the next stage
        reads, observers. -> whether the command stops here."""
        if ran:
            manifest.record_stage(stage.name, marker, artifacts)
            if artifacts.get("mlflow_run_id"):
                manifest.data["mlflow_runs"][stage.name] = artifacts["mlflow_run_id"]
                manifest.save()
            if store is not None:
                store.push_top()    # the manifest, so another machine sees what finished
        declared = stage.declares(stage.section(cfg))
        if declared:   # what a later stage needs of this one's config, run or skipped (the demo's site)
            manifest.data["artifacts"].setdefault(stage.name, {}).update(declared)
        if stage.kind != "sink":   # a sink judges nothing: the next stage reads what the last judge kept
            state["upstream"] = parts
            state["judged"] = marker["output_digest"]
            sinks.clear()
        else:
            sinks.append(marker["output_digest"])
        state["prev"] = marker["output_digest"]
        if stage.name not in summary:   # skipped: its stats from the earlier run
            summary[stage.name] = controls.read(stage.name, "stats.json")
        if stage.kind != "sink" and (why := stage.dead_end(summary[stage.name] or {})):
            raise UserError(why)   # after its _SUCCESS: fixing the setting reruns just what it changes
        for obs in observers:   # run or skipped: they skip what they did before
            obs.after_stage(stage.name, run_dir=run_dir, cfg=cfg, manifest=manifest, summary=summary,
                            log=log, storage=storage, ran=ran)
        return until == stage.name or only == stage.name

    # a sink whose next stage reads none of it (the tokenizer, then the shard stage) runs in a
    # thread beside that stage; it is settled, in stage order, before anything after it
    beside = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="capline-stage")
    pending = None       # (stage, future of _run_stage's result)

    def settle_pending() -> bool:
        nonlocal pending
        if pending is None:
            return False
        stage, future = pending
        pending = None
        marker, artifacts, parts, summary[stage.name] = future.result()
        return settle(stage, marker, parts, True, artifacts)

    stopped = False
    try:
        for i, stage in enumerate(stages):
            if pending is not None and not _beside(stage, wanted):
                settle_pending()
            sdir = run_dir / stage.name
            fingerprint = stage.fingerprint(cfg)   # once: it may hash files (the source, evaluation sets)
            read, also = stage_inputs(stage, state["prev"], state["judged"], sinks)
            in_digest = input_digest(fingerprint, read, state["judged"], also)
            # its control files side by side: one wait on the storage's latency, not three; with them the
            # listing its wipe reads, where the manifest says it finished from another input (every
            # stage of an append: one wait less each)
            rerun = (controls.mirror and stage.name in wanted
                     and manifest.data["stages"].get(stage.name, {}).get("input_digest") != in_digest)
            marker, listed, started, *entries = controls.read_all(
                stage.name, ("_SUCCESS", "parts.json", "_STARTED"), listing=rerun)
            parts = parts_from_json(listed) if marker else None
            ran, artifacts = False, None
            if marker and marker.get("input_digest") == in_digest and parts is not None and _complete(stage, cfg, controls):
                log(f"{stage.name}: done before with the same input, skipped")
                if stage.name not in manifest.data["stages"]:
                    # a run folder made from another's stage folders (a rebuild copies the source): what
                    # the stage registered travels in its own _SUCCESS
                    manifest.record_stage(stage.name, marker, marker.get("artifacts"))
                if controls.mirror and not (sdir / "_SUCCESS").is_file():   # the working copy's view of it
                    for name, obj in (("parts.json", [p.to_json() for p in parts]),
                                      ("stats.json", controls.read(stage.name, "stats.json")),
                                      ("_SUCCESS", marker)):
                        controls.write_local(stage.name, name, obj)
            elif stage.name not in wanted:
                if only:
                    raise UserError(f"--only {only}: stage {stage.name} before it has not finished; "
                                    f"run `capline run --until {stage.name}` first")
                stopped = True
                break
            else:
                if warming is None and not stage.trains:
                    # a data stage shuffles (the source's checks, dedup, the key index, shards): the
                    # first shuffle's workers start while the first stage that runs plans (none when
                    # every stage is skipped as done); joined before Ray can stop (a thread that
                    # reached Ray after its shutdown would start a new one)
                    warming = executor.warm_shuffles()
                nxt = stages[i + 1] if i + 1 < len(stages) else None
                apart = stage.kind == "sink" and _beside(nxt, wanted) and until != stage.name and only != stage.name
                ctx = StageContext(name=stage.name, run_dir=run_dir, stage_dir=sdir, cfg=stage.section(cfg),
                                   seed=cfg.seed, run_name=cfg.name, storage=storage, upstream=state["upstream"],
                                   artifacts=dict(manifest.data.get("artifacts", {})), log=log,
                                   fingerprint=fingerprint, executor=Executor(log=log) if apart else executor,
                                   notes=stage.note_names())
                run = functools.partial(_run_stage, stage, ctx, in_digest, controls, store, upstream_digest=read,
                                        judged_digest=state["judged"], sinks=also, last=marker, started=started,
                                        entries=entries[0] if entries else None)
                if apart:
                    log(f"{stage.name}: runs beside {nxt.name}, which reads none of it")
                    pending = (stage, beside.submit(run))
                    continue
                marker, artifacts, parts, summary[stage.name] = run()
                ran = True
            if settle_pending() or settle(stage, marker, parts, ran, artifacts):
                stopped = True
                break
        if pending is not None:
            stopped = settle_pending() or stopped
    finally:
        beside.shutdown(wait=True)     # a stage that failed beside another: that one finishes first
        if warming is not None:
            warming.join()
    if not stopped:
        # every stage finished: what a later `--incremental` run compares its source with
        manifest.data["completed"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                      "inputs": input_fingerprints(cfg, stages)}
        manifest.save()
    return summary


def _complete(stage: Stage, cfg: RunConfig, controls) -> bool:
    """A finish with the same input that is all the config asks (the stats read only for a stage
    that can ask for more: one read, where a skip otherwise reads none)."""
    if type(stage).complete is Stage.complete:
        return True
    return stage.complete(cfg, controls.read(stage.name, "stats.json") or {})


def _run_stage(stage: Stage, ctx: StageContext, in_digest: str, controls: Controls,
               store, upstream_digest: str = "", judged_digest: str = "",
               sinks: tuple = (), last: dict | None = None,
               started: dict | None = None, entries: tuple | None = None) -> tuple[dict, dict, list[dict], dict]:
    """upstream_digest: the previous stage's output digest, kept in `_SUCCESS` so `capline status`
    can tell a stage made from an earlier stage's older output (stale) without the config. `last`,
    `started`: the stage's `_SUCCESS` and `_STARTED` as the caller just read them (None: none);
    `entries`: its folder's listing read with them, if it was."""
    sdir = ctx.stage_dir
    wiped = started is None or started.get("input_digest") != in_digest
    if wiped:
        # made from other inputs: nothing in it can be trusted, except the stage's own
        # content-addressed caches (ingest's per-partition downloads) and the key index, which
        # records the sha256 of each ledger it indexed: the ledgers rewritten are indexed anew, the
        # old segments that held only them deleted unread
        from .key_index import KEYS

        controls.wipe(stage.name, stage.preserve + (KEYS,), entries)
        last = None     # its _SUCCESS went with the rest
    sdir.mkdir(parents=True, exist_ok=True)
    before = (last or {}).get("files", {})   # what the last finish produced
    controls.remove(stage.name, "_SUCCESS", stored=not wiped)
    controls.write(stage.name, "_STARTED", {"input_digest": in_digest})
    # resuming only what the same input began: after a config or input change the stage starts over
    resuming = started is not None and started.get("input_digest") == in_digest
    ctx.log(f"{stage.name}: running" + (" (resuming partial work)" if resuming else ""))
    t0 = time.time()
    first_record = len(ctx.executor.records)
    result = stage.run(ctx)
    counts = _check(stage, ctx, result)
    written = {p.file for p in result.parts}
    # partitions of an earlier, larger input: deleted together (1,000 a request on an object store);
    # after a wipe only a ledger folder the stage keeps can hold any
    if not wiped or "ledger" in stage.preserve:
        ctx.storage.delete_files([f for f in ctx.storage.list(f"{stage.name}/ledger", ".parquet") if f not in written])
    parts = sorted(result.parts, key=lambda p: p.part)
    index = None
    if parts:   # before _SUCCESS: a finished stage can always say where a key's row is
        from .key_index import build

        index = build(ctx.storage, ctx.executor, stage.name, {p.file: p.sha256 for p in parts}, {p.file: p.n_in for p in parts},
                      # a stage that wrote from the driver (no task) and is small: its index there too
                      in_driver=len(ctx.executor.records) == first_record and sum(p.n_in for p in parts) <= 100_000,
                      given={p.file: p.stored.handle() for p in parts if p.stored is not None})
    for p in result.parts:     # the keys' references let go: the object store frees them
        p.stored = None
    wall = time.time() - t0
    from stages.dataplane import HIST_BINS, HIST_RANGE, sum_histograms

    hist = sum_histograms(parts)
    stats = {"stage": stage.name, **counts, "partitions": len(parts), "wall_seconds": round(wall, 3),
             **result.extra_stats, "tasks": ctx.executor.records[first_record:],
             **({"key_index": {"ledgers": len(parts), "ledgers_read": index.ledgers_read,
                                "ledgers_handed": index.ledgers_handed, "segments": index.segments,
                                "rows_written": index.rows_written}} if index else {}),
             **({"score_hist": {"bins": HIST_BINS, "range": list(HIST_RANGE), **hist}} if hist else {})}
    controls.write_all(stage.name, {"parts.json": [p.to_json() for p in parts], "stats.json": stats})
    files = {p.file: p.sha256 for p in parts}
    files.update(result.files)
    driver = store.push_stage(stage.name, ctx.log, before) if store is not None and store.uri else {}
    files.update(driver)
    ctx.storage.delete_files(sorted(set(before) - set(files)))     # produced by the last finish, not by this one
    # a sink that wrote nothing the digest can see (a model lives in train/model, evaluated on the
    # driver) is what it was made from; one that writes files (tokenizer, shards) is its files alone,
    # so the same shards have the same digest whatever config came before them
    chain = in_digest if stage.kind == "sink" and not parts and not result.files else None
    marker = {"input_digest": in_digest, "output_digest": output_digest(parts, result.files, chain),
              "upstream_digest": upstream_digest, **({"chain": chain} if chain else {}),
              # after a sink: the last judge's output it read too (`capline status` checks both)
              **({"judged_digest": judged_digest} if judged_digest != upstream_digest else {}),
              **({"sink_digests": list(sinks)} if sinks else {}),     # and the other sinks' outputs it read
              "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "outputs": dict(sorted(result.files.items())), "files": dict(sorted(files.items())),
              "artifacts": result.artifacts,
              "driver_files": sorted(driver)}
    controls.write(stage.name, "_SUCCESS", marker)    # last: the stage is finished once this exists
    dropped = ", ".join(f"{k}={v}" for k, v in counts["dropped"].items()) or "none"
    ctx.log(f"{stage.name}: {counts['in']} in, {counts['kept']} kept, dropped: {dropped} ({wall:.1f}s)")
    return marker, result.artifacts, parts, stats


def _check(stage: Stage, ctx: StageContext, result) -> dict:
    """in = kept + dropped for every partition a stage wrote, and its partitions took exactly what the
    stage before kept. A sink writes no ledger (or, like the shard stage, one of where samples went):
    what it says it consumed must be what was kept before it."""
    if result.parts or stage.kind != "sink":
        return check_parts(stage.name, result.parts, ctx.upstream)
    from stages.dataplane import add_sums

    n = sum(u.kept for u in ctx.upstream or [])
    if result.consumed is not None:
        got, checksum = result.consumed
        if got != n or int(checksum) != add_sums(*(u.kept_sum for u in ctx.upstream or [])):
            raise RuntimeError(f"stage {stage.name}: {n} samples were kept before it, it read {got} "
                               "(key-set checksums differ): a sample was lost or added")
    return {"in": n, "kept": n, "dropped": {}}
