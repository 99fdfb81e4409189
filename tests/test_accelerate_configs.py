"""training/accelerate_configs/*.yaml through accelerate's public API: every config loads with accelerate's own
config class (which refuses unknown keys), asks for the launcher it is named for, and the plugin each process
builds from it applies to a real drafter: FSDP2 wraps the drafter's decoder layers, ZeRO-2 is stage 2 without
offload. One config is launched for real (`accelerate launch --config_file ... training/train.py --help`).

What CPU cannot show: accelerate engages FSDP and DeepSpeed only on GPUs (on CPU a launch with these configs trains
without sharding), and DeepSpeed is not installed here; the GPU run itself is left to a device check.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

from conftest import make_drafter, make_target
from hf_retrace.models.modeling_retrace import ReTraceDrafterDecoderLayer, ReTraceDrafterModel


ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "training" / "accelerate_configs"
EXPECTED = {  # config -> (distributed type, processes)
    "single_gpu.yaml": (DistributedType.NO, 1),
    "cpu_2proc.yaml": (DistributedType.MULTI_GPU, 2),  # torchrun's launcher; the recipe's use_cpu makes CPU ranks
    "multi_gpu.yaml": (DistributedType.MULTI_GPU, 8),
    "fsdp2.yaml": (DistributedType.FSDP, 8),
    "zero2.yaml": (DistributedType.DEEPSPEED, 8),
}


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerates_config_class(name):
    config = ClusterConfig.from_yaml_file(CONFIGS / name)
    assert (config.distributed_type, config.num_processes) == EXPECTED[name]
    assert config.num_machines == 1 and config.use_cpu is False


def test_a_mistyped_key_is_refused(tmp_path):
    """The check above can fail: accelerate refuses a key it does not know (here a typo of `num_processes`)."""
    config = yaml.safe_load((CONFIGS / "multi_gpu.yaml").read_text())
    config["num_process"] = config.pop("num_processes")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="unknown keys"):
        ClusterConfig.from_yaml_file(tmp_path / "typo.yaml")


def _fsdp_plugin(fsdp_config: dict) -> FullyShardedDataParallelPlugin:
    """The plugin of an `fsdp_config` block, through the plugin's public constructor."""
    assert fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    return FullyShardedDataParallelPlugin(
        fsdp_version=fsdp_config["fsdp_version"],
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=fsdp_config["fsdp_transformer_layer_cls_to_wrap"],
        reshard_after_forward=fsdp_config["fsdp_reshard_after_forward"],
        state_dict_type=fsdp_config["fsdp_state_dict_type"],
        cpu_offload=fsdp_config["fsdp_offload_params"],
    )


def test_fsdp2_config_wraps_the_drafter_decoder_layers():
    fsdp_config = ClusterConfig.from_yaml_file(CONFIGS / "fsdp2.yaml").fsdp_config
    assert fsdp_config["fsdp_transformer_layer_cls_to_wrap"] in ReTraceDrafterModel._no_split_modules
    plugin = _fsdp_plugin(fsdp_config)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # save_model writes one loadable safetensors file
    plugin.set_auto_wrap_policy(make_drafter(make_target()))  # resolves the class name against the real drafter
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {ReTraceDrafterDecoderLayer}


def test_fsdp_config_with_a_wrong_layer_class_is_refused():
    """The check above can fail: a layer class the drafter does not have is an error when the policy is built."""
    fsdp_config = ClusterConfig.from_yaml_file(CONFIGS / "fsdp2.yaml").fsdp_config
    plugin = _fsdp_plugin({**fsdp_config, "fsdp_transformer_layer_cls_to_wrap": "Qwen3DecoderLayer"})
    with pytest.raises(ValueError, match="Qwen3DecoderLayer"):
        plugin.set_auto_wrap_policy(make_drafter(make_target()))


def test_zero2_config_gives_a_stage_2_deepspeed_plugin():
    deepspeed_config = ClusterConfig.from_yaml_file(CONFIGS / "zero2.yaml").deepspeed_config
    parameters = inspect.signature(DeepSpeedPlugin).parameters
    plugin = DeepSpeedPlugin(**{k: v for k, v in deepspeed_config.items() if k in parameters})
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == 2 and zero["stage"] == 2
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "none"
    # batch sizes and clipping are left to the Trainer's arguments ("auto"), so recipes stay the one source
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"


@pytest.mark.slow  # ~10 s: accelerate's launcher starts training/train.py in a fresh interpreter
def test_accelerate_launch_starts_the_training_script():
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "--config_file", str(CONFIGS / "single_gpu.yaml"), "training/train.py",
               "--help"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: hf-retrace train") and "--retrace_mode" in done.stdout
