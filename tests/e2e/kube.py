"""A small client for the e2e cluster's API server: JSON over HTTPS with a client certificate
(standard library only, so a tight pod loop costs one request, not a kubectl process)."""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from typing import Any, Optional

from .pki import Identity


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


class Api:
    def __init__(self, host: str, port: int, ca: str, identity: Optional[Identity], token: str = "") -> None:
        """Authenticated by a client certificate (identity) or a bearer token."""
        self._host, self._port = host, port
        self._context = ssl.create_default_context(cafile=ca)
        if identity is not None:
            self._context.load_cert_chain(identity.cert, identity.key)
        self._token = token
        self._local = threading.local()  # one keep-alive connection per thread
        self._opened: list[http.client.HTTPSConnection] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for conn in self._opened:
                conn.close()
            self._opened.clear()

    def _connection(self) -> http.client.HTTPSConnection:
        conn: Optional[http.client.HTTPSConnection] = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self._host, self._port, context=self._context, timeout=30)
            self._local.conn = conn
            with self._lock:
                self._opened.append(conn)
        return conn

    def request(
        self, method: str, path: str, body: Optional[Any] = None, content_type: str = "application/json"
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (1, 2):  # a keep-alive connection the server closed: once more, fresh
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                raw = response.read().decode()
                break
            # (ssl.SSLEOFError: the server closed it under TLS, which is no ConnectionError)
            except (http.client.HTTPException, ConnectionError, ssl.SSLEOFError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        if response.status >= 400:
            raise ApiError(response.status, raw)
        if not raw:
            return None
        return json.loads(raw) if response.getheader("Content-Type", "").startswith("application/json") else raw

    def get(self, path: str, **query: str) -> Any:
        if query:
            path += "?" + urllib.parse.urlencode(query)
        return self.request("GET", path)

    def create(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def delete(
        self, path: str, missing_ok: bool = True, grace: Optional[int] = 0, propagation: Optional[str] = None
    ) -> None:
        """DELETE; grace None keeps the object's own grace period (as `kubectl delete` does);
        propagation "Orphan" leaves the dependents (`kubectl delete --cascade=orphan`)."""
        body: Optional[dict[str, Any]] = (
            None if grace is None else {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": grace}
        )
        if propagation:
            body = {"kind": "DeleteOptions", "apiVersion": "v1", **(body or {}), "propagationPolicy": propagation}
        try:
            self.request("DELETE", path, body)
        except ApiError as exc:
            if not (missing_ok and exc.status == 404):
                raise

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def strategic_patch(self, path: str, body: Any) -> Any:
        """A strategic merge patch: lists with merge keys (containers, env) merge by name."""
        return self.request("PATCH", path, body, content_type="application/strategic-merge-patch+json")
