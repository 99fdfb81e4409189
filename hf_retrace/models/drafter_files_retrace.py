# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Hub file: imports torch, transformers and the Hub files `.datastore_file_retrace`, `.lookup_retrace`,
# `.decoding_retrace` only, so `trust_remote_code=True` loads it.
"""What a drafter keeps beside its weights: its decoding settings (`generation_config.json`, `decoding_retrace`) and
its datastore (`datastore.safetensors`, `datastore_file_retrace`). [`ReTraceDrafterFilesMixin`] gives
`ReTraceDrafterModel` their in-memory form (`generation_config`, `datastore_tokens`), saving and loading."""

import os
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.utils import cached_file

from .datastore_file_retrace import DATASTORE_FILE, SEPARATOR, load_datastore_file, save_datastore_file
from .decoding_retrace import (
    DECODING_DEFAULTS,
    ReTraceDecodingSettings,
    check_no_settings_on_config,
    drafter_generation_config,
    resolve_decoding_settings,
)
from .lookup_retrace import NgramDatastore


class ReTraceDrafterFilesMixin:
    """For a `PreTrainedModel` whose `__init__` sets `generation_config` ([`drafter_generation_config`]),
    `datastore_tokens` (`None`) and `_datastore_index` (`None`); its `from_pretrained` calls `_load_decoding_files`."""

    def set_datastore(self, responses) -> None:
        """Attaches a datastore for datastore lookup (`generation_config.datastore_num_tokens`): `responses`, a list of
        token-id lists (the target's own responses, e.g. the training pool's), kept with a separator between them in
        `datastore_tokens` and saved as `datastore.safetensors` beside the weights. `None` removes it (and turns
        datastore lookup off)."""
        self._datastore_index = None
        if responses is None:
            self.datastore_tokens = None
            self.generation_config.datastore_num_tokens = None
            return
        flat = [token for response in responses for token in (*response, SEPARATOR)]
        ids = torch.tensor(flat, dtype=torch.int32)
        if len(ids) <= len(responses) or ids.max() >= self.config.vocab_size or (ids < SEPARATOR).any():
            raise ValueError(f"datastore responses must be non-empty token-id lists in [0, {self.config.vocab_size})")
        self.datastore_tokens = ids

    @property
    def datastore_size(self) -> int | None:
        """Tokens in the datastore, separators included; `None` without one."""
        return None if self.datastore_tokens is None else len(self.datastore_tokens)

    def datastore(self, num_tokens: int, max_ngram_size: int, min_ngram_size: int) -> NgramDatastore:
        """The [`NgramDatastore`] index of `datastore_tokens` for these n-gram sizes, built on first use (~3 s for
        the shipped 1.75M tokens) and kept until they change (`num_tokens` only bounds a lookup's walk)."""
        if self.datastore_tokens is None:
            raise ValueError("this drafter has no datastore: attach one with `set_datastore(responses)`")
        index = self._datastore_index
        if index is None or (index.ngram_sizes[0], index.ngram_sizes[-1]) != (max_ngram_size, min_ngram_size):
            index = NgramDatastore(self.datastore_tokens.numpy(), num_tokens, max_ngram_size, min_ngram_size)
            self._datastore_index = index
        index.num_tokens = num_tokens
        return index

    def decoding_settings(self, call_generation_config: GenerationConfig | None = None) -> ReTraceDecodingSettings:
        """The validated decoding settings of a `generate` call: `generation_config`, with the call's overrides
        (`decoding_retrace` says which count). Raises `ValueError` naming a bad setting, or one set on `config`."""
        check_no_settings_on_config(self.config)
        return resolve_decoding_settings(
            self.generation_config, self.config.block_size, self.datastore_tokens is not None, call_generation_config
        )

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus the drafter's `generation_config.json` (decoding settings) and
        `datastore.safetensors` (when it has a datastore; a stale one in `save_directory` is removed)."""
        if kwargs.get("push_to_hub"):
            raise ValueError("save_pretrained(push_to_hub=True) would upload before the datastore is written; save, "
                             "then call `drafter.push_to_hub(repo_id)`")  # fmt: skip
        self.decoding_settings()  # refuse to write settings that cannot run
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            self.save_pretrained_decoding_files(save_directory)

    def save_pretrained_decoding_files(self, save_directory) -> None:
        """Writes only `generation_config.json` and `datastore.safetensors` (removing a stale one when the drafter
        has no datastore) into `save_directory`: re-attaching a datastore leaves the weights file alone."""
        self.decoding_settings()
        self.generation_config.save_pretrained(save_directory)
        datastore_file = Path(save_directory) / DATASTORE_FILE
        if self.datastore_tokens is not None:
            save_datastore_file(datastore_file, self.datastore_tokens.numpy(), self.config.vocab_size)
        elif datastore_file.is_file():
            datastore_file.unlink()

    def _load_decoding_files(self, path, hub_kwargs: dict) -> None:
        """After the weights: `generation_config.json` and `datastore.safetensors` of `path` (folder or repo)."""
        settings_file = _cached_file(path, "generation_config.json", hub_kwargs)
        if settings_file is not None:
            # the decoding keys only (the drafter never generates on its own); a missing or null key is its default
            stored = GenerationConfig.from_pretrained(os.path.dirname(settings_file))
            found = {key: getattr(stored, key, None) for key in DECODING_DEFAULTS}
            self.generation_config = drafter_generation_config(**{k: v for k, v in found.items() if v is not None})
        datastore_file = _cached_file(path, DATASTORE_FILE, hub_kwargs)
        if datastore_file is not None:
            ids = load_datastore_file(datastore_file, self.config.vocab_size)  # checked: checksum, vocabulary
            self.datastore_tokens, self._datastore_index = torch.from_numpy(ids), None
        self.decoding_settings()  # a folder whose settings cannot run fails here, not at the first generate


def _cached_file(path, name: str, hub_kwargs: dict) -> str | None:
    """`name` in the folder or Hub repo `path`, downloaded if needed; `None` when there is none."""
    if os.path.isdir(str(path)):
        subfolder = hub_kwargs.get("subfolder") or ""
        local = os.path.join(str(path), subfolder, name)
        return local if os.path.isfile(local) else None
    return cached_file(path, name, _raise_exceptions_for_missing_entries=False, **hub_kwargs)


__all__ = ["ReTraceDrafterFilesMixin"]
