"""The served model's tokenizer in the local Hugging Face cache, under the name clients look it up by.

`SamplingClient.get_tokenizer()` (and tinker-cookbook's `get_tokenizer(model_name)`) call
`AutoTokenizer.from_pretrained(<served model name>)`: a Hub lookup, which fails offline and for names
that are not on the Hub, such as `loraplex/tiny`. When the server starts, it files the model directory's
tokenizer files into the Hugging Face cache as a snapshot of that repo id, so a client on the same machine
(same user, same HF_HOME) finds them there; transformers falls back to the cache when the Hub cannot be
reached, or reads it directly with HF_HUB_OFFLINE=1. A cache entry that already exists is never touched.
A client on another machine needs `--model-name` to be the served model's Hub id (docs/OPERATIONS.md).
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

from huggingface_hub import constants

from loraplex.durable import write_directory_atomically

# Everything a tokenizer loads; never the weights.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "config.json",
)
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def offer_tokenizer(model_dir: Path, repo_id: str, cache_dir: Path | None = None) -> Path | None:
    """File `model_dir`'s tokenizer files as the cached `main` snapshot of model repo `repo_id`; return the
    snapshot directory, or None if `repo_id` is no Hub id or the cache already has that repo."""
    if not _REPO_ID.fullmatch(repo_id):
        return None
    repo = Path(cache_dir or constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    if repo.exists():
        return None
    files = [model_dir / name for name in _TOKENIZER_FILES if (model_dir / name).is_file()]
    revision = hashlib.sha1(b"".join(path.read_bytes() for path in files)).hexdigest()

    def fill(staging: Path) -> None:
        snapshot = staging / "snapshots" / revision
        snapshot.mkdir(parents=True)
        for path in files:
            shutil.copyfile(path, snapshot / path.name)
        (staging / "refs").mkdir()
        (staging / "refs" / "main").write_text(revision)

    write_directory_atomically(repo, fill, replace=False)  # a racing server's copy is as good as ours
    return repo / "snapshots" / revision
