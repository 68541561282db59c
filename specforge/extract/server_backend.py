"""Hidden states from servers that speak SGLang's /generate (the `server` and `sglang` backends).

A server returns one kind of hidden state (docs/contract.md §7): `return_hidden_states` gives the final
post-norm state, and a server launched with aux capture gives the aux layers' outputs,
concatenated, *in place of* the final state. The store needs both, so extraction talks to two
servers of the same target, an aux server and a final server. Each batch goes to both at once as
SGLang's batched request (`input_ids` a list of lists, `max_new_tokens` 1, temperature 0,
`return_hidden_states`), and each answer holds one row per prompt token.

- `extract.backend=server`: running servers at `extract.aux_url` and `extract.final_url`
  (SGLang, or `specforge serve` with the same flags: serving/app.py, serving/handler.py).
- `extract.backend=sglang`: this process launches the two SGLang servers on its GPU, waits for
  /health, and always stops them (`extraction_servers`); under torchrun every rank launches its
  own pair on its own GPU and extracts its share of the samples (stage.py).

Why servers and not `sglang.Engine` in this process: the capture mode is a setting of the whole
engine, so the two modes need two engines on one GPU, and SGLang's way to run two instances on
one GPU is two processes with their own ports and `mem_fraction_static`. As servers, the same
client is also exercised against `specforge serve` where SGLang cannot run.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from specforge.extract.batching import Extractor
from specforge.launch.process import ServerProcess, free_port, http_json, server_info

SAMPLING = {"max_new_tokens": 1, "temperature": 0.0}


def prompt_rows(meta_info, n: int, width: int, where: str) -> np.ndarray:
    """The first n rows of meta_info["hidden_states"] as float32 [n, width]. SGLang appends one
    element per forward: a block of rows per prefill chunk, then one row per decoded token."""
    blocks = meta_info.get("hidden_states") if isinstance(meta_info, dict) else None
    if not blocks:
        raise ValueError(f"{where}: the answer has no meta_info.hidden_states (start the server with "
                         "--enable-return-hidden-states)")
    rows, got = [], 0
    for block in blocks:
        t = np.asarray(block, dtype=np.float32)  # 2.5x faster than torch.tensor(list)
        t = t[None] if t.ndim == 1 else t
        if t.ndim != 2:
            raise ValueError(f"{where}: hidden_states holds a block of shape {list(t.shape)}, expected rows")
        rows.append(t)
        got += t.shape[0]
        if got >= n:
            break
    if got < n:
        raise ValueError(f"{where}: {got} hidden-state rows for {n} prompt tokens; the server must compute "
                         "the whole prompt (launch it with --disable-radix-cache)")
    out = np.concatenate(rows)[:n]
    if out.shape[1] != width:
        raise ValueError(f"{where}: rows of {out.shape[1]} values, expected {width}")
    return out


def decode_answer(content: bytes, ids: Sequence[str], lengths: Sequence[int], width: int, where: str) -> list:
    """One batched /generate answer (JSON bytes) -> float32 [n, width] rows per prompt. Parsing the
    JSON is the costly part of this backend (docs/benchmarks.md), so it runs in worker processes."""
    answer = json.loads(content)
    if not isinstance(answer, list) or len(answer) != len(ids):
        raise ValueError(f"{where}: expected a list of {len(ids)} results for a batch of {len(ids)} prompts")
    return [prompt_rows(r.get("meta_info") if isinstance(r, dict) else None, n, width, f"{where}, sample {sid!r}")
            for sid, n, r in zip(ids, lengths, answer)]


class ServerExtractor(Extractor):
    """aux [S, len(aux) * H] from the aux server and last [S, H] from the final server, per row.

    `run` keeps decode_workers + 1 batches in flight: while the servers compute one, the client
    decodes the JSON of others, in `decode_workers` processes when > 1 (one process decodes
    ~3,000 SmolLM2 tokens/s: docs/benchmarks.md)."""

    def __init__(self, aux_url: str, final_url: str, aux_layer_ids: Sequence[int], hidden_size: int,
                 batch_tokens: int, storage_dtype: torch.dtype = torch.bfloat16, timeout_s: float = 600.0,
                 decode_workers: int = 1):
        super().__init__(batch_tokens, storage_dtype)
        self.aux_layer_ids = list(aux_layer_ids)
        self.urls = {"aux": aux_url.rstrip("/"), "last": final_url.rstrip("/")}
        self.widths = {"aux": len(self.aux_layer_ids) * hidden_size, "last": hidden_size}
        self.timeout_s = timeout_s
        self.in_flight = max(1, decode_workers) + 1  # also overlaps the servers' compute with decoding
        self.http = ThreadPoolExecutor(2 * self.in_flight, thread_name_prefix="extract-http")
        # spawn: the workers only parse JSON; a fork of a process holding torch threads is unsafe
        self.decoders = (ProcessPoolExecutor(decode_workers, mp_context=multiprocessing.get_context("spawn"))
                         if decode_workers > 1 else None)

    def check_servers(self) -> None:
        """Refuse servers whose /server_info says they return other states than this run needs
        (servers that do not say are checked by the width of their rows)."""
        for kind, url in self.urls.items():
            name = "extract.aux_url" if kind == "aux" else "extract.final_url"
            info = server_info(url)
            if info.get("enable_return_hidden_states") is False:
                raise ValueError(f"{name}={url}: the server does not return hidden states; start it with "
                                 "--enable-return-hidden-states")
            captures = info.get("enable_return_aux_hidden_states")
            if kind == "aux":
                ids = info.get("return_aux_hidden_state_layer_ids")
                if captures is False:
                    raise ValueError(f"{name}={url}: the server does not capture aux hidden states; start it with "
                                     "--enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids "
                                     + " ".join(map(str, self.aux_layer_ids)))
                if ids is not None and list(ids) != self.aux_layer_ids:
                    raise ValueError(f"{name}={url}: the server captures layers {list(ids)}, this run needs "
                                     f"{self.aux_layer_ids} (target.aux_layer_ids)")
            elif captures:
                raise ValueError(f"{name}={url}: the server captures aux hidden states, which replace the final "
                                 "state; give a server started without --enable-return-aux-hidden-states")

    def _fetch(self, kind: str, body: dict, ids: list[str], lengths: list[int]) -> list:
        url = self.urls[kind] + "/generate"
        args = (http_json(url, body, self.timeout_s, raw=True), ids, lengths, self.widths[kind], url)
        return self.decoders.submit(decode_answer, *args).result() if self.decoders else decode_answer(*args)

    @staticmethod
    def request_body(rows: Sequence[dict]) -> dict:
        """SGLang's batched /generate request for the prompts of `rows`."""
        seqs = [r["input_ids"].tolist() if torch.is_tensor(r["input_ids"]) else list(r["input_ids"]) for r in rows]
        return {"input_ids": seqs, "sampling_params": SAMPLING, "return_hidden_states": True}

    def _submit(self, rows: Sequence[dict]) -> dict:
        """Both requests of one batch, started: {kind: future of the rows}."""
        ids, lengths = [r["id"] for r in rows], [len(r["input_ids"]) for r in rows]
        body = self.request_body(rows)
        return {kind: self.http.submit(self._fetch, kind, body, ids, lengths) for kind in self.urls}

    def _collect(self, rows: Sequence[dict], pending: dict, t0: float) -> list[dict]:
        """The batch's states as stored tensors; its tokens and the seconds since t0 counted."""
        arrays = {kind: f.result() for kind, f in pending.items()}
        lens = [len(r["input_ids"]) for r in rows]
        self.count(lens, max(lens), t0)
        return [{kind: torch.from_numpy(a[i]).to(self.storage_dtype) for kind, a in arrays.items()}
                for i in range(len(rows))]

    def forward_rows(self, rows: Sequence[dict]) -> list[dict]:
        return self._collect(rows, self._submit(rows), time.perf_counter())

    def run(self, samples: Sequence[dict], chunk: int | None = None):
        """Extractor.run with batches in flight; results in the same order."""
        window: deque = deque()
        t0 = time.perf_counter()

        def collect():
            nonlocal t0
            rows, pending = window.popleft()
            out = self._collect(rows, pending, t0)  # wall time between collected batches
            t0 = time.perf_counter()
            return zip(rows, out)

        for rows in self.batches(samples, chunk):
            window.append((rows, self._submit(rows)))
            if len(window) >= self.in_flight:
                yield from collect()
        while window:
            yield from collect()

    def close(self) -> None:
        self.http.shutdown(wait=False, cancel_futures=True)
        if self.decoders is not None:
            self.decoders.shutdown(wait=False, cancel_futures=True)


# (target_path, port, aux_layer_ids | None) -> the command of an aux (ids) or final (None) server
ExtractionCommand = Callable[..., list]


@contextlib.contextmanager
def extraction_servers(build: ExtractionCommand, target_path, aux_layer_ids: Sequence[int], log_dir: Path, *,
                       env: dict | None = None, startup_timeout_s: float = 900.0):
    """Start the aux and the final server on free ports, wait until both answer /health, yield
    (aux_url, final_url); both are always stopped when the block ends (also on errors, Ctrl-C,
    SIGTERM). Their output goes to `log_dir/{aux,final}.log`."""
    with contextlib.ExitStack() as stack:
        procs = []
        for name, ids in (("aux", list(aux_layer_ids)), ("final", None)):
            port = free_port()
            proc = ServerProcess(build(target_path, port, ids), port, Path(log_dir) / f"{name}.log", env=env,
                                 startup_timeout_s=startup_timeout_s)
            stack.callback(proc.stop)
            procs.append(proc.start())  # both load at once
        for proc in procs:
            proc.wait_healthy()
        yield procs[0].base_url, procs[1].base_url


def gpu_env(local_rank: int, local_world_size: int) -> dict | None:
    """CUDA_VISIBLE_DEVICES for this rank's servers when several ranks share a node: the
    local_rank-th visible GPU (of CUDA_VISIBLE_DEVICES when set, as Slurm does), or the one GPU a
    task sees when Slurm binds one to each (--gpus-per-task=1), as training's DistEnv.device picks it."""
    if local_world_size <= 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in visible.split(",") if g.strip()] if visible else [str(i) for i in range(local_world_size)]
    if len(gpus) == 1:
        return {"CUDA_VISIBLE_DEVICES": gpus[0]}
    if local_rank >= len(gpus):
        raise ValueError(f"rank {local_rank} of {local_world_size} on this node, but only GPUs {gpus} are visible")
    return {"CUDA_VISIBLE_DEVICES": gpus[local_rank]}


@contextlib.contextmanager
def open_server_extractor(cfg, target_path, aux_layer_ids: Sequence[int], text_config, storage_dtype: torch.dtype,
                          log_dir: Path, env):
    """The ServerExtractor of `extract.backend` server (the running servers at extract.aux_url and
    extract.final_url) or sglang (this process's two SGLang servers, launched on its GPU and
    stopped when the block ends), checked against the servers' /server_info."""
    ex = cfg.extract
    with contextlib.ExitStack() as stack:
        if ex.backend == "server":
            urls = ex.aux_url, ex.final_url
        else:
            from specforge.launch.sglang_commands import sglang_extraction_command

            def build(target, port, ids):
                extra = list(ex.sglang_args) + (list(ex.sglang_aux_args) if ids is not None else [])
                return sglang_extraction_command(
                    target, port, ids, num_layers=text_config.num_hidden_layers, version=ex.sglang_version,
                    extra_args=extra, options={"dtype": cfg.target.dtype, "mem_fraction_static": ex.mem_fraction_static,
                                               "trust_remote_code": bool(cfg.target.trust_remote_code)})

            build(target_path, 0, aux_layer_ids)  # a version or layer-id problem fails before anything starts
            urls = stack.enter_context(extraction_servers(build, target_path, aux_layer_ids, log_dir,
                                                          env=gpu_env(env.local_rank, env.local_world_size),
                                                          startup_timeout_s=ex.server_startup_timeout_s))
        extractor = ServerExtractor(*urls, aux_layer_ids, text_config.hidden_size, ex.batch_tokens, storage_dtype,
                                    ex.request_timeout_s, ex.decode_workers)
        stack.callback(extractor.close)
        extractor.check_servers()
        yield extractor
