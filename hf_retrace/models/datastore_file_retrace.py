# Copyright 2026 the hf_retrace authors. Apache-2.0.
#
# Shared policy file: imports numpy and the standard library only. It is a Hub file (`trust_remote_code=True` loads
# it) and the vLLM plugin's copy (`integrations/vllm/hf_retrace_vllm/shared/`, kept identical by
# `utils/check_copies.py`).
"""`datastore.safetensors`, the drafter's datastore beside its weights: one 1-D tensor `token_ids`, the target's
responses concatenated with a separator between them (the layout and every check: `docs/formats.md`).

dtype `uint16` when the vocabulary fits (`vocab_size <= 65535`, the separator stored as 65535), else `int32` (the
separator stored as -1). Metadata: `{"format": "pt", "separator": "<int>", "sha256": "<hex sha256 of the tensor
bytes>"}`; a file whose bytes do not match its checksum is refused.

The safetensors layout (8-byte little-endian header length, JSON header, raw little-endian data) is written and read
here with the standard library and numpy, so neither engine needs `safetensors`; `safetensors`' `safe_open` reads
these files unchanged (tested).
"""

import hashlib
import json
import struct
from pathlib import Path

import numpy as np


DATASTORE_FILE = "datastore.safetensors"
TENSOR_NAME = "token_ids"
SEPARATOR = -1  # in memory: between responses in the flat token buffer
_UINT16_SEPARATOR = 65535
_DTYPES = {"U16": np.dtype("<u2"), "I32": np.dtype("<i4")}
_MAX_HEADER_BYTES = 1 << 20  # a one-tensor header is ~200 bytes; anything larger is not a datastore file


def save_datastore_file(path, token_ids, vocab_size: int) -> None:
    """Writes `token_ids` to `path` in the format above.

    Args:
        path (`str` or `os.PathLike`): the file (`<folder>/datastore.safetensors`).
        token_ids (array-like of shape `(S,)`): token ids in `[0, vocab_size)`, [`SEPARATOR`] between responses.
        vocab_size (`int`): the target's vocabulary size, which picks the dtype.
    """
    ids = np.asarray(token_ids).astype(np.int64).reshape(-1)
    if vocab_size <= _UINT16_SEPARATOR:
        stored, dtype, separator = np.where(ids == SEPARATOR, _UINT16_SEPARATOR, ids).astype("<u2"), "U16", 65535
    else:
        stored, dtype, separator = ids.astype("<i4"), "I32", SEPARATOR
    data = stored.tobytes()
    metadata = {"format": "pt", "separator": str(separator), "sha256": hashlib.sha256(data).hexdigest()}
    entry = {"dtype": dtype, "shape": [len(ids)], "data_offsets": [0, len(data)]}
    header = {TENSOR_NAME: entry, "__metadata__": metadata}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    Path(path).write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def load_datastore_file(path, vocab_size: int) -> np.ndarray:
    """Reads and verifies a datastore file.

    Args:
        path (`str` or `os.PathLike`): the file.
        vocab_size (`int`): the drafter's vocabulary size; every stored id must be below it.
    Returns:
        `np.ndarray` of shape `(S,)`, int32: the token ids, [`SEPARATOR`] (-1) between responses.
    Raises:
        `ValueError` ("corrupt datastore file ...") on a bad header, a checksum mismatch or ids outside the vocabulary.
    """
    raw = Path(path).read_bytes()
    header, data = _split(raw, path)
    entry, metadata = header[TENSOR_NAME], header["__metadata__"]
    start, end = entry["data_offsets"]
    data = data[start:end]
    if hashlib.sha256(data).hexdigest() != metadata.get("sha256"):
        raise ValueError(
            f"corrupt datastore file {path}: its sha256 does not match the one in its metadata (truncated or changed "
            "since it was written). Attach the datastore again with `hf-retrace datastore` or download it again."
        )
    ids = np.frombuffer(data, dtype=_DTYPES[entry["dtype"]]).astype(np.int32)
    ids[ids == int(metadata["separator"])] = SEPARATOR
    if len(ids) == 0 or ids[-1] != SEPARATOR or ids.min() < SEPARATOR or ids.max() >= vocab_size:
        raise ValueError(
            f"corrupt datastore file {path}: it must hold token ids in [0, vocab_size={vocab_size}) ending with the "
            "separator; it was written for another vocabulary or damaged. Attach the datastore again with "
            "`hf-retrace datastore`."
        )
    return ids


def _split(raw: bytes, path) -> tuple[dict, bytes]:
    """`(header, data bytes)` of a one-tensor file, or a `ValueError` saying what is wrong."""
    try:
        (length,) = struct.unpack("<Q", raw[:8])
        if not 0 < length <= min(_MAX_HEADER_BYTES, len(raw) - 8):
            raise ValueError(f"header length {length} out of range")
        header = json.loads(raw[8 : 8 + length])
        entry = header[TENSOR_NAME]
        if entry["dtype"] not in _DTYPES or len(entry["shape"]) != 1 or "sha256" not in header["__metadata__"]:
            raise ValueError(f"unexpected tensor {entry} or metadata")
        int(header["__metadata__"]["separator"])
        start, end = entry["data_offsets"]
        itemsize = _DTYPES[entry["dtype"]].itemsize
        if not 0 <= start <= end == len(raw) - 8 - length or end - start != entry["shape"][0] * itemsize:
            raise ValueError(f"data offsets {entry['data_offsets']} do not fit the {len(raw)}-byte file")
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"corrupt datastore file {path}: not a datastore.safetensors with one 1-D `{TENSOR_NAME}` tensor ({err}). "
            "Attach the datastore again with `hf-retrace datastore` or download it again."
        ) from err
    return header, raw[8 + length :]


__all__ = ["DATASTORE_FILE", "SEPARATOR", "TENSOR_NAME", "load_datastore_file", "save_datastore_file"]
