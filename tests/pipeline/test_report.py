"""The report's own check, under headless Chromium (tests/helpers.py: chromium_console). The report
itself is rendered and checked on the demo run in tests/stages/test_filter_stages.py."""
import pytest

from helpers import chromium_console


@pytest.mark.slow
def test_a_broken_image_is_a_console_error(tmp_path):
    """The check above can fail: the page's own script reports images that do not load."""
    from pipeline.report import _CHECK_IMAGES

    page = tmp_path / "p.html"
    page.write_text(f"<html><head>{_CHECK_IMAGES}</head><body><img alt='k1' src='data:image/png;base64,AAAA'></body></html>")
    console = chromium_console(page, tmp_path / "p.png", size="400,300")
    assert any("image did not load: k1" in ln for ln in console), console


def test_the_score_histograms_come_from_the_registry_with_each_stages_own_cuts(tmp_path):
    """The stages that declare a score axis (registry order) get a chart; each names its cuts: the
    settings it declares, or for clip_score the cut its stats recorded."""
    import json

    from pipeline.report import _score_charts
    from stages.registry import STAGES, by_name

    assert [s.name for s in STAGES if s.score_cuts is not None] == ["dedup", "language", "clip_score"]
    config = {"stages": {"language": {"min_confidence": 0.5}, "dedup": {"eval_threshold": 0.92, "within_threshold": 0.97}}}
    assert by_name("language").cut_lines(config["stages"]["language"], {}) == [("min_confidence", 0.5)]
    assert by_name("dedup").cut_lines(config["stages"]["dedup"], {}) == [("eval_threshold", 0.92), ("within_threshold", 0.97)]
    assert by_name("clip_score").cut_lines({}, {"threshold": 0.3}) == [("threshold", 0.3)]
    assert by_name("clip_score").cut_lines({}, {"keep_fraction": 0.7, "cut": 0.21}) == [("top 0.7 cut", 0.21)]
    hist = {"bins": 4, "range": [0, 1], "kept": [0, 3, 5, 0], "dropped": [2, 1, 0, 0]}
    for stage in ("dedup", "clip_score", "basic"):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "stats.json").write_text(json.dumps({"score_hist": hist, "cut": 0.4, "keep_fraction": 0.7}))
    charts = _score_charts(tmp_path, config)
    assert len(charts) == 2 and all("data:image/png;base64," in c for c in charts)   # basic declares no axis
