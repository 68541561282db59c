"""Command lines that run `specforge serve` (the embedded engine's HTTP server) as a process.

The counterparts of sglang_commands.py with the same arguments, so evaluation and extraction
launch our server and SGLang's alike (process.py starts, waits for and stops either).
"""
from __future__ import annotations

import sys


def embedded_server_command(target_path, draft_path=None, tree=None, port: int = 30000, *,
                            dtype: str = "bfloat16", threads: int | None = None,
                            extra_args=(), python: str | None = None) -> list[str]:
    """The command that runs this server as a process (the embedded counterpart of
    sglang_commands.sglang_server_command, with the same arguments)."""
    if (draft_path is None) != (tree is None):
        raise ValueError("embedded_server_command: give both draft_path and tree (EAGLE3) or neither (base)")
    cmd = [python or sys.executable, "-m", "specforge.cli", "serve", "--target", str(target_path),
           "--host", "127.0.0.1", "--port", str(int(port)), "--dtype", dtype]
    if draft_path is not None:
        cmd += ["--draft", str(draft_path), "--tree", str(tree)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    return cmd + [str(a) for a in extra_args]


def embedded_extraction_command(target_path, port: int, aux_layer_ids=None, *, dtype: str = "bfloat16",
                                threads: int | None = None, python: str | None = None) -> list[str]:
    """A server for the `server` extract backend: final post-norm states (aux_layer_ids None) or
    the aux layers' outputs, with SGLang's flag names (sglang_commands.sglang_extraction_command)."""
    flags = ["--enable-return-hidden-states"]
    if aux_layer_ids is not None:
        flags += ["--enable-return-aux-hidden-states", "--return-aux-hidden-state-layer-ids", *map(str, aux_layer_ids)]
    return embedded_server_command(target_path, port=port, dtype=dtype, threads=threads, extra_args=flags, python=python)
