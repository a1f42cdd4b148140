"""The admin HTTP API: runtime attach, detach and clear of the L3 backend.

    GET    /hicache/storage-backend         backend, options (secrets redacted),
                                            policies, L2 occupancy, counters
    PUT    /hicache/storage-backend         attach, or update the attached
                                            backend's policies (JSON body)
    DELETE /hicache/storage-backend         detach (idempotent; deletes nothing);
                                            optional JSON body {"pending_backups": ...}
    POST   /hicache/storage-backend/clear   delete every object of the attached L3
    POST   /set_hicache_storage_backend     SGLang's older form: {"storage_backend":
                                            "<name>" | null, ...}; null = detach

PUT body (SGLang's names are accepted too, in brackets)::

    {"backend": "file",                         [hicache_storage_backend]
     "extra_config": {"path": "/mnt/l3"},       [hicache_storage_backend_extra_config(_json)]
     "prefetch_policy": "timeout",              [hicache_storage_prefetch_policy]
     "write_policy": "write_through",           [hicache_write_policy]
     "pending_backups": "finish"}               replace: the old backend's unwritten
                                                backups: finish | drop | move

``extra_config`` is what ``hicache_storage_backend_extra_config`` takes (an
object or a JSON string of one, not ``@file``). A file named inside it
(``@/path`` values, ``*_file`` options) must lie in the operator's
``admin_api_file_dirs``, and backend ``dynamic`` must name a module of
``admin_api_dynamic_modules`` (admin_guard.py). Omitted on a re-attach, the
attached options, prefetch policy and write policy stay.

Every call passes, in order (a refused one reaches nothing of the engine):

1. Host and Origin (403): bound to loopback, ``Host`` must be the bound
   address or ``localhost`` with the port; an ``Origin`` header must be the
   same origin (``http://`` + Host). A web page on another site (or a DNS
   rebinding one) is refused even when the browser sends the request.
2. The key (401): ``Authorization: Bearer <key>`` unless admin_api_key is
   "none"; by default a key made at start into a 0600 file (admin_key.py).
3. Content-Type (415): POST and PUT need ``application/json`` (what a browser
   cannot send cross-site without asking first); DELETE may omit it.
4. The body (PUT, POST): at most ``MAX_BODY_BYTES``, checked from
   Content-Length before reading and while reading (413), JSON nested at most
   ``MAX_JSON_DEPTH`` deep (400).

Answers are JSON: the GET view on success; ``{"error": ..., "field": ...}``
with 400 for a bad body or an unknown backend (nothing changes), 401 without
the key, 403 for a foreign Host or Origin, 409 (admin_storage_switch=idle
only) when the engine is not idle or another backend is attached, 413 for
a body over the limit, 415 without a JSON Content-Type, 500 when a rank
failed an attach (rolled back), 502 when the backend cannot be reached, 503
when the engine does not take the call in time.

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hicache import io_threads
from vllm_hicache.admin.guard import (
    AdminPolicy,
    allowed_hosts,
    content_type_problem,
    json_depth,
    origin_problem,
)
from vllm_hicache.admin.key_file import remove_key_file, write_key_file
from vllm_hicache.admin.storage_control import AttachSpec, DetachSpec, StorageControl
from vllm_hicache.config_admin import ADMIN_KEY_AUTO, admin_key_file
from vllm_hicache.policy.storage_switch import (
    DEFAULT_PENDING_BACKUPS,
    PENDING_BACKUPS,
    PendingBackups,
)
from vllm_hicache.policy.write import WRITE_POLICIES
from vllm_hicache.storage_config import (
    PREFETCH_POLICIES,
    STORAGE_BACKENDS,
    parse_storage,
)

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)

API_PATH = "/hicache/storage-backend"
LEGACY_PATH = "/set_hicache_storage_backend"
# How long a call waits for the engine loop to take it.
ENGINE_WAIT_S = 30.0
MAX_BODY_BYTES = 64 * 1024
# An attach body nests a few levels; far deeper is an attack on the parser.
MAX_JSON_DEPTH = 32
# No file and no dynamic module may be named (the operator allowed none).
NOTHING_ALLOWED = AdminPolicy()

_ALIASES = {
    "backend": ("backend", "hicache_storage_backend"),
    "extra_config": ("extra_config", "hicache_storage_backend_extra_config",
                     "hicache_storage_backend_extra_config_json"),
    "prefetch_policy": ("prefetch_policy", "hicache_storage_prefetch_policy"),
    "write_policy": ("write_policy", "hicache_write_policy"),
    "pending_backups": ("pending_backups",),
}


class BodyError(ValueError):
    """A bad request body; ``field`` names the offending field."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def parse_attach(body: Any, legacy: bool = False,
                 policy: AdminPolicy = NOTHING_ALLOWED) -> AttachSpec | None:
    """Validate an attach body (nothing is read from the engine, nothing
    changes); None for the legacy form's ``"storage_backend": null``.
    ``policy`` says which files and modules the options may name."""
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
    extra = {}
    if "extra_config" in values:  # else the attached options stay: nothing new is named
        extra = _extra_config(*values["extra_config"])
        try:
            policy.check_attach(backend, extra)
        except ValueError as err:
            raise BodyError(values["extra_config"][0], str(err)) from None
    policies: dict[str, str | None] = {}
    for canon, choices in (("prefetch_policy", PREFETCH_POLICIES),
                           ("write_policy", WRITE_POLICIES),
                           ("pending_backups", PENDING_BACKUPS)):
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
    # parse_storage gives None only for no keys, and the backend key is always there.
    assert storage is not None, "parse_storage ignored hicache_storage_backend"
    return AttachSpec(
        backend=backend, storage_keys=storage_keys, storage=storage,
        prefetch_policy_given=policies["prefetch_policy"] is not None,
        extra_config_given="extra_config" in values,
        write_policy=policies["write_policy"],
        pending_backups=PendingBackups(policies["pending_backups"] or DEFAULT_PENDING_BACKUPS),
    )


def parse_detach(body: Any) -> DetachSpec:
    """Validate a DETACH body (``None``: no body): only ``pending_backups``,
    ``finish`` or ``drop`` (a detach has nowhere to move them)."""
    if body is None:
        return DetachSpec()
    if not isinstance(body, dict):
        raise BodyError("body", "expected a JSON object")
    for key in body:
        if key != "pending_backups":
            raise BodyError(key, f"unknown field {key!r}; accepted: pending_backups")
    value = body.get("pending_backups", DEFAULT_PENDING_BACKUPS)
    choices = (PendingBackups.FINISH, PendingBackups.DROP)
    if not isinstance(value, str) or value not in choices:
        raise BodyError("pending_backups", f"invalid pending_backups {value!r} for a detach; "
                                           f"accepted: {', '.join(choices)}")
    return DetachSpec(PendingBackups(value))


def _extra_config(key: str, raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if isinstance(raw, str):
        if raw.startswith("@"):
            raise BodyError(key, "the admin API takes the options themselves, not a file; "
                                 "send them as a JSON object")
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


def build_app(control: StorageControl, api_key: str = "", engine_wait_s: float = ENGINE_WAIT_S,
              *, host: str, port: int, policy: AdminPolicy = NOTHING_ALLOWED):
    """The FastAPI app of an API bound to ``host:port``; every route needs
    ``Authorization: Bearer <api_key>`` when a key is set."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="vllm_hicache admin API", docs_url=None, redoc_url=None,
                  openapi_url=None)

    def error(status: int, message: str, field: str | None = None, **headers: str):
        body = {"error": message} if field is None else {"error": message, "field": field}
        return JSONResponse(body, status, headers=headers or None)

    hosts = allowed_hosts(host, port)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        header, problem = origin_problem(request.headers, hosts)
        if problem:
            return error(403, problem, header)
        if api_key and not _authorized(request.headers.get("authorization", ""), api_key):
            return error(401, "missing or wrong admin API key (Authorization: Bearer <key>)",
                         **{"WWW-Authenticate": "Bearer"})
        problem = content_type_problem(request.method, request.headers.get("content-type"))
        if problem:
            return error(415, problem, "Content-Type")
        return await call_next(request)

    async def run(kind: str, spec: AttachSpec | DetachSpec | None = None):
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
                answer, control.drain_timeout_s + 2 * control.ack_timeout_s + engine_wait_s)
        return JSONResponse(body, status)

    async def read_body(request: Request, optional: bool = False) -> Any:
        too_large = BodyError("body", f"larger than {MAX_BODY_BYTES} bytes", status=413)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            raise too_large
        raw = bytearray()
        async for chunk in request.stream():  # without Content-Length: up to the limit
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise too_large
        if not raw.strip():
            if optional:
                return None
            raise BodyError("body", "expected a JSON object")
        if json_depth(raw, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise BodyError("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BodyError("body", f"not valid JSON: {err}") from None

    async def attach(request: Request, legacy: bool):
        try:
            spec = parse_attach(await read_body(request), legacy=legacy, policy=policy)
        except BodyError as err:
            return error(err.status, str(err), err.field)
        return await run("detach") if spec is None else await run("attach", spec)

    @app.get(API_PATH)
    async def get_backend():
        return await run("get")

    @app.put(API_PATH)
    async def put_backend(request: Request):
        return await attach(request, legacy=False)

    @app.delete(API_PATH)
    async def delete_backend(request: Request):
        try:
            spec = parse_detach(await read_body(request, optional=True))
        except BodyError as err:
            return error(err.status, str(err), err.field)
        return await run("detach", spec)

    @app.post(API_PATH + "/clear")
    async def clear_backend():
        return await run("clear")

    @app.post(LEGACY_PATH)
    async def set_backend(request: Request):
        return await attach(request, legacy=True)

    return app


class AdminServer:
    """uvicorn serving ``build_app`` on a daemon thread. The socket is bound
    in ``start`` so a taken port fails the engine's start, naming the key.
    With ``key_file``, ``start`` makes the key and writes it there (removed
    by ``stop``); else ``api_key`` is the key ("" = none)."""

    def __init__(self, control: StorageControl, host: str, port: int, api_key: str = "",
                 key_file: Path | None = None, policy: AdminPolicy = NOTHING_ALLOWED) -> None:
        self.control = control
        self.host = host
        self.port = port
        self._api_key = api_key
        self.key_file = key_file
        self._policy = policy
        self._server: uvicorn.Server | None = None
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
        if self.key_file is not None:
            try:
                self._api_key = write_key_file(self.key_file)
            except ValueError:
                sock.close()
                raise
        app = build_app(self.control, self._api_key, host=self.host, port=self.port,
                        policy=self._policy)
        config = uvicorn.Config(app, loop="asyncio",
                                log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = io_threads.named_thread(self._server.run, "hicache-admin",
                                               kwargs={"sockets": [sock]})
        self._thread.start()
        logger.info("HiCache admin API on %s (%s)", self.url,
                    f"Authorization: Bearer <the key in {self.key_file}>" if self.key_file
                    else "Authorization: Bearer key required" if self._api_key
                    else "no key: loopback only")
        return self

    def stop(self) -> None:
        self.control.close()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None
        if self.key_file is not None and self._api_key:
            remove_key_file(self.key_file, self._api_key)


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
    auto = cfg.admin_api_key == ADMIN_KEY_AUTO
    return AdminServer(control, cfg.admin_api_host, port, "" if auto else cfg.admin_api_key,
                       key_file=admin_key_file(cfg.admin_api_key_dir, port) if auto else None,
                       policy=AdminPolicy.from_config(cfg)).start()
