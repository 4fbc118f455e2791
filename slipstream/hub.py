"""Reaching the Hugging Face Hub: is there a network, and is a hub id already cached?

Offline, `transformers` and `huggingface_hub` retry each request with back-off before they
give up: 49-58 s for one tokenizer (measured: HF_ENDPOINT at a closed local port, 2-core
machine), and their error then reads like a bad id. So before a hub id is fetched we decide
once, in at most a few seconds, whether the hub can be reached: `HF_HUB_OFFLINE` (or
`TRANSFORMERS_OFFLINE`) set means no, else one TCP connect to the endpoint's host with a
3 s timeout (skipped behind a proxy, which a direct connect cannot judge). Offline, a cached
repo is loaded from the cache (`local_files_only`); an uncached one is a one-line error that
says there is no network and names the offline choice.

No torch or transformers import here: the CLI checks paths before either loads.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from functools import lru_cache
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 3.0
OFFLINE_CHOICE = (
    "use model.path=smollm2-demo (built in, works offline), a local folder or .gguf file, "
    "or connect and retry"
)


def _endpoint() -> tuple[str, bool]:
    from huggingface_hub import constants

    return constants.ENDPOINT, bool(constants.HF_HUB_OFFLINE)


def offline_reason() -> str | None:
    """Why the hub cannot be reached (`HF_HUB_OFFLINE`, or the connect error), or None."""
    return _offline_reason(*_endpoint())


@lru_cache(maxsize=4)
def _offline_reason(endpoint: str, offline: bool) -> str | None:
    if offline:
        return "HF_HUB_OFFLINE is set"
    url = urlsplit(endpoint)
    if url.scheme in urllib.request.getproxies() or not url.hostname:
        return None  # behind a proxy a direct connect proves nothing: let the hub answer
    port = url.port or (443 if url.scheme == "https" else 80)
    error: list[str] = []

    def connect() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:  # refused, unreachable, no DNS, timed out
            error.append(e.strerror or type(e).__name__)

    # A thread bounds the DNS lookup too, which the socket timeout does not cover.
    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(CONNECT_TIMEOUT_S + 1.0)
    if probe.is_alive():
        return f"no answer from {endpoint} within {CONNECT_TIMEOUT_S + 1.0:.0f} s"
    return f"cannot reach {endpoint}: {error[0]}" if error else None


def is_cached(repo_id: str) -> bool:
    """Does the local hub cache hold a snapshot of this model repo (config or tokenizer)?"""
    from huggingface_hub import try_to_load_from_cache

    files = ("config.json", "tokenizer_config.json")
    return any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in files)


def hub_files_only(repo_id: str, what: str) -> bool:
    """Before fetching `repo_id`: True when offline with the repo cached (load with
    `local_files_only=True`), False when the hub can be asked; a ValueError when offline
    and not cached, saying so."""
    reason = offline_reason()
    if reason is None:
        return False
    if is_cached(repo_id):
        return True
    raise ValueError(
        f"{what}: '{repo_id}' is a hub id, but the hub cannot be reached (no network: "
        f"{reason}) and it is not in the local cache; {OFFLINE_CHOICE}"
    )


def no_network_error(message: str) -> bool:
    """Is an error from transformers/huggingface_hub a failure to connect (not a bad id)?"""
    text = message.lower()
    return "couldn't connect" in text or "offline mode" in text or "connection" in text


def hub_error(what: str, source: str, kind: str, e: Exception) -> ValueError:
    """One line for a hub id that did not load: no network (said so), or the hub's answer."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if no_network_error(str(e)):
        return ValueError(
            f"{what}: '{source}' is a hub id, but the hub cannot be reached (no network: "
            f"{first}); {OFFLINE_CHOICE}"
        )
    return ValueError(
        f"{what}: '{source}' is no local path, and the hub gave no {kind} by that id ({first})"
    )
