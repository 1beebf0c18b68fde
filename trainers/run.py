"""Start a training job: checks, the MLflow run, and a Ray Train TorchTrainer (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .configtools import build
from .data import check_readers, list_shards
from .errors import UserError
from .remote import location
from .models import ModelConfig
from .tracking import flatten, log_dataset, start_run, tracking_uri
from .train_config import TrainConfig


def model_config(tc: TrainConfig, vocab_size: int) -> ModelConfig:
    args = dict(tc.model_args)
    if "vocab_size" in args and args["vocab_size"] != vocab_size:
        raise UserError(f"the tokenizer has {vocab_size} pieces but train.model_args.vocab_size is "
                        f"{args['vocab_size']}; remove it (it follows the tokenizer) or retrain the tokenizer")
    args.update(family=tc.model, size=tc.size, vocab_size=vocab_size, max_len=tc.max_len, image_size=tc.image_size)
    return build(ModelConfig, args, "train.model_args")


def train(run_dir: Path, shard_dir: Path, tokenizer: Path, tc: TrainConfig, seed: int, dataset_digest: str,
          out_dir: Path, log=print) -> dict:
    """Train to tc.steps (resuming an interrupted job in out_dir). Returns final.json plus the run id."""
    import sentencepiece as spm
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from .loop import train_loop_per_worker

    # workers run elsewhere (another directory, maybe another node): hand them absolute paths
    run_dir, tokenizer, out_dir = (Path(p).resolve() for p in (run_dir, tokenizer, out_dir))
    shard_dir = location(shard_dir)   # an s3:// URI stays one: workers read the shards from there
    shards = list_shards(shard_dir)
    check_readers(len(shards), tc.num_workers, tc.loader_workers)
    if not Path(tokenizer).is_file():
        raise UserError(f"no tokenizer model at {tokenizer}; run the tokenizer stage first")
    vocab = spm.SentencePieceProcessor(model_file=str(tokenizer)).get_piece_size()
    mc = model_config(tc, vocab)
    if tc.image_encoder and not (Path(tc.image_encoder) / "model.json").is_file():
        raise UserError(f"train.image_encoder {tc.image_encoder}: not a capline model checkpoint")
    out_dir.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri(run_dir)
    id_file = out_dir / "mlflow_run_id"
    if id_file.is_file():
        run_id = id_file.read_text().strip()
        log(f"train: resuming MLflow run {run_id}")
    else:
        params = flatten({"train": dataclasses.asdict(tc), "model": dataclasses.asdict(mc), "seed": seed})
        try:
            run_id = start_run(uri, run_dir, tc.experiment, f"{tc.model}-{tc.size}",
                               params, {"capline.dataset_digest": dataset_digest, "capline.run_dir": str(run_dir)})
            log_dataset(uri, run_id, name=f"{Path(run_dir).name}-shards", digest=dataset_digest, source=str(shard_dir))
            from .tracking import client

            client(uri).log_artifact(run_id, str(tokenizer), "tokenizer")
        except Exception as err:  # noqa: BLE001 - before any work: say where tracking failed and stop
            raise UserError(f"cannot start an MLflow run at {uri} ({type(err).__name__}: "
                            f"{str(err).splitlines()[0][:200] if str(err) else ''}); is the server up? "
                            "(unset MLFLOW_TRACKING_URI to track in the run folder)") from None
        id_file.write_text(run_id)
    if isinstance(shard_dir, str):
        log(f"train: workers read the {len(shards)} shards from {shard_dir}")
    log(f"train: {tc.model}/{tc.size}, {tc.steps} steps of {tc.global_batch} on {tc.num_workers} workers "
        f"({tc.accumulation} micro-batches each), MLflow run {run_id} at {uri}")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"train": dataclasses.asdict(tc), "model": dataclasses.asdict(mc), "seed": seed,
                           "shard_dir": str(shard_dir), "tokenizer": str(tokenizer), "out_dir": str(out_dir),
                           "mlflow_uri": uri, "run_id": run_id},
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu),
        run_config=RunConfig(name=f"train-{run_id[:12]}", storage_path=str((out_dir / "ray").resolve()),
                             checkpoint_config=CheckpointConfig(num_to_keep=tc.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=tc.max_failures)))
    trainer.fit()
    final = json.loads((out_dir / "final.json").read_text())
    from .tracking import client, replay_unlogged

    try:   # the server may be back by now: catch up on what training could not log, then the artifacts
        replay_unlogged(uri, run_id, out_dir / "unlogged_metrics.jsonl", log=log)
        c = client(uri)
        c.log_artifacts(run_id, str(out_dir / "model"), "model")
        c.log_artifacts(run_id, str(out_dir / "export"), "encoder")
        if (out_dir / "samples").is_dir():
            c.log_artifacts(run_id, str(out_dir / "samples"), "samples")
        c.set_terminated(run_id)
        final["mlflow"] = {"unlogged": 0}
    except Exception as err:  # noqa: BLE001 - the model is on disk; tracking is what failed
        lost = (out_dir / "unlogged_metrics.jsonl")
        log(f"mlflow: could not finish the run's tracking at {uri} ({type(err).__name__}); the model is in "
            f"{out_dir / 'model'}; not logged: the model and encoder artifacts"
            + (f" and the metrics in {lost}" if lost.is_file() else ""))
        final["mlflow"] = {"unlogged_artifacts": ["model", "encoder"], "unlogged_metrics_file":
                           str(lost) if lost.is_file() else None}
    nodes = sorted({p.read_text().strip() for p in (out_dir / "_nodes").glob("rank*")})
    return {**final, "mlflow_run_id": run_id, "tracking_uri": uri, "nodes": nodes}
