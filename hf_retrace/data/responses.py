"""Training data for the drafter: the target's own responses to a prompt pool, tokenized with a response-only loss
mask, and the collator that pads them (DESIGN.md Sec. 3: "Responses are the TARGET's own generations")."""

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, load_from_disk
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from . import IGNORE_INDEX


logger = logging.get_logger(__name__)

_DATASET_DIR = "dataset"
_SHARDS_DIR = "shards"


def _fingerprint(target, tokenizer, prompts: list[list[dict]], settings: dict) -> str:
    """Hash of everything that changes the generated responses (not of `save_every` or the output folder)."""
    payload = {
        "target": str(target.config.name_or_path),
        "target_config": target.config.to_diff_dict(),
        "dtype": str(target.dtype),
        "chat_template": tokenizer.chat_template,
        "vocab_size": len(tokenizer),
        "prompts": prompts,
        "settings": settings,
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, width - len(seq) :] = 1
    return input_ids, attention_mask


def _trim_response(ids: list[int], eos_token_ids: set[int]) -> tuple[list[int], bool]:
    """Cuts a generated row after its first end-of-sequence token (kept); later tokens are padding."""
    for i, token in enumerate(ids):
        if token in eos_token_ids:
            return ids[: i + 1], True
    return ids, False


def _load_shards(shard_dir: Path) -> dict[int, dict]:
    records = {}
    for path in sorted(shard_dir.glob("*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                records[record["index"]] = record
    return records


def _write_shard(shard_dir: Path, name: str, records: list[dict]) -> None:
    tmp = shard_dir / f".{name}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, shard_dir / f"{name}.jsonl")  # atomic: an interrupted write never leaves a half shard


def _generation_kwargs(target, tokenizer, max_new_tokens, do_sample, temperature, top_p) -> tuple[dict, set[int]]:
    """`generate` kwargs, plus the ids that end a response (the target's generation config first)."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad_token_id, top_k=None)
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p)
    else:  # greedy: silence sampling defaults a generation_config may carry
        kwargs.update(temperature=None, top_p=None)
    return kwargs, set(eos if isinstance(eos, list) else [eos])


def _generate_batch(target, batch_prompt_ids, generation_kwargs, eos_token_ids, seed) -> list[tuple[list[int], bool]]:
    input_ids, attention_mask = _left_pad(batch_prompt_ids, generation_kwargs["pad_token_id"])
    torch.manual_seed(seed)  # per-batch seed: a resumed sampling run draws exactly what an uninterrupted one would
    with torch.inference_mode():
        out = target.generate(
            input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device), **generation_kwargs
        )
    new_tokens = out[:, input_ids.shape[1] :].tolist()  # [B, T_new]
    return [_trim_response(row, eos_token_ids) for row in new_tokens]


def generate_responses(
    target,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[dict]],
    output_dir: str | os.PathLike,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    save_every: int = 1,
) -> Dataset:
    """Regenerates responses to `prompts` with the target itself (batched, left-padded), resumably and cached.

    Prompts are sorted by tokenized length into fixed batches (less padding); every `save_every` batches the finished
    rows are written as a JSONL shard under `output_dir/<fingerprint>/shards`. A rerun with the same target, prompts
    and settings skips finished batches, and once all are done returns the cached `datasets` folder
    `output_dir/<fingerprint>/dataset` without generating anything. Greedy results are identical whether or not a
    run was interrupted (batches are fixed; sampling reseeds with `seed + batch_index`).

    Args:
        target (`PreTrainedModel`): the target (causal LM) whose responses are wanted.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer, with a chat template.
        prompts (`list[list[dict]]`): chat conversations, e.g. from `hf_retrace.data.prompts.load_prompts`.
        output_dir (`str` or `os.PathLike`): cache root; results go in a sub-folder named by the fingerprint.
        max_new_tokens (`int`, *optional*, defaults to 256): generation budget per prompt.
        batch_size (`int`, *optional*, defaults to 32): prompts per `generate` call.
        do_sample (`bool`, *optional*, defaults to `False`): greedy decoding when `False`.
        temperature (`float`, *optional*, defaults to 1.0), top_p (`float`, *optional*, defaults to 1.0): sampling.
        seed (`int`, *optional*, defaults to 0): sampling seed.
        save_every (`int`, *optional*, defaults to 1): batches per checkpoint shard (not part of the fingerprint).

    Returns:
        `Dataset` in prompt order with columns `index` (`int`), `messages` (the prompt plus the assistant response),
        `response_ids` (`list[int]`, the exact generated tokens, end-of-sequence included when reached) and
        `finished` (`bool`, whether an end-of-sequence token was generated within `max_new_tokens`).
    """
    settings = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, do_sample=do_sample, seed=seed)
    if do_sample:
        settings.update(temperature=temperature, top_p=top_p)
    run_dir = Path(output_dir) / _fingerprint(target, tokenizer, prompts, settings)
    if (run_dir / _DATASET_DIR / "dataset_info.json").is_file():
        logger.info(f"Loading cached responses from {run_dir / _DATASET_DIR}")
        return load_from_disk(str(run_dir / _DATASET_DIR))
    shard_dir = run_dir / _SHARDS_DIR
    shard_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "settings.json").write_text(json.dumps(dict(settings, target=target.config.name_or_path), indent=2))

    generation_kwargs, eos_token_ids = _generation_kwargs(
        target, tokenizer, max_new_tokens, do_sample, temperature, top_p
    )
    all_prompt_ids = [_prompt_ids(tokenizer, messages) for messages in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (len(all_prompt_ids[i]), i))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    records = _load_shards(shard_dir)
    pending = [b for b, batch in enumerate(batches) if any(i not in records for i in batch)]
    if len(pending) < len(batches):
        logger.info(f"Resuming: {len(batches) - len(pending)}/{len(batches)} batches already generated in {run_dir}")

    buffer, new_tokens, start = [], 0, time.perf_counter()
    progress = tqdm(pending, desc="generating responses", unit="batch")
    for count, b in enumerate(progress, 1):
        batch = batches[b]
        batch_prompt_ids = [all_prompt_ids[i] for i in batch]
        outputs = _generate_batch(target, batch_prompt_ids, generation_kwargs, eos_token_ids, seed + b)
        for i, (response_ids, finished) in zip(batch, outputs):
            buffer.append({"index": i, "response_ids": response_ids, "finished": finished})
            new_tokens += len(response_ids)
        progress.set_postfix(tok_per_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
        if count % save_every == 0 or count == len(pending):
            _write_shard(shard_dir, f"batch_{b:06d}", buffer)
            records.update({r["index"]: r for r in buffer})
            buffer = []
            logger.info(
                f"{len(records)}/{len(prompts)} responses in {run_dir.name}; "
                f"{new_tokens} new tokens at {new_tokens / (time.perf_counter() - start):.1f} tok/s"
            )
    return _finalize(tokenizer, prompts, records, run_dir)


def _finalize(tokenizer, prompts, records: dict[int, dict], run_dir: Path) -> Dataset:
    rows = {"index": [], "messages": [], "response_ids": [], "finished": []}
    for i, messages in enumerate(prompts):
        record = records[i]
        text = tokenizer.decode(record["response_ids"], skip_special_tokens=True)
        rows["index"].append(i)
        rows["messages"].append(
            [{"role": m["role"], "content": m["content"]} for m in messages] + [{"role": "assistant", "content": text}]
        )
        rows["response_ids"].append(record["response_ids"])
        rows["finished"].append(record["finished"])
    dataset = Dataset.from_dict(rows)
    tmp = run_dir / f".{_DATASET_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    os.replace(tmp, run_dir / _DATASET_DIR)
    num_tokens = sum(len(r) for r in rows["response_ids"])
    logger.info(f"Saved {len(dataset)} responses ({num_tokens} tokens) to {run_dir / _DATASET_DIR}")
    return load_from_disk(str(run_dir / _DATASET_DIR))


def _response_ids(tokenizer, messages: list[dict], prompt_ids: list[int], eos_token_id: int) -> list[int]:
    """Tokens of the final assistant turn: through the chat template when it extends the prompt token for token
    (template tokens after the end-of-turn dropped), else the plain text followed by the end-of-sequence token."""
    full_ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    if full_ids[: len(prompt_ids)] == prompt_ids:
        response = full_ids[len(prompt_ids) :]
        return response[: response.index(eos_token_id) + 1] if eos_token_id in response else response
    return tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"] + [eos_token_id]


def _tokenize_batch(batch: dict, tokenizer, max_length: int) -> dict:
    out = {"input_ids": [], "loss_mask": []}
    response_column = batch.get("response_ids")
    for row, messages in enumerate(batch["messages"]):
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError(f"every conversation must end with an assistant turn, got {messages[-1:]}")
        prompt_ids = _prompt_ids(tokenizer, messages[:-1])
        if response_column is not None and response_column[row] is not None:
            response_ids = list(response_column[row])  # the exact tokens the target generated
        else:
            response_ids = _response_ids(tokenizer, messages, prompt_ids, tokenizer.eos_token_id)
        input_ids = (prompt_ids + response_ids)[:max_length]
        loss_mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_length]
        if sum(loss_mask) > 0:  # samples left without response tokens are dropped (counted by the caller)
            out["input_ids"].append(input_ids)
            out["loss_mask"].append(loss_mask)
    return out


def tokenize_conversations(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> Dataset:
    """Tokenizes chat conversations for drafter training, with the loss on the final assistant turn only.

    The prompt is every message but the last, rendered by the chat template with the generation prompt; the response
    is the `response_ids` column when present (the exact target tokens from `generate_responses`), otherwise the last
    message tokenized through the chat template. Sequences are truncated to `max_length`; samples with no response
    token left are dropped (the count is logged).

    Args:
        dataset (`Dataset`): with a `messages` column (conversations ending with an assistant turn) and optionally
            `response_ids`.
        tokenizer (`PreTrainedTokenizerBase`): the target tokenizer, with a chat template.
        max_length (`int`): maximum tokens per sample (prompt + response).

    Returns:
        `Dataset` with `input_ids` (`list[int]`) and `loss_mask` (`list[int]`, 1 on response tokens, 0 on prompt and
        template tokens), one row per kept sample.

    Raises:
        `ValueError`: if no sample has response tokens after truncation ("dataset has no response tokens").
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    tokenized = dataset.map(
        _tokenize_batch,
        batched=True,
        remove_columns=dataset.column_names,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
        desc="tokenizing conversations",
    )
    num_dropped = len(dataset) - len(tokenized)
    if len(tokenized) == 0:
        raise ValueError(
            f"dataset has no response tokens: all {len(dataset)} samples are empty after truncation to "
            f"max_length={max_length} (increase max_length or shorten the prompts)"
        )
    if num_dropped:
        logger.warning(f"dropped {num_dropped}/{len(dataset)} samples with no response tokens within max_length")
    return tokenized


@dataclass
class DataCollatorForReTrace:
    """Pads tokenized samples to the longest in the batch (right padding), TRL-style.

    Args:
        pad_token_id (`int`, *optional*): padding id for `input_ids`; defaults to the tokenizer's pad (or eos) id.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): where `pad_token_id` is read from when not given.
        pad_to_multiple_of (`int`, *optional*): round the padded length up to a multiple of this.

    Returns (from `__call__(examples)`, each example with `input_ids` and `loss_mask`):
        `dict` with `input_ids`, `attention_mask` and `loss_mask`, `torch.LongTensor`s of shape
        `(batch_size, seq_len)`; padding has `attention_mask = loss_mask = 0`.

    Example:
        ```python
        >>> collator = DataCollatorForReTrace(pad_token_id=0)
        >>> examples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
        >>> collator(examples)["input_ids"]
        tensor([[5, 6, 7],
                [8, 0, 0]])
        ```
    """

    pad_token_id: int | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.pad_token_id is None and self.tokenizer is not None:
            tok = self.tokenizer
            self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if self.pad_token_id is None:
            raise ValueError("DataCollatorForReTrace needs a pad_token_id, or a tokenizer with a pad or eos token")

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(example["input_ids"]) for example in examples)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(examples), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
        loss_mask = torch.zeros((len(examples), length), dtype=torch.long)
        for row, example in enumerate(examples):
            if len(example["loss_mask"]) != len(example["input_ids"]):
                raise ValueError(f"example {row}: loss_mask and input_ids lengths differ")
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
            attention_mask[row, :n] = 1
            loss_mask[row, :n] = torch.as_tensor(example["loss_mask"], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


@dataclass
class DataCollatorWithFeatures:
    """Collates rows of a feature cache ([`hf_retrace.data.pool.load_feature_dataset`]): right-padded `input_ids`,
    `attention_mask`, `loss_mask` (1 on response tokens, from `prompt_length`) and the cached target `features`.

    Args:
        cache_layer_ids (`list[int]`): the layers the cache holds, in its column order.
        layer_ids (`list[int]`): the layers the drafter reads (`config.target_layer_ids`), a subset.
        hidden_size (`int`): width of one layer's features.
        max_length (`int`, *optional*): rows are cut to this many tokens.
        pad_token_id (`int`, *optional*, defaults to 0).

    Returns (from `__call__(examples)`): the [`DataCollatorForReTrace`] keys, plus `features`, a bf16 tensor of
    shape `(batch, seq_len, len(layer_ids) * hidden_size)`, zero on padding, and, when the cache has them
    ([`hf_retrace.data.pool.cache_target_ids`]), `target_ids` `(batch, seq_len)`: the target's greedy token after
    each position, `-100` on padding.
    """

    cache_layer_ids: list[int]
    layer_ids: list[int]
    hidden_size: int
    max_length: int | None = None
    pad_token_id: int = 0

    def __post_init__(self):
        missing = [k for k in self.layer_ids if k not in self.cache_layer_ids]
        if missing:
            raise ValueError(f"the feature cache holds layers {self.cache_layer_ids}, not {missing}")
        h = self.hidden_size
        self._columns = torch.cat([torch.arange(h) + self.cache_layer_ids.index(k) * h for k in self.layer_ids])

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [min(len(e["input_ids"]), self.max_length or len(e["input_ids"])) for e in examples]
        width = max(lengths)
        batch = len(examples)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        loss_mask = torch.zeros((batch, width), dtype=torch.long)
        features = torch.zeros((batch, width, len(self._columns)), dtype=torch.bfloat16)
        for row, (example, n) in enumerate(zip(examples, lengths)):
            input_ids[row, :n] = torch.as_tensor(example["input_ids"][:n], dtype=torch.long)
            attention_mask[row, :n] = 1
            loss_mask[row, int(example["prompt_length"]) : n] = 1
            bits = torch.from_numpy(np.ascontiguousarray(example["features"][:n]).astype(np.int16, copy=False))
            features[row, :n] = bits.view(torch.bfloat16)[:, self._columns]  # stored as the bf16 bit pattern
        batch = dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, features=features)
        if all("target_ids" in e for e in examples):
            batch["target_ids"] = torch.full_like(input_ids, IGNORE_INDEX)
            for row, (example, n) in enumerate(zip(examples, lengths)):
                batch["target_ids"][row, :n] = torch.as_tensor(example["target_ids"][:n], dtype=torch.long)
        return batch
