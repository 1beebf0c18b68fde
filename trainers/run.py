"""Start a training job: checks, the MLflow run, and a Ray Train TorchTrainer (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

from trainers.families import spec

import dataclasses
from contextlib import contextmanager
from pathlib import Path

from infra.configtools import build
from .data import check_readers, shard_counts
from infra.errors import UserError
from .models import ModelConfig
from infra.tracking import flatten, log_dataset, redact, start_run, tracking_uri
from .train_config import TrainConfig



@contextmanager
def _interrupts_noticed():
    """Ray Train installs its own SIGINT handler during fit() (it aborts the run gracefully, then
    returns or exits 0/1 without a word); note that it fired, so Ctrl-C ends `capline train` as it
    ends every other stage: "interrupted; rerun to resume", exit 130. -> a list, non-empty once fired."""
    import signal

    fired: list = []
    real, before = signal.signal, signal.getsignal(signal.SIGINT)

    def recording(sig, handler):
        if sig == signal.SIGINT and callable(handler):
            def noticed(s, frame, handler=handler):
                fired.append(s)
                return handler(s, frame)
            return real(sig, noticed)
        return real(sig, handler)

    signal.signal = recording
    try:
        yield fired
    finally:
        signal.signal = real
        real(signal.SIGINT, before)


def _cluster_shape() -> dict:
    import ray

    alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return {"cpus": sum(r.get("CPU", 0) for r in alive), "gpus": sum(r.get("GPU", 0) for r in alive),
            "nodes": len(alive)}


def check_fits(tc, shape: dict) -> None:
    """Ray Train waits, silently and forever, for workers the cluster cannot place: say so before
    it starts, naming the setting."""
    least, name = (tc.min_workers, "train.min_workers") if tc.min_workers else (tc.num_workers, "train.num_workers")
    if tc.use_gpu and shape["gpus"] < least:
        raise UserError(f"train.use_gpu is true and {name} is {least}, but the cluster has "
                        f"{shape['gpus']:g} GPU(s); set train.use_gpu: false, lower {name}, or add GPU nodes")
    if shape["cpus"] < least:
        raise UserError(f"{name} is {least} (a CPU each) but the cluster has {shape['cpus']:g} CPUs "
                        f"on {shape['nodes']} node(s); lower {name} or add nodes")

def model_config(tc: TrainConfig, vocab_size: int) -> ModelConfig:
    args = dict(tc.model_args)
    if "vocab_size" in args and args["vocab_size"] != vocab_size:
        raise UserError(f"the tokenizer has {vocab_size} pieces but train.model_args.vocab_size is "
                        f"{args['vocab_size']}; remove it (it follows the tokenizer) or retrain the tokenizer")
    args.update(family=tc.model, size=tc.size, vocab_size=vocab_size, max_len=tc.max_len, image_size=tc.input_size)
    return build(ModelConfig, args, "train.model_args")


def train(storage, shards_rel: str, tokenizer_rel: str, tc: TrainConfig, seed: int, dataset_digest: str,
          out_rel: str, run_dir: Path, log=print, tags: dict | None = None) -> dict:
    """Train to tc.steps (resuming an interrupted job under out_rel). Returns final.json plus the run id.

    Everything lives in the run folder's `storage` (local, or a bucket): workers list and stream the
    shards from `shards_rel`, rank 0 (on whichever node) writes the model, the encoder and
    final.json under `out_rel`, and Ray Train keeps its checkpoints in `out_rel/ray` on the same
    storage, so a replacement worker on another node resumes from them. `run_dir` is the driver's
    working copy (the default MLflow store lives there). `tags`: more MLflow run tags (the caller's
    git commit, source, the data-build run's id)."""
    import sentencepiece as spm

    from infra.remote import importing_ray_data

    with importing_ray_data():      # Ray Train imports Ray Data
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, ValidationConfig, ValidationTaskConfig
        from ray.train.torch import TorchTrainer

    from .loop import WorkerJob, train_loop_per_worker

    shards = [storage.uri(r) for r in storage.list(shards_rel, ".tar")]
    if not shards:
        raise UserError(f"no shards (*.tar) in {storage.uri(shards_rel)}; run the pipeline's shard stage first")
    samples = int(shard_counts(shards).sum())
    for world in tc.worker_counts:
        check_readers(samples, world, tc.micro_batch or tc.per_worker_batch(world))
    check_fits(tc, _cluster_shape())
    if not storage.exists(tokenizer_rel):
        raise UserError(f"no tokenizer model at {storage.uri(tokenizer_rel)}; run the tokenizer stage first")
    tokenizer = storage.read_bytes(tokenizer_rel)   # small: it travels in the job's config
    vocab = spm.SentencePieceProcessor(model_proto=tokenizer).get_piece_size()
    hf_rel = None
    if tc.lm_path:     # ClipCap on a pretrained Hugging Face LM: its tokenizer replaces the run's
        from .models.hf_lm import HFTokenizer, check_folder

        check_folder(tc.lm_path)
        vocab = HFTokenizer(tc.lm_path).get_piece_size()
        hf_rel = f"{out_rel}/hf_lm"     # the workers read their copy from the run folder
        storage.put_dir(hf_rel, str(Path(tc.lm_path).expanduser()))
    mc = model_config(tc, vocab)
    if tc.image_encoder and not (Path(tc.image_encoder) / "model.json").is_file():
        raise UserError(f"train.image_encoder {tc.image_encoder}: not a capline model checkpoint")
    encoder_rel = lm_rel = None
    if tc.image_encoder:   # a folder on this machine: the workers read their copy from the run folder
        encoder_rel = f"{out_rel}/image_encoder"
        storage.put_dir(encoder_rel, tc.image_encoder)
    if tc.lm_checkpoint:
        if not (Path(tc.lm_checkpoint) / "model.safetensors").is_file():
            raise UserError(f"train.lm_checkpoint {tc.lm_checkpoint}: not a capline model checkpoint")
        lm_rel = f"{out_rel}/lm_checkpoint"
        storage.put_dir(lm_rel, tc.lm_checkpoint)
    if spec(tc.model).needs_encoder:   # refuse a frozen random LM here, not in every worker after Ray starts
        from .tasks import make_task

        make_task(dataclasses.replace(mc, hf_lm=str(Path(tc.lm_path).expanduser())) if tc.lm_path else mc,
                  tc.image_encoder, tc.lm_checkpoint).build()
    uri = tracking_uri(run_dir)
    id_file = f"{out_rel}/mlflow_run_id"
    if storage.exists(id_file):
        run_id = storage.read_bytes(id_file).decode().strip()
        log(f"train: resuming MLflow run {run_id}")
    else:
        import time

        resolved = {"train": dataclasses.asdict(tc), "model": dataclasses.asdict(mc), "seed": seed}
        params = flatten(resolved)
        job = {"capline.run_dir": storage.uri(), "capline.train_dir": out_rel}
        try:   # a name per job: a retrain of the same model is told apart in the runs list
            from infra.tracking import end_abandoned

            for old in end_abandoned(uri, tc.experiment, job):
                log(f"train: MLflow run {old} trained this folder before a change of what it decides; it will "
                    "not be resumed, and is marked KILLED")
            run_id = start_run(uri, run_dir, tc.experiment, f"{tc.model}-{tc.size}-{time.strftime('%Y%m%d-%H%M%S')}",
                               params, {"capline.dataset_digest": dataset_digest, **job,
                                        "capline.shards": storage.uri(shards_rel), **(tags or {})})
            from infra.tracking import client as _client

            _client(uri).log_dict(run_id, resolved, "config/train.json")
            log_dataset(uri, run_id, name=f"{Path(storage.root).name}-shards", digest=dataset_digest,
                        source=storage.uri(shards_rel))
            from infra.tracking import client

            import tempfile

            with tempfile.TemporaryDirectory(prefix="capline-tokenizer-") as tmp:
                (Path(tmp) / "spm.model").write_bytes(tokenizer)
                client(uri).log_artifact(run_id, str(Path(tmp) / "spm.model"), "tokenizer")
        except Exception as err:  # noqa: BLE001 - before any work: say where tracking failed and stop
            raise UserError(f"cannot start an MLflow run at {redact(uri)} ({type(err).__name__}: "
                            f"{redact(str(err).splitlines()[0][:200]) if str(err) else ''}); is the server up? "
                            "(unset MLFLOW_TRACKING_URI to track in the run folder)") from None
        storage.write_bytes(id_file, run_id.encode())
    log(f"train: workers read the {len(shards)} shards from {storage.uri(shards_rel)}")
    on = (f"{tc.min_workers}-{tc.num_workers} workers as the cluster has them (elastic; the global batch stays "
          f"{tc.global_batch})" if tc.min_workers else
          f"{tc.num_workers} workers ({tc.accumulation(tc.num_workers)} micro-batches each)")
    log(f"train: {tc.model}/{tc.size}, {tc.steps} steps of {tc.global_batch} on {on}, MLflow run {run_id} at {redact(uri)}")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": WorkerJob(train=tc, model=mc, seed=seed, shards=shards, tokenizer=tokenizer,
                                            storage=storage, out=out_rel, image_encoder=encoder_rel,
                                            lm_checkpoint=lm_rel, hf_lm=hf_rel, mlflow_uri=uri, run_id=run_id)},
        scaling_config=ScalingConfig(num_workers=tc.scaling, use_gpu=tc.use_gpu),
        validation_config=_evaluation_during(tc, mc, run_dir, uri, run_id, ValidationConfig, ValidationTaskConfig),
        run_config=RunConfig(name=f"train-{run_id[:12]}", storage_path=storage.path(f"{out_rel}/ray"),
                             storage_filesystem=storage.fs,
                             checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=tc.max_failures)))
    with _TrainingProgress(storage, f"{out_rel}/progress.json", tc.steps, log), _interrupts_noticed() as interrupted:
        try:
            trainer.fit()
        except BaseException:
            if interrupted:   # Ray Train's own SIGINT handler aborted the run (and may sys.exit)
                raise KeyboardInterrupt from None
            raise
        if interrupted:
            raise KeyboardInterrupt
    final = storage.read_json(f"{out_rel}/final.json")
    from infra.tracking import client, replay_unlogged

    try:   # the server may be back by now: catch up on what training could not log, then the artifacts
        spill = f"{out_rel}/unlogged_metrics.jsonl"
        if storage.exists(spill):
            import tempfile

            local = Path(tempfile.mkdtemp(prefix="capline-unlogged-")) / "unlogged_metrics.jsonl"
            local.write_bytes(storage.read_bytes(spill))
            replay_unlogged(uri, run_id, local, log=log)
            if not local.exists():
                storage.delete(spill)
        c = client(uri)
        c.log_artifacts(run_id, str(storage.local_dir(f"{out_rel}/model")), "model")
        c.log_artifacts(run_id, str(storage.local_dir(f"{out_rel}/export")), "encoder")
        if storage.list(f"{out_rel}/samples"):
            c.log_artifacts(run_id, str(storage.local_dir(f"{out_rel}/samples")), "samples")
        c.set_terminated(run_id)
        final["mlflow"] = {"unlogged": 0}
    except Exception as err:  # noqa: BLE001 - the model is saved; tracking is what failed
        lost = storage.exists(f"{out_rel}/unlogged_metrics.jsonl")
        log(f"mlflow: could not finish the run's tracking at {redact(uri)} ({type(err).__name__}); the model is in "
            f"{storage.uri(out_rel + '/model')}; not logged: the model and encoder artifacts"
            + (f" and the metrics in {storage.uri(out_rel + '/unlogged_metrics.jsonl')}" if lost else ""))
        final["mlflow"] = {"unlogged_artifacts": ["model", "encoder"], "unlogged_metrics_file":
                           storage.uri(f"{out_rel}/unlogged_metrics.jsonl") if lost else None}
    nodes = sorted({storage.read_bytes(p).decode().strip() for p in storage.list(f"{out_rel}/_nodes")})
    return {**final, "mlflow_run_id": run_id, "tracking_uri": redact(uri), "nodes": nodes}


def _evaluation_during(tc: TrainConfig, mc: ModelConfig, run_dir: Path, uri: str, run_id: str, config, task):
    """train.eval_every's evaluation task, on this (the driver's) node: the run folder's working copy,
    with the evaluation config and the tokenizer, is here."""
    if not tc.eval_every:
        return None
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .eval_during import validate_checkpoint

    return config(fn=validate_checkpoint,
                  task_config=task(fn_kwargs={"run_dir": str(run_dir), "model": mc, "mlflow_uri": uri, "run_id": run_id}),
                  # no CPU of its own: a cluster full of training workers would hold it back until the end
                  ray_remote_kwargs={"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
                      ray.get_runtime_context().get_node_id(), soft=False)})


class _TrainingProgress:
    """While Ray Train runs: the step, loss and examples/s rank 0 writes, as a progress bar with an ETA."""

    def __init__(self, storage, rel: str, steps: int, log):
        import threading

        self.storage, self.rel, self.steps, self.log = storage, rel, steps, log
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="capline-train-progress", daemon=True)

    def __enter__(self):
        if self.storage.exists(self.rel):
            self.storage.delete(self.rel)   # a resumed job's old figures: wait for the new ones
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)
        return False

    def _watch(self) -> None:
        from infra.progress import Progress

        bar = None
        seen = -1
        while True:
            stopping = self.stop.wait(2.0)
            try:
                p = self.storage.read_json(self.rel) if self.storage.exists(self.rel) else None
            except Exception:  # noqa: BLE001 - half-written or unreachable for a moment: next time
                p = None
            if p and p["step"] != seen:
                if bar is None:
                    bar = Progress("train", self.steps, self.log, unit="steps")
                bar.update(p["step"], rate=p.get("steps_per_s"), loss=round(p["loss"], 4),
                           examples_per_s=round(p["examples_per_s"], 1))
                seen = p["step"]
            if stopping:
                if bar is not None:
                    bar.close()
                return
