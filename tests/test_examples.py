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
