"""Unit: config loading, validation messages and --set overrides."""
import pytest

from pipeline.config import load_config
from infra.configtools import apply_override
from infra.errors import ConfigError, UserError


def test_demo_config_loads_with_its_values():
    cfg = load_config()
    assert cfg.source.kind == "synthetic"
    assert cfg.source.num_samples == 2000
    assert cfg.stages.ingest.image_size == 64


def test_override_sets_nested_value_with_yaml_types():
    cfg = load_config(None, ["stages.ingest.timeout=5", "source.num_samples=10", "ray.num_cpus=null"])
    assert cfg.stages.ingest.timeout == 5.0 and isinstance(cfg.stages.ingest.timeout, float)
    assert cfg.source.num_samples == 10
    assert cfg.ray.num_cpus is None


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["stages.ingest.timout=5"])
    msg = str(err.value)
    assert "stages.ingest.timout" in msg and "did you mean 'timeout'" in msg


def test_negative_samples_rejected_with_key():
    with pytest.raises(ConfigError, match=r"source.num_samples.*positive"):
        load_config(None, ["source.num_samples=-3"])


def test_wrong_type_and_literal_rejected():
    with pytest.raises(ConfigError, match=r"stages.ingest.thread_count.*integer"):
        load_config(None, ["stages.ingest.thread_count=many"])
    with pytest.raises(ConfigError, match=r"source.kind.*'synthetic' \| 'urls'"):
        load_config(None, ["source.kind=ftp"])


def test_override_into_a_value_is_an_error():
    data = {"seed": 1}
    with pytest.raises(ConfigError, match="not a section"):
        apply_override(data, "seed.x=2")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_override(data, "seed")


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)


def test_urls_kind_needs_a_path():
    with pytest.raises(ConfigError, match="source.path"):
        load_config(None, ["source.kind=urls"])


def test_config_survives_a_json_round_trip_unchanged():
    """A manifest stores the config as JSON; rebuilding from it must hash the same (int defaults of
    float fields included)."""
    import json

    from pipeline.config import RunConfig
    from infra.configtools import build

    cfg = load_config()
    again = build(RunConfig, json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.digest() == cfg.digest()
    assert isinstance(cfg.source.defects.huge_pixels, float)


def test_a_parallelism_cap_of_an_older_capline_is_ignored_with_a_note(capsys):
    """dedup, language, clip_score and shard took `num_workers` (tasks in flight for the whole
    cluster); the executor sizes that from the cluster now: an old config still loads, and says so."""
    old = load_config(None, ["stages.dedup.num_workers=2", "stages.shard.num_workers=8"])
    assert old.stages == load_config(None, []).stages
    err = capsys.readouterr().err
    assert "config key 'stages.dedup.num_workers' is no longer used (the executor sizes parallelism" in err
    assert "stages.shard.num_workers" in err
    with pytest.raises(ConfigError, match="stages.basic.num_workers"):
        load_config(None, ["stages.basic.num_workers=2"])      # basic never had it: still an unknown key


def test_an_append_only_line_refuses_filters_that_would_move_published_samples():
    """stages.shard.append needs a cut and a scorer that judge a sample the same every run."""
    from pipeline.runner import preflight
    from stages.shard.stage import check_line_settings

    line = ["stages.shard.append=true"]
    with pytest.raises(UserError, match=r"stages.shard.append: .*set stages.clip_score.reuse_cut=true"):
        check_line_settings(load_config(None, line))
    with pytest.raises(UserError, match=r"set stages.clip_score.bootstrap.reuse=true"):
        check_line_settings(load_config(None, [*line, "stages.clip_score.reuse_cut=true"]))
    with pytest.raises(UserError, match=r"set stages.clip_score.bootstrap.reuse=true"):
        preflight(load_config(None, [*line, "stages.clip_score.threshold=0.2", "stages.clip_score.keep_fraction=null"]))
    check_line_settings(load_config(None, [*line, "stages.clip_score.reuse_cut=true",
                                           "stages.clip_score.bootstrap.reuse=true"]))
    check_line_settings(load_config(None, [*line, "stages.clip_score.enabled=false"]))
    preflight(load_config(None, []))     # without append: nothing to keep


def test_dataset_line_is_one_switch_for_the_four_settings_a_line_needs():
    from pipeline.config import LINE_SETTINGS

    cfg = load_config(None, ["dataset_line=true"])
    assert (cfg.stages.shard.append, cfg.stages.tokenizer.reuse, cfg.stages.clip_score.bootstrap.reuse,
            cfg.stages.clip_score.reuse_cut) == (True,) * 4 == (True,) * len(LINE_SETTINGS)
    off = load_config(None, [])
    assert not (off.dataset_line or off.stages.shard.append or off.stages.tokenizer.reuse)
    with pytest.raises(UserError, match="stages.tokenizer.reuse: false contradicts dataset_line: true"):
        load_config(None, ["dataset_line=true", "stages.tokenizer.reuse=false"])


@pytest.mark.slow   # 1.6-5.5 s: kept out of the fast set (under a minute)
def test_capline_config_lists_every_setting_with_its_default_and_meaning():
    from helpers import capline
    from infra.configtools import describe_settings
    from pipeline.config import RunConfig

    rows = describe_settings(RunConfig)
    assert len(rows) > 150 and sum(1 for _, _, m in rows if m) / len(rows) > 0.95
    built = RunConfig()
    for key, default, _ in rows:             # every key listed is where the config holds it, with that default
        obj = built
        for part in key.split("."):
            obj = getattr(obj, part)
        assert obj == default, key
    assert len({k for k, _, _ in rows}) == len(rows)
    out = capline("config", "--grep", "compact_rows")
    assert out.returncode == 0 and out.stdout.startswith("stages.ingest.compact_rows = 20000  # [how the work runs; decides nothing] the stages after"), out.stdout
    demo = capline("config", "configs/demo.yaml", "--grep", "stages.ingest.compact_rows")
    assert demo.stdout.startswith("stages.ingest.compact_rows = 1000  (default 20000)"), demo.stdout
    removed = capline("config", "--grep", "batch_size").stdout
    assert "stages.dedup.batch_size" not in removed and "stages.clip_score.bootstrap.batch_size" in removed


def test_how_the_work_runs_is_neither_fingerprinted_nor_on_the_card():
    from infra.configtools import describe_settings
    from pipeline.config import RunConfig
    from pipeline.dataset_card import thresholds
    from stages.registry import STAGES

    plain = load_config(None, [])
    cut = load_config(None, ["stages.dedup.bucket_rows=5000", "stages.dedup.cpus_per_worker=2",
                             "stages.shard.map_bytes=100000000", "stages.ingest.compact_rows=500"])
    assert all(s.fingerprint(plain) == s.fingerprint(cut) for s in STAGES)
    decides = load_config(None, ["stages.dedup.within_threshold=0.9"])
    assert any(s.fingerprint(plain) != s.fingerprint(decides) for s in STAGES)
    card = thresholds(plain)
    assert "within_threshold" in card["dedup"] and "bucket_rows" not in card["dedup"] and "map_bytes" not in card.get("shard", {})
    marked = {k for k, _, m in describe_settings(RunConfig) if m.startswith("[how")}
    assert {"stages.dedup.bucket_rows", "stages.ingest.compact_rows", "stages.shard.map_bytes"} <= marked
    assert "stages.dedup.within_threshold" not in marked


@pytest.mark.slow   # 1.6-5.5 s: kept out of the fast set (under a minute)
def test_no_numeric_setting_takes_a_negative_nan_or_infinite_value():
    """Every count, size, time, rate and share: -1, .nan and .inf are refused with the key named
    (stages.ingest.task_retries=-1 was infinite retries in Ray). The one exception a class declares
    (SIGNED): train.max_failures, whose -1 is Ray Train's "any number"; its .nan and .inf are refused."""
    from infra.configtools import describe_settings
    from pipeline.config import RunConfig
    from trainers.train_config import TrainConfig

    signed = {f"train.{k}" for k in TrainConfig.SIGNED}
    assert signed == {"train.max_failures"}
    numeric = [k for k, d, _ in describe_settings(RunConfig) if isinstance(d, (int, float)) and not isinstance(d, bool)]
    assert len(numeric) > 80
    for key in numeric:
        for bad in ("-1", ".nan", ".inf") if key not in signed else (".nan", ".inf", "-2"):
            section = key.rsplit(".", 1)[0] + "." if "." in key else key   # the key, or its section's pair check
            with pytest.raises(UserError, match=section.replace(".", r"\.")):
                load_config(None, [f"{key}={bad}"])


def test_the_dashboard_starts_when_the_command_trains_unless_the_config_says():
    """Ray's dashboard costs every local start 1-2.5 s; Ray Train needs it (its placement-group
    cleaner reads the State API through it), a data build does not."""
    from infra.ray_runtime import wants_dashboard
    from pipeline.runner import trains

    cfg = load_config()
    assert cfg.ray.dashboard is None
    assert trains(None, None) and trains(None, "train") and not trains("shard", None) and not trains(None, "dedup")
    assert wants_dashboard(cfg.ray, trains(None, None)) and not wants_dashboard(cfg.ray, trains("shard", None))
    assert wants_dashboard(load_config(None, ["ray.dashboard=true"]).ray, False)
    assert not wants_dashboard(load_config(None, ["ray.dashboard=false"]).ray, True)
    with pytest.raises(ConfigError, match=r"ray.dashboard"):
        load_config(None, ["ray.dashboard=sometimes"])


def test_every_shipped_config_loads_and_the_recipes_say_what_they_keep():
    """configs/ is what users copy: each file loads and validates; the published recipes keep what
    their papers say (DataComp's 30 % of the pool by L/14, LAION-400M's B/32 cosine >= 0.3)."""
    from pathlib import Path

    from pipeline.config import load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    loaded = {p.stem: load_config(str(p), []) for p in sorted(root.glob("*.yaml"))}
    assert {"demo", "datacomp_clip_l14_30", "datacomp_basic", "datacomp_basic_and_clip_l14_30", "laion400m"} <= set(loaded)
    for name in ("datacomp_clip_l14_30", "datacomp_basic_and_clip_l14_30"):
        c = loaded[name].stages.clip_score
        assert (c.scorer, c.column, c.keep_fraction, c.keep_fraction_of) == ("column", "clip_l14_similarity_score", 0.3, "pool")
    assert not loaded["datacomp_basic"].stages.clip_score.enabled and not loaded["datacomp_clip_l14_30"].stages.basic.enabled
    b = loaded["datacomp_basic"].stages.basic
    assert (b.min_chars, b.min_words, b.min_image_side, b.max_aspect_ratio) == (6, 3, 200, 3.0)
    c = loaded["laion400m"].stages.clip_score
    assert (c.scorer, c.column, c.threshold) == ("column", "similarity", 0.3)
    # the pool is the list's own column: a model's scores exist only for what was downloaded
    import pytest

    from infra.errors import UserError

    with pytest.raises(UserError, match="keep_fraction_of.*needs scorer: column"):
        load_config(None, ["stages.clip_score.keep_fraction_of=pool"])


def test_evaluation_during_training_is_on_checkpoints_and_not_for_clipcap():
    import pytest

    from infra.errors import UserError
    from pipeline.config import load_config

    assert load_config(None, ["train.eval_every=100", "train.checkpoint_every=50"]).train.eval_every == 100
    with pytest.raises(UserError, match=r"train.eval_every.*multiple of train.checkpoint_every \(50\)"):
        load_config(None, ["train.eval_every=30", "train.checkpoint_every=50"])
    with pytest.raises(UserError, match=r"train.eval_every.*clipcap is evaluated at the end only"):
        load_config(None, ["train.eval_every=50", "train.checkpoint_every=50", "train.model=clipcap",
                           "train.image_encoder=/nowhere"])
    from trainers.train_config import TrainConfig

    assert "eval_every" in TrainConfig.HOW     # changing it resumes the job, never restarts it


def test_an_elastic_worker_range_keeps_the_global_batch_whole_on_every_count():
    import pytest

    from infra.errors import UserError
    from pipeline.config import load_config
    from trainers.train_config import TrainConfig

    tc = load_config(None, ["train.num_workers=4", "train.min_workers=2", "train.global_batch=48"]).train
    assert tc.scaling == (2, 4) and list(tc.worker_counts) == [2, 3, 4]
    assert [tc.per_worker_batch(w) for w in tc.worker_counts] == [24, 16, 12]
    assert load_config(None, ["train.num_workers=4"]).train.scaling == 4      # fixed unless min_workers is set
    with pytest.raises(UserError, match=r"train.global_batch': 64 is not divisible by 3 workers .*divisible by 12"):
        load_config(None, ["train.num_workers=4", "train.min_workers=2", "train.global_batch=64"])
    with pytest.raises(UserError, match=r"train.min_workers': must be 0 .* or 1..2"):
        load_config(None, ["train.min_workers=3"])
    with pytest.raises(UserError, match=r"train.micro_batch': must divide the per-worker batch 16"):
        load_config(None, ["train.num_workers=4", "train.min_workers=2", "train.global_batch=48", "train.micro_batch=12"])
    assert "min_workers" in TrainConfig.HOW    # a changed range resumes the job
