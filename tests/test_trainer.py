"""ReTraceTrainer on a tiny target: W_v = 0 parity with the DFlash drafter it starts from, every trainable parameter
trains, resume == uninterrupted, LoRA round trip with lossless generation, and clear errors on bad input."""

import os

import pytest
import torch
from datasets import Dataset

from hf_retrace import ReTraceDrafterModel
from hf_retrace.trainer.trainer import ReTraceTrainer
from hf_retrace.trainer.config import ReTraceConfig
from hf_retrace.trainer.setup import build_tiny_target, synthetic_dataset


B = 4


def collate(rows):
    """Right padding, built directly (tests do not depend on the data module)."""
    width = max(len(r["input_ids"]) for r in rows)
    batch = {k: torch.zeros(len(rows), width, dtype=torch.long) for k in ("input_ids", "loss_mask", "attention_mask")}
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(row["input_ids"])
        batch["loss_mask"][i, :n] = torch.tensor(row["loss_mask"])
        batch["attention_mask"][i, :n] = 1
    return batch


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(seed=0)


@pytest.fixture(scope="module")
def dataset(target):
    return synthetic_dataset(target, num_examples=32, prompt_length=6, response_length=18, seed=0)


def make_args(tmp_path, **overrides):
    defaults = dict(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=4, num_anchors=6,
        max_steps=4, logging_steps=1, save_strategy="no", learning_rate=3e-3, warmup_steps=0, seed=0,
        beta_warmup_steps=2, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    return ReTraceConfig(**{**defaults, **overrides})


def fresh_drafter(target, seed=1):
    torch.manual_seed(seed)
    return ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=B).float()


def train(drafter, target, dataset, args, **kwargs):
    trainer = ReTraceTrainer(
        model=drafter, target=target, args=args, train_dataset=dataset, data_collator=collate, **kwargs
    )
    trainer.train(resume_from_checkpoint=kwargs.pop("resume", None))
    return trainer


@pytest.fixture(scope="module")
def dflash_dir(target, dataset, tmp_path_factory):
    """A briefly DFlash-trained drafter saved with save_pretrained (its W_v is still 0: dflash mode freezes it)."""
    out = tmp_path_factory.mktemp("dflash")
    trainer = train(fresh_drafter(target), target, dataset, make_args(out, training_mode="dflash", max_steps=3))
    trainer.save_model(str(out))
    return out


def _first_loss(trainer):
    return next(log["loss"] for log in trainer.state.log_history if "loss" in log)


def test_dflash_checkpoint_is_a_drafter_folder(dflash_dir, target):
    drafter = ReTraceDrafterModel.from_pretrained(dflash_dir)
    assert os.path.isfile(dflash_dir / "config.json")
    assert torch.count_nonzero(drafter.retrace.value_proj.weight) == 0  # dflash mode never trains ReTrace modules


def test_retrace_step0_equals_dflash_drafter_and_all_params_train(dflash_dir, target, dataset, tmp_path):
    start = ReTraceDrafterModel.from_pretrained(dflash_dir)
    initial = {n: p.detach().clone() for n, p in start.named_parameters()}
    retrace = train(start, target, dataset, make_args(tmp_path / "a", training_mode="retrace", max_steps=4))
    # Same anchors and rounds with the conditioning switched off: the plain DFlash drafter's loss.
    plain = ReTraceDrafterModel.from_pretrained(dflash_dir)
    off = train(plain, target, dataset, make_args(tmp_path / "b", retrace_mode="off", max_steps=1))
    assert _first_loss(retrace) == pytest.approx(_first_loss(off), abs=1e-6)  # W_v = 0 parity at step 0
    trainable = [n for n, p in retrace.model.named_parameters() if p.requires_grad]
    assert any(n.startswith("retrace.") for n in trainable) and any(n.startswith("layers.") for n in trainable)
    unchanged = [n for n, p in retrace.model.named_parameters() if p.requires_grad and torch.equal(p, initial[n])]
    assert unchanged == []
    logs = retrace.state.log_history[0]
    for key in ("loss", "train_acceptance", "conditioned_share", "mean_retained", "gate_norm", "beta"):
        assert key in logs
    assert logs["beta"] == 0.0 and retrace.state.log_history[-2]["beta"] == 1.0  # linear warm-up over 2 steps
    assert retrace.model.retrace.beta == 1.0  # inference value after training


@pytest.mark.parametrize(
    "mode, retrace_mode, trained_prefixes",
    [
        ("dflash", None, {"fc", "hidden_norm", "layers", "norm"}),
        ("retrace_modules_only", None, {"retrace"}),
        ("retrace", "gated", {"fc", "hidden_norm", "layers", "norm", "retrace"}),
    ],
)
def test_training_modes_freeze_what_they_do_not_train(target, dataset, tmp_path, mode, retrace_mode, trained_prefixes):
    args = make_args(tmp_path, training_mode=mode, retrace_mode=retrace_mode, max_steps=2, beta_warmup_steps=0)
    trainer = train(fresh_drafter(target), target, dataset, args)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert {n.split(".")[0] for n in trainable} == trained_prefixes
    if retrace_mode == "gated":  # no correction in gated mode: W_c gets no gradient and stays frozen
        assert "retrace.correction.weight" not in trainable


def test_retrace_learning_rate_gives_the_modules_their_own_rate(dflash_dir, target, dataset, tmp_path):
    args = make_args(tmp_path, max_steps=1, learning_rate=1e-3, retrace_learning_rate=2e-2, beta_warmup_steps=0)
    trainer = train(ReTraceDrafterModel.from_pretrained(dflash_dir), target, dataset, args)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    grouped = []
    for group in trainer.optimizer.param_groups:
        kinds = {names[id(p)].startswith("retrace.") for p in group["params"]}
        assert len(kinds) == 1  # a group is all ReTrace modules or all backbone
        assert group["initial_lr"] == (2e-2 if kinds.pop() else 1e-3)
        grouped += [names[id(p)] for p in group["params"]]
    assert sorted(grouped) == sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    # Adam's first step moves each parameter by about its group's rate: W_v (0 before) by ~2e-2, the backbone ~1e-3
    start = ReTraceDrafterModel.from_pretrained(dflash_dir)
    assert trainer.model.retrace.value_proj.weight.abs().max().item() == pytest.approx(2e-2, rel=0.05)
    moved = (trainer.model.layers[0].mlp.down_proj.weight - start.layers[0].mlp.down_proj.weight).abs().max().item()
    assert moved == pytest.approx(1e-3, rel=0.05)


@pytest.mark.parametrize("verification", ["faithful", "teacher_forced"])
def test_resume_equals_uninterrupted(target, dataset, tmp_path, verification):
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, verification_features=verification)
    full = train(fresh_drafter(target), target, dataset, args)
    resumed = ReTraceTrainer(
        model=fresh_drafter(target, seed=5), target=target, args=args, train_dataset=dataset, data_collator=collate
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_lora_trains_saves_loads_and_generates_losslessly(dflash_dir, target, dataset, tmp_path):
    from peft import LoraConfig, PeftModel

    args = make_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=3)
    trainer = train(ReTraceDrafterModel.from_pretrained(dflash_dir), target, dataset, args,
                    peft_config=LoraConfig(r=4, lora_alpha=8))  # fmt: skip
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable) and any("retrace.modules_to_save" in n for n in trainable)
    assert not any(".fc." in n or n.endswith("norm.weight") for n in trainable)  # backbone frozen except LoRA
    live = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    trainer.save_model(str(tmp_path / "merged"))
    for name, value in trainer.model.state_dict().items():  # merged in place, then unmerged: the live model is intact
        torch.testing.assert_close(value, live[name], msg=name)

    merged = ReTraceDrafterModel.from_pretrained(tmp_path / "merged").eval()
    assert set(merged.state_dict()) == set(ReTraceDrafterModel.from_pretrained(dflash_dir).state_dict())
    assert torch.count_nonzero(merged.retrace.value_proj.weight) > 0  # the ReTrace modules trained fully
    adapter = PeftModel.from_pretrained(ReTraceDrafterModel.from_pretrained(dflash_dir), tmp_path / "checkpoint-3")
    for (name, a), (_, b) in zip(adapter.merge_and_unload().state_dict().items(), merged.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)

    prompt = torch.tensor([dataset[0]["input_ids"][:6]])
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = target.generate(prompt, **kwargs)
    assert torch.equal(target.generate(prompt, assistant_model=merged, **kwargs), expected)


def test_error_target_without_drafter_layers(target, dataset, tmp_path):
    drafter = ReTraceDrafterModel.from_target(
        build_tiny_target(num_hidden_layers=8), num_hidden_layers=1, block_size=B, target_layer_ids=[6]
    )
    with pytest.raises(ValueError, match="target_layer_ids"):
        ReTraceTrainer(model=drafter, target=target, args=make_args(tmp_path), train_dataset=dataset)


def test_error_hidden_size_mismatch(target, dataset, tmp_path):
    drafter = ReTraceDrafterModel.from_target(build_tiny_target(hidden_size=64, head_dim=16), num_hidden_layers=1)
    with pytest.raises(ValueError, match="hidden_size"):
        ReTraceTrainer(model=drafter, target=target, args=make_args(tmp_path), train_dataset=dataset)


@pytest.mark.parametrize(
    "rows, match",
    [
        ({"input_ids": [[1, 2, 3, 4]] * 2, "loss_mask": [[0, 0, 0, 0]] * 2}, "no response tokens"),
        ({"input_ids": [[1, 2, 3, 4]], "loss_mask": [[0, 1, 0, 1]]}, "no response tokens"),  # no anchor + next
        ({"messages": [["hi"]]}, "tokenize"),
    ],
)
def test_error_bad_dataset(target, tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        ReTraceTrainer(
            model=fresh_drafter(target), target=target, args=make_args(tmp_path), train_dataset=Dataset.from_dict(rows)
        )


def test_error_block_size_mismatch(target, dataset, tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        ReTraceTrainer(
            model=fresh_drafter(target), target=target, args=make_args(tmp_path, block_size=8), train_dataset=dataset
        )


@pytest.mark.parametrize(
    "field, value",
    [
        ("training_mode", "eagle"), ("verification_features", "oracle"), ("retrace_mode", "both"), ("num_anchors", 0),
        ("retrace_learning_rate", 0.0), ("distillation_weight", -1.0),
    ],  # fmt: skip
)
def test_error_bad_config_value(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        make_args(tmp_path, **{field: value})


def test_error_distillation_outside_dflash_mode(tmp_path):
    with pytest.raises(ValueError, match="training_mode='dflash' only"):
        make_args(tmp_path, training_mode="retrace", distillation_weight=0.5)


def test_evaluate_reports_loss_and_acceptance_deterministically(target, dataset, tmp_path):
    args = make_args(tmp_path, max_steps=1, eval_strategy="no", per_device_eval_batch_size=4)
    trainer = ReTraceTrainer(
        model=fresh_drafter(target), target=target, args=args, train_dataset=dataset, eval_dataset=dataset,
        data_collator=collate,
    )  # fmt: skip
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first["eval_loss"] == second["eval_loss"] > 0
    assert {"eval_acceptance", "eval_conditioned_share", "eval_beta"} <= set(first)


def test_target_arguments_follow_trl_and_the_old_name_still_works(tmp_path):
    with pytest.warns(FutureWarning, match="target_name_or_path` is deprecated"):
        old = ReTraceConfig(str(tmp_path), target_name_or_path="tiny-random-qwen3", use_cpu=True)
    assert old.target_model_name_or_path == "tiny-random-qwen3" and old.target_name_or_path is None
    with pytest.raises(ValueError, match="disagree"), pytest.warns(FutureWarning):
        ReTraceConfig(str(tmp_path), target_name_or_path="a/b", target_model_name_or_path="c/d", use_cpu=True)
    args = ReTraceConfig(str(tmp_path), target_model_init_kwargs='{"attn_implementation": "eager"}', use_cpu=True)
    assert args.target_model_init_kwargs == {"attn_implementation": "eager"}  # a JSON string from the command line
    with pytest.raises(ValueError, match="target_dtype"):
        ReTraceConfig(str(tmp_path), target_model_init_kwargs={"dtype": "float16"}, use_cpu=True)


def test_target_model_init_kwargs_reach_from_pretrained(tmp_path):
    from tokenizers import Tokenizer, models

    from transformers import PreTrainedTokenizerFast

    from hf_retrace.trainer.setup import load_target

    build_tiny_target().save_pretrained(tmp_path / "target")
    vocab = {f"w{i}": i for i in range(128)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0"))).save_pretrained(
        tmp_path / "target"
    )
    for implementation in ("eager", "sdpa"):
        target, tokenizer = load_target(str(tmp_path / "target"), "float32", {"attn_implementation": implementation})
        assert target.config._attn_implementation == implementation and tokenizer is not None
    with pytest.raises(ValueError, match="path/Hub targets"):
        load_target("tiny-random-qwen3", "float32", {"attn_implementation": "eager"})


@pytest.mark.parametrize(
    "step, max_steps, warmup, beta",
    [(0, 10, 4, 0.0), (1, 10, 4, 0.25), (3, 10, 4, 0.75), (4, 10, 4, 1.0), (9, 10, 4, 1.0), (0, 10, 0, 1.0),
     (1, 20, None, 0.5), (2, 20, None, 1.0)],  # None: 10% of max_steps
)  # fmt: skip
def test_beta_warmup_schedule(step, max_steps, warmup, beta):
    from hf_retrace.trainer.callbacks import warmed_up_beta

    assert warmed_up_beta(step, max_steps, warmup) == beta


def test_save_writes_a_model_card_with_the_trainer_tags(dflash_dir, target, dataset, tmp_path):
    from huggingface_hub import ModelCard

    from hf_retrace.hub.model_card import CARD_TAGS

    card = ModelCard.load(dflash_dir / "README.md")  # written by the fixture's trainer.save_model
    assert set(CARD_TAGS) | set(ReTraceTrainer._tag_names) <= set(card.data.tags)
    assert card.data.base_model is None  # the tiny target has no Hub id
    assert f'"{dflash_dir.name}"' in card.text  # the usage snippet names the folder (no hub_model_id)
    drafter = fresh_drafter(target)
    drafter.generation_config.update(num_assistant_tokens=2, prompt_lookup_num_tokens=5)
    trainer = ReTraceTrainer(model=drafter, target=target, train_dataset=dataset, data_collator=collate,
                             args=make_args(tmp_path, hub_model_id="org/my-drafter", max_steps=1))  # fmt: skip
    trainer.create_model_card(tags=["extra"])
    card = ModelCard.load(tmp_path / "README.md")
    assert "extra" in card.data.tags and '"org/my-drafter"' in card.text
    # the decoding settings are the drafter's generation_config, not defaults
    assert "the drafter still drafts its whole block) | 2 |" in card.text and "skips that cycle) | 5 |" in card.text
    assert set(ReTraceTrainer._tag_names) <= set(trainer.model.model_tags)


def test_card_base_model_is_the_target_hub_id_only(tmp_path):
    from hf_retrace.trainer.trainer import _hub_id_of_target

    assert _hub_id_of_target("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "local").mkdir()
    assert _hub_id_of_target(str(tmp_path / "org" / "local")) is None and _hub_id_of_target("") is None
