"""hf_retrace.hub.publish: the Hub folder, its card, `hf-retrace publish`, and loading it where hf_retrace is not
installed.

Everything is offline. "The Hub" is a fake `HF_HUB_CACHE` that the mocked `HfApi.upload_folder` fills with exactly the
files it was asked to upload; the target is published there too, so the card's snippet runs unmodified.
"""

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModel, PreTrainedTokenizerFast
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from hf_retrace import ReTraceDrafterModel
from hf_retrace.hub import model_card
from hf_retrace.hub import publish as hub
from hf_retrace.hub import validation as hub_validation


REPO_ID, TARGET_ID = "org/tiny-retrace", "org/tiny-target"
SUPPORT = (5, 6, 7)  # the only tokens the restricted target emits greedily
EVAL = {
    "target": "tiny-qwen3",
    "results": [
        {"method": "retrace", "prompt_set": "gsm_symbolic", "tau": 3.4149, "tokens_per_s": 61.23, "speedup": 2.268},
        {"method": "dflash", "prompt_set": "gsm_symbolic", "tau": 3.1, "tokens_per_s": None},
        {"method": "target", "prompt_set": "humaneval|x"},
    ],
}
EXPECTED_ROWS = [
    ["retrace", "gsm_symbolic", "3.41", "61.2", "2.27×"],
    ["dflash", "gsm_symbolic", "3.10", "–", "–"],
    ["target", "humaneval\\|x", "–", "–", "–"],
]


# ------------------------------------------------------------------------------------------------------ fixtures


def make_target() -> transformers.Qwen3ForCausalLM:
    """Tiny Qwen3 whose greedy choice is always in SUPPORT (lm-head rows a, -a, c; zero elsewhere) and whose a/b/c
    embeddings coincide, so a random drafter gets some drafts accepted and every acceptance length occurs."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, tie_word_embeddings=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        direction, third = torch.randn(2, head.shape[1])
        head.zero_()
        head[SUPPORT[0]], head[SUPPORT[1]], head[SUPPORT[2]] = direction, -direction, 0.5 * third
        embed[SUPPORT[1]], embed[SUPPORT[2]] = embed[SUPPORT[0]], embed[SUPPORT[0]]
    return model


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(128)} | {"[UNK]": 0}
    vocab.update({"Speculative": 9, "decoding": 10, "is": 11})
    tokenizer = Tokenizer(models.WordLevel({k: v for k, v in vocab.items() if k != "w0"}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[UNK]")


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def drafter(target):
    """With datastore lookup on, so the folder carries generation_config.json and datastore.safetensors and the
    remote-code checks cover them."""
    torch.manual_seed(1)
    drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=4)
    with torch.no_grad():
        for param in drafter.retrace.parameters():  # non-zero W_v, W_c, gate: the conditioning changes drafts
            param.normal_(0.0, 0.5)
    responses = []
    for seed in range(3):  # the target's own responses to other prompts: the datastore proposes now and then
        ids = torch.randint(8, 128, (1, 9), generator=torch.Generator().manual_seed(seed + 10))
        responses.append(target.generate(ids, do_sample=False, max_new_tokens=20)[0, 9:].tolist())
    drafter.set_datastore(responses)
    drafter.generation_config.update(datastore_num_tokens=2, datastore_min_ngram_size=4)
    return drafter.eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(8, 128, (1, 9), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def eval_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "bench.json"
    path.write_text(json.dumps(EVAL))
    return path


@pytest.fixture(scope="module")
def folder(drafter, eval_json, tmp_path_factory):
    out = tmp_path_factory.mktemp("hub") / "tiny-retrace"
    return hub.save_for_hub(drafter, out, base_model=TARGET_ID, eval_results_json=eval_json, datasets=["org/prompts"])


class FakeHub:
    """Replaces HfApi's transport: records calls, and `upload_folder` copies the files it selects (the folder minus
    `ignore_patterns` + huggingface_hub's defaults, matched independently here) into a fake offline Hub cache."""

    def __init__(self, cache: Path):
        self.cache, self.create_calls, self.uploads = cache, [], []

    def create_repo(self, api, repo_id, **kwargs):
        self.create_calls.append((repo_id, kwargs))

    def upload_folder(self, api, *, repo_id, folder_path, ignore_patterns=None, **kwargs):
        root, patterns = Path(folder_path), list(ignore_patterns or []) + DEFAULT_IGNORE_PATTERNS
        files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        files = {k: v for k, v in files.items() if not any(fnmatch.fnmatch(k, pat) for pat in patterns)}
        self.uploads.append({"repo_id": repo_id, "files": files, "kwargs": kwargs})
        put_in_cache(self.cache, repo_id, files)
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()


def put_in_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    """Lays `files` out as huggingface_hub's cache does for revision `main` (what a download would leave)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    for relpath, content in files.items():
        (snapshot / relpath).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / relpath).write_bytes(content)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text("0" * 40)


def patch_hub(monkeypatch, fake: FakeHub) -> None:
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: fake.create_repo(api, repo_id, **kw))
    monkeypatch.setattr(HfApi, "upload_folder", lambda api, **kw: fake.upload_folder(api, **kw))


@pytest.fixture(scope="module")
def published(folder, target, tmp_path_factory):
    """`hf-retrace publish` of a copy of `folder` to REPO_ID through the fake Hub; the target is put there too. The
    copy holds only what model_cards/ keeps (no code files, no recipe): publish writes them."""
    root = tmp_path_factory.mktemp("published")
    copy = shutil.copytree(folder, root / "folder")
    strip_code(copy)
    fake = FakeHub(root / "hub_cache")
    with pytest.MonkeyPatch.context() as mp:
        patch_hub(mp, fake)
        assert hub.publish_main([str(copy), "--repo-id", REPO_ID, "--private"]) == 0
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    make_tokenizer().save_pretrained(target_dir)
    put_in_cache(fake.cache, TARGET_ID, {p.name: p.read_bytes() for p in target_dir.iterdir() if p.is_file()})
    return copy, fake


def strip_code(folder: Path) -> None:
    """Leaves what model_cards/ keeps: card, config, weights, eval JSON."""
    for name in hub_validation.CODE_FILES:
        (folder / name).unlink()
    shutil.rmtree(folder / "custom_generate")


def greedy(model, prompt, **kwargs):
    return model.generate(prompt, max_new_tokens=24, do_sample=False, **kwargs)[0].tolist()


# ------------------------------------------------------------------------------------------- isolated subprocess

ISOLATED_CHECK = r"""
import json, sys
import torch
from transformers import AutoModel, AutoModelForCausalLM
try:
    import hf_retrace
    hf_retrace_error = None
except ImportError as err:
    hf_retrace_error = str(err)
prompt = torch.tensor(json.loads(sys.argv[1]))
target = AutoModelForCausalLM.from_pretrained("org/tiny-target").eval()
greedy = lambda **kw: target.generate(prompt, max_new_tokens=24, do_sample=False, **kw)[0].tolist()
out = {"hf_retrace_error": hf_retrace_error, "greedy": greedy()}
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.generation.utils import GenerationMixin
is_hooked = lambda: getattr(GenerationMixin._get_candidate_generator, "_retrace_hook", False)
out["hooked_before_import"] = is_hooked()
get_class_from_dynamic_module("modeling_retrace.ReTraceDrafterModel", sys.argv[2])  # import only, no model built
out["hooked_on_import"] = is_hooked()
for name, source in (("folder", sys.argv[2]), ("repo", "org/tiny-retrace")):
    drafter = AutoModel.from_pretrained(source, trust_remote_code=True)
    out[name + "_module"] = type(drafter).__module__
    out[name + "_assistant"] = greedy(assistant_model=drafter)
    out[name + "_acceptance"] = drafter.last_generation_stats.acceptance_lengths
    out[name + "_source_cycles"] = drafter.last_generation_stats.source_cycles
    out[name + "_custom"] = greedy(custom_generate=source, trust_remote_code=True)
print("RESULT " + json.dumps(out))
"""


def run_isolated(args: list[str], cache: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Python with `-I -S` (no user site, no `.pth` files, so no editable hf_retrace) plus bare site-packages."""
    site = sysconfig.get_paths()["purelib"]
    bootstrap = f"import sys; sys.path.append({site!r}); sys.argv = sys.argv[1:]; exec(open(sys.argv[0]).read())"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_MODULES_CACHE": str(cwd / "mods")}
    command = [sys.executable, "-I", "-S", "-c", bootstrap, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_loads_and_generates_losslessly_without_hf_retrace(folder, published, drafter, target, prompt, tmp_path):
    script = tmp_path / "check.py"
    script.write_text(ISOLATED_CHECK)
    proc = run_isolated([str(script), json.dumps(prompt.tolist()), str(folder)], published[1].cache, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["hf_retrace_error"] is not None and "hf_retrace" in out["hf_retrace_error"]
    expected = greedy(target, prompt)
    assert out["greedy"] == expected
    assert not out["hooked_before_import"] and out["hooked_on_import"]  # the remote-code import installs the hook
    greedy(target, prompt, assistant_model=drafter)
    for name in ("folder", "repo"):
        assert out[name + "_module"].startswith("transformers_modules.")
        assert out[name + "_assistant"] == out[name + "_custom"] == expected
        assert out[name + "_acceptance"] == drafter.last_generation_stats.acceptance_lengths  # same drafts
        assert out[name + "_source_cycles"] == drafter.last_generation_stats.source_cycles
    assert drafter.last_generation_stats.source_cycles.get("datastore", 0) > 0  # the datastore file was used


@pytest.mark.slow
def test_card_usage_snippet_runs(published, tmp_path):
    card = ModelCard.load(published[0] / "README.md")
    snippet = re.search(r"## Usage.*?```python\n(.*?)```", card.text, flags=re.DOTALL).group(1)
    assert f'"{REPO_ID}"' in snippet and f'"{TARGET_ID}"' in snippet
    (tmp_path / "snippet.py").write_text(snippet)
    proc = run_isolated([str(tmp_path / "snippet.py")], published[1].cache, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mean acceptance length:" in proc.stdout


# ---------------------------------------------------------------------------------------------- folder + loading


def test_folder_layout(folder):
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "datastore.safetensors",
                     *hub_validation.CODE_FILES, "custom_generate/generate.py", "README.md",
                     "eval_results.json"}  # fmt: skip
    assert not {"num_assistant_tokens", "datastore_size"} & json.loads((folder / "config.json").read_text()).keys()
    assert json.loads((folder / "generation_config.json").read_text())["datastore_num_tokens"] == 2
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_retrace.ReTraceDrafterConfig",
                                  "AutoModel": "modeling_retrace.ReTraceDrafterModel"}  # fmt: skip
    recipe = (folder / "custom_generate/generate.py").read_text()
    assert f"DRAFTER_SOURCE = {json.dumps(str(folder.resolve()))}" in recipe
    # numpy: the shared policy files (a dependency of transformers itself)
    allowed = {"torch", "transformers", "numpy", "huggingface_hub", *sys.stdlib_module_names}
    for path in folder.rglob("*.py"):
        assert absolute_imports(path.read_text()) <= allowed, path


def absolute_imports(source: str) -> set[str]:
    """Top-level package names of the absolute imports in `source`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_from_pretrained_and_auto_model_agree(folder, drafter, target, prompt):
    """In this process hf_retrace is registered, so AutoModel picks the package class even with trust_remote_code
    (transformers prefers explicitly registered code); the folder's own code is loaded explicitly as `remote`. The
    subprocess test covers AutoModel where hf_retrace is absent."""
    native = ReTraceDrafterModel.from_pretrained(folder).eval()
    auto = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    remote_cls = get_class_from_dynamic_module("modeling_retrace.ReTraceDrafterModel", str(folder))
    remote = remote_cls.from_pretrained(folder).eval()
    assert type(native) is ReTraceDrafterModel and auto.config.model_type == "retrace_drafter"
    assert remote_cls.__module__.startswith("transformers_modules.")
    for key, value in drafter.state_dict().items():
        for loaded in (native, auto, remote):
            torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    expected = greedy(target, prompt)
    for loaded in (native, auto, remote):
        assert greedy(target, prompt, assistant_model=loaded) == expected
        assert loaded.last_generation_stats.num_conditioned_rounds > 0


def test_loaded_drafter_drafts_like_the_saved_one(folder, drafter, target, prompt):
    """Regression: `beta` used to be a non-persistent buffer that from_pretrained left uninitialised (meta-device
    load), so loaded drafters drafted differently from the saved one while staying lossless."""
    greedy(target, prompt, assistant_model=drafter)
    expected = drafter.last_generation_stats.acceptance_lengths
    assert len(set(expected)) > 1  # the setup gives a mix of acceptance lengths
    remote_cls = get_class_from_dynamic_module("modeling_retrace.ReTraceDrafterModel", str(folder))
    for loaded in (ReTraceDrafterModel.from_pretrained(folder), remote_cls.from_pretrained(folder)):
        assert float(loaded.retrace.beta) == 1.0
        greedy(target, prompt, assistant_model=loaded.eval())
        assert loaded.last_generation_stats.acceptance_lengths == expected


def test_custom_generate_folder_matches_assistant_model(folder, drafter, target, prompt):
    via_recipe = greedy(target, prompt, custom_generate=str(folder), trust_remote_code=True)
    assert via_recipe == greedy(target, prompt, assistant_model=drafter) == greedy(target, prompt)
    explicit = greedy(target, prompt, custom_generate=str(folder), trust_remote_code=True, drafter=drafter)
    assert explicit == via_recipe


def test_recipe_template_substitution():
    source = hub.render_custom_generate("org/name")
    namespace = {}
    exec(compile(source, "generate.py", "exec"), namespace)
    assert namespace["DRAFTER_SOURCE"] == "org/name" and callable(namespace["generate"])
    assert hub_validation.imports_of_package(source, "hf_retrace") == []


# ---------------------------------------------------------------------------------------------------- the card


def table_rows(text: str) -> list[list[str]]:
    section = text.split("## Evaluation", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|") for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)] for row in rows[2:]]


def test_card_metadata_and_eval_table(folder):
    card = ModelCard.load(folder / "README.md")
    assert model_card.check_card_metadata(card) == []
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["base_model"] == TARGET_ID and data["license"] == "apache-2.0"
    assert data["datasets"] == ["org/prompts"] and set(model_card.CARD_TAGS) <= set(data["tags"])
    ModelCardData(**data)  # round-trips through huggingface_hub's own dataclass
    assert table_rows(card.text) == EXPECTED_ROWS
    assert "Setup: target = `tiny-qwen3`" in card.text
    assert json.loads((folder / "eval_results.json").read_text()) == EVAL


def test_card_metadata_problems_are_reported(drafter):
    card = model_card.render_model_card(
        drafter.config, drafter.decoding_settings(), repo_id=REPO_ID, base_model="./local/target", license=None
    )
    problems = " ".join(model_card.check_card_metadata(card))
    assert "base_model must be a Hub model id" in problems and "license is missing" in problems


@pytest.mark.parametrize("payload", [{"rows": []}, {"results": [1, 2]}, "not json"])
def test_bad_eval_json_is_refused(payload, tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    with pytest.raises(ValueError, match="Evaluation JSON|results|Cannot read"):
        model_card.load_eval_results(path)


# ----------------------------------------------------------------------------------------------------- publish


def test_publish_uploads_the_planned_files(published):
    copy, fake = published
    assert fake.create_calls == [(REPO_ID, {"private": True, "exist_ok": True})]
    (upload,) = [u for u in fake.uploads if u["repo_id"] == REPO_ID]
    assert sorted(upload["files"]) == [path for path, _ in hub.upload_plan(copy)]
    package = Path(hub.__file__).resolve().parents[1] / "models"
    for name in hub_validation.CODE_FILES:  # the folder had none: publish wrote the package's Hub files
        assert upload["files"][name] == (package / name).read_bytes() == (copy / name).read_bytes()
    recipe = upload["files"]["custom_generate/generate.py"].decode()
    assert f'DRAFTER_SOURCE = "{REPO_ID}"' in recipe and str(copy) not in recipe
    card = ModelCard(upload["files"]["README.md"].decode())
    assert card.data.base_model == TARGET_ID and f'"{REPO_ID}"' in card.text  # metadata kept from the saved card
    assert table_rows(card.text) == EXPECTED_ROWS


def test_dry_run_lists_every_file_and_uploads_nothing(folder, capsys, monkeypatch, tmp_path):
    fake = FakeHub(tmp_path / "cache")
    patch_hub(monkeypatch, fake)
    folder = shutil.copytree(folder, tmp_path / "folder")
    (folder / "custom_generate" / "__pycache__").mkdir(exist_ok=True)
    (folder / "custom_generate" / "__pycache__" / "generate.cpython-311.pyc").write_bytes(b"x")
    assert hub.publish_main([str(folder), "--repo-id", "org/other", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert fake.create_calls == [] and fake.uploads == []
    listed = dict((line.split()[1], int(line.split()[0].replace(",", ""))) for line in out.splitlines()[1:-1])
    on_disk = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip
    assert listed.keys() == on_disk.keys()
    rerendered = {"README.md", "custom_generate/generate.py"}  # re-rendered for org/other: sizes of the new content
    assert all(listed[k] == v for k, v in on_disk.items() if k not in rerendered)
    assert "org/other" in out and f"{len(on_disk)} files" in out
    assert 'DRAFTER_SOURCE = "org/other"' not in (folder / "custom_generate/generate.py").read_text()


def _drop_weights(folder: Path):
    (folder / "model.safetensors").unlink()


def _truncate_weights(folder: Path):
    path = folder / "model.safetensors"
    os.truncate(path, path.stat().st_size - 64)


def _shape_mismatch(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))


def _corrupt_datastore(folder: Path):
    path = folder / "datastore.safetensors"
    path.write_bytes(path.read_bytes()[:-2] + b"\x00\x01")


def _drops_auto_map(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    del config["auto_map"]["AutoModel"]
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "breaks, message",
    [
        (_drop_weights, "model.safetensors is missing"),
        (_truncate_weights, "model.safetensors cannot be loaded"),
        (_shape_mismatch, "gate_proj.weight has shape [64, 32] but config.json implies [48, 32]"),
        (_drops_auto_map, "config.json auto_map has no AutoModel entry"),
        (_corrupt_datastore, "corrupt datastore file"),
    ],
)
def test_publish_refuses_broken_folders(breaks, message, folder, tmp_path, capsys, monkeypatch):
    fake = FakeHub(tmp_path / "cache")
    patch_hub(monkeypatch, fake)
    broken = shutil.copytree(folder, tmp_path / "broken")
    breaks(broken)
    assert hub.publish_main([str(broken), "--repo-id", REPO_ID]) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot be published" in err, err
    assert "save_for_hub" in err or "Hub files may import only" in err  # says how to fix it
    assert fake.create_calls == [] and fake.uploads == []


def test_code_files_are_what_the_modeling_file_imports():
    """`CODE_FILES` (what publish writes and validation requires) is exactly the relative-import closure of
    modeling_retrace.py, which is what `register_for_auto_class` copies and `trust_remote_code` fetches."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from hf_retrace.models import modeling_retrace

    closure = {Path(p).name for p in get_relative_import_files(modeling_retrace.__file__)}
    assert closure | {"modeling_retrace.py"} == set(hub_validation.CODE_FILES)


def test_validate_folder_refuses_code_that_imports_hf_retrace_or_is_missing(folder, tmp_path):
    """What a saved folder is checked for on its own (publish replaces the code files with the package's)."""
    broken = shutil.copytree(folder, tmp_path / "broken")
    path = broken / "generation_retrace.py"
    path.write_text(path.read_text() + "\n\ndef _helper():\n    from hf_retrace.hub import publish\n")
    (broken / "custom_generate" / "generate.py").unlink()
    with pytest.raises(hub_validation.HubFolderError) as err:
        hub_validation.validate_folder(broken)
    assert "generation_retrace.py imports hf_retrace (line" in str(err.value)
    assert "custom_generate/generate.py is missing" in str(err.value)
    hub_validation.validate_folder(broken, hub.code_files(REPO_ID))  # what publish would write instead is fine


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repo-id", "just-a-name"], "must look like ORG/NAME"),
        (["--repo-id", REPO_ID, "--base-model", "/abs/path"], "base_model must be a Hub model id"),
    ],
)
def test_publish_refuses_bad_arguments(argv, message, folder, capsys, monkeypatch, tmp_path):
    fake = FakeHub(tmp_path / "cache")
    patch_hub(monkeypatch, fake)
    assert hub.publish_main([str(folder), *argv]) == 2
    assert message in capsys.readouterr().err
    assert fake.uploads == []


def test_publish_refuses_card_without_base_model(drafter, tmp_path, capsys):
    bare = hub.save_for_hub(drafter, tmp_path / "bare")
    assert hub.publish_main([str(bare), "--repo-id", REPO_ID, "--dry-run"]) == 2
    assert "--base-model" in capsys.readouterr().err


@pytest.mark.parametrize("route", ["function", "method"])
def test_push_to_hub_uploads_code_card_and_recipe(route, drafter, monkeypatch, tmp_path):
    fake = FakeHub(tmp_path / "cache")
    patch_hub(monkeypatch, fake)
    push = hub.push_to_hub if route == "function" else lambda d, *a, **k: d.push_to_hub(*a, **k)
    plan, info = push(drafter, "org/pushed", base_model=TARGET_ID, private=True)
    (upload,) = fake.uploads
    assert set(upload["files"]) == {path for path, _ in plan}
    assert {"README.md", "custom_generate/generate.py", *hub_validation.CODE_FILES} <= set(upload["files"])
    assert 'DRAFTER_SOURCE = "org/pushed"' in upload["files"]["custom_generate/generate.py"].decode()
    assert fake.create_calls == [("org/pushed", {"private": True, "exist_ok": True})]
    assert info.commit_url.startswith("https://huggingface.co/org/pushed")


@pytest.mark.parametrize(
    "source, lines",
    [
        ("import hf_retrace", [1]),
        ("import os\nfrom hf_retrace.hub.publish import x", [2]),
        ("import hf_retrace_other\nfrom .modeling_retrace import X", []),
        ("def f():\n    import importlib\n    return importlib.import_module('hf_retrace.trainer.masks')", [3]),
        ("s = 'import hf_retrace'  # a string, not an import", []),
    ],
)
def test_imports_of_package(source, lines):
    assert hub_validation.imports_of_package(source, "hf_retrace") == lines


def test_missing_local_path_and_unknown_command_say_what_is_wrong(capsys):
    from hf_retrace.cli import main as cli_main

    with pytest.raises(OSError, match="'/no/such/path' does not exist"):
        ReTraceDrafterModel.from_pretrained("/no/such/path")
    assert cli_main(["foo"]) == 2
    assert "unknown command 'foo'" in capsys.readouterr().err
    assert cli_main(["--help"]) == 0
