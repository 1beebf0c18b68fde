"""`capline report` on a small full run (through training and evaluation), opened in headless
Chromium (Debian's `chromium`): it must render without console errors; the screenshot is saved."""
import re
import shutil
import subprocess
import tempfile

import pytest

from helpers import capline

pytestmark = pytest.mark.slow

ARGS = ["--set", "source.num_samples=400", "--set", "source.eval_size=40", "--set", "stages.ingest.samples_per_shard=100",
        "--set", "stages.shard.samples_per_shard=150", "--set", "stages.clip_score.bootstrap.steps=40",
        "--set", "train.steps=30", "--set", "train.checkpoint_every=30", "--set", "train.sample_every=30",
        "--set", f"stages.dedup.cache_dir={tempfile.mkdtemp(prefix='capline-eval-index-')}"]


def chromium_console(page, screenshot, size="1300,3000") -> list[str]:
    """Open `page` headless; -> the console messages it logged. No network: every request goes to a
    proxy that does not exist, and Chromium's background services are off."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        pytest.fail("Debian's chromium is not installed; `make test` installs it (apt, as root)")
    proc = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-extensions",
         "--proxy-server=socks5://127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--enable-logging=stderr",
         "--v=0", f"--window-size={size}", f"--screenshot={screenshot}", f"file://{page}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]


def test_report_renders_in_chromium(tmp_path):
    run_dir = tmp_path / "run"
    proc = capline("run", "--run-dir", str(run_dir), *ARGS, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"report: {run_dir}/report.html" in proc.stdout
    out = capline("report", str(run_dir), "--per-reason", "4")
    assert out.returncode == 0, out.stderr
    page = (run_dir / "report.html").read_text()
    for section in ("Funnel", "Scores and thresholds", "Samples kept and dropped", "Training", "Evaluation"):
        assert f"<h2>{section}</h2>" in page
    for reason in ("http_404", "eval_duplicate:demo", "language:de", "clip_score"):
        assert reason in page
    assert "MLflow run" in page and "Training curves unavailable" not in page
    assert re.search(r"few-shot demo_colour", page)
    assert page.count("data:image/png;base64,") >= 5       # funnel, 3 score histograms, curves
    assert page.count("class='card kept'") >= 4 and page.count("class='card dropped'") >= 8
    shot = run_dir / "report.png"
    console = chromium_console(run_dir / "report.html", shot)
    assert console == [], console
    assert shot.stat().st_size > 50_000


def test_a_broken_image_is_a_console_error(tmp_path):
    """The check above can fail: the page's own script reports images that do not load."""
    from pipeline.report import _CHECK_IMAGES

    page = tmp_path / "p.html"
    page.write_text(f"<html><head>{_CHECK_IMAGES}</head><body><img alt='k1' src='data:image/png;base64,AAAA'></body></html>")
    console = chromium_console(page, tmp_path / "p.png", size="400,300")
    assert any("image did not load: k1" in ln for ln in console), console
