"""The allocator the entry points run with (specforge/utils/allocator.py): a real re-exec of a real
Python process, checked from /proc/self/maps."""
import json
import os
import subprocess
import sys

import pytest

from specforge.utils.allocator import mimalloc_path

pytestmark = pytest.mark.skipif(mimalloc_path() is None, reason="cmeel-mimalloc not installed (Linux only)")

PROBE = """
import json, os, sys
from specforge.utils.allocator import preload_mimalloc, mimalloc_loaded
preload_mimalloc()
print(json.dumps({"loaded": mimalloc_loaded(), "preload": os.environ.get("LD_PRELOAD"),
                  "purge": os.environ.get("MIMALLOC_PURGE_DELAY"), "argv": sys.argv[1:],
                  "marker": any(k.startswith("_SPECFORGE") for k in os.environ)}))
"""


def probe(*args, **env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SPECFORGE_ALLOCATOR", "MIMALLOC_PURGE_DELAY")}
    env.update(env_changes)
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=60)
    return done, (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None)


def test_reexec_loads_mimalloc_once_and_restores_the_environment():
    done, seen = probe("plain", "with space", "--flag=a'b\"c")
    assert done.returncode == 0, done.stderr
    assert seen["loaded"] is True
    assert seen["argv"] == ["plain", "with space", "--flag=a'b\"c"]  # the command survives the re-exec
    assert seen["preload"] is None and seen["marker"] is False  # children start on the system allocator
    assert seen["purge"] == "-1"


def test_system_choice_keeps_glibc():
    done, seen = probe(SPECFORGE_ALLOCATOR="system")
    assert done.returncode == 0, done.stderr
    assert seen["loaded"] is False and seen["preload"] is None


def test_a_users_preload_is_kept():
    libm = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                            "/lib/aarch64-linux-gnu/libm.so.6", "/lib64/libm.so.6") if os.path.exists(p))
    done, seen = probe(LD_PRELOAD=libm, MIMALLOC_PURGE_DELAY="100")
    assert done.returncode == 0, done.stderr
    assert seen["loaded"] is True
    assert seen["preload"] == libm  # as the user set it, for the programs the run starts
    assert seen["purge"] == "100"  # a user's mimalloc option wins


def test_unknown_choice_is_refused_by_name():
    done, _ = probe(SPECFORGE_ALLOCATOR="jemalloc")
    assert done.returncode != 0
    assert "SPECFORGE_ALLOCATOR='jemalloc'" in done.stderr and "mimalloc, system" in done.stderr


def test_a_refused_library_does_not_loop(tmp_path):
    """Should the loader refuse the library, the process goes on once, on glibc (no exec loop)."""
    broken = tmp_path / "libmimalloc.so"
    broken.write_text("not an ELF file")
    code = PROBE.replace("preload_mimalloc()", f"import specforge.utils.allocator as a; a.mimalloc_path = lambda: {str(broken)!r}; preload_mimalloc()")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SPECFORGE_ALLOCATOR")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["loaded"] is False and seen["preload"] is None


def test_mimalloc_env_starts_a_child_program_on_mimalloc_unless_the_system_one_is_chosen(monkeypatch):
    from specforge.utils.allocator import mimalloc_env

    monkeypatch.delenv("SPECFORGE_ALLOCATOR", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env = mimalloc_env()
    child = subprocess.run([sys.executable, "-c", "from specforge.utils.allocator import mimalloc_loaded as m; print(m())"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert child.stdout.strip() == "True" and env["MIMALLOC_PURGE_DELAY"] == "-1"
    monkeypatch.setenv("SPECFORGE_ALLOCATOR", "system")
    assert mimalloc_env() is None
