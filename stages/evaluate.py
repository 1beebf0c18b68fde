"""The eval stage: the paper's evaluations on the model the train stage just produced
(trainers/evaluation/run.py). Every sample is kept; nothing is judged here."""
from __future__ import annotations

from .base import Stage, StageContext, StageResult
from .dataplane import passthrough


class EvalStage(Stage):
    name = "eval"

    def section(self, config):
        # what was trained, and the `eval:` section, decide what is evaluated
        import dataclasses

        return {"train": dataclasses.asdict(config.train), "eval": dataclasses.asdict(config.eval)}

    def preflight(self, config) -> None:
        """Evaluation sets that cannot be found fail before the run, not after training."""
        from trainers.evaluation.datasets import check_exists

        check_exists(config.eval)

    def run(self, ctx: StageContext) -> StageResult:
        from trainers.evaluation.run import evaluate, summary

        parts = ctx.map_parts(passthrough, num_cpus=0.25)
        model_dir = ctx.run_dir / "train" / "model"
        if not ctx.storage.is_local:   # evaluation runs here, on the driver: fetch the model into the working copy
            for rel in ctx.storage.list("train/model") + ctx.storage.list("train", "mlflow_run_id") + \
                    ctx.storage.list("tokenizer", ".model"):
                (ctx.run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                (ctx.run_dir / rel).write_bytes(ctx.storage.read_bytes(rel))
        if not (model_dir / "model.json").is_file():
            ctx.log("eval: no trained model (train.steps is 0), nothing to evaluate")
            return StageResult(parts, {"evaluated": False})
        results = evaluate(model_dir, ctx.run_dir, log=ctx.log, strict=False, eval_cfg=ctx.config.eval,
                           seed=ctx.config.seed)
        text = summary(results)
        (ctx.stage_dir / "summary.txt").write_text(text + "\n")   # `capline run` prints it at the end, once
        ctx.log(f"eval: {len(results.get('fewshot', {}))} few-shot, {len(results.get('captioning', {}))} captioning, "
                f"{len(results.get('zeroshot', {}))} zero-shot and {len(results.get('wordorder', {}))} word-order sets; "
                "summary in eval/summary.txt")
        return StageResult(parts, {"evaluated": True}, artifacts={"summary": "eval/summary.txt"})
