"""Who may ask the server in this process, over a fake pool, through raw HTTP as a browser or a script sends it:
the API key on /metrics, the Host and Origin headers, a POST body's Content-Type and JSON it cannot read."""

from __future__ import annotations

import http.client
import json
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest

from shardbook.kernel.ranks.generation_queue import GenerationQueue
from shardbook.kernel.server.server import Server
from shardbook.kernel.server.state import ServeOptions
from tests.e2e.http_helpers import Reply, chat, request
from tests.unit.test_http_in_process import EchoPool, model_state

KEY = "sk-local-test-key"
BODY = {"model": "A", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def serve():
    """Start a server (``--no-batch``) with the given options over the echo pool; each is stopped after the test."""
    servers = []

    def start(**options) -> str:
        runtime = SimpleNamespace(
            pool=EchoPool(),
            generation_queue=GenerationQueue(),
            ctx0=SimpleNamespace(state=model_state("A")),
            server=None,
        )
        servers.append(Server(runtime, ServeOptions(port=0, batch=False, **options)).start())
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> Reply:
    """A request with exactly these headers (http.client adds only Host, unless given, and Content-Length)."""
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = dict(headers or {})
    try:
        conn.putrequest(method, path, skip_host="Host" in headers)
        for name, value in headers.items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        data = response.read()
        return Reply(response.status, dict(response.getheaders()), json.loads(data) if data.startswith(b"{") else {})
    finally:
        conn.close()


def test_metrics_needs_the_api_key_when_the_server_has_one(serve):
    url = serve(api_key=KEY)
    base = url.removesuffix("/v1")
    refused = request(base, "GET", "/metrics")
    assert (refused.status, refused.error["code"]) == (401, "invalid_api_key"), refused.body
    assert "Authorization: Bearer KEY" in refused.error["message"]
    wrong = request(base, "GET", "/metrics", headers={"Authorization": "Bearer sk-other"})
    assert wrong.status == 401
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    scraped = conn.getresponse()
    assert scraped.status == 200 and b"shardbook_generation_tokens_total" in scraped.read()
    conn.close()
    assert request(base, "GET", "/health").status == 200  # the one endpoint open without the key


def test_a_host_that_is_not_a_name_of_the_server_is_refused(serve):
    url = serve()
    port = urlparse(url).port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.2", f"[::1]:{port}"):
        assert raw(url, "GET", "/v1/models", headers={"Host": host}).status == 200, host
    rebound = raw(url, "POST", "/v1/chat/completions", json.dumps(BODY).encode(), {
        "Host": f"attacker.example:{port}", "Content-Type": "application/json",
    })  # fmt: skip
    assert (rebound.status, rebound.error["code"]) == (403, "host_not_allowed"), rebound.body
    assert "DNS rebinding" in rebound.error["message"] and "--allowed-host attacker.example" in rebound.error["message"]
    assert raw(url, "GET", "/health", headers={"Host": "attacker.example"}).status == 403
    assert raw(url, "GET", "/v1/models", headers={"Host": "10.1.2.3"}).status == 403  # not the address it listens on


def test_on_every_interface_any_address_and_the_machines_name_pass(serve):
    import socket

    url = serve(host="0.0.0.0", api_key=KEY)
    for host in ("10.1.2.3:8000", socket.gethostname(), "localhost"):
        assert raw(url, "GET", "/health", headers={"Host": host}).status == 200, host
    assert raw(url, "GET", "/health", headers={"Host": "attacker.example"}).status == 403


def test_an_allowed_host_passes(serve):
    url = serve(allowed_hosts=("llm.example.org",))
    assert raw(url, "GET", "/v1/models", headers={"Host": "LLM.example.org:443"}).status == 200
    assert raw(url, "GET", "/v1/models", headers={"Host": "other.example.org"}).status == 403
    anything = serve(allowed_hosts=("*",))
    assert raw(anything, "GET", "/v1/models", headers={"Host": "other.example.org"}).status == 200


def test_requests_from_a_web_page_are_refused_unless_its_origin_is_allowed(serve):
    url = serve()
    page = {"Origin": "https://attacker.example", "Content-Type": "application/json"}
    posted = raw(url, "POST", "/v1/chat/completions", json.dumps(BODY).encode(), page)
    assert (posted.status, posted.error["code"]) == (403, "origin_not_allowed"), posted.body
    assert "--allowed-origin https://attacker.example" in posted.error["message"]
    assert "Access-Control-Allow-Origin" not in posted.headers  # the page cannot even read the refusal
    assert raw(url, "GET", "/v1/models", headers={"Origin": "null"}).status == 403
    preflight = raw(url, "OPTIONS", "/v1/chat/completions", headers={"Origin": "https://attacker.example"})
    assert preflight.status == 403

    app = "https://app.example.org:8443"
    allowed = serve(allowed_origins=(app,), api_key=KEY)
    preflight = raw(allowed, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": app, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization",
    })  # fmt: skip
    assert preflight.status == 204 and preflight.headers["Access-Control-Allow-Origin"] == app
    assert "Authorization" in preflight.headers["Access-Control-Allow-Headers"]
    reply = chat(allowed, "A", "hi", headers={"Origin": app, "Authorization": f"Bearer {KEY}"}, max_tokens=2)
    assert reply.status == 200 and reply.headers["Access-Control-Allow-Origin"] == app
    no_key = chat(allowed, "A", "hi", headers={"Origin": app}, max_tokens=2)
    assert no_key.status == 401 and no_key.headers["Access-Control-Allow-Origin"] == app  # it may read why
    other = chat(allowed, "A", "hi", headers={"Origin": "https://attacker.example"}, max_tokens=2)
    assert other.status == 403


def test_a_body_that_is_not_declared_json_is_a_415(serve):
    url = serve()
    body = json.dumps(BODY).encode()
    for path in ("/v1/chat/completions", "/v1/completions"):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            refused = raw(url, "POST", path, body, {"Content-Type": content_type})
            assert (refused.status, refused.error["code"]) == (415, "unsupported_media_type"), refused.body
            assert content_type in refused.error["message"]
            assert "Content-Type: application/json" in refused.error["message"]
        assert raw(url, "POST", path, body).status == 415  # none at all (a browser's Blob body)
    ok = raw(url, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json; charset=utf-8"})
    assert ok.status == 200, ok.body


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/v1/chat/completions", b'"messages": [{"role": "user", "content": "hi"}]'),
        ("/v1/completions", b'"prompt": "x"'),
    ],
)
def test_an_integer_too_long_to_convert_is_a_400(serve, path, fields):
    url = serve()
    reply = request(url, "POST", path, b'{"model": "A", ' + fields + b', "seed": 1' + b"0" * 5000 + b"}")
    assert (reply.status, reply.error["type"]) == (400, "invalid_request_error"), reply.body
    assert "integer of 5001 digits" in reply.error["message"] and "4300" in reply.error["message"]
    shorter = request(url, "POST", path, b'{"model": "A", ' + fields + b', "seed": 1' + b"0" * 40 + b"}")
    assert (shorter.status, shorter.error["param"]) == (400, "seed")  # below the limit, the field names itself


def test_the_options_reach_the_server_from_shardbook_serve_and_percent_serve():
    from shardbook.kernel.cli.main import build_parser, split_leading_overrides
    from shardbook.kernel.cli.serve import serve_options, split_flags
    from shardbook.magics.arguments import parse_line
    from shardbook.magics.serve import ServeMagics

    argv = ["serve", "--allowed-host", "llm.example.org", "--model.model_name_or_path", "X"]
    assert split_leading_overrides(argv) == (argv[:3], argv[3:])
    args = build_parser().parse_args(["serve", "--allowed-host", "a.example", "demo", "--allowed-host", "b.example"])
    split_flags(args)
    args.allowed_origin = ["https://app.example.org:8443"]
    options = serve_options(args)
    assert options.allowed_hosts == ("a.example", "b.example")
    assert options.allowed_origins == ("https://app.example.org:8443",)
    magic = parse_line(ServeMagics.serve, "--allowed-origin https://app.example.org --allowed-origin '*'")
    assert magic.allowed_origin == ["https://app.example.org", "*"] and magic.allowed_host is None
    with pytest.raises(ValueError, match="not a web origin.*--allowed-origin https://"):
        ServeOptions(allowed_origins=("app.example.org",)).check()
    with pytest.raises(ValueError, match="not a host name"):
        ServeOptions(allowed_hosts=("http://llm.example.org/",)).check()
