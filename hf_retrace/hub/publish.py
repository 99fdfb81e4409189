"""Sharing ReTrace drafters on the Hugging Face Hub.

[`save_for_hub`] writes a complete Hub folder; [`publish`] (CLI: `hf-retrace publish`) validates it, renders the card
and the `custom_generate` recipe for the repo id, then uploads it with `HfApi.create_repo` + `HfApi.upload_folder`.

Folder layout (everything a user needs with `transformers` alone, `trust_remote_code=True`):

    config.json                  the network (architecture, `retrace_mode`, ...), `auto_map` (AutoConfig, AutoModel)
    generation_config.json       the decoding settings (`num_assistant_tokens`, lookups, ...: `decoding_retrace`)
    model.safetensors            weights (or sharded `model-*.safetensors` + `model.safetensors.index.json`)
    datastore.safetensors        the datastore, when the drafter has one (`datastore_file_retrace`)
    *_retrace.py                 the Hub files of `hf_retrace.models` (`validation.CODE_FILES`), written by
                                 `save_pretrained` (`register_for_auto_class`) and again by `publish`
    custom_generate/generate.py  `target.generate(..., custom_generate=<repo>, trust_remote_code=True)` recipe
    README.md                    model card rendered from `hf_retrace/hub/templates/model_card.md`
    eval_results.json            the evaluation JSON behind the card's table (only when one was given)

`generation_config.json` holds the drafter's decoding settings, not the target's: `generate` runs on the target with
its own config, and transformers reads an assistant's `num_assistant_tokens` from `assistant_model.generation_config`.

A drafter folder kept in a source tree (`model_cards/*`) needs only `config.json` (with `auto_map`),
`generation_config.json`, the weights, its datastore, the card and its `eval_results.json`: `publish` uploads the
whole folder and writes the code files of this package and the recipe into it before
the upload, so the repo always carries the code of the hf_retrace that published it. With hf_retrace installed
such a folder loads with `ReTraceDrafterModel.from_pretrained(folder)` or `AutoModel.from_pretrained(folder)`
(`import hf_retrace` registers the classes, and transformers prefers registered code to `auto_map`).

`custom_generate/generate.py` cannot learn where it was loaded from (transformers copies it into its modules cache),
so its `DRAFTER_SOURCE` names the drafter: the repo id once published (or when `repo_id=` is given), otherwise the
absolute path of the folder. `publish` rewrites it (and the card) for the target repo id before uploading.

The card and its evaluation JSON schema live in [`hf_retrace.hub.model_card`], the folder checks in
[`hf_retrace.hub.validation`]; their entry points listed in this module's `__all__` are re-exported here.
"""

import argparse
import json
import math
import re
import sys
import tempfile
import warnings
from importlib import resources
from pathlib import Path

from huggingface_hub import HfApi, ModelCard
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

from ..models.modeling_retrace import ReTraceDrafterModel
from .validation import (
    CODE_FILES,
    CUSTOM_GENERATE_FILE,
    HubFolderError,
    check_repo_id,
    validate_folder,
    weight_shapes,
)
from .model_card import check_card_metadata, eval_table, load_eval_results, render_model_card


EVAL_FILE = "eval_results.json"
UPLOAD_IGNORE = ["*__pycache__*", "*.pyc", "*.DS_Store"]
_SOURCE_LINE = re.compile(r"^DRAFTER_SOURCE = None\b.*$", flags=re.MULTILINE)


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
        eval_results_json (`str` or `os.PathLike`, *optional*): evaluation JSON (schema in
            `hf_retrace.hub.model_card`).
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
        check_repo_id(repo_id)
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
    files = code_files(repo_id)
    eval_path = Path(eval_results_json) if eval_results_json is not None else folder / EVAL_FILE
    eval_data = load_eval_results(eval_path) if eval_results_json is not None or eval_path.is_file() else None
    if eval_data is not None:
        files[EVAL_FILE] = (json.dumps(eval_data, indent=2, ensure_ascii=False) + "\n").encode()
    meta = {**_current_card_meta(folder), **{k: v for k, v in card_meta.items() if v is not None}}
    drafter = _load_drafter(folder)
    card = render_model_card(
        drafter.config, drafter.decoding_settings(), repo_id=repo_id, datastore_size=drafter.datastore_size,
        eval_data=eval_data, num_parameters=_num_parameters(folder), **meta,
    )  # fmt: skip
    files["README.md"] = str(card).encode()
    return files


def code_files(drafter_source: str) -> dict[str, bytes]:
    """The code a Hub repo of a drafter needs, as `{relative path: content}`: the Hub files of `hf_retrace.models`
    (what `trust_remote_code=True` loads) and `custom_generate/generate.py` for `drafter_source`."""
    models = resources.files("hf_retrace.models")
    files = {name: models.joinpath(name).read_bytes() for name in CODE_FILES}
    files[CUSTOM_GENERATE_FILE] = render_custom_generate(drafter_source).encode()
    return files


def render_custom_generate(drafter_source: str) -> str:
    """Source of `custom_generate/generate.py` whose `DRAFTER_SOURCE` is `drafter_source` (repo id or folder)."""
    template = resources.files("hf_retrace.hub").joinpath("custom_generate_template.py").read_text(encoding="utf-8")
    source, count = _SOURCE_LINE.subn(lambda _: f"DRAFTER_SOURCE = {json.dumps(str(drafter_source))}", template)
    if count != 1:
        raise RuntimeError("custom_generate_template.py must contain exactly one `DRAFTER_SOURCE = None` line")
    return source


def _load_drafter(folder: Path) -> ReTraceDrafterModel:
    """The drafter of `folder` as the card describes it: network, decoding settings and datastore as it loads them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # an old folder's settings move on load; loading it says so
        return ReTraceDrafterModel.from_pretrained(folder)


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    for relpath, content in files.items():
        (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
        (folder / relpath).write_bytes(content)


def _current_card_meta(folder: Path) -> dict:
    if not (folder / "README.md").is_file():
        return {}
    data = ModelCard.load(folder / "README.md").data
    current = {"base_model": data.base_model, "license": data.license, "datasets": data.datasets}
    return {k: v for k, v in current.items() if v is not None}


def _num_parameters(folder: Path) -> int:
    return sum(math.prod(shape) for shape in weight_shapes(folder).values())


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
    """Validates `folder`, renders its code files, card and recipe for `repo_id`, and uploads it (unless `dry_run`).

    The upload is `HfApi.create_repo(exist_ok=True)` then one `HfApi.upload_folder`; before it this package's Hub
    files, the rendered card, recipe and eval JSON are written into `folder`, so the folder mirrors the repo. A dry
    run writes nothing.
    Raises [`HubFolderError`] (a `ValueError`) with the fix when the folder or its card cannot be published.
    Returns:
        `(plan, commit_info)`: the [`upload_plan`] and `upload_folder`'s `CommitInfo` (`None` on a dry run).
    """
    check_repo_id(repo_id)
    folder = Path(folder)
    validate_folder(folder, code_files(repo_id))
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
    parser.add_argument("folder", help="drafter folder written by hf_retrace.hub.publish.save_for_hub")
    parser.add_argument("--repo-id", required=True, help="target Hub repo, ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repo private (if it does not exist)")
    parser.add_argument("--dry-run", action="store_true", help="validate and list the files to upload; upload nothing")
    parser.add_argument("--eval-json", help="evaluation JSON for the card's table (schema: hf_retrace.hub.model_card)")
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
        return 2  # a usage error: exit status 2, as every hf-retrace subcommand (hf_retrace.cli)
    header = "Dry run, nothing uploaded. Would upload:" if args.dry_run else "Uploaded:"
    print(header + "\n" + format_plan(plan, args.repo_id, args.private))
    if info is not None:
        print(f"Commit: {info.commit_url}")
    return 0


__all__ = [
    "HubFolderError",
    "check_card_metadata",
    "code_files",
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
