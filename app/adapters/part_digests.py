"""A file's digest as one SHA-256 per part, the node cache's record of what it downloaded.

A download fetches a file in ranged parts, in any order and on several threads, so no single running hash
sees its bytes in order; each part is hashed as it arrives instead, and the file's digest is recorded without
reading it again. Checking a file against its digests reads it once.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path


def part_hasher():
    """The running hash of one part, fed its bytes as they arrive."""
    return hashlib.sha256()


def part_digest(data: bytes) -> str:
    hasher = part_hasher()
    hasher.update(data)
    return hasher.hexdigest()


@dataclass(frozen=True)
class PartDigests:
    size: int
    part_bytes: int
    sha256: tuple[str, ...]  # hex, of bytes [i * part_bytes, (i + 1) * part_bytes) for each part i in order

    def __post_init__(self):
        if self.size < 0 or self.part_bytes < 1 or len(self.sha256) != -(-self.size // self.part_bytes):
            raise ValueError(f"{len(self.sha256)} part digests for {self.size} bytes in parts of {self.part_bytes}")

    def to_json(self) -> dict:
        return {"size": self.size, "part_bytes": self.part_bytes, "sha256": list(self.sha256)}

    @classmethod
    def from_json(cls, data: dict) -> PartDigests:
        return cls(int(data["size"]), int(data["part_bytes"]), tuple(str(d) for d in data["sha256"]))

    def mismatch(self, path: Path) -> str | None:
        """Why the file at `path` is not the one these digests describe; None where it is."""
        size = path.stat().st_size
        if size != self.size:
            return f"{path.name} is {size} bytes, {self.size} recorded"
        with open(path, "rb") as f:
            for i, expected in enumerate(self.sha256):
                if part_digest(f.read(self.part_bytes)) != expected:
                    start = i * self.part_bytes
                    return f"bytes {start}-{min(start + self.part_bytes, size)} of {path.name} differ from their digest"
        return None


def file_digests(path: Path, part_bytes: int) -> PartDigests:
    """The digests of a file written without them (read once)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        parts = tuple(part_digest(f.read(part_bytes)) for _ in range(0, size, part_bytes))
    return PartDigests(size, part_bytes, parts)
