"""mimalloc for the CPU stages, as torch's own CPU launcher preloads jemalloc or tcmalloc.

glibc hands every large block back to the kernel when it is freed, so each training step maps its
activations afresh and faults every page in again (~180 page faults per token and step at TTT 7 on
the SmolLM2 geometry, a sixth of the step's CPU time in the kernel). mimalloc with purging off
(`MIMALLOC_PURGE_DELAY=-1`) keeps freed pages for the next step: +13-22% training tokens/s at an
8K draft vocab, +55% at 32K, the demo's train stage -19%, with a lower peak RSS, on 2 CPU cores
(docs/benchmarks.md, "The allocator").

An allocator is chosen when a process starts, so the entry points (train.py, evaluate.py) call
`preload_mimalloc()` first: it re-executes the same command once with the library in
`LD_PRELOAD` (the registry package cmeel-mimalloc ships it), then puts `LD_PRELOAD` back as it was,
so that programs the run starts (SGLang servers, compilers) keep the system's allocator.
`SPECFORGE_ALLOCATOR=system` turns it off; elsewhere than Linux, or without the package, nothing
changes.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "SPECFORGE_ALLOCATOR"
_REEXEC = "_SPECFORGE_PRELOAD_BEFORE"  # set for the re-executed process only: LD_PRELOAD as it was
_CHOICES = ("mimalloc", "system")


def mimalloc_path() -> str | None:
    """The shared library of the installed cmeel-mimalloc, or None."""
    from importlib.metadata import PackageNotFoundError, files

    try:
        found = [f.locate() for f in files("cmeel-mimalloc") or [] if f.name == "libmimalloc.so"]
    except PackageNotFoundError:
        return None
    return next((str(Path(p)) for p in found if Path(p).is_file()), None)


def mimalloc_loaded() -> bool:
    try:
        return "libmimalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def running_allocator() -> str:
    """What this process runs on, for benchmark records: "mimalloc" or "glibc"."""
    return "mimalloc" if mimalloc_loaded() else "glibc"


def with_mimalloc(env: dict, library: str) -> dict:
    """A copy of `env` whose programs start on `library`: first in LD_PRELOAD, purging off unless set."""
    env = dict(env)
    before = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{library}:{before}" if before else library
    env.setdefault("MIMALLOC_PURGE_DELAY", "-1")  # keep freed pages: the point of the exercise
    return env


def mimalloc_env() -> dict | None:
    """The environment that starts another program (a peer trainer in a benchmark) on mimalloc
    wherever the entry points would preload it; None where they would not (inherit as is)."""
    library = mimalloc_path() if allocator_choice() == "mimalloc" else None
    return with_mimalloc(os.environ, library) if library else None


def allocator_choice() -> str:
    choice = os.environ.get(ENV, "mimalloc").strip().lower() or "mimalloc"
    if choice not in _CHOICES:
        sys.exit(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(_CHOICES)}")
    return choice


def preload_mimalloc() -> None:
    """Re-execute this process once with mimalloc preloaded (see the module docstring)."""
    choice = allocator_choice()
    if _REEXEC in os.environ:  # the second start: LD_PRELOAD back as it was, for child programs
        before = os.environ.pop(_REEXEC)
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    if choice == "system" or not sys.platform.startswith("linux") or mimalloc_loaded():
        return
    library = mimalloc_path()
    if library is None:
        return
    env = with_mimalloc(os.environ, library)
    env[_REEXEC] = os.environ.get("LD_PRELOAD", "")  # also stops a second re-exec should the loader refuse it
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
