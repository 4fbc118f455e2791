"""Sending a staged folder to the Hub: `huggingface_hub`'s `create_repo` and `upload_folder`,
and every way that fails said in one line (ValueError: exit 2 in the CLI).

The token is huggingface_hub's own (`HF_TOKEN`, or the file `hf auth login` writes); it is
never read into, or written to, any file of ours. What can be checked without a network is
checked before anything slow (`check_push`: the repo id's form, a token, `HF_HUB_OFFLINE`),
then whether the endpoint answers at all (one TCP connect, `slipstream.hub`), so that a
missing token or network is said in seconds, not after a merge or a GGUF export.

No torch import here.
"""

from __future__ import annotations

from pathlib import Path

LOGIN = "run `hf auth login` or set HF_TOKEN (a write token: huggingface.co/settings/tokens)"
# Transport failures of the HTTP clients huggingface_hub has used (requests, httpx, httpx2),
# by class name: which one is installed depends on its version.
_NETWORK_ERRORS = {"ConnectError", "ConnectTimeout", "ConnectionError", "NetworkError",
                   "ProxyError", "ReadError", "ReadTimeout", "RemoteProtocolError", "Timeout",
                   "TimeoutException", "TransportError", "WriteError", "WriteTimeout"}  # fmt: skip


def check_repo_id(repo_id: str, what: str = "push") -> str:
    """`repo_id` when it has the Hub's form ("name" or "namespace/name"), else a one-line
    error saying what the form is."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
        ok = bool(repo_id) and not repo_id.startswith("/") and not repo_id.endswith("/")
    except HFValidationError:
        ok = False
    if not ok:
        raise ValueError(
            f"{what}: '{repo_id}' is not a Hub repo id: give NAME or NAMESPACE/NAME (letters, "
            "digits, '-', '_', '.'; at most 96 characters; no '--' or '..')"
        )
    return repo_id


def check_push(repo_id: str, what: str = "push") -> None:
    """What a push needs before it starts: a valid repo id, a token, offline mode off."""
    from huggingface_hub import constants, get_token

    check_repo_id(repo_id, what)
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{what}: HF_HUB_OFFLINE is set; unset it to push to the Hub")
    if not get_token():
        raise ValueError(f"{what}: no Hugging Face token found; {LOGIN}")


def check_reachable(what: str = "push") -> None:
    """A one-line error when the Hub's endpoint cannot be reached (a few seconds at most)."""
    from slipstream.hub import offline_reason

    reason = offline_reason()
    if reason is not None:
        raise ValueError(f"{what}: the Hub cannot be reached ({reason}); connect and retry")


def create(repo_id: str, *, private: bool = False, revision: str | None = None) -> str:
    """The repo's full id (NAMESPACE/NAME), created if new (`private` applies to a new one),
    with the branch `revision` made from main if it is not there."""
    from huggingface_hub import HfApi

    api = HfApi()  # reads HF_ENDPOINT and the token now, not at import
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        full_id = getattr(url, "repo_id", None) or repo_id
        if revision is not None and revision != "main":
            api.create_branch(full_id, branch=revision, exist_ok=True)
    except Exception as e:  # every failure of the hub's client, said in one line
        raise ValueError(push_error(e, repo_id)) from None
    return full_id


def send(folder: Path, repo_id: str, *, revision: str | None = None) -> tuple[str, str]:
    """`folder` uploaded whole in one commit; (repo url, commit url)."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision,
                                   commit_message="Upload with slipstream push")  # fmt: skip
    except Exception as e:  # every failure of the hub's client, said in one line
        raise ValueError(push_error(e, repo_id)) from None
    return f"{api.endpoint}/{repo_id}", str(getattr(commit, "commit_url", commit))


def push_error(e: BaseException, repo_id: str) -> str:
    """One line for a failed push: auth, network, repo id or the Hub's own answer."""
    from huggingface_hub.utils import HfHubHTTPError

    while not isinstance(e, HfHubHTTPError) and e.__cause__ is not None:
        e = e.__cause__  # "Error while uploading X" wraps the HTTP error that says why
    if isinstance(e, HfHubHTTPError) and getattr(e, "response", None) is not None:
        status = e.response.status_code
        said = _server_said(e)
        if status == 401:
            return f"push: the Hub refused the token (401: {said}); {LOGIN}"
        if status == 403:
            return (f"push: the token may not write to '{repo_id}' (403: {said}); use a write "
                    "token, or a namespace it can write to")  # fmt: skip
        if status in (400, 404, 409, 422) and "revision" not in said.lower():
            return f"push: the Hub rejected the repo id '{repo_id}' ({status}: {said})"
        return f"push: the Hub answered {status} ({said})"
    if _is_network_error(e):
        from huggingface_hub import constants

        return f"push: cannot reach {constants.ENDPOINT} ({_first_line(e)}); connect and retry"
    return f"push: {type(e).__name__}: {_first_line(e)}"


def _is_network_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return isinstance(e, ConnectionError | TimeoutError) or bool(names & _NETWORK_ERRORS)


def _server_said(e: BaseException) -> str:
    said = getattr(e, "server_message", None)
    return _first_line(said) if said else _first_line(e)


def _first_line(e: object) -> str:
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
