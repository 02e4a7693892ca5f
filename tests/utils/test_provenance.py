import re
import subprocess

from megarl.utils.provenance import ROOT, source_commit


def test_commit_from_the_environment_first_then_git(monkeypatch):
    monkeypatch.setenv("MEGARL_COMMIT", "43daa22")
    assert source_commit() == "43daa22"
    monkeypatch.delenv("MEGARL_COMMIT")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}", head) and source_commit() == head


def test_a_tree_without_git_says_unknown(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGARL_COMMIT", raising=False)
    monkeypatch.setattr("megarl.utils.provenance.ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert source_commit() == "unknown"
