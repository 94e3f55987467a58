"""The http(s) image URLs of a request (``--allow-image-urls``), fetched by `deepseek-v41-vl serve`
before the request is rendered. Each URL becomes a base64 data URL of its bytes, so the processor
never opens a connection itself.

What is bounded:

- The whole fetch of a request's URLs ends by ``--image-fetch-timeout`` seconds: its answer (a 400
  past the deadline) does not wait for a slow server. At the deadline its connections are shut
  down, so the worker threads come free then; each socket operation also times out after the time
  left, at most :data:`READ_TIMEOUT` seconds.
- Host names are resolved in a pool of their own (:data:`RESOLVER_THREADS` threads), waited for
  within the deadline: a resolver that hangs holds its resolver thread, not a fetch thread.
- One request fetches at most :data:`FETCHES_PER_REQUEST` URLs at a time, in a pool of
  :data:`FETCH_THREADS` threads, so a request of many slow URLs leaves threads to other requests.
  Many clients each sending slow URLs at once can still make each other's fetches wait, within
  their own deadlines.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import http.client
import ipaddress
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError

from .serve_policy import ServeLimits, ServeRequestError, check_image_count

FETCH_THREADS = 16
FETCHES_PER_REQUEST = 2
RESOLVER_THREADS = 4
READ_TIMEOUT = 10.0  # seconds one socket operation may block, at most
_FETCH_POOL = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="image-fetch")
_RESOLVER_POOL = ThreadPoolExecutor(max_workers=RESOLVER_THREADS, thread_name_prefix="image-resolve")
_CHUNK = 64 * 1024


def _image_parts(body: dict) -> list[tuple[dict, str]]:
    """(part, key of its URL) of every image part of a chat request's ``messages`` or a Responses
    request's ``input`` items; a chat part's URL is under ``image_url.url`` (or ``image_url``)."""
    found = []
    items = [item for key in ("messages", "input") if isinstance(body.get(key), list) for item in body[key]]
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        for part in content if isinstance(content, list) else []:
            if not isinstance(part, dict) or part.get("type") not in ("image_url", "input_image"):
                continue
            holder = part.get("image_url")
            if isinstance(holder, dict):
                found.append((holder, "url"))
            else:
                found.append((part, "image_url"))
    return found


def _is_http(url) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


async def fetch_image_urls(body: dict, limits: ServeLimits) -> dict:
    """Fetch the request's http(s) image URLs (see the module doc); without any, `body` itself.

    Args:
        body: the request's JSON body (not changed: the URLs are replaced in a copy).
        limits: the server's limits (``allow_image_urls``, ``image_fetch_timeout``,
            ``max_image_bytes``, ``max_images``).

    Returns:
        The body to serve, each fetched URL replaced by a base64 data URL.

    Raises:
        ServeRequestError: more images than ``limits.max_images``; a URL that cannot be fetched
            (the message names the error), one not fetched within ``limits.image_fetch_timeout``
            seconds, or one over ``limits.max_image_bytes``.
    """
    if not limits.allow_image_urls:
        return body  # the policy refuses them, naming the option
    parts = _image_parts(body)
    check_image_count(len(parts), limits)
    wanted = [(holder, key) for holder, key in parts if _is_http(holder.get(key))]
    if not wanted:
        return body
    body = copy.deepcopy(body)  # strings are shared, not copied
    parts = [(holder, key) for holder, key in _image_parts(body) if _is_http(holder.get(key))]
    deadline = time.monotonic() + limits.image_fetch_timeout
    slots = asyncio.Semaphore(FETCHES_PER_REQUEST)
    tasks = [asyncio.ensure_future(_fetch(holder[key], deadline, limits, slots)) for holder, key in parts]
    try:
        fetched = await asyncio.gather(*tasks)
    finally:  # one failed: the others stop now, their connections shut down
        for task in tasks:
            task.cancel()
    for (holder, key), data in zip(parts, fetched):
        holder[key] = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
    return body


async def _fetch(url: str, deadline: float, limits: ServeLimits, slots: asyncio.Semaphore) -> bytes:
    loop = asyncio.get_running_loop()
    fetch = _Fetch(url, deadline, limits.max_image_bytes)

    async def run() -> bytes:
        async with slots:
            return await loop.run_in_executor(_FETCH_POOL, fetch.read)

    try:
        return await asyncio.wait_for(run(), max(deadline - time.monotonic(), 0.0))
    except (asyncio.TimeoutError, TimeoutError) as err:
        raise ServeRequestError(
            f"image URL {url[:100]!r} was not fetched within {limits.image_fetch_timeout:g} s (--image-fetch-timeout)"
        ) from err
    except ServeRequestError:
        raise
    except (OSError, ValueError, http.client.HTTPException) as err:  # URLError, HTTPError, refused, bad URLs
        raise ServeRequestError(f"cannot fetch image URL {url[:100]!r}: {err}") from err
    finally:
        fetch.abort()  # a worker still reading stops now


class _Fetch:
    """One URL's fetch: `read` runs in a worker thread; `abort` (from the event loop) shuts its
    connections down, so a blocked read returns at once."""

    def __init__(self, url: str, deadline: float, max_bytes: int):
        self.url, self.deadline, self.max_bytes = url, deadline, max_bytes
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._aborted = False

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            for sock in self._sockets:
                try:  # the plain socket's shutdown, also under TLS: it wakes a blocked read
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

    def left(self) -> float:
        """Seconds one socket operation may take now: the time left, at most READ_TIMEOUT."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 or self._aborted:
            raise TimeoutError("the deadline passed")
        return min(remaining, READ_TIMEOUT)

    def connect(self, address, timeout, source_address=None) -> socket.socket:
        """`socket.create_connection`, its name resolved within the deadline (see the module doc)."""
        host, port = address
        try:
            ipaddress.ip_address(host)
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except ValueError:  # a name
            lookup = _RESOLVER_POOL.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
            try:
                infos = lookup.result(timeout=self.left())
            except FutureTimeoutError:
                lookup.cancel()
                raise TimeoutError(f"resolving {host!r} took past the deadline") from None
        error: OSError = OSError(f"no address for {host!r}")
        for family, kind, proto, _, sockaddr in infos:
            sock = socket.socket(family, kind, proto)
            with self._lock:
                if self._aborted:
                    sock.close()
                    raise TimeoutError("the deadline passed")
                self._sockets.append(sock)
            try:
                sock.settimeout(self.left())
                if source_address:
                    sock.bind(source_address)
                sock.connect(sockaddr)
                return sock
            except OSError as err:
                error = err
                sock.close()
        raise error

    def read(self) -> bytes:
        """The bytes at the URL, read until the deadline (monotonic seconds)."""
        fetch = self

        class Connection(http.client.HTTPConnection):
            def connect(self):
                self._create_connection = fetch.connect
                super().connect()

        class SecureConnection(http.client.HTTPSConnection):
            def connect(self):
                self._create_connection = fetch.connect
                super().connect()
                with fetch._lock:
                    fetch._sockets.append(self.sock)  # the TLS socket the response reads from

        class Plain(urllib.request.HTTPHandler):
            def http_open(self, req):
                return self.do_open(Connection, req)

        class Secure(urllib.request.HTTPSHandler):
            def https_open(self, req):
                return self.do_open(SecureConnection, req, context=self._context)

        opener = urllib.request.OpenerDirector()  # http(s) only: a redirect to file: or ftp: is refused
        for handler in (Plain(), Secure(), urllib.request.HTTPRedirectHandler(),
                        urllib.request.HTTPErrorProcessor(), urllib.request.HTTPDefaultErrorHandler()):
            opener.add_handler(handler)
        data = bytearray()
        try:
            try:
                response = opener.open(self.url, timeout=self.left())
            except urllib.error.URLError as err:  # urllib wraps a deadline hit while connecting
                if isinstance(err.reason, TimeoutError):
                    raise TimeoutError(f"the deadline passed while connecting ({err.reason})") from None
                raise
            with response:
                while True:
                    with self._lock:
                        for sock in self._sockets:  # each read: at most the time left
                            if sock.fileno() != -1:
                                sock.settimeout(self.left())
                    chunk = response.read1(_CHUNK)
                    if not chunk:
                        if self._aborted:  # a shut-down read ends early: not the whole image
                            raise TimeoutError("the deadline passed")
                        return bytes(data)
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise ServeRequestError(
                            f"image URL {self.url[:100]!r} sends more than max_image_bytes={self.max_bytes} bytes "
                            "(--max-image-bytes)"
                        )
        finally:
            with self._lock:
                self._sockets.clear()  # closed with the response: never shut down a reused descriptor
