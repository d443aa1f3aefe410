"""A small Python client of the m31 HTTP service (`m31 serve`), on httpx.

    from m31.client import Client

    with Client("http://127.0.0.1:8031", admin_token=...) as c:
        c.retrieve([{"user_id": 7, "surface": "feed", "platform": "ios", "k": 10}])
        v = c.upsert([{"ad_id": 1, "advertiser_id": 3, ...}])["index_version"]
        c.retrieve([...], min_version=v)  # never answered from an index older than the upsert

Errors come back as `ServiceError` with the HTTP status and the server's message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx


class ServiceError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class Client:
    def __init__(
        self,
        url: str = "http://127.0.0.1:8031",
        token: str | None = None,
        admin_token: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        """`token` is sent on reads, `admin_token` on writes (ad management, snapshots)."""
        self._http = httpx.Client(base_url=url, timeout=timeout)
        self._read = {"Authorization": f"Bearer {token}"} if token else {}
        self._admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, headers: Mapping[str, str], **kw) -> Any:
        response = self._http.request(method, path, headers=headers, **kw)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ServiceError(response.status_code, detail)
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    def retrieve(
        self,
        requests: Sequence[Mapping[str, Any]],
        min_version: int | None = None,
        timeout_ms: int | None = None,
    ) -> dict:
        """{"results": [{"ad_ids", "scores"}...], "index_version", "batch_requests",
        "timings_ms"} for requests such as {"user_id", "surface", "platform", "k", ...}."""
        body: dict[str, Any] = {"requests": list(requests)}
        if min_version is not None:
            body["min_version"] = min_version
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        return self._call("POST", "/v1/retrieve", self._read, json=body)

    def get_ad(self, ad_id: int) -> dict:
        return self._call("GET", f"/v1/ads/{ad_id}", self._read)

    def upsert(self, ads: Sequence[Mapping[str, Any]]) -> dict:
        """{"index_version", "ads"} once the ads are durable."""
        return self._call("PUT", "/v1/ads", self._admin, json={"ads": list(ads)})

    def update(self, ad_id: int, **attributes: Any) -> dict:
        return self._call("PATCH", f"/v1/ads/{ad_id}", self._admin, json=attributes)

    def pause(self, ad_id: int) -> dict:
        return self.update(ad_id, status="paused")

    def resume(self, ad_id: int) -> dict:
        return self.update(ad_id, status="active")

    def delete(self, ad_id: int) -> dict:
        return self._call("DELETE", f"/v1/ads/{ad_id}", self._admin)

    def snapshot(self) -> dict:
        return self._call("POST", "/v1/admin/snapshot", self._admin)

    def add_events(
        self, events: Sequence[Mapping[str, Any]], idempotency_key: str | None = None
    ) -> dict:
        """{"index_version", "users"} once the engagement events are durable; a retry with the
        same `idempotency_key` is applied once."""
        body: dict[str, Any] = {"events": list(events)}
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        return self._call("POST", "/v1/events", self._admin, json=body)

    def set_users(self, users: Sequence[Mapping[str, Any]]) -> dict:
        """Replace users' attributes (user_id, country, age, gender, cohort)."""
        return self._call("PUT", "/v1/users", self._admin, json={"users": list(users)})

    def ready(self) -> bool:
        try:
            self._call("GET", "/health/ready", {})
        except (ServiceError, httpx.TransportError):
            return False
        return True

    def metrics(self) -> str:
        return self._call("GET", "/metrics", {})
