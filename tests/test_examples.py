"""The runnable examples stay runnable (the fast ones; 01_generate.py needs the real target and is the README's
main command)."""

import runpy
from pathlib import Path


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_train_tiny_example_trains_and_decodes_losslessly(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLES / "02_train_tiny.py"), run_name="__main__")
    assert "lossless; tau =" in capsys.readouterr().out


def test_lazy_training_exports():
    import hf_retrace
    from hf_retrace.trainer.trainer import ReTraceTrainer

    assert hf_retrace.ReTraceTrainer is ReTraceTrainer
    assert hf_retrace.ReTraceConfig.__name__ == "ReTraceConfig"


def test_readme_quickstart_runs_as_written(capsys, monkeypatch):
    """The README's Quickstart block, unmodified, from the repository root (offline default target)."""
    import re

    root = EXAMPLES.parent
    readme = (root / "README.md").read_text()
    code = re.search(r"## Quickstart\n.*?```python\n(.*?)```", readme, flags=re.DOTALL).group(1)
    monkeypatch.chdir(root)
    exec(compile(code, "README.md#quickstart", "exec"), {"__name__": "__main__"})
    text, stats = capsys.readouterr().out.strip().splitlines()[-2:]
    assert text.strip() and float(stats.split()[0]) >= 1.0
