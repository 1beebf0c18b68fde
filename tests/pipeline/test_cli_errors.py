"""Bad input at the command line: one line on stderr naming the problem, exit code 2, no traceback."""
import pytest

from helpers import capline

pytestmark = pytest.mark.slow   # a moto server / capline processes per test: not in the fast set


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("capline: error:")
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_malformed_url_file(tmp_path):
    bad = tmp_path / "urls.parquet"
    bad.write_bytes(b"PAR1 this is not parquet at all")
    proc = capline("run", "--run-dir", str(tmp_path / "run"), "--set", "source.kind=urls",
                   "--set", f"source.path={bad}")
    _one_line_error(proc, "not a readable parquet URL list")


def test_missing_columns(tmp_path):
    csv = tmp_path / "urls.csv"
    csv.write_text("link,text\nhttp://example.org/a.jpg,a cat\n")
    proc = capline("run", "--run-dir", str(tmp_path / "run"), "--set", "source.kind=urls",
                   "--set", f"source.path={csv}")
    _one_line_error(proc, "missing column(s) url, caption", "link, text")


def test_demo_eval_set_with_a_url_source(tmp_path):
    csv = tmp_path / "urls.csv"
    csv.write_text("url,caption\nhttp://example.org/a.jpg,a cat\n")
    proc = capline("run", "--set", "source.kind=urls", "--set", f"source.path={csv}")
    _one_line_error(proc, "demo_heldout", "exists only for source.kind synthetic")


def test_missing_url_file(tmp_path):
    proc = capline("run", "--set", "source.kind=urls", "--set", f"source.path={tmp_path}/none.csv")
    _one_line_error(proc, "no such file")


def test_nonexistent_config_key():
    _one_line_error(capline("run", "--set", "stages.ingest.bogus=1"), "stages.ingest.bogus", "unknown key")


def test_negative_number_of_samples():
    _one_line_error(capline("run", "--set", "source.num_samples=-5"), "source.num_samples", "positive")


def test_unreachable_ray_address(tmp_path):
    proc = capline("run", "--run-dir", str(tmp_path / "run"), "--address", "127.0.0.1:1")
    _one_line_error(proc, "cannot reach a Ray cluster at 127.0.0.1:1")
    assert not (tmp_path / "run" / "source").exists()


def test_missing_config_file_and_bad_stage(tmp_path):
    _one_line_error(capline("run", str(tmp_path / "x.yaml")), "no such file")
    _one_line_error(capline("run", "--until", "nosuch"), "--until nosuch", "stages are source, ingest, dedup")


def test_status_of_a_folder_that_is_no_run(tmp_path):
    _one_line_error(capline("status", str(tmp_path)), "not a capline run folder")


@pytest.mark.parametrize("cmd", [["--help"], ["run", "--help"], ["status", "--help"], ["explain", "--help"]])
def test_help_explains_every_option(cmd):
    proc = capline(*cmd)
    assert proc.returncode == 0
    assert "usage: capline" in proc.stdout
    if cmd == ["run", "--help"]:
        for opt in ("--run-dir", "--set", "--until", "--only", "--address", "configs/demo.yaml"):
            assert opt in proc.stdout


@pytest.mark.slow   # four capline processes, one loading digits
def test_eval_bad_input(tmp_path):
    _one_line_error(capline("eval", str(tmp_path / "nope")), "not a capline model checkpoint")
    from trainers.models import ModelConfig, build_model
    from trainers.models.checkpoint import save_model

    cfg = ModelConfig(family="cappa", size="tiny", vocab_size=300, max_len=8, image_size=16, patch=4, width=32,
                      depth=2, heads=2, mlp=64)
    run = tmp_path / "run"
    save_model(build_model(cfg), cfg, run / "train" / "model")
    _one_line_error(capline("eval", str(run / "train" / "model"), "--tasks", "fewshot,vibes"), "unknown task(s) vibes")
    _one_line_error(capline("eval", str(run / "train" / "model"), "--shots", "1,x"), "--shots 1,x")
    from stages.tokenizer import TokenizerConfig, train_sentencepiece

    (run / "tokenizer").mkdir()
    (run / "tokenizer" / "spm.model").write_bytes(train_sentencepiece(
        [f"a small red circle number {i}" for i in range(300)], TokenizerConfig(vocab_size=300)))
    # digits has ~180 images per class: 500-shot cannot leave any for testing
    _one_line_error(capline("eval", str(run / "train" / "model"), "--tasks", "fewshot", "--shots", "500"),
                    "few-shot on digits", "too few for 500-shot")


# a capline process each (~2 s): the same refusals are unit-tested in-process in tests/stages/test_filters.py
@pytest.mark.slow
@pytest.mark.parametrize("overrides, needles", [
    (["stages.clip_score.scorer=checkpoint", "stages.clip_score.checkpoint=/nonexistent/scorer"],
     ["stages.clip_score.checkpoint /nonexistent/scorer: no such folder"]),
    (["stages.clip_score.keep_fraction=0"], ["keep_fraction", "must be in (0, 1]"]),
    (["stages.clip_score.keep_fraction=1.5"], ["keep_fraction", "must be in (0, 1]"]),
    (["stages.language.languages=[en,qq]"], ["qq unknown to the fasttext backend"]),
    (["source.kind=openclipart", "source.path=/nonexistent/svg"], ["apt-get install openclipart-svg"]),
])
def test_filter_config_errors_before_any_work(tmp_path, overrides, needles):
    run_dir = tmp_path / "run"
    args = [a for o in overrides for a in ("--set", o)]
    _one_line_error(capline("run", "--run-dir", str(run_dir), *args), *needles)
    assert not (run_dir / "source").exists()   # refused before the first stage


@pytest.mark.slow
def test_scorer_checkpoint_that_does_not_fit(tmp_path):
    from trainers.models import build_model
    from trainers.models.checkpoint import save_model
    from trainers.models.config import ModelConfig

    cfg = ModelConfig(family="cappa", vocab_size=300, width=32, depth=1, heads=2, mlp=64, patch=8, image_size=16)
    save_model(build_model(cfg), cfg, tmp_path / "cappa")
    proc = capline("run", "--run-dir", str(tmp_path / "run"), "--set", "stages.clip_score.scorer=checkpoint",
                   "--set", f"stages.clip_score.checkpoint={tmp_path / 'cappa'}")
    _one_line_error(proc, "a cappa model has no text embedding to score with")


def test_a_folder_that_is_not_a_capline_run_is_refused_not_wiped(tmp_path):
    """--run-dir at a folder of the user's: each stage clears its own folder, so the user's basic/ or
    dedup/ would go. Refused before anything runs; the files stay. A name that is a path is refused."""
    mine = tmp_path / "my-project"
    (mine / "basic").mkdir(parents=True)
    (mine / "basic" / "notes.txt").write_text("mine")
    (mine / "thesis.tex").write_text("mine too")
    out = capline("run", "--run-dir", str(mine), "--set", "source.num_samples=20")
    assert out.returncode == 2 and "holds files that are not a capline run's (thesis.tex)" in out.stderr, out.stderr
    assert (mine / "basic" / "notes.txt").read_text() == "mine" and "Traceback" not in out.stderr
    # a manifest.json of another tool's made any folder count as a run folder: its source/ was deleted
    web = tmp_path / "webapp"
    (web / "source").mkdir(parents=True)
    (web / "source" / "index.js").write_text("mine")
    (web / "manifest.json").write_text('{"name": "my app", "start_url": "/"}')
    out = capline("run", "--run-dir", str(web), "--set", "source.num_samples=20")
    assert out.returncode == 2 and "holds a manifest.json that is not a capline run's" in out.stderr, out.stderr
    assert (web / "source" / "index.js").read_text() == "mine"
    assert (web / "manifest.json").read_text() == '{"name": "my app", "start_url": "/"}'
    bad = capline("run", "--set", "name=..", "--set", "source.num_samples=20", cwd=tmp_path)
    assert bad.returncode == 2 and "must be one folder name" in bad.stderr, bad.stderr


def test_dot_dot_in_a_bucket_run_folder_is_refused(tmp_path):
    from infra.errors import UserError
    from pipeline.storage import RunStore

    for uri in ("s3://bucket/runs/../../../etc", "s3://bucket/./x"):
        with pytest.raises(UserError, match="'.' and '..' are not folder names in a bucket"):
            RunStore(uri)
    # percent-encoded: pyarrow decodes %2E%2E to '..', and the working copy left the cache
    for uri in ("s3://bucket/runs/%2E%2E/%2E%2E/%2e%2e/etc", "s3://bucket/%2E/x"):
        with pytest.raises(UserError, match="not folder names in a bucket \\(percent-encoded or not\\)"):
            RunStore(uri)
