"""training/accelerate_configs/{fsdp2,zero2}.yaml beyond a YAML snapshot: each goes through accelerate's own launcher
parsing (`accelerate launch --config_file ...` up to the environment it hands the processes), and the plugin each
process would build from that environment is built here and applied to a real drafter.

What CPU cannot show: accelerate engages FSDP and DeepSpeed only on GPUs (on CPU a launch with these configs trains
without sharding), and DeepSpeed is not installed here; the GPU run itself is left to a device check.
"""

import argparse
from pathlib import Path

import pytest
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from conftest import make_drafter, make_target
from hf_retrace.models.modeling_retrace import ReTraceDrafterDecoderLayer


CONFIGS = Path(__file__).resolve().parents[1] / "training" / "accelerate_configs"


def launch_args(config_file: Path) -> tuple[argparse.Namespace, object]:
    """What `accelerate launch --config_file CONFIG training/train.py` resolves before starting processes (the
    config merged into the launch arguments; accelerate's own code, private in 1.x)."""
    args = launch_command_parser().parse_args(["--config_file", str(config_file), "training/train.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as `launch_command` does before the DeepSpeed launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args, defaults


def set_launch_env(monkeypatch, env: dict[str, str]) -> None:
    """The accelerate/FSDP part of a launched process's environment (nothing else of this process changes)."""
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)


def fsdp_plugin(monkeypatch, config_file: Path) -> FullyShardedDataParallelPlugin:
    args, _ = launch_args(config_file)
    assert args.use_fsdp and not args.use_deepspeed
    set_launch_env(monkeypatch, prepare_multi_gpu_env(args))
    return FullyShardedDataParallelPlugin()  # reads FSDP_* as every launched process does


def test_fsdp2_config_wraps_the_drafter_decoder_layers(monkeypatch):
    plugin = fsdp_plugin(monkeypatch, CONFIGS / "fsdp2.yaml")
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # save_model writes one loadable safetensors file
    plugin.set_auto_wrap_policy(make_drafter(make_target()))  # resolves the class name against the real drafter
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {ReTraceDrafterDecoderLayer}


def test_fsdp_config_with_a_wrong_layer_class_is_refused(monkeypatch, tmp_path):
    """The check above can fail: a layer class the drafter does not have is an error when the policy is built."""
    config = yaml.safe_load((CONFIGS / "fsdp2.yaml").read_text())
    config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "Qwen3DecoderLayer"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    plugin = fsdp_plugin(monkeypatch, tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="Qwen3DecoderLayer"):
        plugin.set_auto_wrap_policy(make_drafter(make_target()))


def test_zero2_config_gives_a_stage_2_deepspeed_plugin(monkeypatch):
    args, _ = launch_args(CONFIGS / "zero2.yaml")
    assert args.use_deepspeed and args.num_processes == 8
    command, env = prepare_deepspeed_cmd_env(args)
    assert command is None  # one machine: accelerate's torchrun path, not the `deepspeed` multi-node runner
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    set_launch_env(monkeypatch, env)
    plugin = DeepSpeedPlugin()  # reads ACCELERATE_DEEPSPEED_* as every launched process does
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == 2 and zero["stage"] == 2
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "none"
    # batch sizes and clipping are left to the Trainer's arguments ("auto"), so recipes stay the one source
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"
