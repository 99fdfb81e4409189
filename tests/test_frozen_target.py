"""The frozen target under accelerate (`hf_retrace.trainer.frozen_target`): in the trainer it is frozen, in eval mode,
on the device and unwrapped, its features and the loss are bit-identical to the old `.to(device)` target on CPU fp32,
mixed precision does not reach it, and the dispatch shards it under FSDP (real FSDP1/FSDP2 on two CPU ranks over
gloo) and ZeRO-3 (a stand-in `deepspeed` module: DeepSpeed is not installed here, and ZeRO-3 needs GPUs)."""

import copy
import os
import socket
import subprocess
import sys
import textwrap
import types
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from conftest import ROOT
from hf_retrace.trainer import trainer as trainer_module
from hf_retrace.trainer.frozen_target import _place_unsharded, gathered_parameters, prepare_frozen_target
from hf_retrace.trainer.setup import build_tiny_target, synthetic_dataset
from hf_retrace.data.target_features import compute_target_features, embed_tokens
from hf_retrace.trainer.trainer import ReTraceTrainer, _draft_head
from test_trainer import collate, fresh_drafter, make_args


LAYER_IDS = [1, 2]  # stops after layer 2 of 4 (the early-stop path); [1, 3] reads the last layer


@pytest.fixture(scope="module")
def dataset():
    return synthetic_dataset(build_tiny_target(seed=0), num_examples=8, prompt_length=6, response_length=18, seed=0)


def make_trainer(target, dataset, tmp_path, **overrides):
    args = make_args(tmp_path, **{"max_steps": 1, "per_device_eval_batch_size": 4, **overrides})
    return ReTraceTrainer(
        model=fresh_drafter(target), target=target, args=args, train_dataset=dataset, eval_dataset=dataset,
        data_collator=collate,
    )  # fmt: skip


def old_preparation(target, accelerator):
    """What the trainer did before `prepare_frozen_target`: the reference of the bit-identity tests."""
    return target.eval().requires_grad_(False).to(accelerator.device), None


def first_batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_trainer_target_is_frozen_in_eval_on_the_device_and_unwrapped(dataset, tmp_path):
    target = build_tiny_target(seed=0).train().requires_grad_(True)
    trainer = make_trainer(target, dataset, tmp_path)
    assert trainer.target is target and trainer._target_engine is None  # the object the objective calls parts of
    assert not any(m.training for m in target.modules())
    assert not any(p.requires_grad for p in target.parameters())
    assert {p.device for p in target.parameters()} == {trainer.accelerator.device}
    assert target not in trainer.accelerator._models  # see the next-but-one test


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_training_and_features_equal_the_old_to_device_target(dataset, tmp_path, monkeypatch, bf16):
    """CPU, fp32 and bf16 mixed precision: two training steps leave the drafter bit-identical to the old
    `.to(device)` target's run, and the target's features are still the fp32 target's own (no autocast wraps it)."""
    trainer = make_trainer(build_tiny_target(seed=0), dataset, tmp_path / "new", bf16=bf16, max_steps=2)
    trainer.train()
    monkeypatch.setattr(trainer_module, "prepare_frozen_target", old_preparation)
    old = make_trainer(build_tiny_target(seed=0), dataset, tmp_path / "old", bf16=bf16, max_steps=2)
    old.train()
    new_state, old_state = trainer.model.state_dict(), old.model.state_dict()
    assert new_state.keys() == old_state.keys()
    assert all(torch.equal(new_state[k], old_state[k]) for k in new_state)
    assert not torch.equal(new_state["fc.weight"], fresh_drafter(trainer.target).state_dict()["fc.weight"])  # trained

    reference = build_tiny_target(seed=0)
    batch = first_batch(trainer)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for layer_ids in (LAYER_IDS, [1, 3]):
        got = compute_target_features(trainer.target, ids, layer_ids, mask)
        assert got.dtype == torch.float32
        assert torch.equal(got, compute_target_features(reference, ids, layer_ids, mask))
    assert torch.equal(embed_tokens(trainer.target, ids), embed_tokens(reference, ids))
    assert "forward" not in vars(trainer.target) and "_original_forward" not in vars(trainer.target)


def test_evaluate_before_train_still_prepares_the_drafter(dataset, tmp_path):
    """A target registered in `accelerator._models` (what `prepare_model` does) makes `Trainer.evaluate()` skip
    preparing the drafter, so under bf16 it would evaluate without autocast."""
    trainer = make_trainer(build_tiny_target(seed=0), dataset, tmp_path, bf16=True)
    assert trainer.accelerator.native_amp
    trainer.evaluate()
    assert getattr(trainer.model, "_is_accelerate_prepared", False) and "_original_forward" in vars(trainer.model)


def fake_accelerator(kind, deepspeed_config=None, fsdp_plugin=None):
    return SimpleNamespace(
        distributed_type=kind, device=torch.device("cpu"), device_placement=True, verify_device_map=lambda m: False,
        state=SimpleNamespace(
            deepspeed_plugin=SimpleNamespace(deepspeed_config=deepspeed_config) if deepspeed_config else None,
            fsdp_plugin=fsdp_plugin,
        ),
        torch_device_mesh=None, parallelism_config=None,
    )  # fmt: skip


def deepspeed_config(stage):
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"},
        "zero_optimization": {
            "stage": stage, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"},
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 7,
        },
    }  # fmt: skip


class FakeEngine(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """A stand-in `deepspeed` module recording `initialize` calls."""
    calls = []

    def initialize(model, config):
        calls.append((model, config))
        return FakeEngine(model), None, None, None

    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(initialize=initialize, calls=calls))
    return calls


def test_zero3_partitions_the_decoder_in_an_inference_engine(fake_deepspeed):
    target = build_tiny_target(seed=0).train()
    config = deepspeed_config(stage=3)
    accelerator = fake_accelerator(DistributedType.DEEPSPEED, deepspeed_config=config)
    prepared, engine = prepare_frozen_target(target, accelerator)
    assert prepared is target and not target.training and not any(p.requires_grad for p in target.parameters())
    [(model, passed)] = fake_deepspeed
    assert model is target.get_decoder() and engine.module is model and not engine.training
    zero = passed["zero_optimization"]
    assert "optimizer" not in passed and "scheduler" not in passed and "offload_optimizer" not in zero
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "none"}
    assert zero["reduce_bucket_size"] == 32 * 32 and zero["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert zero["stage3_param_persistence_threshold"] == 7  # set by the user: kept
    assert passed["bf16"] == {"enabled": False} and passed["fp16"] == {"enabled": False}  # an fp32 target stays fp32
    assert config == deepspeed_config(stage=3)  # the run's own config (the drafter's engine) is untouched


def test_zero3_engine_follows_a_bf16_target(fake_deepspeed):
    accelerator = fake_accelerator(DistributedType.DEEPSPEED, deepspeed_config=deepspeed_config(stage=3))
    prepare_frozen_target(build_tiny_target(seed=0).to(torch.bfloat16), accelerator)
    assert fake_deepspeed[0][1]["bf16"] == {"enabled": True}


@pytest.mark.parametrize(
    "kind, config", [(DistributedType.DEEPSPEED, deepspeed_config(stage=2)), (DistributedType.MULTI_CPU, None)]
)
def test_zero2_and_ddp_replicate_the_target(fake_deepspeed, kind, config):
    target = build_tiny_target(seed=0)
    prepared, engine = prepare_frozen_target(target, fake_accelerator(kind, deepspeed_config=config))
    assert prepared is target and engine is None and fake_deepspeed == []


def test_zero3_features_run_the_decoder_to_its_end():
    """A partitioned layer (`ds_id`) switches off the early stop: the last layer runs, the features are unchanged."""
    target = build_tiny_target(seed=0)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    last_layer_calls = []
    target.model.layers[-1].register_forward_hook(lambda *args: last_layer_calls.append(1))
    expected = compute_target_features(target, ids, LAYER_IDS)
    assert last_layer_calls == []  # the early stop
    for param in target.model.layers.parameters():
        param.ds_id = 0
    assert torch.equal(compute_target_features(target, ids, LAYER_IDS), expected)
    assert last_layer_calls == [1]


class FakeGatheredParameters:
    """DeepSpeed's gather: full values inside the block; after it the gathered buffer is released (reused: zeroed
    here, so a tensor still reading it shows zeros) and the parameter is a placeholder again."""

    def __init__(self, params):
        self.params = params

    def __enter__(self):
        for param in self.params:
            param.data = param.ds_full.clone()

    def __exit__(self, *exc):
        for param in self.params:
            param.data.zero_()
            param.data = torch.empty(0)


@pytest.mark.parametrize("vocab_ids", [None, torch.tensor([3, 5, 6, 7])], ids=["full", "reduced"])
def test_draft_head_of_a_partitioned_lm_head_survives_the_gather(monkeypatch, vocab_ids):
    zero = types.SimpleNamespace(GatheredParameters=FakeGatheredParameters)
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(zero=zero))
    target = build_tiny_target(seed=0)
    weight = target.lm_head.weight
    full = weight.detach().clone()
    weight.ds_id, weight.ds_full = 0, full
    weight.data = torch.empty(0)
    head = _draft_head(target, vocab_ids)
    assert weight.numel() == 0  # released after the gather
    assert torch.equal(head.weight, full if vocab_ids is None else full[vocab_ids])
    with gathered_parameters(target.model.norm) as partitioned:  # a module without ds_id: nothing to gather
        assert partitioned is False


def test_place_unsharded_moves_all_but_the_shards_and_keeps_ties():
    target = build_tiny_target(seed=0, tie_word_embeddings=True)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    kept = target.model.layers[1]
    _place_unsharded(target, torch.device("meta"), skip=(kept,))
    assert target.lm_head.weight is target.model.embed_tokens.weight and target.lm_head.weight.is_meta
    assert all(t.device.type == "cpu" for t in [*kept.parameters(), *kept.buffers()])
    others = [m for i, m in enumerate(target.model.layers) if i != 1] + [target.model.norm, target.model.rotary_emb]
    assert all(t.is_meta for m in others for t in [*m.parameters(), *m.buffers()])


FSDP_RANKS = textwrap.dedent(
    """
    import os, sys
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


    def run(rank, world, port, done):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from hf_retrace.trainer.frozen_target import prepare_frozen_target
        from hf_retrace.trainer.setup import build_tiny_target
        from hf_retrace.data.target_features import compute_target_features, embed_tokens
        from hf_retrace.trainer.trainer import _draft_head

        reference = build_tiny_target(seed=0)
        ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(0))
        for version in (2, 1):
            accelerator = SimpleNamespace(
                distributed_type=DistributedType.FSDP, device=torch.device("cpu"), torch_device_mesh=None,
                parallelism_config=None,
                state=SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version)),
            )
            target, engine = prepare_frozen_target(build_tiny_target(seed=0).train(), accelerator)
            layer = target.get_decoder().layers[0]
            if version == 2:
                shard = layer.mlp.up_proj.weight.to_local()
                assert type(layer).__name__ == "FSDPQwen3DecoderLayer" and shard.shape == (32, 32), shard.shape
            else:
                assert type(layer).__name__ == "FullyShardedDataParallel"
                numel = sum(p.numel() for p in layer.parameters())
                total = sum(p.numel() for p in reference.model.layers[0].parameters())
                assert numel == (total + 1) // 2, (numel, total)
            assert engine is None and not target.training and not any(p.requires_grad for p in target.parameters())
            for _ in range(2):  # gathered and resharded again on every call
                for layer_ids in ([1, 2], [1, 3]):
                    got = compute_target_features(target, ids, layer_ids)
                    assert torch.equal(got, compute_target_features(reference, ids, layer_ids)), (version, layer_ids)
            assert torch.equal(embed_tokens(target, ids), embed_tokens(reference, ids))
            assert torch.equal(_draft_head(target, None).weight, reference.lm_head.weight)
            # One file per rank and version: two ranks printing to one pipe can interleave their lines.
            open(os.path.join(done, f"rank {rank} fsdp{version} ok"), "w").close()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(run, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
    """
)


@pytest.mark.slow
def test_fsdp_shards_the_decoder_layers_on_two_cpu_ranks(tmp_path):
    """Real FSDP2 (`fully_shard`) and FSDP1 over gloo: each rank holds half of every layer, and features, block
    embeddings and draft head equal the unsharded target's bit for bit, on the early-stop and the last-layer path."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "fsdp_ranks.py"
    script.write_text(FSDP_RANKS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = tmp_path / "done"
    done.mkdir()
    out = subprocess.run(
        [sys.executable, str(script), str(port), str(done)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(path.name for path in done.iterdir()) == [
        "rank 0 fsdp1 ok", "rank 0 fsdp2 ok", "rank 1 fsdp1 ok", "rank 1 fsdp2 ok",
    ]  # fmt: skip


def test_fsdp_dispatch_follows_the_plugin_version(monkeypatch):
    """Without a process group: version 2 calls `fully_shard` on every layer with no mixed-precision casting, and
    an unknown version is refused."""
    import torch.distributed.fsdp as fsdp

    from accelerate.utils import FullyShardedDataParallelPlugin

    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kwargs: calls.append((module, kwargs)) or module)
    target = build_tiny_target(seed=0)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    prepare_frozen_target(target, fake_accelerator(DistributedType.FSDP, fsdp_plugin=plugin))
    assert [m for m, _ in calls] == list(target.model.layers)
    policy = calls[0][1]["mp_policy"]
    assert policy.param_dtype is None and policy.reduce_dtype is None and calls[0][1]["reshard_after_forward"] is True
    plugin = copy.copy(plugin)
    plugin.fsdp_version = 3
    with pytest.raises(ValueError, match="FSDP version 3"):
        prepare_frozen_target(build_tiny_target(seed=0), fake_accelerator(DistributedType.FSDP, fsdp_plugin=plugin))
