"""The batch bench imports another git revision as its own package."""

from pathlib import Path

import pytest


pytestmark = pytest.mark.real


@pytest.mark.skipif(not (Path(__file__).resolve().parents[3] / ".git").exists(), reason="needs the git checkout")
def test_batch_bench_imports_another_revision_as_its_own_package(tmp_path):
    """``dspark bench --suite batch --against REV`` runs REV's engine beside this one in one process: the
    revision's package is extracted under its own name and imports cleanly; a revision git does not
    know is a clear error."""
    import importlib
    import sys
    from dspark_core.bench.batch import _import_revision
    name = _import_revision("HEAD", tmp_path)
    try:
        assert name == "dspark_core_HEAD" and name != "dspark_core"
        old = importlib.import_module(f"{name}.runner")
        assert old.TargetRunner is not importlib.import_module("dspark_core.model.runner").TargetRunner
    finally:
        sys.path.remove(str(tmp_path))
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]
    with pytest.raises(ValueError, match="no-such-revision"):
        _import_revision("no-such-revision", tmp_path / "x")
