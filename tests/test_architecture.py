"""The package dependency rules of docs/architecture, enforced with import-linter."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    res = subprocess.run([exe, "--config", str(REPO / "pyproject.toml")], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "KEPT" in res.stdout and "BROKEN" not in res.stdout


def test_core_imports_without_mlops_packages():
    code = ("import sys, dspark_core.cli.main, dspark_core.engine.decode_one, dspark_core.drafters, dspark_core.model.target;"
            "bad=[m for m in ('mlflow','prefect','duckdb','fastapi','sqlalchemy') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
