"""Where prepare reads from: the Hugging Face hub or a local mirror folder in the hub's layout.

One rule for a missing network: fail fast with one line. Before any download, :func:`check_hub`
makes one HEAD request to the endpoint (``$HF_ENDPOINT``, default https://huggingface.co) with a
short timeout, so an offline machine gets ``cannot reach https://huggingface.co (...)`` after at
most ``PROBE_TIMEOUT_S`` seconds instead of the libraries' retries and tracebacks; with
``HF_HUB_OFFLINE=1`` set it says so without trying. A mirror (``--mirror DIR``) is read as
``DIR/<repo id>`` and never touches the network.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from hacrl_megatron.errors import InputError, one_line_text

DEFAULT_ENDPOINT = "https://huggingface.co"
PROBE_TIMEOUT_S = 5.0
_TRUE = ("1", "true", "yes", "on")


class HubError(InputError):
    """The hub cannot be reached, or a repository or file is missing; one line, exit status 2."""


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``HF_DATASETS_OFFLINE`` for datasets) asks for no network at all."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def check_hub(timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`HubError` unless the hub endpoint answers (any HTTP status counts as an answer)."""
    url = endpoint()
    if offline():
        raise HubError(f"HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set, so nothing is downloaded from {url}: "
                       "unset it on a connected machine, or pass --mirror DIR (a local copy in the hub's layout)")
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # the server answered
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise HubError(f"cannot reach {url} ({reason}); check the network or proxy (HTTPS_PROXY), "
                       "set HF_ENDPOINT to a hub mirror, or pass --mirror DIR (a local copy in the hub's layout)") from None


def mirror_repo(mirror: str | os.PathLike, repo_id: str) -> Path:
    """``<mirror>/<repo id>``, which must exist (HubError naming it otherwise)."""
    path = Path(mirror).expanduser() / repo_id
    if not path.is_dir():
        raise HubError(f"--mirror {mirror}: no folder {path} for {repo_id} (expected the hub repository's files there)")
    return path


def one_line(err: BaseException) -> str:
    """An exception from huggingface_hub/datasets/requests as one line (their messages span several)."""
    text = one_line_text(str(err))
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
