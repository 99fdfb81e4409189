# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""The drafter's training pool: the target's greedy responses, stored twice.

- **Tokens** (`<pool_dir>/tokens/shard_*.npz`): prompt and response ids as compressed uint16, a few MB per million
  tokens, small enough to commit. They are what took hours to make.
- **Features** (`<feature_dir>/shard_*`, `datasets` folders, memory-mapped Arrow): the target hidden states of
  `layer_ids` for every token, bf16 (stored as its uint16 bits; Arrow has no bf16), ~1.2 KB per layer and token. Big
  and rebuildable: [`cache_pool_features`] recomputes any missing shard from the token shards.

[`build_pool`] makes both at once with [`ContinuousBatchGenerator`] (the features are captured while decoding, for
free) and resumes: prompts whose row is already in a token shard are skipped; rows in flight when it stopped are
regenerated.
"""

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from itertools import takewhile
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from datasets import Array2D, Dataset, Features, Sequence, Value, concatenate_datasets, load_from_disk
from datasets.table import InMemoryTable
from transformers.utils import logging

from . import IGNORE_INDEX
from .continuous_generation import ContinuousBatchGenerator, GeneratedRow, PromptItem
from .target_features import compute_target_features


logger = logging.get_logger(__name__)

FEATURE_META = "feature_cache.json"


def pool_prompt_stream(sources: dict[str, list[list[int]]]) -> list[PromptItem]:
    """Interleaves per-source prompt lists so that every prefix of the stream keeps the sources' proportions.

    Item `i` of a source with `n` prompts sorts at `(i + 0.5) / n`; ties break by source order. Indices are stream
    positions, so they are stable as long as `sources` is.
    """
    keyed = []
    for order, (name, prompts) in enumerate(sources.items()):
        keyed += [((i + 0.5) / len(prompts), order, name, ids) for i, ids in enumerate(prompts)]
    keyed.sort(key=lambda k: k[:2])
    return [PromptItem(index, name, ids) for index, (_, _, name, ids) in enumerate(keyed)]


def read_token_shards(pool_dir: str | os.PathLike) -> list[dict]:
    """All rows of the token shards: dicts with `index`, `source`, `prompt_ids`, `response_ids`, `finished`,
    `shard`."""
    rows = []
    for path in sorted((Path(pool_dir) / "tokens").glob("shard_*.npz")):
        with np.load(path) as data:
            bounds = np.concatenate([[0], np.cumsum(data["prompt_length"] + data["response_length"])])
            sources = [str(s) for s in data["source"]]
            for r in range(len(data["index"])):
                tokens = data["tokens"][bounds[r] : bounds[r + 1]].astype(np.int64).tolist()
                p = int(data["prompt_length"][r])
                rows.append(dict(index=int(data["index"][r]), source=sources[r], prompt_ids=tokens[:p],
                                 response_ids=tokens[p:], finished=bool(data["finished"][r]),
                                 shard=path.stem))  # fmt: skip
    return rows


def load_pool_dataset(pool_dir: str | os.PathLike, max_length: int | None = None) -> Dataset:
    """The token shards as a tokenized training set (`input_ids`, `loss_mask`: 0 on the prompt, 1 on the response),
    for `feature_source="online"`, where the target computes the features in every step (a GPU run: no cache on disk).

    Built with array arithmetic, not per-token Python lists: a pool of tens of millions of tokens loads in seconds.

    Args:
        pool_dir (`str` or `os.PathLike`): a pool folder (`tokens/shard_*.npz`).
        max_length (`int`, *optional*): cut every row to its first `max_length` tokens.
    """
    paths = sorted((Path(pool_dir) / "tokens").glob("shard_*.npz"))
    if not paths:
        raise ValueError(f"{pool_dir} has no token shard (expected {Path(pool_dir) / 'tokens' / 'shard_*.npz'}).")
    ids, masks, lengths = [], [], []
    for path in paths:
        with np.load(path) as data:
            prompt, tokens = data["prompt_length"], data["tokens"]
            full = prompt + data["response_length"]
        kept = full if max_length is None else np.minimum(full, max_length)
        # token j of row r sits at starts[r] + j in the shard's flat `tokens`; keep j < kept[r]
        starts = np.repeat(np.cumsum(full) - full, kept)
        within = np.arange(kept.sum()) - np.repeat(np.cumsum(kept) - kept, kept)
        ids.append(tokens[starts + within].astype(np.int64))
        masks.append((within >= np.repeat(prompt, kept)).astype(np.int64))
        lengths.append(kept)
    offsets = pa.array(np.concatenate([[0], np.cumsum(np.concatenate(lengths))]), type=pa.int64())
    table = pa.table({
        "input_ids": pa.LargeListArray.from_arrays(offsets, pa.array(np.concatenate(ids))),
        "loss_mask": pa.LargeListArray.from_arrays(offsets, pa.array(np.concatenate(masks))),
    })  # fmt: skip
    return Dataset(InMemoryTable(table))


def _write_token_shard(path: Path, rows: list[GeneratedRow]) -> None:
    tokens = np.concatenate([np.asarray(r.prompt_ids + r.response_ids, dtype=np.uint16) for r in rows])
    tmp = path.with_name(f".{path.stem}.tmp.npz")
    np.savez_compressed(
        tmp, index=np.array([r.index for r in rows], dtype=np.int64), source=np.array([r.source for r in rows]),
        prompt_length=np.array([len(r.prompt_ids) for r in rows], dtype=np.int64),
        response_length=np.array([len(r.response_ids) for r in rows], dtype=np.int64),
        finished=np.array([r.finished for r in rows]), tokens=tokens,
    )  # fmt: skip
    os.replace(tmp, path)  # atomic: an interrupted write never leaves a half shard


def _feature_schema(width: int) -> Features:
    return Features({
        "index": Value("int64"), "input_ids": Sequence(Value("int32")), "prompt_length": Value("int32"),
        "features": Array2D(shape=(None, width), dtype="uint16"),
    })  # fmt: skip


def _write_feature_shard(path: Path, rows: list[GeneratedRow]) -> None:
    """`features` bf16 `[n, F]` per row, stored as the uint16 bit pattern (viewed back by the collator)."""
    width = rows[0].features.shape[1]
    data = {
        "index": [r.index for r in rows],
        "input_ids": [r.prompt_ids + r.response_ids for r in rows],
        "prompt_length": [len(r.prompt_ids) for r in rows],
        "features": [r.features.to(torch.bfloat16).view(torch.uint16).numpy() for r in rows],
    }
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    Dataset.from_dict(data, features=_feature_schema(width)).save_to_disk(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _write_feature_meta(feature_dir: Path, target_name: str, layer_ids: list[int], hidden_size: int) -> None:
    meta = {"target": target_name, "layer_ids": list(layer_ids), "hidden_size": hidden_size, "dtype": "bfloat16"}
    path = feature_dir / FEATURE_META
    if path.is_file():
        old = json.loads(path.read_text())
        if old != meta:
            raise ValueError(
                f"{feature_dir} holds features of {old}, not of {meta}; use another --feature-dir or delete it."
            )
        return
    feature_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2))


def build_pool(
    target, prompt_stream: list[PromptItem], pool_dir, feature_dir=None, *, eos_token_ids: set[int],
    layer_ids: list[int], target_name: str, batch_size: int = 64, max_new_tokens: int = 256, shard_rows: int = 256,
    max_response_tokens: int | None = None, max_seconds: float | None = None, pad_token_id: int = 0,
) -> int:  # fmt: skip
    """Generates the pool (tokens and, with `feature_dir`, features) resumably; returns its response-token count.

    Args:
        prompt_stream (`list[PromptItem]`): e.g. from [`pool_prompt_stream`]; must be the same list on resume.
        pool_dir, feature_dir (`str` or `os.PathLike`): token shards (small, committable) and feature shards.
        eos_token_ids (`set[int]`): end-of-response tokens.
        layer_ids (`list[int]`): 0-based target layers to capture (a superset of what the drafters read).
        target_name (`str`): the identity the feature cache is keyed by, with `layer_ids`.
        shard_rows (`int`): finished rows per shard (the unit of checkpointing).
        max_response_tokens (`int`, *optional*): stop once the pool holds this many response tokens.
        max_seconds (`float`, *optional*): stop taking new prompts after this many seconds (rows in flight finish
            and are written), for a run on a lent machine with a fixed time budget.
    """
    tokens_dir = Path(pool_dir) / "tokens"
    tokens_dir.mkdir(parents=True, exist_ok=True)
    if feature_dir is not None:
        feature_dir = Path(feature_dir)
        _write_feature_meta(feature_dir, target_name, layer_ids, target.config.get_text_config().hidden_size)
    done = read_token_shards(pool_dir)
    total = sum(len(r["response_ids"]) for r in done)
    # skip by stream position and by prompt: positions shift when a source list changes (e.g. the open-ended corpora
    # installed on one machine and not another), and a prompt already in the pool must not be generated twice
    finished_ids, finished_prompts = {r["index"] for r in done}, {tuple(r["prompt_ids"]) for r in done}
    todo = [item for item in prompt_stream
            if item.index not in finished_ids and tuple(item.prompt_ids) not in finished_prompts]  # fmt: skip
    logger.warning(f"pool: {len(done)} rows ({total} response tokens) already in {tokens_dir}; {len(todo)} to go")
    next_shard = len(list(tokens_dir.glob("shard_*.npz")))
    generator = ContinuousBatchGenerator(
        target, eos_token_ids, batch_size=batch_size, max_new_tokens=max_new_tokens,
        layer_ids=layer_ids if feature_dir is not None else None, pad_token_id=pad_token_id,
    )  # fmt: skip
    buffer, start = [], time.perf_counter()
    # the generator pulls prompts lazily, so this stops feeding new rows once the pool is big enough or time is up
    deadline = None if max_seconds is None else start + max_seconds
    wanted = takewhile(
        lambda _: (max_response_tokens is None or total < max_response_tokens)
        and (deadline is None or time.perf_counter() < deadline),
        todo,
    )
    for row in generator.generate(wanted):
        buffer.append(row)
        total += len(row.response_ids)
        if len(buffer) % 32 == 0:
            rate = generator.generated_tokens / (time.perf_counter() - start)
            logger.warning(f"pool: {len(buffer)} rows buffered, {total} response tokens, {rate:.0f} tok/s")
        if len(buffer) == shard_rows:
            _flush(buffer, tokens_dir, feature_dir, next_shard)
            next_shard, buffer = next_shard + 1, []
            rate = generator.generated_tokens / (time.perf_counter() - start)
            logger.warning(f"pool: shard {next_shard - 1} written; {total} response tokens, {rate:.0f} tok/s")
    if buffer:
        _flush(buffer, tokens_dir, feature_dir, next_shard)
    return total


def _flush(rows: list[GeneratedRow], tokens_dir: Path, feature_dir: Path | None, shard: int) -> None:
    rows = sorted(rows, key=lambda r: r.index)
    if feature_dir is not None:  # features first: a token shard never exists without its features from this run
        _write_feature_shard(feature_dir / f"shard_{shard:05d}", rows)
    _write_token_shard(tokens_dir / f"shard_{shard:05d}.npz", rows)


@torch.no_grad()
def cache_pool_features(
    target, pool_dir, feature_dir, *, layer_ids: list[int], target_name: str, batch_tokens: int = 8192
) -> list[str]:
    """Computes the features of every token shard that has none in `feature_dir` (batched prefill, longest rows
    first, up to `batch_tokens` padded tokens per forward); returns the shards it wrote. Resumable per shard."""
    feature_dir = Path(feature_dir)
    _write_feature_meta(feature_dir, target_name, layer_ids, target.config.get_text_config().hidden_size)
    by_shard: dict[str, list[dict]] = {}
    for row in read_token_shards(pool_dir):
        by_shard.setdefault(row["shard"], []).append(row)
    written = []
    for shard, rows in sorted(by_shard.items()):
        if (feature_dir / shard / "dataset_info.json").is_file():
            continue
        fields = ("index", "source", "prompt_ids", "response_ids", "finished")
        generated = [GeneratedRow(*(r[field] for field in fields)) for r in rows]
        row_length = lambda r: len(r.prompt_ids) + len(r.response_ids)  # noqa: E731
        for batch in _length_batches(generated, row_length, batch_tokens):
            _prefill_features(target, batch, layer_ids)
        _write_feature_shard(feature_dir / shard, generated)
        written.append(shard)
        logger.warning(f"features: {shard} ({len(rows)} rows) written to {feature_dir}")
    return written


def _length_batches(items: list, length: Callable[[object], int], batch_tokens: int) -> Iterator[list]:
    """`items` longest first, cut into consecutive batches of at most `batch_tokens` padded tokens each (a batch is
    as wide as its first, longest item; an item longer than `batch_tokens` gets a batch of its own)."""
    batch = []
    for item in sorted(items, key=lambda x: -length(x)):
        if batch and (len(batch) + 1) * length(batch[0]) > batch_tokens:
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def _prefill_features(target, rows: list[GeneratedRow], layer_ids: list[int]) -> None:
    """Sets `row.features` from one right-padded forward; the last token's row is zeroed as in generation."""
    sequences = [r.prompt_ids + r.response_ids for r in rows]
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
    device = next(target.parameters()).device
    feats = compute_target_features(target, input_ids.to(device), layer_ids, mask.to(device))
    for i, (row, seq) in enumerate(zip(rows, sequences)):
        row.features = feats[i, : len(seq)].to(torch.bfloat16).cpu().clone()
        row.features[-1] = 0


@torch.no_grad()
def target_greedy_ids(target, input_ids: torch.LongTensor, attention_mask: torch.Tensor, chunk_rows: int = 2048):
    """The target's greedy next token after every position: `argmax(logits[:, t])`, i.e. what greedy decoding would
    put at `t + 1` (the lm head runs `chunk_rows` rows at a time, never materialising `[batch, T, V]` logits).

    Args:
        input_ids, attention_mask (`torch.Tensor` of shape `(batch, T)`): a right-padded batch.
    Returns:
        `torch.LongTensor` of shape `(batch, T)`.
    """
    hidden = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # post-norm
    flat = hidden.flatten(0, 1)  # [batch * T, hidden]
    head = target.get_output_embeddings()
    ids = torch.cat([head(flat[i : i + chunk_rows]).argmax(-1) for i in range(0, flat.shape[0], chunk_rows)])
    return ids.view(input_ids.shape)


def cache_target_ids(target, feature_dir, *, batch_tokens: int = 8192) -> list[str]:
    """Adds a `target_ids` column to every feature shard that lacks one; returns the shards it rewrote.

    `target_ids[t]` is the target's greedy token after position `t`, `-100` on the last one. On response positions
    (`t >= prompt_length - 1`) it is the recorded greedy response itself, `input_ids[t + 1]`; only the prompt is run
    through the target (causal attention: prompt positions never see the response), so this costs a prefill of the
    prompts alone. With it the trainer can anchor blocks in prompts too (`completion_only_loss=False`): human text
    labelled by the target's greedy chain. Resumable per shard (each shard is rewritten atomically).

    The preamble that every row of a shard shares (the chat template's system prompt, 24 tokens for SmolLM2) gets
    `-100`: the trainer anchors prompt blocks only where `target_ids` is set, and a block repeated in every row would
    take ~20% of the prompt anchors to learn one sentence. Shards labelled before this rule get it on the next call.
    """
    feature_dir = Path(feature_dir)
    written = []
    for path in sorted(p for p in feature_dir.glob("shard_*") if (p / "dataset_info.json").is_file()):
        dataset = load_from_disk(str(path))
        if "target_ids" in dataset.column_names:
            if _mask_shared_preamble(dataset, path):
                written.append(path.name)
            continue
        rows = [(r["input_ids"], max(int(r["prompt_length"]), 1)) for r in
                dataset.select_columns(["input_ids", "prompt_length"])]  # fmt: skip
        prompt_lengths = [p for _, p in rows]
        labels = [ids[1:] + [IGNORE_INDEX] for ids, _ in rows]  # the recorded chain; prompts overwritten below
        for batch in _length_batches(range(len(rows)), prompt_lengths.__getitem__, batch_tokens):
            input_ids = torch.zeros(len(batch), prompt_lengths[batch[0]], dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for j, i in enumerate(batch):
                p = prompt_lengths[i]
                input_ids[j, :p], mask[j, :p] = torch.tensor(rows[i][0][:p]), 1
            device = next(target.parameters()).device
            greedy = target_greedy_ids(target, input_ids.to(device), mask.to(device)).cpu()
            for j, i in enumerate(batch):
                p = prompt_lengths[i]
                # position p - 1's greedy token is the response's first
                labels[i][: p - 1] = greedy[j, : p - 1].tolist()
        shared = _shared_preamble_length(rows)
        labels = [[IGNORE_INDEX] * shared + row[shared:] for row in labels]
        _save_with_column(dataset, "target_ids", labels, path)
        written.append(path.name)
        logger.warning(f"target ids: {path.name} ({len(rows)} rows, {sum(prompt_lengths)} prompt tokens)")
    return written


def _shared_preamble_length(rows: list[tuple[list[int], int]]) -> int:
    """Length of the prefix shared by every row's prompt (0 for a single row), kept below the shortest prompt."""
    if len(rows) < 2:
        return 0
    prompts = [ids[:prompt_length] for ids, prompt_length in rows]
    shortest = min(len(p) for p in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


def _mask_shared_preamble(dataset: Dataset, path: Path) -> bool:
    """Applies the shared-preamble rule of [`cache_target_ids`] to a shard labelled without it; False if done."""
    rows = [(r["input_ids"], max(int(r["prompt_length"]), 1)) for r in
            dataset.select_columns(["input_ids", "prompt_length"])]  # fmt: skip
    shared = _shared_preamble_length(rows)
    labels = dataset["target_ids"]
    if all(row[t] == IGNORE_INDEX for row in labels for t in range(shared)):
        return False
    labels = [[IGNORE_INDEX] * shared + row[shared:] for row in labels]
    _save_with_column(dataset.remove_columns("target_ids"), "target_ids", labels, path)
    logger.warning(f"target ids: {path.name}: the {shared}-token preamble shared by every row is now unlabelled")
    return True


def _save_with_column(dataset: Dataset, name: str, values: list, path: Path) -> None:
    dataset = dataset.add_column(name, values, feature=Sequence(Value("int32")))
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def load_feature_dataset(feature_dir, layer_ids: list[int] | None = None, target_name: str | None = None) -> Dataset:
    """The cached features as one memory-mapped `Dataset` (`index`, `input_ids`, `prompt_length`, `features`).

    Raises:
        `ValueError`: the folder has no feature cache, or it was made for another target, or lacks a layer the
            drafter reads.
    """
    feature_dir = Path(feature_dir)
    meta_path = feature_dir / FEATURE_META
    if not meta_path.is_file():
        raise ValueError(
            f"{feature_dir} is not a feature cache (no {FEATURE_META}); build it with "
            "`hf-retrace build-pool` (or `python training/build_pool.py`), with `--features-only` on a fresh machine."
        )
    meta = json.loads(meta_path.read_text())
    if target_name is not None and meta["target"] != target_name:
        raise ValueError(f"{feature_dir} holds features of target {meta['target']!r}, not of {target_name!r}.")
    missing = sorted(set(layer_ids or []) - set(meta["layer_ids"]))
    if missing:
        raise ValueError(
            f"the drafter reads target layers {layer_ids} but {feature_dir} caches only {meta['layer_ids']} "
            f"(missing {missing}); rebuild the cache with those layers or use feature_source='online'."
        )
    shards = sorted(p for p in feature_dir.glob("shard_*") if (p / "dataset_info.json").is_file())
    if not shards:
        raise ValueError(f"{feature_dir} has no finished feature shard yet.")
    datasets = [load_from_disk(str(p)) for p in shards]
    labelled = sum("target_ids" in d.column_names for d in datasets)
    if 0 < labelled < len(datasets):  # a pool grown after `--target-ids` ran: keep the columns every shard has
        logger.warning(
            f"{len(datasets) - labelled} of {len(datasets)} feature shards in {feature_dir} have no target_ids, so "
            "the column is dropped (prompt blocks, completion_only_loss=False, need it): add them with "
            "`hf-retrace build-pool --features-only --target-ids`."
        )
        datasets = [d.remove_columns("target_ids") if "target_ids" in d.column_names else d for d in datasets]
    dataset = concatenate_datasets(datasets)
    dataset.info.description = json.dumps(meta)
    return dataset


__all__ = [
    "build_pool",
    "cache_pool_features",
    "cache_target_ids",
    "load_feature_dataset",
    "load_pool_dataset",
    "pool_prompt_stream",
    "read_token_shards",
    "target_greedy_ids",
]
