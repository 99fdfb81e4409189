"""Keeps the vLLM plugin's copies of the shared policy files identical to their originals, as transformers'
`utils/check_copies.py` keeps its `# Copied from` code.

The drafting policy is written once, in `hf_retrace/models/` (Hub files that import numpy, the standard library and
each other only). The plugin cannot import `hf_retrace` (vLLM's venv has an older transformers), so it runs copies in
`integrations/vllm/hf_retrace_vllm/shared/`: each is one header line, then the original byte for byte.

    python utils/check_copies.py          # lists every copy that drifted; exit status 1 if any
    python utils/check_copies.py --fix    # rewrites the copies from the originals

`tests/test_check_copies.py` runs the check in the main suite. To share another file, add its name to `SHARED_FILES`
and run `--fix`.
"""

import argparse
import ast
import sys
from pathlib import Path


SHARED_FILES = (
    "datastore_file_retrace.py",
    "lookup_retrace.py",
    "sources_retrace.py",
    "policy_settings_retrace.py",
    "acceptance_retrace.py",
    "cost_model_retrace.py",
    "goodput_retrace.py",
    "online_datastore_retrace.py",
    "speculation_retrace.py",
)
ORIGINALS = Path("hf_retrace/models")
COPIES = Path("integrations/vllm/hf_retrace_vllm/shared")
HEADER = "# Copied from hf_retrace/models/{name} by utils/check_copies.py --fix; edit the original.\n"
ALLOWED_IMPORTS = {"numpy"}  # besides the standard library and relative imports of other shared files
_NOT_COPIES = {"__init__.py"}  # the copies' package file is the plugin's own
REPO = Path(__file__).resolve().parents[1]


def expected_copy(name: str, root: Path = REPO) -> str:
    """The text the copy of `name` must have: the header line, then the original."""
    return HEADER.format(name=name) + (root / ORIGINALS / name).read_text(encoding="utf-8")


def check_copies(root: Path = REPO, fix: bool = False) -> list[str]:
    """Problems with the copies under `root` (empty when all are identical); with `fix`, rewrites them first and
    removes copies of files no longer shared."""
    problems = []
    for name in SHARED_FILES:
        copy, want = root / COPIES / name, expected_copy(name, root)
        if copy.is_file() and copy.read_text(encoding="utf-8") == want:
            continue
        if fix:
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(want, encoding="utf-8")
        else:
            state = "differs from" if copy.is_file() else "is missing; it copies"
            problems.append(f"{COPIES / name} {state} {ORIGINALS / name}")
    for copy in sorted((root / COPIES).glob("*.py")):
        if copy.name not in SHARED_FILES and copy.name not in _NOT_COPIES:
            if fix:
                copy.unlink()
            else:
                problems.append(f"{COPIES / copy.name} is not in SHARED_FILES (a stale copy?)")
    return problems


def check_imports(root: Path = REPO) -> list[str]:
    """Imports of the shared originals beyond the standard library, numpy and the other shared files (the plugin's
    venv has neither torch's pinned build nor transformers 5)."""
    problems = []
    for name in SHARED_FILES:
        tree = ast.parse((root / ORIGINALS / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            elif isinstance(node, ast.ImportFrom):
                if node.level != 1 or f"{node.module}.py" not in SHARED_FILES:
                    problems.append(f"{ORIGINALS / name}: `from {'.' * node.level}{node.module} import ...` is not "
                                    "a shared file")  # fmt: skip
                continue
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ALLOWED_IMPORTS:
                    problems.append(f"{ORIGINALS / name}: imports {module}, beyond the stdlib and numpy")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix", action="store_true", help="rewrite the copies from the originals")
    args = parser.parse_args(argv)
    problems = check_imports() + check_copies(fix=args.fix)
    for problem in problems:
        print(problem)
    if problems and not args.fix:
        print("run `python utils/check_copies.py --fix` to copy the originals over")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
