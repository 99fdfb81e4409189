"""Checks that a drafter folder can be published to the Hub (layout in `hf_retrace.hub.publish`).

[`validate_folder`] raises [`HubFolderError`] listing every problem with its fix: missing or unloadable weights,
config vs weight-shape mismatches, missing code files or `auto_map`, and code files that import `hf_retrace`
(Hub users do not have it). [`check_repo_id`] checks a target repo id the same way.
"""

import ast
import json
from pathlib import Path

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open

from ..models.configuration_retrace import ReTraceDrafterConfig
from ..models.datastore_file_retrace import DATASTORE_FILE, load_datastore_file
from ..models.modeling_retrace import ReTraceDrafterModel


# every Hub file of `hf_retrace.models`: `modeling_retrace.py` imports the others (transitively), and
# `register_for_auto_class` copies them all; `tests/test_hub.py` checks this list is that import closure
CODE_FILES = (
    "configuration_retrace.py", "modeling_retrace.py", "generation_retrace.py", "sources_retrace.py",
    "decoding_retrace.py", "draft_head_retrace.py", "hook_retrace.py", "drafter_files_retrace.py",
    "lookup_retrace.py", "datastore_file_retrace.py", "policy_settings_retrace.py", "acceptance_retrace.py",
    "cost_model_retrace.py", "goodput_retrace.py", "online_datastore_retrace.py", "speculation_retrace.py",
    "speculation_state_retrace.py",
)  # fmt: skip
CUSTOM_GENERATE_FILE = "custom_generate/generate.py"


class HubFolderError(ValueError):
    """A drafter folder that cannot be published; the message lists every problem with its fix."""


def validate_folder(folder, rendered: dict[str, bytes] | None = None) -> None:
    """Raises [`HubFolderError`] listing every problem (and its fix) that keeps `folder` from being published:
    missing/unloadable weights, config vs weight-shape mismatches, missing code files or `auto_map`, code files
    that import `hf_retrace` (Hub users do not have it).

    Args:
        folder (`str` or `os.PathLike`): the drafter folder.
        rendered (`dict[str, bytes]`, *optional*): files `{relative path: content}` that will be written into the
            folder before the upload (`hf-retrace publish` writes the code files and the recipe); they count as
            present and are checked instead of the folder's copies.
    """
    folder, rendered = Path(folder), rendered or {}
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HubFolderError(f"{folder}/config.json is missing or unreadable ({err}); write the folder with "
                             "`save_for_hub(drafter, folder)`.") from err  # fmt: skip
    problems = _check_code_files(folder, config, rendered) + _check_package_imports(folder, rendered)
    problems += _check_datastore(folder, config)
    try:
        shapes = weight_shapes(folder)
    except HubFolderError as err:
        problems.append(str(err))
    else:
        problems += _check_shapes(folder, shapes)
    if problems:
        raise HubFolderError(f"{folder} cannot be published:\n" + "\n".join(f"  - {p}" for p in problems))


def weight_shapes(folder) -> dict[str, list[int]]:
    """`{parameter name: shape}` read from the safetensors headers (single file or sharded index)."""
    folder, index = Path(folder), Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in folder.glob("*.bin")) or "no weights file"
        raise HubFolderError(
            f"model.safetensors is missing ({found}). Save the drafter with `save_for_hub(drafter, folder)`; "
            "it writes safetensors."
        )
    shapes = {}
    for name in files:
        try:
            with safe_open(folder / name, framework="pt") as f:
                shapes.update({key: list(f.get_slice(key).get_shape()) for key in f.keys()})
        except Exception as err:  # noqa: BLE001 - any unreadable file is reported the same way
            raise HubFolderError(
                f"{name} cannot be loaded ({err}); it is corrupt or truncated: re-save the drafter with "
                "`save_for_hub(drafter, folder)` or download it again."
            ) from err
    return shapes


def _check_shapes(folder: Path, shapes: dict) -> list[str]:
    try:
        config = ReTraceDrafterConfig.from_pretrained(folder)
    except (ValueError, TypeError, OSError) as err:
        return [f"config.json is not a valid ReTrace drafter config ({err}); fix the field or re-save the drafter."]
    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in ReTraceDrafterModel(config).state_dict().items()}
    problems = [f"weight {k} is missing" for k in sorted(expected.keys() - shapes.keys())]
    problems += [f"weight {k} is not part of this config's model" for k in sorted(shapes.keys() - expected.keys())]
    for key in sorted(expected.keys() & shapes.keys()):
        if shapes[key] != expected[key]:
            problems.append(f"weight {key} has shape {shapes[key]} but config.json implies {expected[key]}")
    if problems:
        problems.append("config.json and the weights disagree: re-save both with `save_for_hub(drafter, folder)`.")
    return problems


def _check_datastore(folder: Path, config: dict) -> list[str]:
    if not (folder / DATASTORE_FILE).is_file():
        return []
    try:
        load_datastore_file(folder / DATASTORE_FILE, int(config.get("vocab_size", 0)))
    except (ValueError, OSError) as err:
        return [f"{err} (or re-save the drafter with `save_for_hub(drafter, folder)`)"]
    return []


def _check_code_files(folder: Path, config: dict, rendered: dict[str, bytes]) -> list[str]:
    def present(name: str) -> bool:
        return name in rendered or (folder / name).is_file()

    problems = [f"{name} is missing" for name in (*CODE_FILES, CUSTOM_GENERATE_FILE) if not present(name)]
    auto_map = config.get("auto_map") or {}
    for auto_class in ("AutoConfig", "AutoModel"):
        if auto_class not in auto_map:
            problems.append(f"config.json auto_map has no {auto_class} entry")
        elif not present(auto_map[auto_class].split(".")[0] + ".py"):
            problems.append(f"auto_map {auto_class} points to {auto_map[auto_class]!r}, whose file is missing")
    if problems:
        problems.append("re-save with `save_for_hub(drafter, folder)`, which copies the code files and auto_map.")
    return problems


def _check_package_imports(folder: Path, rendered: dict[str, bytes]) -> list[str]:
    sources = {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*.py")}
    sources.update({rel: content for rel, content in rendered.items() if rel.endswith(".py")})
    problems = []
    for rel in sorted(sources):
        try:
            lines = imports_of_package(sources[rel].decode("utf-8"), "hf_retrace")
        except SyntaxError as err:
            problems.append(f"{rel} is not valid Python ({err})")
            continue
        if lines:
            problems.append(
                f"{rel} imports hf_retrace (line {', '.join(map(str, lines))}), which Hub users do not have; Hub "
                "files may import only torch, transformers, numpy and each other (`from .modeling_retrace import ...`)"
            )
    return problems


def imports_of_package(source: str, package: str) -> list[int]:
    """Line numbers where `source` imports `package` (`import`, `from ... import`, `import_module`/`__import__`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            names = [node.args[0].value]
        else:
            continue
        if any(name == package or name.startswith(package + ".") for name in names):
            lines.append(node.lineno)
    return sorted(lines)


def _is_dynamic_import(node: ast.Call) -> bool:
    func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    first = node.args[0] if node.args else None
    return func in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str)


def check_repo_id(repo_id: str) -> None:
    """Raises [`HubFolderError`] unless `repo_id` is a full `ORG/NAME` Hub id."""
    if "/" not in repo_id or not is_repo_id(repo_id):
        raise HubFolderError(
            f"--repo-id must look like ORG/NAME, got {repo_id!r}: the recipe in custom_generate/generate.py loads "
            "the drafter by this full id."
        )


def is_repo_id(value: str) -> bool:
    """Whether `value` is a valid Hub repo id (`NAME` or `ORG/NAME`)."""
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


__all__ = [
    "CODE_FILES",
    "CUSTOM_GENERATE_FILE",
    "HubFolderError",
    "check_repo_id",
    "imports_of_package",
    "is_repo_id",
    "validate_folder",
    "weight_shapes",
]
