"""Where a checkpoint argument points: a local directory, or a Hugging Face hub repo id resolved
through huggingface_hub's cache (offline first; no remote code is ever fetched or run)."""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from moe_jax.errors import CheckpointError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken"]


def resolve_source(src: str | Path) -> Path:
    """A local checkpoint directory, or the snapshot directory of hub repo `org/name`: from the
    local cache, else downloaded (weights, configs and tokenizer files only)."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{src}: not a directory (expected a checkpoint directory or a hub repo id)")
    text = str(src)
    if not REPO_ID.match(text) or text.startswith((".", "/")) or ".." in text:
        raise CheckpointError(f"{src}: no such directory (and not a hub repo id of the form org/name)")
    try:
        return Path(snapshot_download(text, allow_patterns=PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(
            f"{src}: no such directory, and not in the local hub cache ({cache}); "
            f"HF_HUB_OFFLINE is set, so it was not downloaded"
        )
    try:
        return Path(snapshot_download(text, allow_patterns=PATTERNS))
    except GatedRepoError:
        raise CheckpointError(f"{src}: a gated hub repo: accept its terms and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{src}: no such directory, and no such hub repo (or it is private: log in with `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{src}: the hub repo has no revision 'main'") from None
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{src}: no such directory, not in the local hub cache ({cache}), and the hub cannot be reached (offline?)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{src}: download from the hub failed ({type(e).__name__}: {e})") from None
