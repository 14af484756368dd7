"""The batch and bootstrap benches import another git revision as its own package (``--against REV``)."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the git checkout")


def _flat_layout_revision() -> str | None:
    """A revision whose dspark_core still has the flat module names (``dspark_core/runner.py``), if the
    clone's history has one."""
    res = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%H", "--", "dspark_core/runner.py"],
                         capture_output=True, text=True)
    last_change = res.stdout.strip()        # the commit that moved it away
    return f"{last_change}~1" if res.returncode == 0 and last_change else None


def _forget(name: str, folder: Path) -> None:
    sys.path.remove(str(folder))
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def test_another_revision_imports_as_its_own_package_with_its_own_modules(tmp_path):
    """``--against HEAD`` runs HEAD's engine beside this one in one process: the revision's package is
    extracted under its own name, and its modules import one another, never this package's; a revision
    git does not know is a clear error."""
    from dspark_core.bench.batch import _import_revision, revision_module
    name = _import_revision("HEAD", tmp_path)
    try:
        assert name == "dspark_core_HEAD"
        runner = revision_module(name, "runner")
        assert runner.__name__.startswith(name + ".")
        assert runner.TargetRunner is not importlib.import_module("dspark_core.model.runner").TargetRunner
        spec_batch = revision_module(name, "spec_batch")
        assert spec_batch.run_requests.__module__.startswith(name + ".")
        assert all(m.startswith(name) for m in (spec_batch.AcceptanceStats.__module__, spec_batch.SamplingParams.__module__))
        for role in ("target", "drafters", "sampling", "plain_batch", "inputs", "policy"):
            assert revision_module(name, role).__name__.startswith(name + ".")
    finally:
        _forget(name, tmp_path)
    with pytest.raises(ValueError, match="no-such-revision"):
        _import_revision("no-such-revision", tmp_path / "x")


def test_a_revision_with_the_flat_module_layout_still_imports(tmp_path):
    """Revisions from before the package layout (``dspark_core.runner``, ``dspark_core.batch``,
    ``dspark_core.proposers``) serve every role the suites call under their flat names."""
    from dspark_core.bench.batch import REVISION_MODULES, _import_revision, revision_module
    rev = _flat_layout_revision()
    if rev is None:
        pytest.skip("no revision with the flat layout in this clone's history")
    name = _import_revision(rev, tmp_path)
    try:
        got = {role: revision_module(name, role).__name__ for role in REVISION_MODULES}
        assert got == {role: f"{name}.{names[-1]}" for role, names in REVISION_MODULES.items()}
        assert hasattr(importlib.import_module(f"{name}.proposers"), "build_proposer")
        assert hasattr(importlib.import_module(f"{name}.batch"), "generate_batch")
    finally:
        _forget(name, tmp_path)
