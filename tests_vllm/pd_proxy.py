"""A small P/D proxy that does what llm-d's routing sidecar does for vLLM's
NixlConnector (its ``nixlv2`` connector mode), for the kvseal handoff tests.

For each ``POST /v1/completions``: the request goes to the prefill instance
with ``max_tokens`` 1, ``stream`` off and ``kv_transfer_params``
``{"do_remote_decode": true}``; the prefill's answer carries the decode's
``kv_transfer_params``; the original request goes to the decode instance with
them, and the decode's answer is the client's. A prefill that fails (down,
an error status, no params) costs the decode nothing but the handoff: the
request goes to the decode without params, which computes the prompt itself
(what an operator wants from a proxy: an answer).

It runs in the test's process (a thread); no part of the engines' trust: it
sees and may rewrite the params, which kvseal never trusts for correctness
(docs/pd.md).
"""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_S = 300.0


def post(url: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """POST ``body`` as JSON; the JSON answer (RuntimeError on a non-200)."""
    u = urlsplit(url)
    c = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    try:
        c.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
    finally:
        c.close()
    if r.status != 200:
        raise RuntimeError(f"{url}: HTTP {r.status}: {data[:500]!r}")
    out: dict[str, Any] = json.loads(data)
    return out


def prefill(base: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill step: the decode's params from the prefill's answer (None
    when it gave none)."""
    req = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    req.pop("stream_options", None)
    params = post(base + "/v1/completions", req).get("kv_transfer_params")
    return params if isinstance(params, dict) else None


def decode(base: str, body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode step: the original request, with the prefill's params."""
    req = dict(body)
    if params is not None:
        req["kv_transfer_params"] = params
    return post(base + "/v1/completions", req)


def complete(prefill_base: str, decode_base: str, body: dict[str, Any]) -> dict[str, Any]:
    """Both steps; a failed prefill step leaves the decode computing alone."""
    try:
        params = prefill(prefill_base, body)
    except (OSError, RuntimeError, http.client.HTTPException, ValueError):
        params = None
    return decode(decode_base, body, params)


class Proxy:
    """The proxy as an HTTP server on 127.0.0.1 (``url``), in a thread."""

    def __init__(self, prefill_base: str, decode_base: str) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n))
                    out = json.dumps(complete(outer.prefill_base, outer.decode_base, body))
                    status = 200
                except (OSError, RuntimeError, ValueError) as e:
                    out, status = json.dumps({"error": str(e)}), 502
                data = out.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                return

        self.prefill_base, self.decode_base = prefill_base, decode_base
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._t = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._t.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
