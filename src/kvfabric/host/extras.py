"""Optional dependencies: which `pip install 'kvfabric[extra]'` brings each one.

The core package (the cache engine, its tiers, the vLLM and SGLang connectors, server mode and the cluster) needs
none of these, so that it installs beside an inference engine's own pins. They are imported where they are used,
never at kvfabric's import; a command that needs a missing one ends with `missing_extra`'s line.
"""
from __future__ import annotations

from dataclasses import dataclass

EXTRAS = {  # top-level module -> the extra that installs it
    "transformers": "hf", "accelerate": "hf", "gguf": "hf",  # the reference engine, the demo, model set-up
    "constriction": "cachegen",  # CacheGen's arithmetic coder
    "av": "video",  # KVFetcher's video codec
    "matplotlib": "plot",  # benchmark plots
    "cryptography": "security",  # sealed chunks (AEAD) and `bench p2p --tls`'s throw-away certificate
}


@dataclass(frozen=True, slots=True)
class MissingExtra:
    module: str
    extra: str

    def __str__(self) -> str:
        return (f"this needs the optional package {self.module!r}, not installed here: "
                f"pip install 'kvfabric[{self.extra}]' (or 'kvfabric[all]')")


def missing_extra(exc: BaseException) -> MissingExtra | None:
    """The optional dependency whose absence raised `exc` (a ModuleNotFoundError), or None for anything else."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    module = exc.name.split(".")[0]
    return MissingExtra(module, EXTRAS[module]) if module in EXTRAS else None
