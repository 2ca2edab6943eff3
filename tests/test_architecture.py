"""The map and the territory agree: the README's layer diagram, the architecture page's diagram and the
import-linter layers contract (pyproject.toml) name the same layers in the same order, and every package and
module of src/kvfabric is in one of them (kvfabric.data, the shipped data sets, is in none: only a forbidden
contract guards it). tests/test_layers.py checks that the code keeps to the contract."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```\n(.*?)^```", re.S | re.M)


def contract_layers() -> list[set[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (layers,) = [c["layers"] for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers"]
    return [{name.strip() for name in layer.split("|")} for layer in layers]


def diagram_layers(text: str) -> list[set[str]]:
    """The layers a diagram draws: each line that starts with a name (a folder/ or a module.py), siblings split by
    `|`; its description follows after two spaces."""
    found = []
    for line in text.splitlines():
        if not line or line[0] in " │─▼":
            continue
        names = re.split(r"\s{2,}", line.strip())[0]
        found.append({name.strip().removesuffix("/").removesuffix(".py") for name in names.split("|")})
    return found


def _block_after(path: Path, marker: str) -> str:
    text = path.read_text()
    return FENCE.search(text, text.index(marker)).group(1)


def test_the_readme_diagram_is_the_contract():
    assert diagram_layers(_block_after(ROOT / "README.md", "## Architecture")) == contract_layers()


def test_the_architecture_page_diagram_is_the_contract():
    assert diagram_layers(_block_after(ROOT / "docs" / "architecture.md", "# Architecture")) == contract_layers()


def test_every_package_and_module_is_in_a_layer():
    top = {p.stem for p in (ROOT / "src" / "kvfabric").iterdir()
           if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.stem != "__init__"}
    in_layers = set().union(*contract_layers())
    assert top - in_layers == {"data"}
    assert in_layers <= top


def test_a_layer_out_of_order_is_noticed():
    text = _block_after(ROOT / "README.md", "## Architecture")
    lines = text.splitlines()
    swapped = "\n".join([lines[1], lines[0], *lines[2:]])
    assert diagram_layers(swapped) != contract_layers()
