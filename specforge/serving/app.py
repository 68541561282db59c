"""`specforge serve`: the embedded engine behind an HTTP server that speaks SGLang's protocol.

The server's lifecycle (HTTP thread + engine thread, port, readiness, shutdown) and the command
line; the protocol itself is handler.py, the engine thread worker.py, model loading model.py.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from specforge.launch.process import API_KEY_ENV
from specforge.serving.handler import Handler
from specforge.serving.model import LoadedModel, check_draft_checkpoint, load_model
from specforge.serving.policy import (DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S,
                                      ServePolicy, is_loopback)
from specforge.serving.worker import EngineWorker

log = logging.getLogger("specforge.serve")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    worker: EngineWorker
    model_name: str
    policy: ServePolicy

    @property
    def version(self) -> str:
        """/server_info's `version` (here, so that the handler needs nothing from this module)."""
        return _version()

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):  # a client went away
            return
        log.exception("error while serving %s", client_address)


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"specforge-eagle3 {version('specforge-eagle3')}"
    except Exception:
        return "specforge-eagle3"


class EmbeddedServer:
    """The HTTP server and its engine thread. `loader` builds the LoadedModel in the engine
    thread, after the port is open (so /health answers 503 meanwhile). Use as a context manager
    or call start() / close(). port=0 picks a free port. `policy`: API key, request limits and
    image roots (default: no key, no local images)."""

    def __init__(self, loader: Callable[[], LoadedModel], *, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "default", policy: ServePolicy | None = None):
        self.worker = EngineWorker(loader)
        self.httpd = _HTTPServer((host, port), Handler)
        self.httpd.worker = self.worker
        self.httpd.model_name = model_name
        self.httpd.policy = policy or ServePolicy()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="specforge-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "EmbeddedServer":
        self._thread.start()
        self.worker.start()
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> "EmbeddedServer":
        deadline = time.monotonic() + timeout_s
        while not self.worker.ready.wait(0.1):
            if self.worker.load_error is not None:
                raise RuntimeError(f"the model failed to load: {self.worker.load_error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the model did not load within {timeout_s:.0f} s")
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.worker.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


# ---- command line ----------------------------------------------------------------------------------


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", "--model-path", dest="target", required=True, help="target model directory")
    p.add_argument("--draft", "--speculative-draft-model-path", dest="draft", default=None,
                   help="EAGLE3 draft checkpoint directory (omit to serve the base model)")
    p.add_argument("--tree", default="8_2_16", help="draft tree T_K_N (steps_topk_drafttokens)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; any other than loopback should come with --api-key")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="every request but GET /health must send Authorization: Bearer KEY (SGLang's flag; "
                        "default: $SPECFORGE_API_KEY, which keeps the key out of `ps`)")
    p.add_argument("--image-root", dest="image_roots", action="extend", nargs="+", default=[], metavar="DIR",
                   help="image_data may name local files inside these directories (after symlinks); "
                        "default none: only base64 data: URIs")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                   help="largest image file or decoded data: URI, in bytes")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body, in bytes (larger: 413)")
    p.add_argument("--read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="longest wait on a client socket; a request body must arrive whole within it (else 408)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--exact-ancestor-attention", action="store_true",
                   help="draft beams attend to their real ancestors (default: SGLang's lanes)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--image-min-pixels", type=int, default=None,
                   help="vision-language targets: resize images to at least this many pixels (data.image_min_pixels)")
    p.add_argument("--image-max-pixels", type=int, default=None,
                   help="vision-language targets: resize images to at most this many pixels (data.image_max_pixels)")
    p.add_argument("--enable-return-hidden-states", action="store_true",
                   help="answer /generate requests with return_hidden_states (prefill rows, as SGLang)")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true",
                   help="return the aux layers' outputs (concatenated) in place of the final state")
    p.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="+", default=None,
                   help="decoder layers whose outputs are the aux hidden states (with the flag above)")
    p.add_argument("--log-level", default="info")


def warn_if_exposed(host: str, policy: ServePolicy) -> None:
    """A server reachable from other machines without a key runs anyone's requests: say so."""
    if policy.api_key is None and not is_loopback(host):
        print(f"serve: WARNING: listening on {host!r}, which other machines can reach, without --api-key: "
              "anyone who can connect can use this server", file=sys.stderr, flush=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def serve(args: argparse.Namespace) -> None:
    """Run until SIGINT/SIGTERM; exit non-zero, before the port opens, on a bad flag or a draft that
    does not fit the target, and once it is open, when the model cannot be loaded."""
    import signal

    from specforge.engine.tree import TreeSpec

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not 1 <= args.port <= 65535:
        raise SystemExit(f"serve: --port must lie in [1, 65535], got {args.port}")
    if args.threads is not None and args.threads < 0:
        raise SystemExit(f"serve: --threads must be >= 0 (0: torch's default), got {args.threads}")
    for path in (args.target, args.draft):
        if path is not None and not Path(path).is_dir():
            raise SystemExit(f"serve: {path} is not a directory")
    if args.draft:
        try:  # a bad tree fails before anything loads
            TreeSpec.parse(args.tree)
        except ValueError as e:
            raise SystemExit(f"serve: {e}") from None
    aux_ids = None
    if args.enable_return_aux_hidden_states or args.return_aux_hidden_state_layer_ids:
        if not (args.enable_return_aux_hidden_states and args.return_aux_hidden_state_layer_ids
                and args.enable_return_hidden_states):
            raise SystemExit("serve: aux hidden states need --enable-return-hidden-states, "
                             "--enable-return-aux-hidden-states and --return-aux-hidden-state-layer-ids")
        aux_ids = args.return_aux_hidden_state_layer_ids
    try:
        policy = ServePolicy(api_key=args.api_key, image_roots=tuple(args.image_roots),
                             max_request_bytes=args.max_request_bytes, read_timeout_s=args.read_timeout_s,
                             max_image_bytes=args.max_image_bytes)
    except ValueError as e:
        raise SystemExit(f"serve: {e}") from None
    warn_if_exposed(args.host, policy)
    if args.draft:
        try:  # a draft for another target stops here, before the port opens
            check_draft_checkpoint(args.draft, args.target)
        except ValueError as e:
            raise SystemExit(f"serve: {e}") from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    def loader():
        return load_model(args.target, args.draft, args.tree if args.draft else None, dtype=args.dtype,
                          device=args.device, exact_ancestor_attention=args.exact_ancestor_attention,
                          return_hidden_states=args.enable_return_hidden_states, aux_hidden_state_layer_ids=aux_ids,
                          image_min_pixels=args.image_min_pixels, image_max_pixels=args.image_max_pixels)

    name = args.served_model_name or Path(args.target).name
    try:
        server = EmbeddedServer(loader, host=args.host, port=args.port, model_name=name, policy=policy)
    except OSError as e:
        raise SystemExit(f"serve: cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    signal.signal(signal.SIGTERM, _interrupt)
    log.info("serving %s%s on %s", args.target, f" + {args.draft} ({args.tree})" if args.draft else "", server.url)
    server.start()
    try:
        while server.worker.load_error is None:
            time.sleep(0.5)
        raise SystemExit(f"serve: the model failed to load: {server.worker.load_error}")
    except KeyboardInterrupt:
        log.info("shutting down")
    finally:
        server.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="specforge serve", description=__doc__.split("\n")[0])
    add_serve_args(p)
    serve(p.parse_args(argv))


if __name__ == "__main__":
    main()
