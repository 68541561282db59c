"""Start a server process, wait for /health, and always stop it.

`ServerProcess` is a context manager: the server is stopped when the block ends, whatever ends it
(an exception, Ctrl-C, or SIGTERM, which is turned into an exception while a server runs). The
server gets its own session (process group), so SGLang's scheduler and detokenizer children are
stopped with it: SIGTERM to the group, then SIGKILL after a grace period. An atexit hook is the
last resort for servers still running when the interpreter exits.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit
from pathlib import Path
from typing import Mapping, Sequence

log = logging.getLogger(__name__)

_RUNNING: set["ServerProcess"] = set()
_saved_sigterm: list = []  # the handler to restore, while ours is installed


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


class Terminated(BaseException):
    """SIGTERM arrived while a server was running (BaseException, like KeyboardInterrupt)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now (the OS picks it); small race with other processes, as always."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Local servers are never reached through a proxy from the environment (http_proxy without no_proxy).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def url_problem(name: str, value: str | None) -> str | None:
    """Why `value` (a server's base URL, setting or flag `name`) cannot be one, or None (also unset)."""
    if value is None or value == "":
        return None
    parts = urlsplit(str(value))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{name} {str(value)!r} is not an http(s) URL (e.g. http://127.0.0.1:30000)"
    return None


def check_urls(urls: Mapping[str, str | None]) -> None:
    """Refuse (InvalidInput) the first of {setting: value} that is set but not a server's base URL."""
    from specforge.errors import InvalidInput

    for name, value in urls.items():
        if (problem := url_problem(name, value)) is not None:
            raise InvalidInput(problem)


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with _DIRECT.open(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


API_KEY_ENV = "SPECFORGE_API_KEY"  # the servers' API key, for our clients and `specforge serve` alike


def api_key_from_env() -> str | None:
    """The key from the environment: never in a config file a run saves, nor in `ps`."""
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(api_key: str | None) -> dict:
    """SGLang's (and `specforge serve`'s) --api-key, as a Bearer token."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_json(url: str, body=None, timeout: float = 600.0, *, raw: bool = False, api_key: str | None = None):
    """GET url (body None) or POST body as JSON, with `api_key` (default: SPECFORGE_API_KEY's) if set;
    the decoded JSON answer (raw: its bytes). An HTTP error raises RuntimeError with the server's own
    message; nothing answering, ConnectionError."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **auth_headers(api_key or api_key_from_env())}
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with _DIRECT.open(req, timeout=timeout) as r:
            content = r.read()
            return content if raw else json.loads(content)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise RuntimeError(f"{url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ConnectionError(f"{url}: no answer ({getattr(e, 'reason', e)})") from None


def server_info(url: str, timeout: float = 30.0, api_key: str | None = None) -> dict:
    """GET /server_info (SGLang's older name: /get_server_info): a server's arguments (SGLang's
    server args; `specforge serve` answers the same keys) and state."""
    try:
        return http_json(url + "/server_info", timeout=timeout, api_key=api_key)
    except RuntimeError:
        return http_json(url + "/get_server_info", timeout=timeout, api_key=api_key)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """`command` run as a server answering on http://host:port, output to `log_path`."""

    def __init__(self, command: Sequence[str], port: int, log_path, *, host: str = "127.0.0.1",
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 900.0,
                 stop_timeout_s: float = 30.0, health_path: str = "/health"):
        self.command = [str(c) for c in command]
        self.host, self.port = host, int(port)
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env} if self.env is not None else None
        with open(self.log_path, "ab") as logf:
            logf.write(f"$ {' '.join(self.command)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(self.command, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        _track(self, running=True)
        log.info("started server pid %d on %s (log: %s)", self.proc.pid, self.base_url, self.log_path)
        return self

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Poll GET /health until 200; fail early (with the log's tail) if the process exits."""
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        url = self.base_url + self.health_path
        while True:
            code = self.proc.poll() if self.proc else None
            if self.proc is None or code is not None:
                raise ServerStartError(
                    f"server exited with code {code} before it was healthy: {' '.join(self.command)}\n"
                    f"--- last lines of {self.log_path} ---\n{_tail(self.log_path)}"
                )
            if http_status(url, timeout=5.0) == 200:
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"server not healthy after {timeout_s:.0f} s at {url}\n"
                    f"--- last lines of {self.log_path} ---\n{_tail(self.log_path)}"
                )
            time.sleep(0.25)

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after `stop_timeout_s`; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("server pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, self.stop_timeout_s)
        # The group outlives its leader while children (SGLang's scheduler, detokenizer) live.
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10.0  # a signal is delivered asynchronously: see them gone
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        # Forgotten only now: a second Ctrl-C during the above leaves it to the atexit hook.
        self.proc = None
        _track(self, running=False)
        log.info("stopped server pid %d (exit %s)", proc.pid, proc.returncode)
        return proc.returncode

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _track(server: ServerProcess, running: bool) -> None:
    """Keep the set of running servers; while it is not empty, SIGTERM raises `Terminated` in the
    main thread so `with` blocks unwind and stop their servers."""
    was_empty = not _RUNNING
    (_RUNNING.add if running else _RUNNING.discard)(server)
    if threading.current_thread() is not threading.main_thread():
        return
    if running and was_empty and not _saved_sigterm:
        _saved_sigterm.append(signal.signal(signal.SIGTERM, _raise_terminated))
    elif not _RUNNING and _saved_sigterm:
        previous = _saved_sigterm.pop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in process group `pgid`."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def _raise_terminated(signum, frame):
    previous = _saved_sigterm[0] if _saved_sigterm else None
    if callable(previous):  # e.g. a preemption handler that records the signal
        previous(signum, frame)
    raise Terminated(f"signal {signum}")


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()
