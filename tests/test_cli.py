"""`hf-retrace`: a user's mistake (a missing file, an invalid value) is one line on stderr and exit status 2, before
any model loads; a bug keeps its traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

import hf_retrace.cli as cli
from hf_retrace.cli import UsageError, check_exists, exits_on_usage_error, looks_like_a_path


ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "training" / "recipes" / "tiny.yaml"


def _usage_error(argv: list[str], capsys, *expected: str) -> str:
    """Runs `hf-retrace ARGV`, asserts status 2 and one stderr line holding every `expected` text; returns it."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    line = captured.err
    assert line.count("\n") == 1 and "Traceback" not in line, line
    assert line.startswith(f"hf-retrace {argv[0]}: error: "), line
    assert all(text in line for text in expected), line
    return line


def _datastore(*extra: str) -> list[str]:
    """`hf-retrace datastore` with a real drafter folder and pool folder (a shipped card, the checkout), then `extra`
    (the last --drafter wins; --pool appends)."""
    card = ROOT / "model_cards" / "smollm2-135m-dflash"
    return ["datastore", "--drafter", str(card), "--pool", str(ROOT), "--output", "/no/out", *extra]


def _recipe(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(TINY.read_text() + text)
    return str(path)


def test_train_with_a_missing_recipe(capsys, tmp_path):
    missing = str(tmp_path / "missing.yaml")
    _usage_error(["train", "--config", missing], capsys, f"--config {missing!r}: no such recipe file")
    _usage_error(["train", f"--config={missing}"], capsys, f"--config {missing!r}: no such recipe file")


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("bogus_field: 3\n", "bogus_field"),  # TrlParser: an unknown recipe field
        ("retrace_mode: sideways\n", "retrace_mode must be one of"),  # ReTraceConfig's validation
        ("dataset_name: ./no/such/rows.jsonl\n", "dataset_name './no/such/rows.jsonl': no such dataset file"),
        ("target_model_name_or_path: /no/such/target\n", "target_model_name_or_path '/no/such/target'"),
    ],
)
def test_train_with_a_bad_recipe_value(capsys, tmp_path, extra, expected):
    _usage_error(["train", "--config", _recipe(tmp_path, extra), "--output_dir", str(tmp_path)], capsys, expected)
    assert not any(tmp_path.glob("checkpoint-*")) and not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--methods", "dflash=/no/such/dir"], "--methods dflash=FOLDER: '/no/such/dir': no such drafter folder"),
        (["--methods", "nonsense"], "cannot parse method 'nonsense'"),
        (["--prompt-sets", "no_such_set:3"], "unknown set 'no_such_set'"),
        (["--prompt-sets", "/no/prompts.jsonl"], "no such prompt file"),
        (["--target", "/no/such/target"], "--target '/no/such/target'"),
        (["--baseline", "nope"], "--baseline 'nope' is not one of --methods"),
    ],
)
def test_bench_with_a_bad_argument(capsys, tmp_path, argv, expected):
    _usage_error(["bench", *argv, "--output-dir", str(tmp_path / "out")], capsys, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate-data", "--mix", "gsm_symbolic"], "name:num_prompts"),
        (["generate-data", "--mix", "no_such_set:3"], "unknown prompt set 'no_such_set'"),
        (["generate-data", "--mix", "gsm_symbolic:20", "--seed", "9990"], "reaches the evaluation seeds"),
        (["build-pool", "--layer-ids", "1,x"], "--layer-ids"),
        (["build-pool", "--features-only", "--pool-dir", "/no/pool"], "--pool-dir '/no/pool': no such pool folder"),
        (["draft-vocab", "--drafter", "/no/d", "--pool", "p", "--size", "8", "--output", "o"], "--drafter '/no/d'"),
        (["analyze", "--drafter", "/no/d:corrected"], "--drafter '/no/d': no such drafter folder"),
        (_datastore("--drafter", "/no/d"), "--drafter '/no/d': no such drafter folder; pass an existing drafter"),
        (_datastore("--drafter", str(ROOT / "examples")), "no config.json there"),
        (_datastore("--pool", "/no/pool:10"), "--pool '/no/pool': no such pool folder"),
        (_datastore("--num-tokens", "0"), "--num-tokens (candidates per lookup) must be >= 1, got 0"),
        (_datastore("--min-ngram-size", "4", "--max-ngram-size", "3"), "need 1 <= --min-ngram-size <= --max-ngram"),
        (["replay", "--drafter", "model_cards/smollm2-135m-dflash"], "expected NAME=FOLDER"),
        (["replay", "--drafter", "d=/no/d"], "--drafter '/no/d': no such drafter folder"),
        (["replay", "--drafter", f"d={ROOT}", "--check-bench", "/no/r.json"], "--check-bench '/no/r.json': no such"),
        (["replay", "--drafter", f"d={ROOT}", "--pool-rows", "0:8", "--pool-dir", "/no/p"], "--pool-dir '/no/p'"),
        (["replay", "--drafter", f"d={ROOT}", "--block-sizes", "16,1"], "expected comma-separated integers >= 2"),
        (["replay", "--drafter", f"d={ROOT}", "--prompt-lookup-num-tokens", "3", "--prompt-lookup-ngram-sizes", "2,3"],
         "expected MAX,MIN"),
    ],
)
def test_data_commands_with_a_bad_argument(capsys, argv, expected):
    """Refused before any model or pool is read."""
    _usage_error(argv, capsys, expected)


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only `UsageError` is reported as a usage error: any other exception of a subcommand propagates."""

    def buggy(argv):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr("hf_retrace.bench.run.main", buggy)
    with pytest.raises(ValueError, match="internal invariant"):
        cli.main(["bench"])


def test_the_decorator_reports_only_usage_errors(capsys):
    @exits_on_usage_error("prog")
    def main(argv):
        if argv == ["bad"]:
            raise UsageError("--x 'bad': use a good one")
        return None

    assert main(["ok"]) == 0 and capsys.readouterr().err == ""
    assert main(["bad"]) == 2 and capsys.readouterr().err == "prog: error: --x 'bad': use a good one\n"


@pytest.mark.parametrize(
    "value, is_path",
    [("owner/name", False), ("name", False), ("/abs/dir", True), ("./rel", True), ("a/b/c", True), ("x.jsonl", True)],
)
def test_looks_like_a_path(value, is_path):
    assert looks_like_a_path(value) is is_path


def test_check_exists(tmp_path):
    check_exists(str(tmp_path), "--x")  # exists
    check_exists("owner/name", "--x")  # may be a Hub repo: left to the loader
    with pytest.raises(UsageError, match="or a Hub repo id"):
        check_exists(str(tmp_path / "missing"), "--x")
    with pytest.raises(UsageError, match=r"pass an existing file$"):
        check_exists("owner/name", "--x", "file", repo_id_ok=False)


@pytest.mark.slow  # fresh interpreters importing torch and trl
@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "hf_retrace.cli", "bench", "--methods", "dflash=/no/such/dir"],
        [sys.executable, str(ROOT / "training" / "train.py"), "--config", "missing.yaml"],
    ],
)
def test_the_console_entry_points_exit_2_with_one_line(command, tmp_path):
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
