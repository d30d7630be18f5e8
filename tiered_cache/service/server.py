"""The store server: `tiered_cache.v1.KVCache` over a `BlobStore`, plus `grpc.health.v1`.

Requests are parsed by our own deserializers, so a malformed message gets INVALID_ARGUMENT with
a message a person can act on (grpc's default answer to an unparsable request is a bare
INTERNAL). Every refusal is counted in the server's stats; nothing a client sends stops the
server from serving everyone else.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tiered_cache import __version__
from tiered_cache.index.keys import KEY_BYTES
from tiered_cache.service.client import message_options
from tiered_cache.service.config import ServerConfig
from tiered_cache.service.store import BlobStore
from tiered_cache.tiers.base import BlobTier
from tiered_cache.tiers.codec import BlobError, BlobFault, check_fingerprint, read_header, verify_blob
from tiered_cache.tiers.memory import MemoryTier
from tiered_cache.v1 import cache_pb2 as pb

SERVICE = "tiered_cache.v1.KVCache"
_PUT_BATCH = 32  # blobs written to the store per lock acquisition
_GET_BATCH = 16  # blobs read from the store per lock acquisition (bounds memory per stream)
_TIERS = {"ram": pb.TIER_RAM, "disk": pb.TIER_DISK, "redis": pb.TIER_REDIS}
_REFUSALS = {
    BlobFault.CORRUPT: pb.CORRUPT_BLOB, BlobFault.WRONG_KEY: pb.KEY_MISMATCH,
    BlobFault.WRONG_FINGERPRINT: pb.FINGERPRINT_MISMATCH, BlobFault.UNKNOWN_CODEC: pb.UNKNOWN_CODEC,
    BlobFault.WRONG_SHAPE: pb.CORRUPT_BLOB,
}


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Server options: those shared with clients, and no port sharing (a busy port is an error)."""
    return [*message_options(max_message_bytes), ("grpc.so_reuseport", 0)]


@dataclass
class _Malformed:
    """What our deserializer returns for bytes that are not the expected message."""

    message_type: str
    size: int


def _parser(message_cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError):
            return _Malformed(message_cls.DESCRIPTOR.full_name, len(data))
    return parse


class ServerCounters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.requests = self.rejected = self.unauthenticated = self.refused_blobs = self.active_streams = 0

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


class KVCacheService:
    def __init__(self, store: BlobStore, config: ServerConfig, counters: ServerCounters) -> None:
        self.store = store
        self.config = config
        self.counters = counters

    # --- helpers -------------------------------------------------------------------------------
    def _reject(self, context: grpc.ServicerContext, message: str) -> None:
        self.counters.add("rejected")
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _check_keys(self, request: Any, context: grpc.ServicerContext) -> list[bytes]:
        if isinstance(request, _Malformed):
            self._reject(context, f"request is not a valid {request.message_type} ({request.size} bytes)")
        keys = list(request.keys)
        if len(keys) > self.config.max_keys:
            self._reject(context, f"{len(keys)} keys in one request; the limit is {self.config.max_keys}")
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                self._reject(context, f"key {i} is {len(key)} bytes; page keys are {KEY_BYTES} bytes (SHA-256)")
        return keys

    # --- RPCs ----------------------------------------------------------------------------------
    def Lookup(self, request: Any, context: grpc.ServicerContext) -> pb.LookupResponse:
        self.counters.add("requests")
        keys = self._check_keys(request, context)
        where = self.store.locate(keys)
        tiers = [_TIERS.get(w, pb.TIER_RAM) if w else pb.TIER_NONE for w in where]
        leading = next((i for i, w in enumerate(where) if w is None), len(where))
        return pb.LookupResponse(leading=leading, tiers=tiers)

    def Get(self, request: Any, context: grpc.ServicerContext) -> Iterator[pb.PageBlob]:
        self.counters.add("requests")
        keys = self._check_keys(request, context)
        fingerprint = bytes(request.fingerprint)
        if fingerprint and len(fingerprint) != KEY_BYTES:
            self._reject(context, f"fingerprint is {len(fingerprint)} bytes; expected 32 raw bytes")
        self.counters.add("active_streams")
        try:
            for start in range(0, len(keys), _GET_BATCH):
                if not context.is_active():
                    return
                chunk = keys[start:start + _GET_BATCH]
                for key, blob in zip(chunk, self.store.get(chunk), strict=True):
                    if blob is None or (fingerprint and not _fingerprint_ok(blob, fingerprint)):
                        continue
                    yield pb.PageBlob(key=key, blob=blob)
        finally:
            self.counters.add("active_streams", -1)

    def Put(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> pb.PutResponse:
        self.counters.add("requests")
        self.counters.add("active_streams")
        response = pb.PutResponse()
        batch: list[tuple[bytes, bytes]] = []
        try:
            for item in request_iterator:
                if isinstance(item, _Malformed):
                    self._flush_put(batch, response)
                    self._reject(context, f"stream item is not a valid {item.message_type} ({item.size} bytes); "
                                          f"{response.stored} pages stored before it")
                refusal = self._validate(item)
                if refusal is not None:
                    response.refused.append(refusal)
                    self.counters.add("refused_blobs")
                    continue
                batch.append((bytes(item.key), bytes(item.blob)))
                if len(batch) >= _PUT_BATCH:
                    self._flush_put(batch, response)
            self._flush_put(batch, response)
        finally:
            self.counters.add("active_streams", -1)
        return response

    def Stats(self, request: Any, context: grpc.ServicerContext) -> pb.StatsResponse:
        self.counters.add("requests")
        c = self.counters
        server = pb.ServerStats(version=__version__, uptime_s=time.monotonic() - c.started, requests=c.requests,
                                rejected_requests=c.rejected, unauthenticated=c.unauthenticated,
                                refused_blobs=c.refused_blobs, active_streams=c.active_streams)
        tiers = [pb.TierStats(**{k: v for k, v in s.to_dict().items() if k != "hit_rate"})
                 for s in self.store.stats()]
        return pb.StatsResponse(tiers=tiers, server=server)

    # --- Put internals -------------------------------------------------------------------------
    def _validate(self, item: Any) -> pb.Refusal | None:
        key, blob, fingerprint = bytes(item.key), item.blob, bytes(item.fingerprint)
        if len(key) != KEY_BYTES:
            return pb.Refusal(key=key, reason=pb.BAD_KEY, message=f"key is {len(key)} bytes, expected {KEY_BYTES}")
        if len(blob) > self.config.max_page_bytes:
            return pb.Refusal(key=key, reason=pb.TOO_LARGE,
                              message=f"blob is {len(blob):,} bytes; this server takes at most "
                                      f"{self.config.max_page_bytes:,}")
        try:
            header = verify_blob(blob, key)
            if fingerprint:
                check_fingerprint(header, fingerprint)
        except BlobError as exc:
            return pb.Refusal(key=key, reason=_REFUSALS[exc.fault], message=str(exc))
        return None

    def _flush_put(self, batch: list[tuple[bytes, bytes]], response: pb.PutResponse) -> None:
        if batch:
            stored, held = self.store.put(batch)
            response.stored += stored
            response.already_held += held
            batch.clear()


def _fingerprint_ok(blob: bytes, fingerprint: bytes) -> bool:
    try:
        check_fingerprint(read_header(blob, check_crc=False), fingerprint)
    except BlobError:
        return False
    return True


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuse calls to the store without `authorization: Bearer <token>` (health checks stay open)."""

    def __init__(self, token: str, counters: ServerCounters) -> None:
        self.expected = f"Bearer {token}"
        self.counters = counters

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: send metadata `authorization: Bearer <token>`")
        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method.startswith("/grpc.health."):
            return continuation(details)
        import hmac

        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode(), self.expected.encode()):
            return continuation(details)
        self.counters.add("unauthenticated")
        return self._deny_stream if details.method.endswith("/Put") else self._deny_unary


def build_store(config: ServerConfig) -> BlobStore:
    lower: list[BlobTier] = []
    if config.disk_path:
        from tiered_cache.tiers.disk import DiskTier

        lower.append(DiskTier(config.disk_path, config.disk_capacity))
    if config.redis_url:
        from tiered_cache.tiers.redis import RedisTier

        lower.append(RedisTier(config.redis_url, config.redis_prefix))
    return BlobStore(MemoryTier(config.ram_capacity), lower, config.write_through)


class StoreServer:
    """A running store server. `start()` binds and returns the port; `stop()` drains and flushes."""

    def __init__(self, config: ServerConfig, store: BlobStore | None = None) -> None:
        self.config = config
        self.store = store or build_store(config)
        self.counters = ServerCounters()
        self.health = health.HealthServicer()
        interceptors = [_TokenInterceptor(config.token, self.counters)] if config.token else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.workers),
                                  interceptors=interceptors, options=grpc_options(config.max_message_bytes))
        self.service = KVCacheService(self.store, config, self.counters)
        self.server.add_generic_rpc_handlers([_handlers(self.service)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    def start(self) -> int:
        host = self.config.host
        address = f"[{host}]:{self.config.port}" if ":" in host and not host.startswith("[") else \
            f"{host}:{self.config.port}"
        if self.config.tls_cert:
            creds = grpc.ssl_server_credentials([(Path(self.config.tls_key).read_bytes(),
                                                  Path(self.config.tls_cert).read_bytes())])
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    def stop(self) -> int:
        """Stop taking calls, let in-flight streams finish (up to grace_s), flush RAM downward."""
        self.health.enter_graceful_shutdown()
        self.server.stop(self.config.grace_s).wait()
        return self.store.flush()


def _handlers(service: KVCacheService) -> grpc.GenericRpcHandler:
    ser = lambda message: message.SerializeToString()  # noqa: E731
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Lookup": grpc.unary_unary_rpc_method_handler(service.Lookup, _parser(pb.LookupRequest), ser),
        "Get": grpc.unary_stream_rpc_method_handler(service.Get, _parser(pb.GetRequest), ser),
        "Put": grpc.stream_unary_rpc_method_handler(service.Put, _parser(pb.PageBlob), ser),
        "Stats": grpc.unary_unary_rpc_method_handler(service.Stats, _parser(pb.StatsRequest), ser),
    })


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; then drain, flush, and return 0."""
    stop = threading.Event()

    def on_signal(*_: Any) -> None:
        # Drain once: later signals are ignored (grace_s bounds the drain; SIGKILL still works).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):  # before "listening" is printed: no window without them
        signal.signal(sig, on_signal)
    server = StoreServer(config)
    port = server.start()
    where = f"{config.host}:{port}"
    print(f"tiered-cache serve: listening on {where} ({'TLS' if config.tls_cert else 'plaintext'}, "
          f"{'token required' if config.token else 'no token'})", flush=True)
    if not config.loopback_only:
        print(f"tiered-cache serve: WARNING: listening beyond loopback on {config.host}"
              + ("" if config.token else "; set --token so only your instances can read and write pages"),
              file=sys.stderr, flush=True)
    stop.wait()
    print("tiered-cache serve: shutting down (draining streams, flushing RAM to the next tier)", flush=True)
    flushed = server.stop()
    print(f"tiered-cache serve: flushed {flushed} pages; bye", flush=True)
    return 0
