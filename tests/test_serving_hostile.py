"""`specforge serve` against hostile or broken clients and mismatched checkpoints (issue #14):
real servers on 127.0.0.1, real sockets, the exact answer to each bad input, and the server still
serving afterwards. Servers are shared per module, one per set of flags."""
from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import os
import shutil
import socket
import re
import select
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from specforge.checkpoint import CheckpointError, check_fits_target, save_checkpoint
from specforge.launch.embedded_commands import embedded_server_command
from specforge.launch.process import ServerProcess, free_port
from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.serving.app import EmbeddedServer, warn_if_exposed
from specforge.serving.images import resolve_image_path
from specforge.serving.model import check_draft_checkpoint, load_model
from specforge.serving.policy import ServePolicy, is_loopback
from specforge.utils.images import image_formats

KEY = "s3cret-key"
READ_TIMEOUT_S = 1.0
MAX_REQUEST_BYTES = 1 << 16
MAX_IMAGE_BYTES = 4096
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


# ---- servers and clients ---------------------------------------------------------------------------


def _start(loader, policy):
    server = EmbeddedServer(loader, policy=policy).start()
    server.wait_ready(120)
    return server


@pytest.fixture(scope="module")
def text_server(tiny_target_dir):
    """No key; reads time out after 1 s; bodies up to 64 KiB."""
    server = _start(lambda: load_model(tiny_target_dir, dtype="float32"),
                    ServePolicy(read_timeout_s=READ_TIMEOUT_S, max_request_bytes=MAX_REQUEST_BYTES))
    yield server
    server.close()


@pytest.fixture(scope="module")
def keyed_server(tiny_target_dir):
    server = _start(lambda: load_model(tiny_target_dir, dtype="float32"), ServePolicy(api_key=KEY))
    yield server
    server.close()


@pytest.fixture(scope="module")
def image_dirs(two_image_prompt, tmp_path_factory):
    """root/ (the server's --image-root: the prompt's two images, a 30 KB noise image, a symlink to
    a file outside) and outside/ (an image the server must not read)."""
    paths, _ = two_image_prompt
    base = tmp_path_factory.mktemp("image_roots")
    root, outside = base / "root", base / "outside"
    root.mkdir(), outside.mkdir()
    shutil.copy(paths[0], root / "a.png")
    shutil.copy(paths[1], root / "b.png")
    shutil.copy(paths[1], outside / "secret.png")
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (100, 100, 3), generator=g, dtype=torch.uint8).numpy()
    Image.fromarray(noise).save(root / "big.png")
    (root / "link.png").symlink_to(outside / "secret.png")
    return root, outside


@pytest.fixture(scope="module")
def vl_server(tiny_vl_dir, image_dirs):
    server = _start(lambda: load_model(tiny_vl_dir, dtype="float32"),
                    ServePolicy(image_roots=(image_dirs[0],), max_image_bytes=MAX_IMAGE_BYTES))
    yield server
    server.close()


def port_of(server) -> int:
    return server.httpd.server_address[1]


def request(server, method, path, body=None, headers=None):
    """One request over http.client: (status, headers, decoded JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=30)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def raw_exchange(server, data: bytes, *, half_close=False, timeout=10.0):
    """Send bytes as they are and read until the server closes the connection (a server that keeps
    it open fails the test by the socket timeout): (status, headers, JSON body, raw answer, seconds)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body), raw, time.monotonic() - start


def post_head(content_length=None, extra=b"") -> bytes:
    """The head of a POST /generate, with this Content-Length header (None: without one)."""
    cl = b"" if content_length is None else b"Content-Length: " + content_length.encode() + b"\r\n"
    return b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + cl + extra + b"\r\n"


def assert_serving(server, headers=None):
    """The server still answers a real generation."""
    status, _, out = request(server, "POST", "/generate", {**GENERATE, "input_ids": None, "text": "hi"}, headers)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2, out


def error_message(body) -> str:
    return body["error"]["message"]


# ---- the request body: Content-Length, size, time, JSON --------------------------------------------


@pytest.mark.parametrize("head, message", [
    (post_head(None), "Content-Length header is required"),
    (post_head("abc"), "Content-Length must be one byte count, got 'abc'"),
    (post_head("-1"), "Content-Length must be one byte count, got '-1'"),
    (post_head("5", b"Content-Length: 7\r\n"), "Content-Length must be one byte count, got '5', '7'"),
    (post_head(None, b"Transfer-Encoding: chunked\r\n"), "Transfer-Encoding request bodies are not supported"),
], ids=["missing", "not-a-number", "negative", "two-values", "chunked"])
def test_bad_content_length_gets_400_and_the_connection_closed(text_server, head, message):
    status, headers, body, _, _ = raw_exchange(text_server, head)
    assert status == 400 and error_message(body).startswith(message), body
    assert body["error"]["code"] == 400 and headers["connection"] == "close"
    assert_serving(text_server)


def test_too_large_body_gets_413_before_it_is_sent(text_server):
    status, _, body, _, _ = raw_exchange(text_server, post_head(str(10**12)))
    assert status == 413 and error_message(body) == (
        f"the request body ({10**12} bytes) is larger than --max-request-bytes ({MAX_REQUEST_BYTES})")
    # A client that asks first (Expect: 100-continue) gets the 413 instead of "100 Continue".
    _, _, _, raw, _ = raw_exchange(text_server, post_head(str(MAX_REQUEST_BYTES + 1), b"Expect: 100-continue\r\n"))
    assert raw.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in raw
    assert_serving(text_server)


def test_short_body_times_out_with_408(text_server):
    status, _, body, _, seconds = raw_exchange(text_server, post_head("100") + b'{"text": "')
    assert status == 408 and error_message(body) == (
        "the request body was not received within --read-timeout-s (1 s): 10 of 100 bytes")
    assert READ_TIMEOUT_S <= seconds < READ_TIMEOUT_S + 4
    assert_serving(text_server)


def test_trickling_body_is_cut_off_at_the_deadline(text_server):
    """One byte every 0.2 s never lets a single read wait 1 s; the body's deadline still ends it."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port_of(text_server)), timeout=10) as s:
        s.sendall(post_head("1000"))
        start = time.monotonic()
        while not select.select([s], [], [], 0.2)[0]:  # until the server answers
            s.sendall(b" ")
            assert time.monotonic() - start < READ_TIMEOUT_S + 4
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:  # our last byte may arrive after the server closed
            pass
    assert answer.startswith(b"HTTP/1.1 408 ") and b" of 1000 bytes" in answer
    assert_serving(text_server)


def test_body_ending_early_gets_400(text_server):
    status, _, body, _, _ = raw_exchange(text_server, post_head("100") + b'{"text": "', half_close=True)
    assert status == 400 and error_message(body) == "the request body ended after 10 of 100 bytes (Content-Length)"
    assert_serving(text_server)


def test_silent_client_is_answered_or_dropped_within_the_timeout(text_server):
    """Headers that stop arriving get a 408; a connection that never sends a byte is closed (no
    request was made, so there is nothing to answer): neither holds a thread."""
    status, _, body, _, seconds = raw_exchange(text_server, b"POST /generate HTTP/1.1\r\nHost: t\r\n")
    assert status == 408
    assert error_message(body) == "the request headers were not received within --read-timeout-s (1 s)"
    assert seconds < READ_TIMEOUT_S + 4
    with socket.create_connection(("127.0.0.1", port_of(text_server)), timeout=10) as s:
        start = time.monotonic()
        assert s.recv(1) == b""
        assert time.monotonic() - start < READ_TIMEOUT_S + 4
    assert_serving(text_server)


@pytest.mark.parametrize("data", [b'{"text": ', b'{"text": "\xff"}', b"[" * 50_000, b"[1, 2]"],
                         ids=["truncated", "not-utf8", "nested-too-deep", "not-an-object"])
def test_bad_json_gets_400_and_the_connection_stays_usable(text_server, data):
    conn = http.client.HTTPConnection("127.0.0.1", port_of(text_server), timeout=30)
    try:
        conn.request("POST", "/generate", body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        want = "the JSON body must be an object" if data == b"[1, 2]" else "invalid JSON body: "
        assert resp.status == 400 and error_message(body).startswith(want), body
        conn.request("POST", "/generate", body=json.dumps(GENERATE).encode())  # same connection
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["meta_info"]["completion_tokens"] == 2
    finally:
        conn.close()


@pytest.mark.parametrize("body, message", [
    ({"text": "hi", "sampling_params": [1]}, "sampling_params must be an object, got [1]"),
    ({"text": "hi", "sampling_params": {"stop_token_ids": ["a"]}}, "stop_token_ids must be a list of token ids"),
])
def test_wrongly_typed_fields_get_400(text_server, body, message):
    status, _, out = request(text_server, "POST", "/generate", body)
    assert status == 400 and error_message(out).startswith(message), out


def test_http_level_errors_are_json_too(text_server):
    got, headers, body, _, _ = raw_exchange(text_server, b"PUT /generate HTTP/1.1\r\nHost: t\r\n\r\n")
    assert (got, headers["content-type"]) == (501, "application/json")
    assert error_message(body) == "Unsupported method ('PUT')"
    # A request line without a version is answered as HTTP/0.9 is: the body alone.
    with socket.create_connection(("127.0.0.1", port_of(text_server)), timeout=10) as s:
        s.sendall(b"GARBAGE\r\n")
        raw = b"".join(iter(lambda: s.recv(65536), b""))
    assert json.loads(raw) == {"error": {"message": "Bad request syntax ('GARBAGE')", "code": 400}}
    assert_serving(text_server)


# ---- API key ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"bearer {KEY}", KEY, f"Bearer {KEY}x",
                                           "Bearer \u00e9\u00e8"],
                         ids=["none", "wrong", "lowercase-scheme", "no-scheme", "longer", "non-ascii"])
def test_requests_without_the_key_get_401(keyed_server, authorization):
    headers = {} if authorization is None else {"Authorization": authorization.encode("utf-8").decode("latin-1")}
    for method, path, body in [("POST", "/generate", GENERATE), ("POST", "/no/such/route", {}),
                               ("GET", "/server_info", None), ("GET", "/v1/models", None)]:
        status, got_headers, out = request(keyed_server, method, path, body, headers)
        assert status == 401, (method, path, out)
        assert error_message(out) == "a valid API key is required: send the header Authorization: Bearer <key>"
        assert got_headers["WWW-Authenticate"] == "Bearer"


def test_the_key_opens_every_route_and_health_needs_none(keyed_server):
    assert request(keyed_server, "GET", "/health")[0] == 200
    good = {"Authorization": f"Bearer {KEY}"}
    assert request(keyed_server, "GET", "/server_info", headers=good)[0] == 200
    assert request(keyed_server, "POST", "/no/such/route", {}, good)[0] == 404
    assert_serving(keyed_server, good)


def test_our_benchmark_client_sends_the_key(keyed_server):
    """eval.api_key / `specforge bench --api-key`: the serving benchmark can measure a keyed server."""
    from specforge.eval.bench_client import random_token_requests, run_benchmark

    url = f"http://127.0.0.1:{port_of(keyed_server)}"
    requests = random_token_requests(2, 4, 3, 50, seed=0)
    result = run_benchmark(url, requests, warmup=0, api_key=KEY)
    assert result.metrics["completed"] == 2 and result.metrics["failed"] == 0
    refused = run_benchmark(url, requests, warmup=0)
    assert refused.metrics["completed"] == 0 and "HTTP 401" in refused.metrics["errors"][0]


def test_our_clients_take_the_key_from_the_environment(keyed_server, monkeypatch):
    """SPECFORGE_API_KEY, read by the benchmark client and by http_json (extract=server's calls)."""
    from specforge.eval.bench_client import random_token_requests, run_benchmark
    from specforge.launch.process import API_KEY_ENV, http_json

    url = f"http://127.0.0.1:{port_of(keyed_server)}"
    with pytest.raises(RuntimeError, match="HTTP 401"):
        http_json(url + "/server_info", timeout=30)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert http_json(url + "/server_info", timeout=30)
    result = run_benchmark(url, random_token_requests(1, 4, 3, 50, seed=0), warmup=0)
    assert result.metrics["completed"] == 1


def test_the_key_is_refused_on_a_kept_alive_connection_without_losing_it(keyed_server):
    """A 401 reads a small body first, so the client reads the answer and may go on."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(keyed_server), timeout=30)
    try:
        conn.request("POST", "/generate", body=json.dumps(GENERATE).encode())
        resp = conn.getresponse()
        assert resp.status == 401 and resp.getheader("Connection") is None
        resp.read()
        conn.request("POST", "/generate", body=json.dumps(GENERATE).encode(),
                     headers={"Authorization": f"Bearer {KEY}"})
        assert conn.getresponse().status == 200
    finally:
        conn.close()


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("", False), ("10.1.2.3", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_exposed_host_without_a_key_warns(capsys):
    warn_if_exposed("0.0.0.0", ServePolicy())
    assert "serve: WARNING: listening on '0.0.0.0', which other machines can reach, without --api-key" \
        in capsys.readouterr().err
    warn_if_exposed("0.0.0.0", ServePolicy(api_key=KEY))
    warn_if_exposed("127.0.0.1", ServePolicy())
    assert capsys.readouterr().err == ""


# ---- image_data --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_prompt(two_image_prompt, tiny_vl_dir) -> str:
    """The rendered two-image prompt (one placeholder per image)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_vl_dir)).apply_chat_template(
        two_image_prompt[1], add_generation_prompt=True, tokenize=False)


def _image_request(text, image_data):
    return {"text": text, "image_data": image_data,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}


def _data_uri(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def refused(ref) -> str:
    return f"image_data[1]: {str(ref)!r} is not an image file under the server's --image-root"


def test_images_under_the_root_and_data_uris_give_the_same_tokens(vl_server, image_dirs, vl_prompt):
    root, _ = image_dirs
    by_path = _image_request(vl_prompt, [str(root / "a.png"), str(root / "b.png")])
    by_uri = _image_request(vl_prompt, [str(root / "a.png"), _data_uri(root / "b.png")])
    (s1, _, out1), (s2, _, out2) = (request(vl_server, "POST", "/generate", b) for b in (by_path, by_uri))
    assert s1 == s2 == 200, (out1, out2)
    assert out1["output_ids"] == out2["output_ids"] and len(out1["output_ids"]) == 3


def test_paths_outside_the_root_and_missing_paths_get_the_same_answer(vl_server, image_dirs, vl_prompt):
    """No existence oracle: an existing file outside the root, one reached through a symlink or
    `..`, a missing file inside or outside the root, a directory: one message."""
    root, outside = image_dirs
    for ref in [outside / "secret.png", root / "link.png", f"{root}/../outside/secret.png", root / "missing.png",
                outside / "missing.png", "/etc/passwd", "relative/missing.png", root, "bad\0name.png"]:
        body = _image_request(vl_prompt, [str(root / "a.png"), str(ref)])
        status, _, out = request(vl_server, "POST", "/generate", body)
        assert (status, error_message(out)) == (400, refused(ref)), ref
    assert_serving(vl_server)


@pytest.mark.parametrize("make_ref, message", [
    (lambda root: "data:image/png;base64,@@@@", "image_data[1]: the data URI is not valid base64"),
    (lambda root: "data:image/png;base64," + base64.b64encode(b"not an image").decode(),
     f"image_data[1]: cannot be read as an image ({', '.join(image_formats())}): UnidentifiedImageError"),
    (lambda root: "data:text/plain,hello", "image_data[1]: a data URI must read data:image/<type>;base64,<data>"),
    (lambda root: "data:image/png;base64," + "A" * 8000,
     f"image_data[1]: the data URI holds about 6000 bytes, more than --max-image-bytes ({MAX_IMAGE_BYTES})"),
    (lambda root: str(root / "big.png"), f"image_data[1]: {{root}}/big.png: "),
    (lambda root: "http://example.com/a.png", "image_data[1]: the embedded server takes local image files only"),
], ids=["bad-base64", "not-an-image", "not-base64-uri", "uri-too-large", "file-too-large", "url"])
def test_bad_images_get_400(vl_server, image_dirs, vl_prompt, make_ref, message):
    root, _ = image_dirs
    body = _image_request(vl_prompt, [str(root / "a.png"), make_ref(root)])
    status, _, out = request(vl_server, "POST", "/generate", body)
    assert status == 400 and error_message(out).startswith(message.format(root=root)), out
    if "big.png" in message:
        size = (root / "big.png").stat().st_size
        assert error_message(out).endswith(f"{size} bytes, more than --max-image-bytes ({MAX_IMAGE_BYTES})")


def test_placeholders_without_pixels_get_400(vl_server, vl_prompt, tiny_vl_dir):
    """Image or video placeholder tokens the request gives no pixels for fail before the engine."""
    info = vl_server.worker.model.vl[1]
    cases = [({"text": vl_prompt}, "the prompt holds 2 image placeholder tokens (id {image}) but no image_data"),
             ({"input_ids": [5, info.video_token_id, 7]},
              "the prompt holds video placeholder tokens (id {video}): video inputs are not supported")]
    for prompt, message in cases:
        for path, body in [("/generate", prompt), ("/v1/completions", {"prompt": next(iter(prompt.values()))})]:
            status, _, out = request(vl_server, "POST", path, body)
            assert status == 400, (path, out)
            assert error_message(out).startswith(message.format(image=info.image_token_id, video=info.video_token_id))
    assert_serving(vl_server)


def test_without_an_image_root_no_local_path_is_read(two_image_prompt):
    """The default policy: every local path refused, existing or not, with one message."""
    assert ServePolicy().image_roots == ()
    for ref in [two_image_prompt[0][0], "/no/such.png"]:
        with pytest.raises(ValueError) as e:
            resolve_image_path(ref, ServePolicy().image_roots, "image_data[0]")
        assert str(e.value) == ("image_data[0]: this server reads no local image files (start it with "
                                "--image-root DIR); send the image as a base64 data: URI")


def test_an_image_root_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"--image-root {tmp_path}/none: not a directory")):
        ServePolicy(image_roots=(tmp_path / "none",))


# ---- a draft that does not fit the target ------------------------------------------------------------


@pytest.fixture(scope="module")
def target_config(tiny_target_dir):
    return AutoConfig.from_pretrained(str(tiny_target_dir))


def _checkpoint(config: Eagle3Config, path):
    save_checkpoint(Eagle3Draft(config).eval(), path, dtype=torch.float32)
    return path


@pytest.mark.parametrize("change, message", [
    ({"target_hidden_size": 32}, "target_hidden_size 32 != the target's hidden_size 64"),
    ({"vocab_size": "+1"}, "vocab_size {v1} != the target's vocab_size {v}"),
    ({"aux_layer_ids": [0, 1, 4]}, "eagle_config.eagle_aux_hidden_state_layer_ids: [0, 1, 4] must be 3 distinct "
                                   "ascending ids in [0, 4) (the target has 4 decoder layers)"),
    ({"rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
     "rope_scaling.mrope_section: [2, 3, 3], but the target is a text model"),
], ids=["hidden-size", "vocab", "aux-ids", "mrope"])
def test_check_fits_target_names_the_field(target_config, change, message, tmp_path):
    cfg = Eagle3Config.from_target(target_config, [0, 1, 2])
    v = cfg.vocab_size
    change = {k: v + 1 if val == "+1" else val for k, val in change.items()}
    check_fits_target(cfg, target_config, tmp_path)  # the unchanged draft fits
    with pytest.raises(CheckpointError) as e:
        check_fits_target(dataclasses.replace(cfg, **change), target_config, tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: the draft does not fit the target: ")
    assert message.format(v=v, v1=v + 1) in str(e.value)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": None}, "rope_scaling.mrope_section: missing, but the target uses M-RoPE positions"),
    ({"aux_layer_ids": [1, 3, 4]}, "aux layer id 1: its output carries the target's deepstack visual features "
                                   "(layers 0..1); the ids must be >= 2"),
], ids=["no-mrope", "deepstack-layer"])
def test_check_fits_a_vl_target(tiny_vl_dir, change, message, tmp_path):
    vl_config = AutoConfig.from_pretrained(str(tiny_vl_dir))
    cfg = Eagle3Config.from_target(vl_config, [2, 3, 4])
    check_fits_target(cfg, vl_config, tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        check_fits_target(dataclasses.replace(cfg, **change), vl_config, tmp_path)


def test_a_checkpoint_with_wrong_t2d_is_refused_before_serving(target_config, tiny_target_dir, tmp_path):
    ckpt = _checkpoint(Eagle3Config.from_target(target_config, [0, 1, 2]), tmp_path / "ckpt")
    check_draft_checkpoint(ckpt, tiny_target_dir)
    tensors = load_file(ckpt / "model.safetensors")
    v = target_config.vocab_size
    tensors["t2d"] = tensors["t2d"][:-1]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        check_draft_checkpoint(ckpt, tiny_target_dir)
    assert str(e.value) == f"{ckpt}/model.safetensors: t2d: ({v - 1},) != expected ({v},)"


def test_an_in_process_server_refuses_a_misfit_draft(target_config, tiny_target_dir, tmp_path):
    cfg = Eagle3Config.from_target(target_config, [0, 1, 2])
    v = cfg.vocab_size + 1  # d2t/t2d of a larger vocab, consistent in themselves
    ckpt = _checkpoint(dataclasses.replace(cfg, vocab_size=v, draft_vocab_size=v), tmp_path / "ckpt")
    with EmbeddedServer(lambda: load_model(tiny_target_dir, ckpt, "3_1_4", dtype="float32")) as server:
        with pytest.raises(RuntimeError) as e:
            server.wait_ready(60)
    assert f"CheckpointError: {ckpt}/config.json: the draft does not fit the target: vocab_size" in str(e.value)


def test_serve_refuses_a_misfit_draft_at_start_up(target_config, tiny_target_dir, tmp_path):
    """The process exits non-zero before it listens, naming the file and the field; an exposed
    host without a key was warned about first."""
    ckpt = _checkpoint(Eagle3Config.from_target(target_config, [1, 2, 7]), tmp_path / "ckpt")
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "serve", "--target", str(tiny_target_dir),
                           "--draft", str(ckpt), "--tree", "3_1_4", "--host", "0.0.0.0", "--port", str(port)],
                          capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert proc.returncode == 1, proc.stderr
    assert "serve: WARNING: listening on '0.0.0.0', which other machines can reach, without --api-key" in proc.stderr
    assert proc.stderr.strip().endswith(
        f"serve: {ckpt}/config.json: the draft does not fit the target: eagle_config.eagle_aux_hidden_state_layer_ids: "
        "[1, 2, 7] must be 3 distinct ascending ids in [0, 4) (the target has 4 decoder layers)")
    assert "on http://" not in proc.stderr  # it never listened


def test_serve_refuses_a_bad_tree_in_one_line_before_it_loads(tiny_target_dir, target_config, tmp_path):
    ckpt = _checkpoint(Eagle3Config.from_target(target_config, [0, 1, 3]), tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "serve", "--target", str(tiny_target_dir),
                           "--draft", str(ckpt), "--tree", "0_1_2", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("serve: tree 0_1_2: steps must be a positive integer, got 0")


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "serve: --port must lie in [1, 65535], got 99999"),  # was bind()'s OverflowError
    (["--port", "31999", "--threads", "-1"], "serve: --threads must be >= 0 (0: torch's default), got -1")])
def test_serve_refuses_a_port_or_thread_count_that_cannot_be_in_one_line(tiny_target_dir, flags, message):
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "serve", "--target", str(tiny_target_dir), *flags],
                          capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith(message)


def test_a_server_stopped_by_sigterm_exits_cleanly(tiny_target_dir, tmp_path):
    """SIGTERM (what ServerProcess, Slurm and `kill` send) ends `specforge serve` with exit 0.
    Its engine thread used to be left freeing tensors while the interpreter finalised: the process
    aborted ("terminate called without an active exception", exit 134) on every stop."""
    port = free_port()
    log = tmp_path / "serve.log"
    server = ServerProcess(embedded_server_command(tiny_target_dir, port=port, dtype="float32", threads=1), port, log,
                           startup_timeout_s=120)
    server.start().wait_healthy()  # the model loaded, waiting for requests
    assert server.stop() == 0, log.read_text()[-2000:]
    assert "terminate called" not in log.read_text() and "shutting down" in log.read_text()
