"""training/train.py: recipes parse, the tiny recipe trains and saves a loadable drafter, two CPU ranks (DDP over gloo)
see different data and end with the same weights, and unknown recipe fields fail before any compute."""

import importlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from hf_retrace import ReTraceDrafterModel
from hf_retrace.trainer.setup import build_tiny_target


ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "training" / "recipes" / "tiny.yaml"


def _train_module():
    spec = importlib.util.spec_from_file_location("retrace_train_script", ROOT / "training" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_pool(tmp_path, prompt_lengths: list[int], max_new_tokens: int):
    """A feature cache at `tmp_path / "features"` of the tiny target's greedy answers to random prompts (one per
    entry of `prompt_lengths`); returns (target, items)."""
    from hf_retrace.data.continuous_generation import PromptItem
    from hf_retrace.data.pool import build_pool

    target = build_tiny_target()
    items = [PromptItem(i, "rand", torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(i)).tolist())
             for i, n in enumerate(prompt_lengths)]  # fmt: skip
    build_pool(target, items, tmp_path / "pool", tmp_path / "features", eos_token_ids=set(), layer_ids=[0, 1, 2],
               target_name="tiny-random-qwen3", batch_size=4, max_new_tokens=max_new_tokens)  # fmt: skip
    return target, items


@pytest.mark.parametrize("recipe", sorted((ROOT / "training" / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses(recipe, tmp_path):
    script_args, training_args, _ = (
        _train_module()
        .make_parser()
        .parse_args_and_config(
            ["--config", str(recipe), "--output_dir", str(tmp_path), "--use_cpu", "true"]  # GPU recipes parse here too
        )
    )
    assert training_args.training_mode in ("dflash", "retrace", "retrace_modules_only")
    assert script_args.dataset_name


def test_unknown_recipe_field_fails_before_compute(tmp_path):
    recipe = yaml.safe_load(TINY.read_text()) | {"num_anchor": 8}  # typo of num_anchors
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ValueError, match="num_anchor"):
        _train_module().make_parser().parse_args_and_config(["--config", str(path)])


def _script_module(name: str):
    spec = importlib.util.spec_from_file_location(f"retrace_{name}_script", ROOT / "training" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["train", "generate_data", "build_pool"])
def test_training_scripts_are_thin_entry_points(name):
    """training/*.py only hand over to hf_retrace.scripts (which `hf-retrace` runs too)."""
    package = importlib.import_module(f"hf_retrace.scripts.{name}")
    module = _script_module(name)
    assert module.main is package.main and module.make_parser is package.make_parser
    assert module.cli_main is package.cli_main
    code = [line for line in (ROOT / "training" / f"{name}.py").read_text().split('"""')[-1].splitlines()
            if line.strip() and not line.startswith("#")]  # fmt: skip
    assert len(code) <= 6, code


@pytest.mark.parametrize("command", ["train", "generate-data", "build-pool"])
def test_cli_has_the_training_commands(command, capsys):
    from hf_retrace.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: hf-retrace {command}" in capsys.readouterr().out


def test_cli_train_runs_a_recipe(tmp_path):
    from hf_retrace.cli import main as cli_main

    argv = ["train", "--config", str(TINY), "--output_dir", str(tmp_path), "--max_steps", "1", "--save_strategy", "no"]
    assert cli_main(argv) == 0
    drafter = ReTraceDrafterModel.from_pretrained(tmp_path)
    assert drafter.config.block_size == 4 and drafter.config.num_hidden_layers == 1


def test_accelerate_configs():
    configs = {
        p.stem: yaml.safe_load(p.read_text()) for p in (ROOT / "training" / "accelerate_configs").glob("*.yaml")
    }
    assert {"single_gpu", "multi_gpu", "fsdp2", "zero2", "cpu_2proc"} <= set(configs)
    assert configs["fsdp2"]["fsdp_config"]["fsdp_version"] == 2
    assert configs["fsdp2"]["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "ReTraceDrafterDecoderLayer"
    assert configs["zero2"]["deepspeed_config"]["zero_stage"] == 2
    assert configs["multi_gpu"]["distributed_type"] == "MULTI_GPU"


def test_tiny_recipe_trains_saves_and_drafts_losslessly(tmp_path):
    train = _train_module()
    args = train.make_parser().parse_args_and_config(["--config", str(TINY), "--output_dir", str(tmp_path)])
    trainer = train.main(*args)
    assert trainer.state.global_step == 4
    assert (tmp_path / "checkpoint-2" / "model.safetensors").is_file()
    drafter = ReTraceDrafterModel.from_pretrained(tmp_path).eval()
    target = build_tiny_target()
    prompt = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), target.generate(prompt, **kwargs))


_RECORDING_LAUNCHER = textwrap.dedent(
    """
    # Runs training/train.py unchanged, recording each rank's batches and final weights next to the output.
    import json, os, runpy, sys
    import hf_retrace.trainer.trainer as trainer_module

    seen = []
    compute_loss = trainer_module.ReTraceTrainer.compute_loss
    train = trainer_module.ReTraceTrainer.train

    def recording_compute_loss(self, model, inputs, *args, **kwargs):
        seen.extend(inputs["input_ids"].tolist())
        return compute_loss(self, model, inputs, *args, **kwargs)

    def recording_train(self, *args, **kwargs):
        out = train(self, *args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        params = {n: p.detach().double().sum().item() for n, p in model.named_parameters()}
        path = os.path.join(self.args.output_dir, f"rank{self.args.process_index}.json")
        with open(path, "w") as f:
            json.dump({"world": self.args.world_size, "seen": seen, "params": params}, f)
        return out

    trainer_module.ReTraceTrainer.compute_loss = recording_compute_loss
    trainer_module.ReTraceTrainer.train = recording_train
    sys.argv = [sys.argv[1]] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


@pytest.mark.slow
def test_two_cpu_processes_ddp(tmp_path):
    launcher = tmp_path / "launch_recorded.py"
    launcher.write_text(_RECORDING_LAUNCHER)
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "training" / "accelerate_configs" / "cpu_2proc.yaml"),
        str(launcher), str(ROOT / "training" / "train.py"), "--config", str(TINY), "--output_dir", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(rank["world"] == 2 for rank in ranks)
    seen = [{tuple(row) for row in rank["seen"]} for rank in ranks]
    assert seen[0] and seen[1] and not seen[0] & seen[1]  # each rank trained on its own shard of the data
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP kept the replicas identical
    saved = ReTraceDrafterModel.from_pretrained(out)
    for name, param in saved.named_parameters():
        assert param.double().sum().item() == pytest.approx(ranks[0]["params"][name], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("loss_type, mode", [("ce", "dflash"), ("eal", "retrace")])
def test_cached_feature_training_with_a_reduced_vocabulary(tmp_path, loss_type, mode):
    """train.py on a feature cache (the target's decoder never runs in a step), with a reduced draft vocabulary
    chosen from the responses; the saved drafter keeps its vocabulary and decodes losslessly."""
    target, items = _tiny_pool(tmp_path, [4 + i % 5 for i in range(12)], max_new_tokens=20)
    module = _train_module()
    script_args, training_args, model_args = module.make_parser().parse_args_and_config(
        ["--config", str(TINY), "--output_dir", str(tmp_path / "out"), "--dataset_name", str(tmp_path / "features"),
         "--feature_source", "cached", "--drafter_target_layer_ids", "1", "--drafter_draft_vocab_size", "24",
         "--loss_type", loss_type, "--training_mode", mode, "--verification_features", "teacher_forced",
         "--max_steps", "3", "--save_strategy", "no", "--num_anchors", "6",
         "--max_blocks_per_forward", "4", "--report_to", "none"]
    )  # fmt: skip
    calls = []
    trainer = None
    handle = None
    from hf_retrace.trainer.trainer import ReTraceTrainer

    original = ReTraceTrainer.__init__

    def init(self, *args, **kwargs):
        nonlocal handle
        original(self, *args, **kwargs)
        handle = self.target.get_decoder().register_forward_pre_hook(lambda *a: calls.append(1))

    ReTraceTrainer.__init__ = init
    try:
        trainer = module.main(script_args, training_args, model_args)
    finally:
        ReTraceTrainer.__init__ = original
        if handle is not None:
            handle.remove()
    assert calls == []  # features came from the cache (ReTrace: teacher-forced verification features, also cached)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    drafter = ReTraceDrafterModel.from_pretrained(tmp_path / "out")
    assert drafter.config.draft_vocab_size == 24 and len(drafter.draft_vocab_ids) == 24
    prompt = torch.tensor([items[0].prompt_ids])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0)
    got = target.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0, assistant_model=drafter)
    assert got.tolist() == expected.tolist()


def test_a_pool_folder_trains_online(tmp_path):
    """A pool's token shards as `dataset_name` with `feature_source=online`: the target computes the features in every
    step (what a GPU run does instead of a feature cache), and the last rows are the held-out split."""
    _tiny_pool(tmp_path, [4 + i % 5 for i in range(10)], max_new_tokens=12)
    module = _train_module()
    script_args, training_args, model_args = module.make_parser().parse_args_and_config(
        ["--config", str(TINY), "--output_dir", str(tmp_path / "out"), "--dataset_name", str(tmp_path / "pool"),
         "--feature_source", "online", "--drafter_target_layer_ids", "1", "--max_steps", "2", "--save_strategy", "no",
         "--num_anchors", "4", "--eval_num_rows", "2", "--eval_strategy", "steps", "--eval_steps", "2",
         "--report_to", "none"]
    )  # fmt: skip
    trainer = module.main(script_args, training_args, model_args)
    assert len(trainer.train_dataset) == 8 and len(trainer.eval_dataset) == 2
    assert [c for c in trainer.train_dataset.column_names] == ["input_ids", "loss_mask"]
    evals = [log for log in trainer.state.log_history if "eval_acceptance" in log]
    assert evals and 0 <= evals[-1]["eval_acceptance"] <= 15


def test_prompt_blocks_train_on_the_greedy_chain(tmp_path):
    """completion_only_loss=False on a cache with target ids anchors blocks in prompts too: more supervised slots
    per step from the same rows; without target ids it is a clear error, and ReTrace modes refuse it."""
    from hf_retrace.data.pool import cache_target_ids

    target, _ = _tiny_pool(tmp_path, [12] * 4, max_new_tokens=6)
    module = _train_module()

    def train(*extra):
        argv = ["--config", str(TINY), "--output_dir", str(tmp_path / "out"), "--dataset_name",
                str(tmp_path / "features"), "--feature_source", "cached", "--drafter_target_layer_ids", "1",
                "--training_mode", "dflash", "--max_steps", "2", "--save_strategy", "no", "--num_anchors", "16",
                "--per_device_train_batch_size", "4", "--logging_steps", "1", "--report_to", "none",
                *extra]  # fmt: skip
        trainer = module.main(*module.make_parser().parse_args_and_config(argv))
        return [log["supervised_slots"] for log in trainer.state.log_history if "supervised_slots" in log]

    with pytest.raises(ValueError, match="target_ids"):
        train("--completion_only_loss", "false")
    cache_target_ids(target, tmp_path / "features")
    completions = train()
    everything = train("--completion_only_loss", "false")
    assert len(everything) == len(completions) == 2
    assert all(e > c for e, c in zip(everything, completions))  # 12-token prompts, 6-token responses
    with pytest.raises(ValueError, match="completion_only_loss"):
        train("--completion_only_loss", "false", "--training_mode", "retrace")


def test_held_out_rows_are_evaluated(tmp_path):
    """--eval_num_rows holds out the newest rows of a feature cache: the trainer never trains on them and reports
    their acceptance at every evaluation; an impossible count is a clear error."""
    from hf_retrace.data.pool import load_feature_dataset

    _tiny_pool(tmp_path, [6] * 8, max_new_tokens=8)
    module = _train_module()

    def parse(*extra):
        return module.make_parser().parse_args_and_config(
            ["--config", str(TINY), "--output_dir", str(tmp_path / "out"), "--dataset_name",
             str(tmp_path / "features"), "--feature_source", "cached", "--drafter_target_layer_ids", "1",
             "--training_mode", "dflash",
             "--max_steps", "2", "--save_strategy", "no", "--num_anchors", "4", "--per_device_train_batch_size", "2",
             "--report_to", "none", *extra]
        )  # fmt: skip

    trainer = module.main(*parse("--eval_num_rows", "3", "--eval_strategy", "steps", "--eval_steps", "1",
                                 "--eval_on_start", "true"))  # fmt: skip
    indices = lambda d: sorted(int(i) for i in d["index"])  # noqa: E731
    assert len(trainer.train_dataset) == 5 and len(trainer.eval_dataset) == 3
    assert not set(indices(trainer.train_dataset)) & set(indices(trainer.eval_dataset))
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert [log["step"] for log in evals] == [0, 1, 2]
    assert all(0 <= log["eval_acceptance"] <= 15 for log in evals)
    with pytest.raises(ValueError, match="eval_num_rows=8"):
        module.main(*parse("--eval_num_rows", "8"))
    # continuing on the rows a pool gained: rows 2..4 train, 5..7 evaluate
    trainer = module.main(*parse("--dataset_start_row", "2", "--eval_num_rows", "3"))
    rows = [int(i) for i in load_feature_dataset(tmp_path / "features")["index"]]
    assert [int(i) for i in trainer.train_dataset["index"]] == rows[2:5]
    assert [int(i) for i in trainer.eval_dataset["index"]] == rows[5:]
    with pytest.raises(ValueError, match="dataset_start_row=5"):
        module.main(*parse("--dataset_start_row", "5", "--eval_num_rows", "3"))
    # a pool still growing: rows from dataset_end_row on are ignored, the eval split is the last rows before it
    trainer = module.main(*parse("--dataset_start_row", "1", "--eval_num_rows", "2", "--dataset_end_row", "6"))
    assert [int(i) for i in trainer.train_dataset["index"]] == rows[1:4]
    assert [int(i) for i in trainer.eval_dataset["index"]] == rows[4:6]
    with pytest.raises(ValueError, match="dataset_end_row=9"):
        module.main(*parse("--dataset_end_row", "9"))


def test_a_continued_drafter_keeps_or_reranks_its_vocabulary(tmp_path):
    """drafter_draft_vocab_size on a loaded drafter: the same size keeps its ids (resuming), another size re-ranks
    them on the training rows (the ids only pick rows of the target's head), and the weights carry over."""
    _tiny_pool(tmp_path, [4 + i % 5 for i in range(8)], max_new_tokens=12)
    module = _train_module()

    def train(output, *extra):
        argv = ["--config", str(TINY), "--output_dir", str(tmp_path / output), "--dataset_name",
                str(tmp_path / "features"), "--feature_source", "cached", "--training_mode", "dflash",
                "--max_steps", "1", "--save_strategy", "no", "--num_anchors", "4", "--report_to", "none", *extra]
        module.main(*module.make_parser().parse_args_and_config(argv))  # fmt: skip
        return ReTraceDrafterModel.from_pretrained(tmp_path / output)

    first = train("first", "--drafter_target_layer_ids", "1", "--drafter_draft_vocab_size", "24")
    kept = train("kept", "--drafter_name_or_path", str(tmp_path / "first"), "--drafter_draft_vocab_size", "24",
                 "--learning_rate", "0")  # fmt: skip
    assert kept.draft_vocab_ids.tolist() == first.draft_vocab_ids.tolist()
    assert torch.equal(kept.fc.weight, first.fc.weight)
    larger = train("larger", "--drafter_name_or_path", str(tmp_path / "first"), "--drafter_draft_vocab_size", "40")
    assert larger.config.draft_vocab_size == 40
    assert set(first.draft_vocab_ids.tolist()) < set(larger.draft_vocab_ids.tolist())
