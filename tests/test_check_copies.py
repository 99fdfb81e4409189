"""`utils/check_copies.py`: the vLLM plugin's copies of the shared policy files are the originals byte for byte (after
their one header line), and the originals import only the standard library, numpy and each other."""

import importlib.util
import shutil
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check_copies():
    spec = importlib.util.spec_from_file_location("check_copies", REPO / "utils" / "check_copies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plugins_copies_are_the_originals(check_copies):
    assert check_copies.check_copies() == [], "run `python utils/check_copies.py --fix`"
    for name in check_copies.SHARED_FILES:
        copy = (REPO / check_copies.COPIES / name).read_text()
        header = f"# Copied from hf_retrace/models/{name} by utils/check_copies.py --fix; edit the original.\n"
        assert copy == header + (REPO / check_copies.ORIGINALS / name).read_text()


def test_the_shared_files_import_only_the_stdlib_numpy_and_each_other(check_copies):
    assert check_copies.check_imports() == []


def _tree(tmp_path, check_copies) -> Path:
    """A copy of the originals and the copies under `tmp_path`, to break."""
    for folder in (check_copies.ORIGINALS, check_copies.COPIES):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_drift_is_reported_and_fixed(tmp_path, check_copies):
    root = _tree(tmp_path, check_copies)
    name = check_copies.SHARED_FILES[0]
    copy = root / check_copies.COPIES / name
    copy.write_text(copy.read_text() + "# a local edit\n")
    (root / check_copies.COPIES / check_copies.SHARED_FILES[1]).unlink()
    (root / check_copies.COPIES / "stale_retrace.py").write_text("")
    problems = check_copies.check_copies(root)
    assert len(problems) == 3 and f"{name} differs from" in problems[0], problems
    assert "is missing" in problems[1] and "stale_retrace.py is not in SHARED_FILES" in problems[2], problems
    assert check_copies.check_copies(root, fix=True) == []
    assert check_copies.check_copies(root) == []
    assert copy.read_text() == check_copies.expected_copy(name, root)
    assert not (root / check_copies.COPIES / "stale_retrace.py").exists()


def test_an_import_beyond_numpy_is_reported(tmp_path, check_copies):
    root = _tree(tmp_path, check_copies)
    original = root / check_copies.ORIGINALS / check_copies.SHARED_FILES[0]
    original.write_text("import torch\nfrom .modeling_retrace import X\n" + original.read_text())
    problems = check_copies.check_imports(root)
    assert any("imports torch" in p for p in problems) and any(".modeling_retrace" in p for p in problems), problems
