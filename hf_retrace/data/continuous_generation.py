# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Greedy generation that keeps its batch full: a finished row is replaced by the next prompt at once.

`transformers.generate` on a fixed batch runs until its longest row ends, so on the SmolLM2 pool about half of the
rows of a batch are finished padding for most steps. Here every slot of the batch holds a live row: when a row ends,
its slot is refilled with a new prompt (prefilled as a small left-padded batch and written into the shared cache,
right-aligned). RoPE positions are per row, so rows of different lengths share one cache; columns no row needs any
more are trimmed from the left.

The target features that DFlash training reads (`hidden_states[k + 1]` for `k in layer_ids`) are captured on the way,
at no extra cost: the prompt's from the prefill, each response token's from the decoding step that feeds it.

Cache layout (`L` layers, `S` slots, `T` columns): per layer `keys/values` `[S, kv_heads, T, head_dim]`, and
`mask` `[S, T]` (1 = a real token of the slot's current row). A row of length `n` occupies the last `n` columns it
has written, possibly with padding columns inside its prompt span (left padding of its prefill batch).
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SlotCacheLayer(DynamicLayer):
    """A cache layer whose keys/values live in a preallocated buffer, written in place.

    `DynamicLayer.update` concatenates, which copies the whole cache every step: at 256 slots and ~900 columns that is
    ~1 GB a step for SmolLM2. Here a step writes one column; the buffer doubles when full. `keys`/`values` are views
    `[S, kv_heads, length, head_dim]` of the buffer, so everything that reads a `DynamicLayer` reads this one.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self._k, self._v, self.length = keys, values, keys.shape[2]
        self._grow(max(2 * self.length, 64))

    def _grow(self, capacity: int) -> None:
        k = self._k.new_zeros(*self._k.shape[:2], capacity, self._k.shape[3])
        v = self._v.new_zeros(*self._v.shape[:2], capacity, self._v.shape[3])
        k[:, :, : self.length], v[:, :, : self.length] = self._k[:, :, : self.length], self._v[:, :, : self.length]
        self._k, self._v = k, v
        self._refresh()

    def _refresh(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[2]
        if end > self._k.shape[2]:
            self._grow(2 * end)
        self._k[:, :, self.length : end], self._v[:, :, self.length : end] = key_states, value_states
        self.length = end
        self._refresh()
        return self.keys, self.values

    def left_pad(self, columns: int) -> None:
        """Shifts every slot right by `columns` (new, zero, masked columns on the left)."""
        if self.length + columns > self._k.shape[2]:
            self._grow(2 * (self.length + columns))
        for buf in (self._k, self._v):
            buf[:, :, columns : columns + self.length] = buf[:, :, : self.length].clone()
            buf[:, :, :columns] = 0
        self.length += columns
        self._refresh()

    def trim_left(self, columns: int) -> None:
        """Drops the first `columns` columns (no slot attends to them any more)."""
        for buf in (self._k, self._v):
            buf[:, :, : self.length - columns] = buf[:, :, columns : self.length].clone()
        self.length -= columns
        self._refresh()

    def write_rows(self, index: torch.LongTensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes a prefill cache `[n, kv_heads, P, head_dim]` into the last `P` columns of slots `index`."""
        width = keys.shape[2]
        self._k[index, :, self.length - width : self.length] = keys
        self._v[index, :, self.length - width : self.length] = values


@dataclass
class PromptItem:
    """A prompt of the pool: its index in the prompt stream, its source set and its templated token ids."""

    index: int
    source: str
    prompt_ids: list[int]


@dataclass
class GeneratedRow:
    """A finished row. `features` `[len(prompt_ids) + len(response_ids), F]` (the `layer_ids` hidden states,
    concatenated, in `feature_dtype`); the last token's row is zero (it is never fed back, and no anchor reads it)."""

    index: int
    source: str
    prompt_ids: list[int]
    response_ids: list[int]
    finished: bool
    features: torch.Tensor | None = None


@dataclass
class _Slot:
    item: PromptItem
    response_ids: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # prompt chunk, then one [1, F] per fed token


class ContinuousBatchGenerator:
    """Greedy decoding of a prompt stream with a batch kept full (see the module docstring).

    Args:
        target (`PreTrainedModel`): a causal LM whose `model(...)` accepts per-row `position_ids` and a 2D mask.
        eos_token_ids (`set[int]`): tokens that end a row (kept in the response).
        batch_size (`int`): slots decoded together.
        max_new_tokens (`int`): response budget per row.
        layer_ids (`list[int]`, *optional*): 0-based target layers whose outputs are captured as features.
        feature_dtype (`torch.dtype`): storage dtype of the captured features (bf16 halves the disk).
        refill_fraction (`float`): prefill new prompts once this share of slots is empty (bigger prefill batches are
            cheaper per token; an empty slot costs one wasted row per step meanwhile).
        pad_token_id (`int`): input of empty slots and of prompt padding.
    """

    def __init__(self, target, eos_token_ids: set[int], *, batch_size: int = 64, max_new_tokens: int = 256,
                 layer_ids: list[int] | None = None, feature_dtype: torch.dtype = torch.bfloat16,
                 refill_fraction: float = 0.125, pad_token_id: int = 0):  # fmt: skip
        if batch_size < 1 or max_new_tokens < 1:
            raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}")
        self.target = target
        self.eos_token_ids = set(eos_token_ids)
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.layer_ids = list(layer_ids or [])
        self.feature_dtype = feature_dtype
        self.min_refill = max(1, int(refill_fraction * batch_size))
        self.pad_token_id = pad_token_id
        self.device = next(target.parameters()).device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)  # [S, T]
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # RoPE position of next input
        self.slots: list[_Slot | None] = [None] * batch_size
        self.generated_tokens = 0

    @torch.inference_mode()
    def generate(self, prompts: Iterable[PromptItem]) -> Iterator[GeneratedRow]:
        """Yields every prompt's row as soon as it finishes (not in prompt order)."""
        stream = iter(prompts)
        exhausted = False
        while True:
            empty = [s for s, slot in enumerate(self.slots) if slot is None]
            if not exhausted and (len(empty) >= self.min_refill or len(empty) == self.batch_size):
                items = [item for _, item in zip(empty, stream)]
                exhausted = len(items) < len(empty)
                if items:
                    yield from self._prefill(empty[: len(items)], items)
            if all(slot is None for slot in self.slots):
                if exhausted:
                    return
                continue
            yield from self._decode_step()
            self._trim()

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        """One target forward; returns last-position greedy tokens `[n]` and captured features `[n, q, F]`."""
        out = self.target(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=True, output_hidden_states=bool(self.layer_ids), logits_to_keep=1,
        )  # fmt: skip
        tokens = out.logits[:, -1].argmax(dim=-1)
        if not self.layer_ids:
            return tokens, None
        features = torch.cat([out.hidden_states[k + 1] for k in self.layer_ids], dim=-1).to(self.feature_dtype)
        return tokens, features

    def _prefill(self, slot_ids: list[int], items: list[PromptItem]) -> Iterator[GeneratedRow]:
        """Prefills `items` as one left-padded batch and writes their cache into `slot_ids`, right-aligned."""
        width = max(len(item.prompt_ids) for item in items)
        input_ids = torch.full((len(items), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            input_ids[row, width - len(item.prompt_ids) :] = torch.tensor(item.prompt_ids)
            mask[row, width - len(item.prompt_ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.target.config)
        tokens, features = self._forward(input_ids, mask, positions, cache)
        self._write_rows(slot_ids, cache, mask)
        for row, (s, item) in enumerate(zip(slot_ids, items)):
            slot = _Slot(item)
            if features is not None:
                slot.features.append(features[row, width - len(item.prompt_ids) :])
            self.slots[s] = slot
            self.positions[s] = len(item.prompt_ids)
        yield from self._append_tokens(slot_ids, tokens.tolist())

    def _write_rows(self, slot_ids: list[int], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Copies a prefill cache (`P` columns) into the last `P` columns of `slot_ids`, left-padding the shared
        cache first when it is shorter than `P`."""
        width = mask.shape[1]
        if self.cache is None:
            self.cache = DynamicCache(config=self.target.config)
            self.cache.layers = [
                SlotCacheLayer(new.keys.new_zeros(self.batch_size, *new.keys.shape[1:]),
                               new.values.new_zeros(self.batch_size, *new.values.shape[1:]))
                for new in cache.layers
            ]  # fmt: skip
            self.mask = torch.zeros(self.batch_size, width, dtype=torch.long, device=self.device)
        grow = width - self.mask.shape[1]
        if grow > 0:  # left-pad every slot by `grow` masked columns
            for layer in self.cache.layers:
                layer.left_pad(grow)
            self.mask = torch.nn.functional.pad(self.mask, (grow, 0))
        index = torch.tensor(slot_ids, device=self.device)
        for layer, new in zip(self.cache.layers, cache.layers):
            layer.write_rows(index, new.keys, new.values)
        self.mask[index] = 0
        self.mask[index, -width:] = mask

    def _decode_step(self) -> Iterator[GeneratedRow]:
        """Feeds every live slot's last token; an empty slot feeds padding that attends only to itself."""
        live = [s for s, slot in enumerate(self.slots) if slot is not None]
        last = [slot.response_ids[-1] if slot is not None else self.pad_token_id for slot in self.slots]
        input_ids = torch.tensor(last, device=self.device).unsqueeze(1)  # [S, 1]
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)  # [S, T + 1]
        tokens, features = self._forward(input_ids, self.mask, self.positions.unsqueeze(1), self.cache)
        self.positions += 1
        if features is not None:
            for s in live:
                self.slots[s].features.append(features[s])  # [1, F]: features of the token just fed
        tokens = tokens.tolist()
        yield from self._append_tokens(live, [tokens[s] for s in live])

    def _append_tokens(self, slot_ids: list[int], tokens: list[int]) -> Iterator[GeneratedRow]:
        for s, token in zip(slot_ids, tokens):
            slot = self.slots[s]
            slot.response_ids.append(token)
            self.generated_tokens += 1
            ended = token in self.eos_token_ids
            if ended or len(slot.response_ids) >= self.max_new_tokens:
                self.slots[s] = None
                self.mask[s] = 0
                yield self._finish(slot, ended)

    def _finish(self, slot: _Slot, ended: bool) -> GeneratedRow:
        features = None
        if slot.features:
            fed = torch.cat(slot.features, dim=0)  # [len(prompt) + len(response) - 1, F]
            features = torch.cat([fed, fed.new_zeros(1, fed.shape[1])]).cpu()  # last token: never fed
        item = slot.item
        return GeneratedRow(item.index, item.source, item.prompt_ids, slot.response_ids, ended, features)

    def _trim(self) -> None:
        """Drops leading columns that no slot attends to (finished rows leave them behind)."""
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else self.mask.shape[1]
        if first < 64 and first < self.mask.shape[1]:  # a copy per trim: only worth it in larger steps
            return
        for layer in self.cache.layers:
            layer.trim_left(first)
        self.mask = self.mask[:, first:]


__all__ = ["ContinuousBatchGenerator", "GeneratedRow", "PromptItem", "SlotCacheLayer"]
