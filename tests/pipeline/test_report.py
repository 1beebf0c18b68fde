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
