"""Secrets stay out of what others can read: `ps` (command lines) and printed URIs."""
import os
import subprocess
import sys

import psutil
import pytest

from helpers import ROOT, free_port
from infra.mlflow import serve
from infra.tracking import redact


@pytest.mark.parametrize("uri, shown", [
    ("postgresql://mlflow:s3cret@db/mlflow", "postgresql://mlflow:***@db/mlflow"),
    ("postgresql://mlflow:pa/ss@db/mlflow", "postgresql://mlflow:***@db/mlflow"),      # "/" in the password
    ("https://u:p@ss@w0rd@mlflow.internal/x", "https://u:***@mlflow.internal/x"),      # "@" in it
    ("error at http://u:a:b@h:5000 and s3://bucket/key", "error at http://u:***@h:5000 and s3://bucket/key"),
])
def test_redact_hides_any_password(uri, shown):
    assert redact(uri) == shown


def test_a_password_on_the_serve_command_line_is_refused():
    out = subprocess.run([sys.executable, "-m", "infra.mlflow.serve", "--backend-store-uri",
                          "postgresql://mlflow:s3cret@127.0.0.1:9/mlflow"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "pass the URI in MLFLOW_BACKEND_STORE_URI instead" in out.stderr and "s3cret" not in out.stderr


@pytest.mark.slow
def test_the_server_reads_its_store_from_the_environment_not_argv(tmp_path):
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    backend = f"sqlite:///{db}"
    proc, url = serve.start(tmp_path / "root", free_port(), backend_uri=backend)
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        lines = [" ".join(p.cmdline()) for p in procs]
        assert lines and not any(str(db) in line for line in lines), lines
        assert db.is_file()                                    # the server used the store it was given
        assert not (tmp_path / "root" / "mlflow.db").exists()  # not the default
    finally:
        serve.stop(proc)
