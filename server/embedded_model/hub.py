"""Hugging Face hub ids (``Qwen/Qwen2.5-0.5B``) as local directories, failing fast when offline.

transformers resolves a hub id file by file and retries the network on each, which took minutes on
a machine without internet before the model was reported broken. Here the id is looked up in the
local Hugging Face cache first; otherwise one quick request says whether the Hub is reachable, and
only then is the snapshot downloaded (once, into the same cache).
"""

import os

from huggingface_hub import model_info, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

REACH_TIMEOUT_S = 10.0


def looks_like_hub_id(path: str) -> bool:
    """``owner/name`` that is not a path on this machine."""
    return (
        not path.startswith(("/", ".", "~"))
        and not os.path.exists(path)
        and path.count("/") == 1
        and all(path.split("/"))
    )


def local_path(path: str) -> str:
    """``path`` itself, or the local snapshot of a hub id."""
    return local_snapshot(path) if looks_like_hub_id(path) else path


def local_snapshot(repo_id: str) -> str:
    """The directory of ``repo_id``: cached, or downloaded now. Raises ValueError with what to do."""
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    advice = (f"download it where the Hub is reachable (`hf download {repo_id} --local-dir DIR`) and "
              f"give the directory as the model path")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"{repo_id!r} is not a local directory nor in the Hugging Face cache, and "
                         f"HF_HUB_OFFLINE is set: {advice}")
    try:
        model_info(repo_id, timeout=REACH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001  DNS, TLS, HTTP errors: all mean "cannot fetch it now"
        raise ValueError(f"{repo_id!r} is not a local directory nor in the Hugging Face cache, and the "
                         f"Hub cannot be reached ({type(exc).__name__}: {exc}): {advice}") from None
    return snapshot_download(repo_id)
