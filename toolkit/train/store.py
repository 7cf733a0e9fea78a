"""The answer store: the target's own answers to many prompts, as compact token ids on disk, appendable and resumable.

A folder holds `index.json` (format, id dtype, what generated the answers, the list of shards) and shards: `NNNNN.bin`,
the token ids of prompt + answer back to back (uint16 when the vocabulary fits, else int32), and `NNNNN.json`, the
shard's small index: prompt hash -> [offset, length, answer start, category], plus the shard's token count. A batch
is appended by writing its ids to the current shard and then replacing the shard's JSON atomically, so a run cut
off at any point leaves a consistent store (ids past the JSON's count are dropped on the next open) and a later run
skips every prompt already answered. Generation can thus be split over several device calls.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..core import files
from ..core.errors import ToolkitError
from ..core.folders import atomic_file

FORMAT = 1
SHARD_TOKENS = 1 << 22             # ~4M ids a shard (8 MB as uint16): its JSON stays small to rewrite per batch
TOKENS = files.Num(0, 2**40, "tokens", whole=True)   # a shard's token count and its rows' offsets and lengths


def prompt_key(text: str) -> str:
    """The store's key of a prompt: the first 16 hex digits of its text's sha256."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def item_key(prompt) -> str:
    """The store's key of a Prompt: its text's key, or for a message with earlier turns, the key of the whole
    conversation (the same last message after other turns is another prompt)."""
    if not getattr(prompt, "context", ()):
        return prompt_key(prompt.text)
    return prompt_key(json.dumps([list(t) for t in prompt.context] + [prompt.text]))


def id_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def write_json(path: Path, obj) -> None:
    atomic_file(path, json.dumps(obj, separators=(",", ":")) + "\n")


def check_index(index, folder: Path) -> dict:
    """index.json of a store: its format, id dtype, meta and shard names, or one line naming what is wrong."""
    ok = (isinstance(index, dict) and index.get("dtype") in ("uint16", "int32") and isinstance(index.get("meta"), dict)
          and isinstance(index.get("shards"), list) and all(isinstance(n, str) and re.fullmatch(r"\d{5}", n)
                                                            for n in index["shards"]))
    if isinstance(index, dict) and index.get("format") != FORMAT:
        raise ToolkitError(f"{folder}: answer store format {index.get('format')!r} is not {FORMAT}")
    if not ok:
        raise ToolkitError(f"{folder / 'index.json'}: not an answer store index (format, dtype, meta, shards)")
    return index


def check_shard(shard, path: Path) -> dict:
    """A shard's JSON: {"tokens": N, "rows": {key: [offset, length, answer start, category]}}, consistent with N."""
    def row_ok(r) -> bool:
        return (isinstance(r, list) and len(r) == 4 and all(TOKENS.ok(x) for x in r[:3]) and isinstance(r[3], str)
                and r[0] + r[1] <= shard["tokens"] and r[2] <= r[1])
    if not (isinstance(shard, dict) and TOKENS.ok(shard.get("tokens"))
            and isinstance(shard.get("rows"), dict) and all(row_ok(r) for r in shard["rows"].values())):
        raise ToolkitError(f"{path}: not an answer store shard index (tokens, rows of [offset, length, start, category])")
    return shard


@dataclass
class Row:
    """One answered prompt: its key, prompt + answer ids, where the answer starts, its category.
    A prompt that was skipped (too long) is stored with no ids, so a resumed run skips it too."""

    key: str
    ids: list[int]
    start: int
    category: str


@dataclass
class Corpus:
    """Every stored sequence as one flat id array with offsets: 100k sequences stay a few hundred MB."""

    tokens: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray
    categories: list[str]
    keys: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.lengths)

    def row(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i] + self.lengths[i]]

    def answer_tokens(self) -> int:
        return int((self.lengths - self.starts).sum())

    def count(self, category: str) -> int:
        return sum(c == category for c in self.categories)

    def batch(self, rows, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ids [S, L] on `device`, and the rows' lengths and answer starts (CPU tensors)."""
        lengths = torch.as_tensor(self.lengths[rows], dtype=torch.long)
        x = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
        for r, i in enumerate(rows):
            x[r, : self.lengths[i]] = self.row(i)
        return torch.from_numpy(x).to(device), lengths, torch.as_tensor(self.starts[rows], dtype=torch.long)


class AnswerStore:
    """An answer store folder (see the module docstring). `meta` says what generated the answers; appending to a
    store made with other settings is refused, so one store never mixes two targets or two length limits."""

    def __init__(self, folder: str | Path, meta: dict | None = None, vocab_size: int | None = None,
                 shard_tokens: int = SHARD_TOKENS):
        self.folder, self.shard_tokens = Path(folder), shard_tokens
        index = self.folder / "index.json"
        if index.is_file():
            self.index = check_index(files.read_json(index, ""), self.folder)
            if meta is not None and self.index["meta"] != meta:
                diff = sorted(k for k in set(meta) | set(self.index["meta"]) if meta.get(k) != self.index["meta"].get(k))
                raise ToolkitError(f"{self.folder}: the stored answers were made with other settings ({', '.join(diff)}); "
                                   "use a new folder")
        elif meta is None or vocab_size is None:
            raise ToolkitError(f"{self.folder}: not an answer store (no index.json)")
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.index = {"format": FORMAT, "dtype": id_dtype(vocab_size), "meta": meta, "shards": []}
            write_json(index, self.index)
        self.dtype = np.dtype(self.index["dtype"])
        self.shards = {name: self.read_shard(name) for name in self.index["shards"]}

    @classmethod
    def exists(cls, folder: str | Path) -> bool:
        return (Path(folder) / "index.json").is_file()

    def read_shard(self, name: str) -> dict:
        path = self.folder / f"{name}.json"
        shard = check_shard(files.read_json(path), path) if path.is_file() else {"tokens": 0, "rows": {}}
        bin_path = self.folder / f"{name}.bin"
        if bin_path.is_file() and bin_path.stat().st_size > shard["tokens"] * self.dtype.itemsize:
            with open(bin_path, "r+b") as f:                # ids of a batch whose JSON was never written
                f.truncate(shard["tokens"] * self.dtype.itemsize)
        return shard

    def keys(self) -> set[str]:
        return {k for s in self.shards.values() for k in s["rows"]}

    def __len__(self) -> int:
        return sum(len(s["rows"]) for s in self.shards.values())

    def current(self) -> str:
        """The shard to append to, opening a new one when the last is full."""
        if not self.index["shards"] or self.shards[self.index["shards"][-1]]["tokens"] >= self.shard_tokens:
            name = f"{len(self.index['shards']):05d}"
            self.shards[name] = {"tokens": 0, "rows": {}}
            self.index["shards"].append(name)
            write_json(self.folder / "index.json", self.index)
        return self.index["shards"][-1]

    def append(self, rows: list[Row]) -> None:
        """Write a batch of answered prompts (ids first, then the shard's JSON, atomically)."""
        if not rows:
            return
        name = self.current()
        shard = {"tokens": self.shards[name]["tokens"], "rows": dict(self.shards[name]["rows"])}
        flat = np.concatenate([np.asarray(r.ids, dtype=np.int64) for r in rows])
        if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(self.dtype).max):
            raise ToolkitError(f"{self.folder}: token id outside {self.dtype} (vocabulary larger than the store's)")
        with open(self.folder / f"{name}.bin", "ab") as f:
            f.write(flat.astype(self.dtype).tobytes())
        for r in rows:
            shard["rows"][r.key] = [shard["tokens"], len(r.ids), r.start, r.category]
            shard["tokens"] += len(r.ids)
        write_json(self.folder / f"{name}.json", shard)
        self.shards[name] = shard

    def load(self, exclude: set[str] = frozenset(), min_answer: int = 2) -> Corpus:
        """Every stored sequence with an answer of at least `min_answer` ids, except the keys in `exclude`."""
        parts, offsets, lengths, starts, cats, keys, base = [], [], [], [], [], [], 0
        for name in self.index["shards"]:
            shard = self.shards[name]
            ids = np.fromfile(self.folder / f"{name}.bin", dtype=self.dtype, count=shard["tokens"])
            parts.append(ids)
            for key, (off, n, start, cat) in shard["rows"].items():
                if key not in exclude and n - start >= min_answer:
                    offsets.append(base + off)
                    lengths.append(n)
                    starts.append(start)
                    cats.append(cat)
                    keys.append(key)
            base += shard["tokens"]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)
        return Corpus(tokens, np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64),
                      np.asarray(starts, dtype=np.int64), cats, keys)
