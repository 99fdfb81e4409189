"""The engines `benchmarks/serving.py` drives: a vLLM worker process (the client side of the JSON-lines protocol that
`serving_vllm_worker.py` serves, with vLLM's CPU preloads in its environment), transformers in this process, and the
target's scoring of sampled continuations (NLL per token).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
WORKER = REPO / "benchmarks" / "serving_vllm_worker.py"
ENV_FILE = Path("scripts") / "vllm-env.sh"  # written by scripts/setup-vllm.sh's side: LD_PRELOAD and friends
PRELOAD_LIBS = ("libtcmalloc", "libiomp5")  # vLLM's CPU install guide: tcmalloc and Intel OpenMP in LD_PRELOAD
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_SHELL_VARIABLES = {"_", "SHLVL", "PWD", "OLDPWD"}


def _sourced_env(env_file: Path, repo: Path) -> dict | None:
    """The environment after `source env_file` in a subshell; None when sourcing fails."""
    command = ["bash", "-c", 'source "$1" >/dev/null 2>&1 && env -0', "vllm-env", str(env_file)]
    out = subprocess.run(command, capture_output=True, cwd=repo, env=os.environ.copy())
    if out.returncode != 0:
        return None
    return dict(item.split("=", 1) for item in out.stdout.decode(errors="replace").split("\0") if "=" in item)


def _find_preloads(repo: Path) -> list[str]:
    """tcmalloc (the system's `libtcmalloc_minimal.so*`, no debug build) and `.venv-vllm/lib/libiomp5.so`."""
    found = []
    for directory in (*_LIB_DIRS, str(repo / ".venv-vllm" / "lib")):
        candidates = sorted(Path(directory).glob("libtcmalloc_minimal.so*"), key=lambda p: len(p.name))
        candidates = [p for p in candidates if "debug" not in p.name]
        if candidates:
            found.append(str(candidates[0]))
            break
    iomp = repo / ".venv-vllm" / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    return found


def vllm_preload_env(repo: Path = REPO, disabled: bool = False) -> tuple[dict, dict]:
    """The variables to add to a vLLM worker's environment, and a record of them for the run info.

    From `scripts/vllm-env.sh` when it exists (sourced in a subshell; every variable it sets or changes is taken),
    else `LD_PRELOAD` built from the libraries found on this machine. The record's `missing` lists the libraries of
    `PRELOAD_LIBS` absent from `LD_PRELOAD`; whether they were really loaded is what the worker reports (`preloaded`).
    The record names the libraries by file name only: it is committed with the results, and their folders are this
    machine's.
    """
    if disabled:
        missing = list(PRELOAD_LIBS)
        return {}, {"source": "disabled (--no-preload)", "LD_PRELOAD": "", "variables": [], "missing": missing}
    updates, source = None, None
    if (repo / ENV_FILE).is_file():
        sourced = _sourced_env(repo / ENV_FILE, repo)
        if sourced is not None:
            updates = {k: v for k, v in sourced.items() if k not in _SHELL_VARIABLES and os.environ.get(k) != v}
            source = str(ENV_FILE)
    if updates is None:
        libs = _find_preloads(repo)
        existing = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
        updates = {"LD_PRELOAD": ":".join(dict.fromkeys(libs + existing))} if libs else {}
        source = "search" + (f" ({ENV_FILE} failed to source)" if (repo / ENV_FILE).is_file() else "")
    preload = updates.get("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
    missing = [lib for lib in PRELOAD_LIBS if lib not in preload]
    named = ":".join(Path(lib).name for lib in preload.split(":") if lib)
    return updates, {"source": source, "LD_PRELOAD": named, "variables": sorted(updates), "missing": missing}


class VllmWorker:
    """A `serving_vllm_worker.py` process: one engine, JSON lines in and out, stderr to a log file."""

    def __init__(self, target: str, speculative_config: dict | None, log_path: Path, mode: str, threads_bind: str,
                 env: dict, max_model_len: int = 4096, max_num_seqs: int | None = None,
                 pin: bool = False):  # fmt: skip
        """`pin`: the worker and every process it starts run on the cores of `threads_bind` only (`taskset`), not
        just vLLM's OpenMP threads, so that two workers side by side never share a core."""
        stats = log_path.with_suffix(".proposer.json")  # the hf-retrace proposer's counters (plugin methods only)
        stats.unlink(missing_ok=True)
        # the preloads' environment first, then the bench's own settings (its cores, its stats file) over it
        env = os.environ | env | {"VLLM_CPU_OMP_THREADS_BIND": threads_bind, "HF_HUB_OFFLINE": "1",
                                  "HF_RETRACE_VLLM_STATS": str(stats)}  # fmt: skip
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        command = ["taskset", "--cpu-list", threads_bind] if pin else []
        command += [str(VLLM_PYTHON), str(WORKER), "--target", target, "--max-model-len", str(max_model_len)]
        command += ["--compile"] if mode == "compiled" else []
        command += [] if max_num_seqs is None else ["--max-num-seqs", str(max_num_seqs)]
        if speculative_config is not None:
            command += ["--speculative-config", json.dumps(speculative_config)]
        self.log_path = log_path
        self._log = log_path.open("w")
        # a session of its own: vLLM's engine-core process is the worker's child, and `close` ends both together
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        text=True, env=env, cwd=REPO, start_new_session=True)  # fmt: skip
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"vLLM worker exited (code {self.process.returncode}): {last_error(self.log_path)}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"vLLM worker: {reply['error']}")
        return reply

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: dict | None = None,
                 cache_salt: str | None = None) -> dict:
        """`sampling`: None (greedy) or `{"temperature": t, "seeds": [one per prompt]}`; `cache_salt`: no prefix-cache
        reuse of earlier calls."""
        request = {"cmd": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens, "sampling": sampling,
                   "cache_salt": cache_salt}  # fmt: skip
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        """Asks the worker to quit; then ends whatever of its process group is left (an engine core orphaned by a
        worker that died would otherwise keep its cores busy)."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is gone: a clean exit
        self.process.wait()
        self._log.close()


def last_error(log_path: Path) -> str:
    """The last line of a worker's log that names an error (a traceback's final line), else its last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0] or line.startswith("Exception")]
    return (errors or lines or ["(empty log)"])[-1][:300]


def vllm_available() -> str | None:
    """None when `.venv-vllm` can run vLLM, else why not."""
    if not VLLM_PYTHON.is_file():
        return f"{VLLM_PYTHON} not found: run scripts/setup-vllm.sh"
    return None


def plugin_available() -> str | None:
    """None when the hf_retrace vLLM plugin is installed in `.venv-vllm` (entry point `vllm.general_plugins`)."""
    code = ("import importlib.metadata as m; "
            "print(any(e.name == 'hf_retrace' for e in m.entry_points(group='vllm.general_plugins')))")  # fmt: skip
    out = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, cwd=REPO)
    if out.stdout.strip() != "True":
        return "the vLLM plugin (integrations/vllm, entry point vllm.general_plugins:hf_retrace) is not installed"
    return None


def card_with_settings(card: str, settings: dict, folder: Path) -> str:
    """A copy of `card` in `folder` whose `generation_config.json` has `settings` set (the weights and the datastore
    linked, not copied); both engines then load it as any card. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in Path(card).iterdir():
        target = folder / source.name
        if source.name == "generation_config.json":
            target.write_text(json.dumps(json.loads(source.read_text()) | settings, indent=2) + "\n")
        elif source.is_file() and not target.exists():
            target.symlink_to(source.resolve())
    return str(folder)


def export_card(card: str, output: Path) -> str | None:
    """Exports `card` for vLLM into `output` (`hf-retrace export --format vllm`); None on success, else why not."""
    if not Path(card, "config.json").is_file():
        return f"drafter card {card} has no config.json"
    # --overwrite: `output` is the bench's own folder, and a rerun into the same --output-dir re-exports there
    command = [sys.executable, "-m", "hf_retrace.cli", "export", "--format", "vllm", "--drafter", card,
               "--output", str(output), "--overwrite"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if out.returncode != 0 or not (output / "config.json").is_file():
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        command = f"hf-retrace export --format vllm --drafter {card}"
        return f"`{command}` failed (exit {out.returncode}): " + " | ".join(tail)
    return None


def continuation_nll(model, prompt_ids: list[int], continuation_ids: list[int], temperature: float) -> float:
    """The target's negative log-likelihood of a sampled continuation at the sampling temperature, summed over its
    tokens: `-sum_t log softmax(logits_t / temperature)[x_t]`, logits_t from one forward over prompt + continuation.
    An exact speculative sampler draws from the same distribution as plain sampling, so its mean per token matches
    plain sampling's within noise; a corrupted one (drafts accepted against the wrong distribution) does not.

    Args:
        model (`PreTrainedModel`): the target, a causal LM.
        prompt_ids (`list[int]`), continuation_ids (`list[int]`): token ids; the continuation is what was sampled.
        temperature (`float`): the sampling temperature (> 0).

    Returns:
        `float`: the summed NLL in nats (0.0 for an empty continuation).
    """
    import torch

    if not continuation_ids:
        return 0.0
    ids = torch.tensor([prompt_ids + continuation_ids], device=model.device)  # [1, P + N]
    with torch.no_grad():
        # position t's logits predict token t + 1: the N generated tokens are predicted by positions P-1 .. P+N-2
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [N, V]
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    target = torch.tensor(continuation_ids, device=log_probs.device)[:, None]  # [N, 1]
    return -log_probs.gather(-1, target).sum().item()


class HfEngine:
    """transformers in this process: the target (skinny GEMM) and the drafter methods, batch 1."""

    def __init__(self, specs: list, target: str, threads: int):
        import torch

        from hf_retrace.bench.methods import Method
        from hf_retrace.bench.methods import MethodSpec as BenchSpec
        from hf_retrace.bench.run import load_target
        from hf_retrace.cpu_attention import enable_masked_gqa_sdpa
        from hf_retrace.skinny_gemm import DEFAULT_TUNE_ROWS, enable_skinny_gemm, enable_skinny_gemm_where_it_pays

        torch.set_num_threads(threads)
        self.torch = torch
        self.target, self.tokenizer = load_target(target, torch.float32, "cpu")
        self.methods = {}
        for spec in specs:
            kind = "drafter" if spec.kind == "drafter" else "ar"
            self.methods[spec.name] = Method(BenchSpec(spec.name, kind, spec.card), torch.float32, "cpu")
        enable_skinny_gemm_where_it_pays(self.target, DEFAULT_TUNE_ROWS, "target")
        enable_masked_gqa_sdpa(self.target, "target")  # verification forwards: no copies of the K/V heads
        for method in self.methods.values():
            if method.drafter is not None:
                enable_skinny_gemm(method.drafter, tune_rows=DEFAULT_TUNE_ROWS)
        self.warm = False

    def warmup(self, prompt: list[int]) -> None:
        for name in self.methods:  # kernels, and the drafter's datastore index
            self.generate(name, prompt, 16)
            self.generate(name, prompt, 16, temperature=0.8, seed=0)
        self.warm = True

    def generate(self, name: str, prompt: list[int], max_new_tokens: int, temperature: float | None = None,
                 seed: int = 0) -> tuple[list[int], list[int], float]:  # fmt: skip
        """Greedy (`temperature=None`) or plain temperature sampling (no top-k / top-p), seeded per call."""
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False}
        if temperature is not None:  # top_k=0: transformers' default top-k of 50 would change the distribution
            kwargs = {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": temperature, "top_k": 0,
                      "top_p": 1.0}  # fmt: skip
            self.torch.manual_seed(seed)
        g = self.methods[name].run(self.target, self.torch.tensor([prompt]), kwargs, "", 0)
        cycles = g.acceptance_lengths if self.methods[name].drafter is not None else g.acceptance_lengths[1:]
        return g.token_ids, cycles, g.seconds  # ar: its first "cycle" is the prefill

    def nll(self, prompt: list[int], continuation: list[int], temperature: float) -> float:
        return continuation_nll(self.target, prompt, continuation, temperature)
