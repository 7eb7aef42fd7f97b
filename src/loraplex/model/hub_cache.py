"""The built-in tiny model's tokenizer in the local Hugging Face cache, under the name clients look it up by.

`SamplingClient.get_tokenizer()` (and tinker-cookbook's `get_tokenizer(model_name)`) call
`AutoTokenizer.from_pretrained(<served model name>)`: a Hub lookup, which fails offline and for names
that are not on the Hub, such as `loraplex/tiny`. When a server of the built-in model starts, it files the
model's tokenizer files into the Hugging Face cache as a snapshot of `loraplex/tiny`, so a client on the
same machine (same user, same HF_HOME) finds them there; transformers falls back to the cache when the Hub
cannot be reached, or reads it directly with HF_HUB_OFFLINE=1. A cache entry that already exists is never
touched.

Only that name, which is ours, is ever filed: a snapshot filed under an operator's `--model-name` (a real
Hub id) would shadow that repository's own files in the cache, and break offline loads of its weights
(refs/main would name a snapshot holding tokenizer files only). Such a name's clients fetch the real
tokenizer from the Hub (docs/OPERATIONS.md).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from huggingface_hub import constants

from loraplex.durable import write_directory_atomically
from loraplex.model.tiny import TINY_MODEL_NAME

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


def offer_tiny_tokenizer(tiny_dir: Path, cache_dir: Path | None = None) -> Path | None:
    """File the built-in model's tokenizer files (from `tiny_dir`) as the cached `main` snapshot of
    `loraplex/tiny`; return the snapshot directory, or None if the cache already has that repo."""
    repo = Path(cache_dir or constants.HF_HUB_CACHE) / f"models--{TINY_MODEL_NAME.replace('/', '--')}"
    if repo.exists():
        return None
    files = [tiny_dir / name for name in _TOKENIZER_FILES if (tiny_dir / name).is_file()]
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
