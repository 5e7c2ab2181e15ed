"""The tokenizer of a model folder, as the router and the reference engine load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What the tokenizers of the supported models are read from: a fast tokenizer's JSON,
# SentencePiece, byte-level BPE (vocab.json with merges.txt), WordPiece, Mistral's tekken.
FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tekken.json")


def tokenizer_problem(folder: str | Path, flag: str = "--model") -> str:
    """What to do about folder `folder` when it holds none of the tokenizer files, else ""
    (also when it is no folder: the caller says that)."""
    path = Path(folder)
    if not path.is_dir() or any((path / name).is_file() for name in FILES):
        return ""
    if next(path.glob("*.tiktoken"), None):
        return ""
    return (
        f"{flag} {folder} has no tokenizer files (one of {', '.join(FILES)}): its prompts "
        "would encode to no tokens; copy them from the model's repository into the folder"
    )


def load_tokenizer(folder: str | Path, flag: str = "--model") -> Any:
    """AutoTokenizer of `folder`; ValueError naming `flag` when the folder has no tokenizer
    files or the tokenizer has no vocabulary besides its special tokens (transformers builds
    one from a folder without them, silently, for some classes: every prompt then encodes to
    no tokens; for others it fails on a missing converter)."""
    if problem := tokenizer_problem(folder, flag):
        raise ValueError(problem)
    try:
        tokenizer = _tokenizer_class(folder).from_pretrained(folder)
    except (OSError, ValueError) as exc:  # (transformers' words, then what to do)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{flag} {folder}: its tokenizer cannot be read ({first}): copy the model "
            "repository's tokenizer files into the folder"
        ) from exc
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ValueError(
            f"{flag} {folder}: its tokenizer ({type(tokenizer).__name__}) has no vocabulary "
            "besides its special tokens, its prompts would encode to no tokens: copy the "
            "model repository's tokenizer files into the folder"
        )
    return tokenizer


def _tokenizer_class(folder: str | Path) -> Any:
    """The class that reads `folder`'s tokenizer: `TokenizersBackend` when its
    tokenizer_config.json names it (a tokenizer.json read as it is), else `AutoTokenizer`.
    AutoTokenizer reads the model's config to choose, which imports its configuration
    class and torch with it: ~3 s of CPU at each start of a service that only tokenizes."""
    import json

    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and config.get("tokenizer_class") == "TokenizersBackend":
        from transformers import TokenizersBackend

        return TokenizersBackend
    from transformers import AutoTokenizer

    return AutoTokenizer


def vocabulary_problem(model: str | Path, other: str | Path, flag: str) -> str:
    """Why model folder `other` (given by `flag`) does not share `model`'s token ids ("" when
    it does, as far as can be told): their tokenizers map a token to another id, or (a folder
    without tokenizer files) `other` has fewer ids than `model` (a larger vocab_size may be
    the same tokenizer's, padded)."""
    import json

    if tokenizer_problem(model) or tokenizer_problem(other, flag):
        try:
            mine, theirs = (
                json.loads((Path(p) / "config.json").read_text())["vocab_size"]
                for p in (model, other)
            )
        except (OSError, ValueError, KeyError):  # (the model's load names it)
            return ""
        if theirs >= mine:
            return ""
        differ = f"its vocab_size is {theirs}, fewer than --model's {mine}"
    else:
        mine, theirs = (
            load_tokenizer(p, f).get_vocab() for p, f in ((model, "--model"), (other, flag))
        )
        if mine == theirs:
            return ""
        differ = f"its tokenizer is not --model's ({len(theirs)} tokens, --model's {len(mine)})"
    return (
        f"{flag} {other}: {differ}: it would score token ids that stand for other text than "
        "the samples', and whatever it gives would be meaningless; give a model of --model's "
        "tokenizer (usually the starting weights of --model)"
    )
