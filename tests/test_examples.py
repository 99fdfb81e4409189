"""The runnable examples stay runnable (the fast ones; 01_generate.py needs the real target and is the README's
main command)."""

import runpy
from pathlib import Path

import pytest


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


@pytest.mark.slow  # the real 135M target, four generate calls
def test_readme_quickstart_runs_as_written(capsys, monkeypatch):
    """The README's Quickstart block, unmodified, from the repository root (offline default target): it runs, prints
    the text and tau, and every speculative `generate` it makes returns exactly what the same call without the
    assistant returns (target-only greedy), whatever the block names its variables."""
    import re

    from transformers import GenerationMixin

    root = EXAMPLES.parent
    readme = (root / "README.md").read_text()
    code = re.search(r"## Quickstart\n.*?```python\n(.*?)```", readme, flags=re.DOTALL).group(1)
    calls, generate = [], GenerationMixin.generate

    def recording_generate(model, *args, **kwargs):
        out = generate(model, *args, **kwargs)
        calls.append((model, args, kwargs, out))
        return out

    monkeypatch.setattr(GenerationMixin, "generate", recording_generate)
    monkeypatch.chdir(root)
    exec(compile(code, "README.md#quickstart", "exec"), {"__name__": "__main__"})
    monkeypatch.setattr(GenerationMixin, "generate", generate)
    speculative = [call for call in calls if call[2].get("assistant_model") is not None]
    assert speculative, "the Quickstart makes no speculative generate call"
    for model, args, kwargs, out in speculative:
        assert kwargs.get("do_sample") is False, "the Quickstart's lossless claim is for greedy decoding"
        drafter = kwargs["assistant_model"]
        target_only = {k: v for k, v in kwargs.items() if k != "assistant_model"}
        expected = generate(model, *args, **target_only)
        assert out.tolist() == expected.tolist(), "speculative output differs from target-only greedy"
        assert drafter.last_generation_stats.tau >= 1.0
        new_tokens = out.shape[1] - (args[0] if args else kwargs["input_ids"]).shape[1]
        assert new_tokens > 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed and printed[0].strip(), "the Quickstart prints no text"
