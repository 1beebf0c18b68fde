"""The eval stage: the paper's evaluations on the model the train stage just produced
(trainers/evaluation/run.py). Every sample is kept; nothing is judged here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Sink, StageContext, StageResult


@dataclass
class EvalSection:
    """What decides an evaluation: what was trained, and the `eval:` section."""
    train: Any
    eval: Any


class EvalStage(Sink):
    name = "eval"

    def section(self, config):
        return EvalSection(config.train, config.eval)

    def preflight(self, config) -> None:
        """Evaluation sets that cannot be found fail before the run, not after training."""
        from trainers.evaluation.datasets import check_exists

        check_exists(config.eval)

    def run(self, ctx: StageContext) -> StageResult:
        from trainers.evaluation.run import evaluate, summary

        parts: list = []   # evaluation judges no sample
        model_dir = ctx.run_dir / "train" / "model"
        # evaluation runs here, on the driver: the model in the working copy
        ctx.storage.copy_to(ctx.run_dir, ctx.storage.list("train/model") + ctx.storage.list("train", "mlflow_run_id")
                            + ctx.storage.list("tokenizer", ".model"))
        if not (model_dir / "model.json").is_file():
            ctx.log("eval: no trained model (train.steps is 0), nothing to evaluate")
            return StageResult(parts, {"evaluated": False})
        results = evaluate(model_dir, ctx.run_dir, log=ctx.log, strict=False, eval_cfg=ctx.cfg.eval,
                           seed=ctx.seed)
        text = summary(results)
        (ctx.stage_dir / "summary.txt").write_text(text + "\n")   # `capline run` prints it at the end, once
        ctx.log(f"eval: {len(results.get('fewshot', {}))} few-shot, {len(results.get('captioning', {}))} captioning, "
                f"{len(results.get('zeroshot', {}))} zero-shot and {len(results.get('wordorder', {}))} word-order sets; "
                "summary in eval/summary.txt")
        return StageResult(parts, {"evaluated": True}, artifacts={"summary": "eval/summary.txt"})
