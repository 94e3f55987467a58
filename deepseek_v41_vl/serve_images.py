"""The http(s) image URLs of a request (``--allow-image-urls``), fetched by `deepseek-v41-vl serve`
before the request is rendered: off the event loop, so a slow server holds up only its own
request, and within ``--image-fetch-timeout`` seconds for the whole fetch (not per read). Each URL
becomes a base64 data URL of its bytes, so the processor never opens a connection itself.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .serve_policy import ServeLimits, ServeRequestError, check_image_count

# fetches run here; each ends by its deadline plus one read's timeout, so the pool drains
_FETCH_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="image-fetch")
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
    fetched = await asyncio.gather(*(_fetch(holder[key], deadline, limits) for holder, key in parts))
    for (holder, key), data in zip(parts, fetched):
        holder[key] = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
    return body


async def _fetch(url: str, deadline: float, limits: ServeLimits) -> bytes:
    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(_FETCH_THREADS, _read_url, url, deadline, limits.max_image_bytes)
    try:
        return await asyncio.wait_for(work, max(deadline - time.monotonic(), 0.0))
    except (asyncio.TimeoutError, TimeoutError) as err:
        raise ServeRequestError(
            f"image URL {url[:100]!r} was not fetched within {limits.image_fetch_timeout:g} s (--image-fetch-timeout)"
        ) from err
    except ServeRequestError:
        raise
    except (OSError, ValueError) as err:  # URLError, HTTPError, refused connections, bad URLs
        raise ServeRequestError(f"cannot fetch image URL {url[:100]!r}: {err}") from err


def _opener() -> urllib.request.OpenerDirector:
    """http(s) only: a redirect to ``file:`` or ``ftp:`` is refused like any other scheme."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.HTTPHandler, urllib.request.HTTPSHandler, urllib.request.HTTPRedirectHandler,
                    urllib.request.HTTPErrorProcessor, urllib.request.HTTPDefaultErrorHandler):
        opener.add_handler(handler())
    return opener


def _read_url(url: str, deadline: float, max_bytes: int) -> bytes:
    """The bytes at `url`, read in a worker thread until `deadline` (monotonic seconds)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no time left")
    data = bytearray()
    with _opener().open(url, timeout=remaining) as response:
        while time.monotonic() < deadline:
            chunk = response.read1(_CHUNK)
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > max_bytes:
                raise ServeRequestError(
                    f"image URL {url[:100]!r} sends more than max_image_bytes={max_bytes} bytes (--max-image-bytes)"
                )
    raise TimeoutError("the deadline passed")
