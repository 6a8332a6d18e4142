"""Where the source checkout is, found the same way wherever a test module sits under tests/."""

from __future__ import annotations

from pathlib import Path


def _repo_root() -> Path:
    """The checkout root: the nearest folder above this file holding setup.py and the bitmtp package."""
    for folder in Path(__file__).resolve().parents:
        if (folder / "setup.py").is_file() and (folder / "bitmtp").is_dir():
            return folder
    raise RuntimeError(f"no setup.py above {__file__}: run the tests from a source checkout")


#: the repository root (holds setup.py, bitmtp/, tests/)
REPO_ROOT = _repo_root()
