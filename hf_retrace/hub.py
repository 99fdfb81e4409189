"""Sharing ReTrace drafters on the Hugging Face Hub.

[`save_for_hub`] writes a complete Hub folder; [`publish`] (CLI: `hf-retrace publish`) validates it, renders the card
and the `custom_generate` recipe for the repo id, then uploads it with `HfApi.create_repo` + `HfApi.upload_folder`.

Folder layout (everything a user needs with `transformers` alone, `trust_remote_code=True`):

    config.json                  drafter config with `auto_map` (AutoConfig, AutoModel)
    model.safetensors            weights (or sharded `model-*.safetensors` + `model.safetensors.index.json`)
    configuration_retrace.py     \
    modeling_retrace.py           } Hub files copied by `save_pretrained` (`register_for_auto_class`)
    generation_retrace.py        /
    custom_generate/generate.py  `target.generate(..., custom_generate=<repo>, trust_remote_code=True)` recipe
    README.md                    model card rendered from `hf_retrace/templates/model_card.md`
    eval_results.json            the evaluation JSON behind the card's table (only when one was given)

No `generation_config.json`: the drafter never generates on its own; `generate` runs on the target, with its config.

`custom_generate/generate.py` cannot learn where it was loaded from (transformers copies it into its modules cache),
so its `DRAFTER_SOURCE` names the drafter: the repo id once published (or when `repo_id=` is given), otherwise the
absolute path of the folder. `publish` rewrites it (and the card) for the target repo id before uploading.

Evaluation JSON schema (input of the card's table; `hf-retrace bench` output is expected to follow it):

    {
      "results": [                       # required: one row per (method, prompt set)
        {"method": "retrace", "prompt_set": "gsm_symbolic", "tau": 3.41, "tokens_per_s": 61.2, "speedup": 2.27},
        ...
      ],
      "target": "...", "dtype": "...",   # optional top-level scalars: shown as a "Setup" line above the table
    }

Row keys `method`, `prompt_set`, `tau`, `tokens_per_s`, `speedup` become the columns; a missing or null one renders
as "–"; other row keys are ignored.
"""

import argparse
import ast
import json
import math
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, HFValidationError, filter_repo_objects, validate_repo_id
from safetensors import safe_open

from .configuration_retrace import ReTraceDrafterConfig
from .modeling_retrace import ReTraceDrafterModel


CODE_FILES = ("configuration_retrace.py", "modeling_retrace.py", "generation_retrace.py")
CUSTOM_GENERATE_FILE = "custom_generate/generate.py"
EVAL_FILE = "eval_results.json"
CARD_TAGS = ("speculative-decoding", "dflash", "retrace")
FIXED_METADATA = {"library_name": "transformers", "pipeline_tag": "text-generation"}
EVAL_COLUMNS = (  # (row key, column title, number format)
    ("method", "Method", "{}"),
    ("prompt_set", "Prompt set", "{}"),
    ("tau", "tau", "{:.2f}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("speedup", "Speedup", "{:.2f}×"),
)
UPLOAD_IGNORE = ["*__pycache__*", "*.pyc", "*.DS_Store"]
DEFAULT_TEMPLATE_PATH = Path(__file__).resolve().parent / "templates" / "model_card.md"
_SOURCE_LINE = re.compile(r"^DRAFTER_SOURCE = None\b.*$", flags=re.MULTILINE)


class HubFolderError(ValueError):
    """A drafter folder that cannot be published; the message lists every problem with its fix."""


# ----------------------------------------------------------------------------------------------------- writing


def save_for_hub(
    drafter, folder, *, repo_id=None, base_model=None, eval_results_json=None, license="apache-2.0", datasets=None
) -> Path:
    """Writes a complete, validated Hub folder for `drafter` (layout in the module docstring).

    Args:
        drafter ([`ReTraceDrafterModel`]): the drafter, from this package or loaded with `trust_remote_code`.
        folder (`str` or `os.PathLike`): output folder, created if needed.
        repo_id (`str`, *optional*): `ORG/NAME` the folder is meant for; defaults to the folder's absolute path
            (the recipe and the card's snippet then load the drafter from there; `publish` rewrites both).
        base_model (`str`, *optional*): Hub id of the target model, for the card metadata and snippet.
        eval_results_json (`str` or `os.PathLike`, *optional*): evaluation JSON (schema in the module docstring).
        license (`str`, defaults to `"apache-2.0"`), datasets (`list[str]`, *optional*): card metadata.
    Returns:
        `Path`: the folder.

    Example:

    ```python
    >>> save_for_hub(drafter, "retrace-qwen3-8b", base_model="Qwen/Qwen3-8B", eval_results_json="bench.json")
    >>> target.generate(**inputs, custom_generate="retrace-qwen3-8b", trust_remote_code=True)
    ```
    """
    if repo_id is not None:
        _check_repo_id(repo_id)
    folder = Path(folder)
    # Class-level, as transformers intends: every later `save_pretrained` of this class also ships the code files.
    type(drafter).register_for_auto_class("AutoModel")
    type(drafter.config).register_for_auto_class()
    drafter.save_pretrained(folder)
    card_meta = {"base_model": base_model, "license": license, "datasets": datasets}
    files = render_hub_files(folder, repo_id or str(folder.resolve()), card_meta, eval_results_json)
    _write_files(folder, files)
    validate_folder(folder)
    return folder


def render_hub_files(folder, repo_id: str, card_meta: dict, eval_results_json=None) -> dict[str, bytes]:
    """The files `hf_retrace` renders for `repo_id` (card, recipe, eval JSON), as `{relative path: content}`.

    `card_meta` keys `base_model`, `license`, `datasets` that are None keep the values of the folder's current card.
    The card's evaluation table comes from `eval_results_json`, else from the folder's `eval_results.json`.
    """
    folder = Path(folder)
    files = {CUSTOM_GENERATE_FILE: render_custom_generate(repo_id).encode()}
    eval_path = Path(eval_results_json) if eval_results_json is not None else folder / EVAL_FILE
    eval_data = load_eval_results(eval_path) if eval_results_json is not None or eval_path.is_file() else None
    if eval_data is not None:
        files[EVAL_FILE] = (json.dumps(eval_data, indent=2, ensure_ascii=False) + "\n").encode()
    meta = {**_current_card_meta(folder), **{k: v for k, v in card_meta.items() if v is not None}}
    config, num_parameters = ReTraceDrafterConfig.from_pretrained(folder), _num_parameters(folder)
    card = render_model_card(config, repo_id=repo_id, eval_data=eval_data, num_parameters=num_parameters, **meta)
    files["README.md"] = str(card).encode()
    return files


def render_custom_generate(drafter_source: str) -> str:
    """Source of `custom_generate/generate.py` whose `DRAFTER_SOURCE` is `drafter_source` (repo id or folder)."""
    template = resources.files("hf_retrace").joinpath("custom_generate_template.py").read_text(encoding="utf-8")
    source, count = _SOURCE_LINE.subn(lambda _: f"DRAFTER_SOURCE = {json.dumps(str(drafter_source))}", template)
    if count != 1:
        raise RuntimeError("custom_generate_template.py must contain exactly one `DRAFTER_SOURCE = None` line")
    return source


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    for relpath, content in files.items():
        (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
        (folder / relpath).write_bytes(content)


# -------------------------------------------------------------------------------------------------- model card


def load_eval_results(path) -> dict:
    """Reads and checks an evaluation JSON (schema in the module docstring)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"Cannot read evaluation JSON {path}: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        example = '{"results": [{"method": "retrace", "prompt_set": "gsm", "tau": 3.4, "speedup": 2.1}]}'
        raise ValueError(f'Evaluation JSON {path} needs a top-level "results" list of rows, e.g. {example}')
    if not all(isinstance(row, dict) for row in data["results"]):
        raise ValueError(f'Every entry of "results" in {path} must be an object (a table row).')
    return data


def format_eval_cell(row: dict, key: str, fmt: str) -> str:
    """One table cell: formatted number, plain text, or "–" when missing/null/NaN."""
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value).replace("|", "\\|")


def eval_table(eval_data: dict) -> str:
    """Markdown table of `eval_data["results"]`, one row per entry, columns `EVAL_COLUMNS`."""
    lines = ["| " + " | ".join(title for _, title, _ in EVAL_COLUMNS) + " |", "|---" * len(EVAL_COLUMNS) + "|"]
    for row in eval_data["results"]:
        lines.append("| " + " | ".join(format_eval_cell(row, key, fmt) for key, _, fmt in EVAL_COLUMNS) + " |")
    return "\n".join(lines)


def render_model_card(
    config, *, repo_id: str, base_model=None, license="apache-2.0", datasets=None, eval_data=None,
    num_parameters=None, template_path=None,
) -> ModelCard:  # fmt: skip
    """Renders `hf_retrace/templates/model_card.md` (or `template_path`) for a drafter `config` published as `repo_id`.

    Metadata: `library_name: transformers`, `pipeline_tag: text-generation`, `base_model` (the target), `license`,
    `tags` [`CARD_TAGS`], `datasets`. The usage snippet loads `repo_id` and `base_model`.
    """
    template = Path(template_path or DEFAULT_TEMPLATE_PATH)
    if not template.is_file():
        raise FileNotFoundError(
            f"Model card template {template} not found; pass template_path= (it ships in the source checkout "
            "under model_cards/)."
        )
    data = ModelCardData(
        **FIXED_METADATA, base_model=base_model, license=license, tags=list(CARD_TAGS), datasets=datasets or None
    )
    setup = {k: v for k, v in (eval_data or {}).items() if k != "results" and isinstance(v, (str, int, float, bool))}
    return ModelCard.from_template(
        data,
        template_path=str(template),
        config=config,
        repo_id=repo_id,
        model_name=repo_id.rstrip("/").split("/")[-1],
        base_model=base_model,
        target_id=base_model or "TARGET_MODEL_ID",
        num_parameters=f"{num_parameters:,}" if num_parameters else "–",
        eval_table=eval_table(eval_data) if eval_data else None,
        eval_setup="Setup: " + ", ".join(f"{k} = `{v}`" for k, v in setup.items()) if setup else None,
    )


def check_card_metadata(card: ModelCard) -> list[str]:
    """Offline metadata checks (the Hub's own YAML validation needs the network); returns the problems found."""
    data = card.data
    problems = [f"{k} must be {v!r}, got {data.get(k)!r}" for k, v in FIXED_METADATA.items() if data.get(k) != v]
    if not data.license:
        problems.append("license is missing; pass --license (e.g. apache-2.0)")
    missing_tags = [t for t in CARD_TAGS if t not in (data.tags or [])]
    if missing_tags:
        problems.append(f"tags {missing_tags} are missing")
    if data.base_model is not None and not _is_repo_id(data.base_model):
        problems.append(f"base_model must be a Hub model id such as 'Qwen/Qwen3-8B', got {data.base_model!r}")
    return problems


def _current_card_meta(folder: Path) -> dict:
    if not (folder / "README.md").is_file():
        return {}
    data = ModelCard.load(folder / "README.md").data
    current = {"base_model": data.base_model, "license": data.license, "datasets": data.datasets}
    return {k: v for k, v in current.items() if v is not None}


# -------------------------------------------------------------------------------------------------- validation


def validate_folder(folder) -> None:
    """Raises [`HubFolderError`] listing every problem (and its fix) that keeps `folder` from being published:
    missing/unloadable weights, config vs weight-shape mismatches, missing code files or `auto_map`, code files
    that import `hf_retrace` (Hub users do not have it)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HubFolderError(f"{folder}/config.json is missing or unreadable ({err}); write the folder with "
                             "`save_for_hub(drafter, folder)`.") from err  # fmt: skip
    problems = _check_code_files(folder, config) + _check_package_imports(folder)
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


def _check_code_files(folder: Path, config: dict) -> list[str]:
    problems = [f"{name} is missing" for name in (*CODE_FILES, CUSTOM_GENERATE_FILE) if not (folder / name).is_file()]
    auto_map = config.get("auto_map") or {}
    for auto_class in ("AutoConfig", "AutoModel"):
        if auto_class not in auto_map:
            problems.append(f"config.json auto_map has no {auto_class} entry")
        elif not (folder / (auto_map[auto_class].split(".")[0] + ".py")).is_file():
            problems.append(f"auto_map {auto_class} points to {auto_map[auto_class]!r}, whose file is missing")
    if problems:
        problems.append("re-save with `save_for_hub(drafter, folder)`, which copies the code files and auto_map.")
    return problems


def _check_package_imports(folder: Path) -> list[str]:
    problems = []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).as_posix()
        try:
            lines = imports_of_package(path.read_text(encoding="utf-8"), "hf_retrace")
        except SyntaxError as err:
            problems.append(f"{rel} is not valid Python ({err})")
            continue
        if lines:
            problems.append(
                f"{rel} imports hf_retrace (line {', '.join(map(str, lines))}), which Hub users do not have; Hub "
                "files may import only torch, transformers and each other (`from .modeling_retrace import ...`)"
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


def _num_parameters(folder: Path) -> int:
    return sum(math.prod(shape) for shape in weight_shapes(folder).values())


def _check_repo_id(repo_id: str) -> None:
    if "/" not in repo_id or not _is_repo_id(repo_id):
        raise HubFolderError(
            f"--repo-id must look like ORG/NAME, got {repo_id!r}: the recipe in custom_generate/generate.py loads "
            "the drafter by this full id."
        )


def _is_repo_id(value: str) -> bool:
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------- upload


def upload_plan(folder, rendered: dict[str, bytes] | None = None) -> list[tuple[str, int]]:
    """`[(path in repo, size in bytes)]` that `upload_folder(folder, ignore_patterns=UPLOAD_IGNORE)` uploads once
    `rendered` is written into `folder`; same listing and filter as huggingface_hub's `upload_folder`."""
    root, rendered = Path(folder).expanduser().resolve(), rendered or {}
    sizes = {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.glob("**/*")) if p.is_file()}
    sizes.update({relpath: len(content) for relpath, content in rendered.items()})
    kept = filter_repo_objects(sorted(sizes), ignore_patterns=UPLOAD_IGNORE + DEFAULT_IGNORE_PATTERNS)
    return [(relpath, sizes[relpath]) for relpath in kept]


def publish(
    folder, repo_id: str, *, private=False, dry_run=False, eval_results_json=None, base_model=None, license=None,
    datasets=None, token=None, commit_message=None, revision=None, create_pr=False,
):  # fmt: skip
    """Validates `folder`, renders its card and recipe for `repo_id`, and uploads it (unless `dry_run`).

    The upload is `HfApi.create_repo(exist_ok=True)` then one `HfApi.upload_folder`; before it the rendered card,
    recipe and eval JSON are written into `folder`, so the folder mirrors the repo. A dry run writes nothing.
    Raises [`HubFolderError`] (a `ValueError`) with the fix when the folder or its card cannot be published.
    Returns:
        `(plan, commit_info)`: the [`upload_plan`] and `upload_folder`'s `CommitInfo` (`None` on a dry run).
    """
    _check_repo_id(repo_id)
    folder = Path(folder)
    validate_folder(folder)
    card_meta = {"base_model": base_model, "license": license, "datasets": datasets}
    rendered = render_hub_files(folder, repo_id, card_meta, eval_results_json)
    card = ModelCard(rendered["README.md"].decode())
    problems = check_card_metadata(card)
    if card.data.base_model is None:
        problems.append("the card names no base_model (the target this drafter serves); pass --base-model ORG/NAME")
    if problems:
        raise HubFolderError("The model card cannot be published:\n" + "\n".join(f"  - {p}" for p in problems))
    plan = upload_plan(folder, rendered)
    if dry_run:
        return plan, None
    _write_files(folder, rendered)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        ignore_patterns=list(UPLOAD_IGNORE),
        commit_message=commit_message or "Upload ReTrace drafter with hf-retrace",
        revision=revision,
        create_pr=create_pr,
    )
    return plan, info


def push_to_hub(drafter, repo_id: str, *, private=False, token=None, commit_message=None, revision=None,
                create_pr=False, **card_kwargs):  # fmt: skip
    """`drafter.push_to_hub` done the `hf-retrace publish` way: [`save_for_hub`] into a temporary folder (code
    files, card and `custom_generate/` included), then [`publish`] it.

    Args:
        card_kwargs: `base_model`, `eval_results_json`, `license`, `datasets`, as for [`save_for_hub`].
    Returns:
        `publish`'s `(plan, commit_info)`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        save_for_hub(drafter, tmp, repo_id=repo_id, **card_kwargs)
        upload = {"token": token, "commit_message": commit_message, "revision": revision, "create_pr": create_pr}
        return publish(tmp, repo_id, private=private, **upload)


def format_plan(plan: list[tuple[str, int]], repo_id: str, private: bool) -> str:
    """Human-readable upload plan: one `size  path` line per file, then the total."""
    width = max((len(f"{size:,}") for _, size in plan), default=1)
    lines = [f"{size:>{width},}  {relpath}" for relpath, size in plan]
    total = sum(size for _, size in plan)
    summary = f"{len(plan)} files, {total:,} bytes -> https://huggingface.co/{repo_id}"
    return "\n".join([*lines, f"{summary} ({'private' if private else 'public'})"])


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-retrace publish", description=publish.__doc__.splitlines()[0])
    parser.add_argument("folder", help="drafter folder written by hf_retrace.hub.save_for_hub")
    parser.add_argument("--repo-id", required=True, help="target Hub repo, ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repo private (if it does not exist)")
    parser.add_argument("--dry-run", action="store_true", help="validate and list the files to upload; upload nothing")
    parser.add_argument("--eval-json", help="evaluation JSON for the card's table (see hf_retrace.hub docstring)")
    parser.add_argument("--base-model", help="Hub id of the target model (defaults to the folder card's)")
    parser.add_argument("--license", help="card license (defaults to the folder card's)")
    parser.add_argument("--dataset", action="append", dest="datasets", help="training dataset id (repeatable)")
    return parser


def publish_main(argv: list[str]) -> int:
    """`hf-retrace publish FOLDER --repo-id ORG/NAME [--private] [--dry-run] [--eval-json F]`."""
    args = make_parser().parse_args(argv)
    card_meta = {"base_model": args.base_model, "license": args.license, "datasets": args.datasets}
    try:
        plan, info = publish(
            args.folder, args.repo_id, private=args.private, dry_run=args.dry_run, eval_results_json=args.eval_json,
            **card_meta,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as err:  # HubFolderError is a ValueError
        print(f"hf-retrace publish: error: {err}", file=sys.stderr)
        return 1
    header = "Dry run, nothing uploaded. Would upload:" if args.dry_run else "Uploaded:"
    print(header + "\n" + format_plan(plan, args.repo_id, args.private))
    if info is not None:
        print(f"Commit: {info.commit_url}")
    return 0


__all__ = [
    "HubFolderError",
    "check_card_metadata",
    "eval_table",
    "load_eval_results",
    "publish",
    "publish_main",
    "push_to_hub",
    "render_custom_generate",
    "render_hub_files",
    "render_model_card",
    "save_for_hub",
    "upload_plan",
    "validate_folder",
]
