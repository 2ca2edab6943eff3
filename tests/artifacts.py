"""Files a test keeps for people to look at (a screenshot, a plot): copied into `KVFABRIC_TEST_ARTIFACTS` (default
`build/test-artifacts` in the repository, ignored by git), where they survive pytest's tmp-dir clean-up."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def keep_artifact(path: Path) -> Path:
    """Copies `path` into the artifact folder; returns the kept copy's path."""
    folder = Path(os.environ.get("KVFABRIC_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(path, folder / path.name))
