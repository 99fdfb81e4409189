"""training/train.py: recipes parse, the tiny recipe trains and saves a loadable drafter, two CPU ranks (DDP over gloo)
see different data and end with the same weights, and unknown recipe fields fail before any compute."""

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
from hf_retrace.training_setup import build_tiny_target


ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "training" / "recipes" / "tiny.yaml"


def _train_module():
    spec = importlib.util.spec_from_file_location("retrace_train_script", ROOT / "training" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    import hf_retrace.trainer as trainer_module

    seen = []
    compute_loss = trainer_module.ReTraceTrainer.compute_loss
    train = trainer_module.ReTraceTrainer.train

    def recording_compute_loss(self, model, inputs, *args, **kwargs):
        seen.extend(inputs["input_ids"].tolist())
        return compute_loss(self, model, inputs, *args, **kwargs)

    def recording_train(self, *args, **kwargs):
        out = train(self, *args, **kwargs)
        params = {n: p.detach().double().sum().item() for n, p in self.accelerator.unwrap_model(self.model).named_parameters()}
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
