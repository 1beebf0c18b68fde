"""Headless Chromium (Debian's `chromium`) for the report tests: `chromium_console` opens a page
offline and returns its console messages. The report itself is rendered and checked on the demo run
in tests/test_filter_stages.py."""
import shutil
import subprocess
import tempfile

import pytest


def chromium_console(page, screenshot, size="1300,3000") -> list[str]:
    """Open `page` headless; -> the console messages it logged. No network: every request goes to a
    proxy that does not exist, and Chromium's background services are off."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        pytest.fail("Debian's chromium is not installed; `make test` installs it (apt, as root)")
    profile = tempfile.mkdtemp(prefix="capline-chromium-")   # a new empty profile every time
    proc = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", f"--user-data-dir={profile}",
         "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-extensions",
         "--proxy-server=socks5://127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--enable-logging=stderr",
         "--v=0", f"--window-size={size}", f"--screenshot={screenshot}", f"file://{page}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]


@pytest.mark.slow
def test_a_broken_image_is_a_console_error(tmp_path):
    """The check above can fail: the page's own script reports images that do not load."""
    from pipeline.report import _CHECK_IMAGES

    page = tmp_path / "p.html"
    page.write_text(f"<html><head>{_CHECK_IMAGES}</head><body><img alt='k1' src='data:image/png;base64,AAAA'></body></html>")
    console = chromium_console(page, tmp_path / "p.png", size="400,300")
    assert any("image did not load: k1" in ln for ln in console), console
