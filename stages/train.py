"""The train stage: pretrain on the final shards with Ray Train (trainers/run.py), tracked in MLflow.

Every sample that reached the shards is kept (training consumes, it does not judge). With
`train.steps: 0` the stage records that and trains nothing.
"""
from __future__ import annotations

from .base import Sink, StageContext, StageResult


class TrainStage(Sink):
    name = "train"
    trains = True

    def section(self, config):
        return config.train

    def complete(self, config, stats: dict) -> bool:
        """A finished job with fewer steps than train.steps asks now goes on from its last checkpoint."""
        return not config.train.steps or (stats.get("step") or 0) >= config.train.steps

    def run(self, ctx: StageContext) -> StageResult:
        import json

        from trainers.run import train

        parts: list = []   # training consumes the shards; it judges no sample
        tc = ctx.cfg
        if tc.steps == 0:
            ctx.log("train: train.steps is 0, nothing to train")
            return StageResult(parts, {"trained": False})
        if tc.optim.warmup_steps >= tc.steps:
            ctx.log(f"train: warning: train.optim.warmup_steps {tc.optim.warmup_steps} >= train.steps {tc.steps}: the "
                    "learning rate never leaves its warmup; lower train.optim.warmup_steps (about a tenth of the "
                    "steps is usual) or train longer")
        manifest = json.loads((ctx.run_dir / "manifest.json").read_text())
        digest = manifest["stages"]["shard"]["output_digest"]
        tags = {"mlflow.source.git.commit": manifest.get("git_revision", ""), "mlflow.source.name": "capline run",
                "mlflow.source.type": "JOB", "capline.config_hash": manifest.get("config_hash", "")}
        if manifest.get("mlflow_runs", {}).get("data"):
            tags["capline.data_run_id"] = manifest["mlflow_runs"]["data"]
        result = train(ctx.storage, ctx.artifact("shard", "folder"), ctx.artifact("tokenizer", "model"), tc,
                       ctx.seed, digest, "train", ctx.run_dir, log=ctx.log, tags=tags)
        ctx.log(f"train: finished at step {result['step']}, loss {result['loss']:.4f}")
        model = ctx.storage.uri("train/model")
        ctx.log(f"train: the model is in {model} (its image encoder alone: {ctx.storage.uri('train/export')}); "
                f"next: capline eval {model}")
        return StageResult(parts, {"trained": True, **result},
                           artifacts={"model": "train/model", "encoder": "train/export",
                                      "mlflow_run_id": result["mlflow_run_id"]})
