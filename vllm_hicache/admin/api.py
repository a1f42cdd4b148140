"""The admin HTTP API: runtime attach, detach and clear of the L3 backend.

    GET    /hicache/storage-backend         backend, options (secrets redacted),
                                            policies, L2 occupancy, counters
    PUT    /hicache/storage-backend         attach, or update the attached
                                            backend's policies (JSON body)
    DELETE /hicache/storage-backend         detach (idempotent; deletes nothing)
    POST   /hicache/storage-backend/clear   delete every object of the attached L3
    POST   /set_hicache_storage_backend     SGLang's older form: {"storage_backend":
                                            "<name>" | null, ...}; null = detach

PUT body (SGLang's names are accepted too, in brackets)::

    {"backend": "file",                         [hicache_storage_backend]
     "extra_config": {"path": "/mnt/l3"},       [hicache_storage_backend_extra_config(_json)]
     "prefetch_policy": "timeout",              [hicache_storage_prefetch_policy]
     "write_policy": "write_through"}           [hicache_write_policy]

``extra_config`` is what ``hicache_storage_backend_extra_config`` takes (an
object or a JSON string of one; no ``@file``: the server reads no file named
by a client, except ``storage_secret``'s). Omitted on a re-attach, the
attached options, prefetch policy and write policy stay.

Answers are JSON: the GET view on success; ``{"error": ..., "field": ...}``
with 400 for a bad body or an unknown backend (nothing changes), 401 without
the key, 409 when the engine is not idle or another backend is attached, 500
when a rank failed an attach (rolled back), 502 when the backend cannot be
reached, 503 when the engine does not take the call in time.

Served by uvicorn (a FastAPI app) on a daemon thread of the EngineCore
process, one per engine (data parallel engine i: port + i), on
``admin_api_host:admin_api_port`` (config.py: loopback by default, off unless
a port is set, a key required off loopback). Each call becomes a command of
``StorageControl`` (admin/storage_control.py), run by the engine loop between steps.
"""

# No ``from __future__ import annotations``: FastAPI resolves the handlers'
# ``Request`` annotations at definition time, and they are local names.
import asyncio
import hmac
import json
import logging
import socket
import threading
from typing import Any

from vllm_hicache import io_threads
from vllm_hicache.admin.storage_control import AttachSpec, StorageControl
from vllm_hicache.policy.write import WRITE_POLICIES
from vllm_hicache.storage_config import (
    PREFETCH_POLICIES,
    STORAGE_BACKENDS,
    parse_storage,
)

logger = logging.getLogger(__name__)

API_PATH = "/hicache/storage-backend"
LEGACY_PATH = "/set_hicache_storage_backend"
# How long a call waits for the engine loop to take it.
ENGINE_WAIT_S = 30.0
MAX_BODY_BYTES = 64 * 1024

_ALIASES = {
    "backend": ("backend", "hicache_storage_backend"),
    "extra_config": ("extra_config", "hicache_storage_backend_extra_config",
                     "hicache_storage_backend_extra_config_json"),
    "prefetch_policy": ("prefetch_policy", "hicache_storage_prefetch_policy"),
    "write_policy": ("write_policy", "hicache_write_policy"),
}


class BodyError(ValueError):
    """A bad request body; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parse_attach(body: Any, legacy: bool = False) -> AttachSpec | None:
    """Validate an attach body (nothing is read from the engine, nothing
    changes); None for the legacy form's ``"storage_backend": null``."""
    if not isinstance(body, dict):
        raise BodyError("body", "expected a JSON object")
    names = {alias: canon for canon, aliases in _ALIASES.items() for alias in aliases}
    if legacy:
        names["storage_backend"] = "backend"
    values: dict[str, tuple[str, Any]] = {}
    for key, value in body.items():
        canon = names.get(key)
        if canon is None:
            raise BodyError(key, f"unknown field {key!r}; accepted: {', '.join(sorted(names))}")
        if canon in values:
            raise BodyError(key, f"{key!r} and {values[canon][0]!r} both give {canon}")
        values[canon] = (key, value)
    if "backend" not in values:
        raise BodyError("storage_backend" if legacy else "backend",
                        f"missing; one of {', '.join(STORAGE_BACKENDS)}")
    backend_key, backend = values["backend"]
    if backend is None and legacy:
        return None
    if not isinstance(backend, str) or backend not in STORAGE_BACKENDS:
        raise BodyError(backend_key, f"unknown backend {backend!r}; accepted: "
                                     f"{', '.join(STORAGE_BACKENDS)}")
    extra = _extra_config(*values["extra_config"]) if "extra_config" in values else {}
    policies: dict[str, str | None] = {}
    for canon, choices in (("prefetch_policy", PREFETCH_POLICIES),
                           ("write_policy", WRITE_POLICIES)):
        key, value = values.get(canon, (canon, None))
        if value is not None and (not isinstance(value, str) or value not in choices):
            raise BodyError(key, f"invalid {canon} {value!r}; accepted: {', '.join(choices)}")
        policies[canon] = value
    storage_keys: dict[str, Any] = {"hicache_storage_backend": backend,
                                    "hicache_storage_backend_extra_config": extra}
    if policies["prefetch_policy"] is not None:
        storage_keys["hicache_storage_prefetch_policy"] = policies["prefetch_policy"]
    try:
        storage = parse_storage(storage_keys)
    except ValueError as err:
        raise BodyError(values.get("extra_config", ("extra_config",))[0], str(err)) from None
    return AttachSpec(
        backend=backend, storage_keys=storage_keys, storage=storage,
        prefetch_policy_given=policies["prefetch_policy"] is not None,
        extra_config_given="extra_config" in values,
        write_policy=policies["write_policy"],
    )


def _extra_config(key: str, raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if isinstance(raw, str):
        if raw.startswith("@"):
            raise BodyError(key, "the admin API reads no file named by a client; send the "
                                 "options as a JSON object")
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as err:
            raise BodyError(key, f"invalid JSON: {err.msg} at line {err.lineno} column "
                                 f"{err.colno}") from None
    if not isinstance(raw, dict):
        raise BodyError(key, "expected a JSON object of backend options")
    return dict(raw)


def _authorized(header: str, api_key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode())


def build_app(control: StorageControl, api_key: str = "", engine_wait_s: float = ENGINE_WAIT_S):
    """The FastAPI app; every route needs ``Authorization: Bearer <api_key>``
    when a key is set."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="vllm_hicache admin API", docs_url=None, redoc_url=None,
                  openapi_url=None)

    def error(status: int, message: str, field: str | None = None, **headers: str):
        body = {"error": message} if field is None else {"error": message, "field": field}
        return JSONResponse(body, status, headers=headers or None)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and not _authorized(request.headers.get("authorization", ""), api_key):
            return error(401, "missing or wrong admin API key (Authorization: Bearer <key>)",
                         **{"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    async def run(kind: str, spec: AttachSpec | None = None):
        future = control.submit(kind, spec)
        answer = asyncio.wrap_future(future)
        try:
            status, body = await asyncio.wait_for(asyncio.shield(answer), engine_wait_s)
        except TimeoutError:
            if control.withdraw(future):
                return error(503, f"the engine did not take the call within {engine_wait_s:g} s "
                                  "(nothing changed)")
            # Taken: its own deadlines bound it.
            status, body = await asyncio.wait_for(
                answer, control.drain_timeout_s + control.ack_timeout_s + engine_wait_s)
        return JSONResponse(body, status)

    async def read_body(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise BodyError("body", f"larger than {MAX_BODY_BYTES} bytes")
        if not raw.strip():
            raise BodyError("body", "expected a JSON object")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BodyError("body", f"not valid JSON: {err}") from None

    async def attach(request: Request, legacy: bool):
        try:
            spec = parse_attach(await read_body(request), legacy=legacy)
        except BodyError as err:
            return error(400, str(err), err.field)
        return await run("detach") if spec is None else await run("attach", spec)

    @app.get(API_PATH)
    async def get_backend():
        return await run("get")

    @app.put(API_PATH)
    async def put_backend(request: Request):
        return await attach(request, legacy=False)

    @app.delete(API_PATH)
    async def delete_backend():
        return await run("detach")

    @app.post(API_PATH + "/clear")
    async def clear_backend():
        return await run("clear")

    @app.post(LEGACY_PATH)
    async def set_backend(request: Request):
        return await attach(request, legacy=True)

    return app


class AdminServer:
    """uvicorn serving ``build_app`` on a daemon thread. The socket is bound
    in ``start`` so a taken port fails the engine's start, naming the key."""

    def __init__(self, control: StorageControl, host: str, port: int, api_key: str = "") -> None:
        self.control = control
        self.host = host
        self.port = port
        self._api_key = api_key
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{API_PATH}"

    def start(self) -> "AdminServer":
        import uvicorn

        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(64)
        except OSError as err:
            raise ValueError(f"HiCache admin API: cannot listen on admin_api_host={self.host!r} "
                             f"admin_api_port={self.port}: {err.strerror or err}") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.control, self._api_key), loop="asyncio",
                                log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = io_threads.named_thread(self._server.run, "hicache-admin",
                                               kwargs={"sockets": [sock]})
        self._thread.start()
        logger.info("HiCache admin API on %s (%s)", self.url,
                    "Authorization: Bearer key required" if self._api_key
                    else "no key: loopback only")
        return self

    def stop(self) -> None:
        self.control.close()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None


def admin_port(base_port: int, vllm_config) -> int:
    """Data parallel engine i listens on ``base_port + i``."""
    parallel = vllm_config.parallel_config
    if base_port and parallel.data_parallel_size > 1:
        return base_port + getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
    return base_port


def start_admin_api(control: StorageControl, cfg, vllm_config) -> "AdminServer | None":
    """The engine's admin API, or None when ``admin_api_port`` is 0."""
    port = admin_port(cfg.admin_api_port, vllm_config)
    if not port:
        return None
    if control.waker is None:
        logger.warning("HiCache admin API: this engine runs in-process; a call is taken only "
                       "when the engine steps for a request")
    return AdminServer(control, cfg.admin_api_host, port, cfg.admin_api_key).start()
