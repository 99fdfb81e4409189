import ast
import gzip
import json
import textwrap
from pathlib import Path

import pytest

from hf_retrace.data import prompts
from hf_retrace.data.prompts import EVAL_SEED_OFFSET, PROMPT_SETS, load_prompts


def _is_conversation(p):
    return isinstance(p, list) and p and all(set(m) == {"role", "content"} for m in p) and p[-1]["role"] == "user"


@pytest.fixture
def small_stdlib(monkeypatch):
    """Restricts the stdlib walk to two modules so the stdlib-based sets build in milliseconds."""
    import heapq
    import json.decoder

    files = [Path(json.decoder.__file__), Path(heapq.__file__)]
    monkeypatch.setattr(prompts, "_stdlib_files", lambda: files)
    prompts._stdlib_functions.cache_clear()
    yield
    prompts._stdlib_functions.cache_clear()


def test_unknown_name_lists_valid_sets():
    valid = "gsm_symbolic, codeio, knights_knaves, humaneval, stdlib, stdlib_complete, open_ended"
    with pytest.raises(ValueError, match=valid):
        load_prompts("gsm8k")
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts("/nonexistent/prompts.jsonl")


def test_gsm_symbolic_is_seeded_and_train_eval_disjoint():
    train = load_prompts("gsm_symbolic", num_prompts=20, seed=0)
    assert len(train) == 20 and all(_is_conversation(p) for p in train)
    assert train == load_prompts("gsm_symbolic", num_prompts=20, seed=0)
    evaluation = load_prompts("gsm_symbolic", num_prompts=20, seed=EVAL_SEED_OFFSET)
    assert not {p[0]["content"] for p in train} & {p[0]["content"] for p in evaluation}


def test_codeio():
    out = load_prompts("codeio", num_prompts=3, seed=0)
    assert len(out) == 3 and all(_is_conversation(p) for p in out)
    assert all("input and output" in p[0]["content"] for p in out)


def test_knights_knaves_is_seeded():
    out = load_prompts("knights_knaves", num_prompts=3, seed=EVAL_SEED_OFFSET)
    assert len(out) == 3 and all(_is_conversation(p) for p in out)
    assert out == load_prompts("knights_knaves", num_prompts=3, seed=EVAL_SEED_OFFSET)
    assert out != load_prompts("knights_knaves", num_prompts=3, seed=0)


def test_humaneval_has_164_function_prompts():
    out = load_prompts("humaneval")
    assert len(out) == 164
    assert all(p[0]["content"].startswith("Complete this Python function:\n") for p in out)
    assert "def has_close_elements(" in out[0][0]["content"]


def test_finite_subset_is_seeded_and_in_canonical_order():
    full = [p[0]["content"] for p in load_prompts("humaneval")]
    subset = [p[0]["content"] for p in load_prompts("humaneval", num_prompts=10, seed=3)]
    assert len(subset) == 10 and subset == sorted(subset, key=full.index)
    assert subset == [p[0]["content"] for p in load_prompts("humaneval", num_prompts=10, seed=3)]
    assert subset != [p[0]["content"] for p in load_prompts("humaneval", num_prompts=10, seed=4)]


def test_stdlib_code_prompts(small_stdlib):
    out = load_prompts("stdlib", num_prompts=8, seed=0)
    assert len(out) == 8 and all(_is_conversation(p) for p in out)
    for p in out:
        code = p[0]["content"].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        ast.parse(code)  # the extracted function is dedented, complete source
        assert code.lstrip().startswith(("def ", "async def ", "@"))


def test_stdlib_complete_prompts_are_humaneval_style_stubs(small_stdlib):
    out = load_prompts("stdlib_complete", num_prompts=8, seed=0)
    assert len(out) == 8 and all(_is_conversation(p) for p in out)
    for p in out:
        header, stub = p[0]["content"].split("\n", 1)
        assert header == "Complete this Python function:"
        node = ast.parse(stub).body[0]  # a stub is complete source: the body is the docstring alone
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) == 1
        assert isinstance(node.body[0].value.value, str) and node.body[0].end_lineno == len(stub.splitlines())
    with_docstring = [f for f in prompts._stdlib_functions() if f[2] is not None]
    assert 0 < len(with_docstring) < len(prompts._stdlib_functions())  # functions without a docstring are skipped


def test_strip_docstring_and_cut_after_docstring():
    code = textwrap.dedent(
        '''\
        def f(x):
            """Doubles x.

            Long description.
            """
            return 2 * x'''
    )
    node = ast.parse(code).body[0]
    assert prompts._strip_docstring(node, code) == "def f(x):\n    return 2 * x"
    # the completion stub is the other half: the function up to the end of its docstring
    assert prompts._cut_after_docstring(node, code) == code.rsplit("\n", 1)[0] + "\n"
    bare = "def g(x):\n    return x"
    assert prompts._cut_after_docstring(ast.parse(bare).body[0], bare) is None


def test_open_ended_uses_installed_corpora(tmp_path, monkeypatch, small_stdlib):
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    (fortunes / "wisdom").write_text("A journey of a thousand miles begins with a single step.\n%\nshort\n%\n")
    (fortunes / "wisdom.dat").write_bytes(b"\x00binary index")
    jargon = tmp_path / "jargon.txt.gz"
    with gzip.open(jargon, "wt") as f:
        f.write("   :kludge: n.\n\n   A clever programming trick.\n\n   :foo: /foo/, n.\n")
    monkeypatch.setattr(prompts, "_FORTUNES_DIR", fortunes)
    monkeypatch.setattr(prompts, "_JARGON_FILE", jargon)
    monkeypatch.setattr(prompts, "_PYDOC_DIR", tmp_path / "missing")
    contents = [p[0]["content"] for p in load_prompts("open_ended")]
    assert sum("A journey of a thousand miles" in c for c in contents) == 1  # "short" is below the length cut
    assert sum("'kludge'" in c for c in contents) == 1 and sum("'foo'" in c for c in contents) == 1
    assert any("Heaps are arrays" in c for c in contents)  # heapq's module docstring, the always-available fallback


def test_open_ended_without_debian_corpora(tmp_path, monkeypatch, small_stdlib):
    for attr in ("_FORTUNES_DIR", "_JARGON_FILE", "_PYDOC_DIR"):
        monkeypatch.setattr(prompts, attr, tmp_path / "missing")
    out = load_prompts("open_ended", num_prompts=2, seed=0)
    assert len(out) == 2 and all(_is_conversation(p) for p in out)


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "Hi"},
        {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert load_prompts(str(path)) == [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"}],
    ]
    path.write_text(json.dumps({"text": "no key"}) + "\n")
    with pytest.raises(ValueError, match="p.jsonl:1: expected a 'prompt' or 'messages' key"):
        load_prompts(str(path))


@pytest.mark.slow
def test_prompt_sets_constant_matches_dispatch():
    assert PROMPT_SETS == (
        "gsm_symbolic", "codeio", "knights_knaves", "humaneval", "stdlib", "stdlib_complete", "open_ended"
    )  # fmt: skip
    for name in PROMPT_SETS[:-1]:  # every name is dispatched (the last, open_ended, has its own tests)
        assert load_prompts(name, num_prompts=1, seed=0)


def test_reasoning_gym_programs_run_in_a_scratch_directory(tmp_path, monkeypatch):
    """Regression: some codeio reference programs write files (e.g. `planet.com`) into the working directory."""
    monkeypatch.chdir(tmp_path)
    with prompts._scratch_cwd():
        Path("planet.com").write_text("x")
        assert Path.cwd() != tmp_path
    assert Path.cwd() == tmp_path and list(tmp_path.iterdir()) == []


def test_finite_sets_split_train_and_eval_apart(small_stdlib):
    from hf_retrace.data.prompts import SPLIT_SETS

    for name in SPLIT_SETS:
        whole = load_prompts(name)
        train = load_prompts(name, split="train", seed=3)
        held_out = load_prompts(name, split="eval", seed=3)
        assert held_out and len(train) + len(held_out) == len(whole)
        train_text = {p[0]["content"] for p in train}
        assert not train_text & {p[0]["content"] for p in held_out}
        # the same item under another seed (another template) is still on the same side
        again = load_prompts(name, split="eval", seed=4)
        assert len(again) == len(held_out) and not {p[0]["content"] for p in again} & train_text
    with pytest.raises(ValueError, match="split must be one of"):
        load_prompts("stdlib", split="test")
