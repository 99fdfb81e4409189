"""The datastore of an exported folder (`datastore.safetensors`, `docs/formats.md`) for the proposer's candidate
sources: the shared reader, with every check, and the shared n-gram index (`shared/`, the transformers side's own
code), so a walk proposes exactly what the transformers side proposes."""

from pathlib import Path

from .shared.datastore_file_retrace import DATASTORE_FILE, SEPARATOR, load_datastore_file
from .shared.lookup_retrace import NgramDatastore


class FolderDatastore:
    """What the shared `DatastoreSource` asks its engine for: `datastore(num_tokens, max_ngram_size,
    min_ngram_size)`, the index of the folder's datastore file (the transformers side asks the drafter the same).

    Args:
        folder (`str` or `os.PathLike`): the exported folder.
        file_name (`str`, *optional*): the `hf_retrace` block's `datastore_file`; `None` when the folder has none.
        vocab_size (`int`): the drafter's vocabulary size; every stored id must be below it.
    """

    def __init__(self, folder, file_name: str | None, vocab_size: int):
        self.path = None if file_name is None else Path(folder) / file_name
        self.vocab_size = vocab_size

    def datastore(self, num_tokens: int, max_ngram_size: int, min_ngram_size: int) -> NgramDatastore:
        if self.path is None:
            raise ValueError("this folder's hf_retrace block names no datastore_file: export the folder again")
        ids = load_datastore_file(self.path, self.vocab_size)  # checked: header, offsets, checksum, vocabulary
        return NgramDatastore(ids, num_tokens, max_ngram_size, min_ngram_size)


__all__ = ["DATASTORE_FILE", "SEPARATOR", "FolderDatastore", "NgramDatastore", "load_datastore_file"]
