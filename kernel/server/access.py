"""Who may ask: the API key, the ``Host`` and ``Origin`` headers and a POST body's ``Content-Type``.

A web page the user visits can make the browser send requests to a server on loopback. Three checks keep
it out, as Jupyter's own server does: a ``Host`` that is not a name of this server is refused (DNS
rebinding: a page's own domain made to resolve to 127.0.0.1), a request from a browser page (an ``Origin``
header) is refused unless that origin is allowed, and a body that is not ``application/json`` is refused
(only JSON bodies make the browser ask the server first, with a CORS preflight). Each raises ``ApiError``.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import socket

from shardbook.kernel.server.openai_api import ApiError

LOCAL_HOSTNAMES = ("localhost",)
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Addresses that listen on every interface: the machine's own names and any IP address then reach it."""
CORS_HEADERS = "Authorization, Content-Type"
CORS_METHODS = "GET, POST, OPTIONS"


def check_api_key(key: str | None, authorization: str) -> None:
    """ApiError 401 unless the server has no key or ``authorization`` is ``Bearer KEY`` (constant-time compare)."""
    if key is None:
        return
    if not authorization.startswith("Bearer "):
        raise ApiError(
            401,
            "missing API key: this server was started with an API key; send the header 'Authorization: Bearer KEY' "
            "(the OpenAI clients do, with api_key=KEY)",
            code="invalid_api_key",
            type="authentication_error",
        )
    if not hmac.compare_digest(authorization[len("Bearer ") :].strip().encode(), key.encode()):
        raise ApiError(401, "invalid API key", code="invalid_api_key", type="authentication_error")


def host_names(bound: str, allowed: tuple[str, ...]) -> set[str]:
    """The names a request's ``Host`` may give for a server listening on ``bound``, lower-case, without a port;
    ``*`` among them allows any. IP addresses are checked apart (``check_host``)."""
    names = {n.lower() for n in (*LOCAL_HOSTNAMES, bound, *allowed)}
    return names | machine_names() if bound in WILDCARD_HOSTS else names


@functools.cache
def machine_names() -> frozenset[str]:
    """This machine's name and fully qualified name, looked up once (``getfqdn`` may ask DNS)."""
    return frozenset({socket.gethostname().lower(), socket.getfqdn().lower()})


def check_host(host_header: str, bound: str, allowed: tuple[str, ...], url: str) -> None:
    """ApiError 403 when ``Host`` names neither this server's address nor a loopback or allowed name.

    An IP address passes when it is a loopback one, the bound one, or any with a wildcard bind (a page cannot
    rebind an IP address); a name passes when it is ``localhost``, the ``--host`` given, the machine's own name
    with a wildcard bind, or one of ``allowed`` (``--allowed-host``).
    """
    host = split_host(host_header)
    names = host_names(bound, allowed)
    if "*" in names or host in names:
        return
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None and (address.is_loopback or bound in WILDCARD_HOSTS or host == split_host(bound)):
        return
    raise ApiError(
        403,
        f"the request's Host header {host_header!r} is not a name of this server, which listens at {url}: a web "
        "page could reach a local server under its own domain name (DNS rebinding), so other names are refused. "
        f"Send the request to {url} (or localhost), or allow that name when starting the server with "
        f"--allowed-host {host or 'NAME'} (a reverse proxy's or tunnel's name).",
        code="host_not_allowed",
        type="permission_error",
    )


def split_host(host_header: str) -> str:
    """``Host``'s name or address, lower-case, without its port or an IPv6 address's brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else host


def check_origin(origin: str | None, allowed: tuple[str, ...]) -> None:
    """ApiError 403 when the request comes from a browser page (it has an ``Origin``) whose origin is not
    allowed (``--allowed-origin``; ``*`` allows any). Scripts and OpenAI clients send no ``Origin``."""
    if origin is None or "*" in allowed or origin.rstrip("/").lower() in {o.rstrip("/").lower() for o in allowed}:
        return
    raise ApiError(
        403,
        f"requests from web pages are refused, and this one comes from the page at {origin}: any site the user "
        "visits could otherwise use the model through the browser. To let a web application use this server, "
        f"allow its origin when starting the server with --allowed-origin {origin}",
        code="origin_not_allowed",
        type="permission_error",
    )


def check_json_body(method: str, content_type: str | None) -> None:
    """ApiError 415 when a POST's body is not declared ``application/json`` (a charset may follow)."""
    if method != "POST":
        return
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json":
        return
    given = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
    raise ApiError(
        415,
        f"the request body has {given}; this server takes JSON bodies only: send the header "
        "'Content-Type: application/json' (the OpenAI clients do; with curl, add -H 'Content-Type: "
        "application/json'). Other types are refused because a web page can post them to a local server "
        "without the browser asking the server first.",
        code="unsupported_media_type",
    )
