"""Unit: the runner's skip/resume logic and the in = kept + dropped invariant, with small fake stages."""
import json

import pytest

from pipeline.config import load_config
from pipeline.runner import check_invariant, run_pipeline
from stages.base import Ledger, Stage, StageResult
from trainers.errors import UserError


class Numbers(Stage):
    name = "numbers"

    def __init__(self):
        self.calls = 0

    def section(self, config):
        return {"n": config.source.num_samples}

    def run(self, ctx):
        self.calls += 1
        ledger = Ledger(self.name)
        for i in range(ctx.config.source.num_samples):
            ledger.keep(f"k{i}")
        (ctx.stage_dir / "out.txt").write_text("numbers")
        return StageResult(ledger)


class DropOdd(Stage):
    name = "dropodd"

    def __init__(self, lose_one=False):
        self.calls = 0
        self.lose_one = lose_one

    def section(self, config):
        return {}

    def run(self, ctx):
        self.calls += 1
        ledger = Ledger(self.name)
        keys = ctx.upstream_kept[1:] if self.lose_one else ctx.upstream_kept
        for k in keys:
            if int(k[1:]) % 2:
                ledger.drop(k, "odd", score=1.0)
            else:
                ledger.keep(k)
        return StageResult(ledger)


def _cfg(n=10):
    return load_config(None, [f"source.num_samples={n}"])


def test_runs_then_skips_then_reruns_when_input_changes(tmp_path):
    a, b = Numbers(), DropOdd()
    summary = run_pipeline(_cfg(), tmp_path, log=lambda m: None, stages=[a, b])
    assert summary["dropodd"] == {**summary["dropodd"], "in": 10, "kept": 5, "dropped": {"odd": 5}}
    assert (tmp_path / "dropodd" / "_SUCCESS").is_file()
    run_pipeline(_cfg(), tmp_path, log=lambda m: None, stages=[a, b])
    assert (a.calls, b.calls) == (1, 1)          # same inputs: nothing redone
    run_pipeline(_cfg(12), tmp_path, log=lambda m: None, stages=[a, b])
    assert (a.calls, b.calls) == (2, 2)          # changed upstream: downstream redone too
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"numbers", "dropodd"}
    assert manifest["config"]["source"]["num_samples"] == 12


def test_a_lost_sample_fails_the_stage_and_leaves_no_marker(tmp_path):
    with pytest.raises(RuntimeError, match="1 samples entered without a verdict"):
        run_pipeline(_cfg(), tmp_path, log=lambda m: None, stages=[Numbers(), DropOdd(lose_one=True)])
    assert not (tmp_path / "dropodd" / "_SUCCESS").exists()
    assert (tmp_path / "numbers" / "_SUCCESS").exists()


def test_until_and_only(tmp_path):
    a, b = Numbers(), DropOdd()
    with pytest.raises(UserError, match="has not finished"):
        run_pipeline(_cfg(), tmp_path, only="dropodd", log=lambda m: None, stages=[a, b])
    run_pipeline(_cfg(), tmp_path, until="numbers", log=lambda m: None, stages=[a, b])
    assert not (tmp_path / "dropodd").exists()
    run_pipeline(_cfg(), tmp_path, only="dropodd", log=lambda m: None, stages=[a, b])
    assert (a.calls, b.calls) == (1, 1)
    with pytest.raises(UserError, match="no such stage"):
        run_pipeline(_cfg(), tmp_path, until="nope", log=lambda m: None, stages=[a, b])


def test_invariant_counts():
    counts = check_invariant("s", ["a", "b", "c"], ["kept", "dropped", "dropped"], ["", "x", "y"], ["a", "b", "c"])
    assert counts == {"in": 3, "kept": 1, "dropped": {"x": 1, "y": 1}}
    with pytest.raises(RuntimeError, match="never entered"):
        check_invariant("s", ["a", "z"], ["kept", "kept"], ["", ""], ["a"])


def test_ledger_refuses_two_verdicts_and_reasonless_drops():
    led = Ledger("s")
    led.keep("a")
    with pytest.raises(ValueError, match="two verdicts"):
        led.drop("a", "x")
    with pytest.raises(ValueError, match="needs a reason"):
        led.drop("b", "")
