"""scripts/vllm-env.sh as a launcher: it finds the CPU preloads and runs the command, whatever `ldconfig -p` prints."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm-env.sh"


def _checkout(tmp_path: Path, ldconfig_body: str) -> dict:
    """A copy of the script in `tmp_path/scripts`, Intel OpenMP where setup-vllm.sh puts it, and a fake `ldconfig`
    first on PATH. Returns the environment to run the launcher in."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "vllm-env.sh")
    (tmp_path / ".venv-vllm" / "lib").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "lib" / "libiomp5.so").write_bytes(b"")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ldconfig = bin_dir / "ldconfig"
    ldconfig.write_text("#!/usr/bin/env bash\n" + ldconfig_body)
    ldconfig.chmod(ldconfig.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND")}
    return env | {"PATH": f"{bin_dir}:{env['PATH']}"}


TCMALLOC_LINE = 'echo "\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => /fake/libtcmalloc_minimal.so.4"\n'


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the script adds Intel OpenMP on x86_64 only")
def test_the_launcher_survives_a_long_ldconfig_listing(tmp_path):
    # the match first, then 2 MB more: a reader that stops at the match closes the pipe while ldconfig still writes
    env = _checkout(tmp_path, TCMALLOC_LINE + "head -c 2000000 /dev/zero | tr '\\0' 'x'\necho\n")
    script = tmp_path / "scripts" / "vllm-env.sh"
    run = subprocess.run([str(script), "bash", "-c", 'echo "$LD_PRELOAD"'], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 0, (run.returncode, run.stderr)
    assert run.stdout.strip() == f"/fake/libtcmalloc_minimal.so.4:{tmp_path / '.venv-vllm' / 'lib' / 'libiomp5.so'}"


def test_a_missing_tcmalloc_is_a_clear_error(tmp_path):
    env = _checkout(tmp_path, 'echo "\tlibc.so.6 (libc6,x86-64) => /lib/libc.so.6"\n')
    run = subprocess.run([str(tmp_path / "scripts" / "vllm-env.sh"), "true"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode != 0 and "libtcmalloc_minimal.so.4 not found" in run.stderr and "setup-vllm.sh" in run.stderr
