"""A device's MLP groups written group-major in kernel form: one group is one contiguous read.

HALO mode re-maps MLP groups per token; a memory-bounded device (halo/compute/group_cache.py) builds a group again when a
ranking needs one it no longer holds. From the model file that means gathering the group's W_gate and W_up rows
and W_down columns (strided across the file) and restating them in MatMulNBits terms (nibble repacking, scale
conversion, or quantizing float32 to int8): nearly all of the time a compact group takes to make.
`halo-agent prepare` does that once per device and format and writes every group's kernel arrays (codes, scales,
offsets; exactly what the kernels would be given) one after the other into `groups.bin`, with a manifest that
names the model (sha256), the format, the group size and every array's shape; a bank then holds a group as the
bytes of one read (or builds its onnxruntime kernels from them).

    halo-agent prepare --model MODEL --weights native     (writes <cache>/prepared/<sha>-<format>-g<size>/)

The agent finds the prepared groups of its model, format and group size by themselves (`find_prepared`); a
stale or damaged directory is refused with what to run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from halo.compute.linear import DequantKernel, KernelProjection, KernelSpec, packed_shape
from halo.compute.neuron_groups import CompactMlpGroup, GroupLayout, MlpShard, mlp_group_kernels
from halo.errors import ConfigError
from halo.host.cache import as_if_created
from halo.host.memory import BufferPool, own_pages
from halo.model.weights import ModelWeights

VERSION = 5  # 2: arrays block-major (a compact group is the read buffer itself); 3: rows last (halo/_nbits.c);
# 4: codes rows next to last in 4-byte words (halo/_nbits.c's integer dot products); 5: one packed array per kernel
# in 16-row tiles, scales float16 where exact (linear.pack)


def prepared_dir(sha256: str, fmt: str, group_size: int) -> Path:
    from halo.host.cache import cache_subdir

    return cache_subdir("prepared", "HALO_PREPARED_DIR") / f"{sha256[:16]}-{fmt}-g{group_size}"


@dataclass(frozen=True)
class KernelForm:
    """Rows of a matrix already in MatMulNBits terms (a prepared group's bytes): what a kernel is filled with."""

    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.codes), self.k)

    def __getitem__(self, rows: slice) -> "KernelForm":
        return KernelForm(self.codes[rows], self.scales[rows], None if self.offsets is None else self.offsets[rows],
                          self.k)


def _fill_from_form(rows: KernelForm, codes, scales, offsets) -> None:
    codes[:], scales[:] = rows.codes, rows.scales
    if offsets is not None:
        offsets[:] = rows.offsets


PREPARED_FILES = ("manifest.json", "groups.bin")  # all a prepared directory holds: the one thing prepare replaces


def prepare(weights: ModelWeights, sha256: str, fmt: str, layout: GroupLayout, out: Path | None = None,
            progress=None) -> Path:
    """Write every MLP group of every layer in kernel form (see the module docstring); returns the directory.
    progress(done, total) after each layer. Written under a temporary name and renamed: never half a directory."""
    out = (out or prepared_dir(sha256, fmt, layout.mlp_group_size)).resolve()  # ("." has no name to add to)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: give a new or empty directory")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in PREPARED_FILES) if out.is_dir() else []
    if foreign:  # prepare replaces the directory whole: never over somebody's files
        raise ConfigError(f"{out} holds files prepare did not write ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}): give a new or empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    # a name of its own (two prepares at once shared one partial: a groups.bin of the right size and the wrong bytes
    # went in), removed if anything stops it (Ctrl-C left tens of MB)
    partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    try:
        as_if_created(partial, directory=True)
        at, groups = _write_groups(weights, fmt, layout, partial / "groups.bin", progress)
        c = weights.config
        manifest = {"version": VERSION, "model_sha256": sha256, "format": fmt, "mlp_group_size": layout.mlp_group_size,
                    "n_layers": c.n_layers, "n_mlp_groups": layout.n_mlp_groups, "dim": c.dim, "bytes": at,
                    "source": str(weights.source), "groups": groups}
        (partial / "manifest.json").write_text(json.dumps(manifest))
        if not out.is_dir():
            try:
                os.replace(partial, out)
                return out
            except OSError:
                if not out.is_dir():
                    raise  # (else another prepare made it meanwhile: its files are replaced below)
        # empty, or prepare's own: its files replaced, the manifest (what makes it valid) last
        (out / "manifest.json").unlink(missing_ok=True)
        for name in PREPARED_FILES[::-1]:
            os.replace(partial / name, out / name)
        partial.rmdir()
        return out
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_groups(weights: ModelWeights, fmt: str, layout: GroupLayout, path: Path, progress) -> tuple[int, list]:
    """Every MLP group's kernels into `path`, group-major: (bytes written, the manifest's group entries)."""
    groups, at = [], 0
    c = weights.config
    with open(path, "wb") as f:
        for layer in range(c.n_layers):
            for g in range(layout.n_mlp_groups):
                entry = {"offset": at, "kernels": []}
                for projection in mlp_group_kernels(weights.layers[layer], layout, g, fmt):
                    kernel = projection.kernels[0]
                    packed = DequantKernel.copy_of(kernel)
                    spec = kernel.spec
                    entry["kernels"].append({"k": kernel.k, "n": kernel.n, "outputs": [[s.start, s.stop] for s in
                                                                                      projection.outputs],
                                             "spec": [spec.bits, spec.block, spec.with_offsets, spec.accuracy_level,
                                                      spec.split_activations],
                                             "scale_dtype": str(packed.scale_dtype),
                                             "arrays": [["packed", list(packed.packed.shape), "uint8"]]})
                    f.write(packed.packed.tobytes())
                    at += packed.nbytes
                    kernel.release()
                entry["bytes"] = at - entry["offset"]
                groups.append(entry)
            if progress is not None:
                progress(layer + 1, c.n_layers)
    return at, groups


class PreparedGroups:
    """A prepared directory, checked against the model, format and group size it must serve. A group is one pread
    of a contiguous range (no readahead: the file is read at random, and under a memory limit a neighbour read
    ahead only pushes out what the device needs): `compact_group` keeps those bytes as they are, `shard` builds
    onnxruntime kernels from them."""

    def __init__(self, path: Path, sha256: str, fmt: str, layout: GroupLayout, n_layers: int):
        fix = "run: halo-agent prepare --model MODEL --weights FORMAT"
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: no readable manifest.json ({e}); {fix}") from None
        expected = {"version": VERSION, "model_sha256": sha256, "format": fmt,
                    "mlp_group_size": layout.mlp_group_size, "n_layers": n_layers, "n_mlp_groups": layout.n_mlp_groups}
        for name, value in expected.items():
            if manifest.get(name) != value:
                raise ConfigError(f"{path}: prepared for {name} {manifest.get(name)!r}, this session needs {value!r}; {fix}")
        data = path / "groups.bin"
        if not data.is_file() or data.stat().st_size != manifest["bytes"]:
            raise ConfigError(f"{path}: groups.bin is missing or truncated (expected {manifest['bytes']} bytes); {fix}")
        self.path, self.layout = path, layout
        self.groups = manifest.get("groups")
        if not isinstance(self.groups, list) or len(self.groups) != n_layers * layout.n_mlp_groups:
            raise ConfigError(f"{path}: manifest.json does not list {n_layers} x {layout.n_mlp_groups} groups; {fix}")
        for i, entry in enumerate(self.groups):
            why = _entry_problem(entry, manifest["bytes"])
            if why:
                raise ConfigError(f"{path}: manifest.json, layer {i // layout.n_mlp_groups} group "
                                  f"{i % layout.n_mlp_groups}: {why}; {fix}")
        self._fd = os.open(data, os.O_RDONLY)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)  # one group per read: no readahead of its neighbours

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def _read(self, layer: int, group: int,
              buffers: BufferPool | None = None) -> tuple[np.ndarray, list[tuple[dict, dict]]]:
        """A group's read buffer (from `buffers`, or pages of its own) and its kernels: (manifest entry, arrays by name,
        views of that buffer) each."""
        entry = self.groups[layer * self.layout.n_mlp_groups + group]
        data = own_pages(entry["bytes"]) if buffers is None else buffers.take(entry["bytes"])
        if os.preadv(self._fd, [data], entry["offset"]) != entry["bytes"]:
            raise ConfigError(f"{self.path}: groups.bin ended inside layer {layer} group {group}; run: halo-agent prepare")
        at, kernels = 0, []
        for kernel in entry["kernels"]:
            arrays = {}
            for name, shape, dtype in kernel["arrays"]:
                size = math.prod(shape) * np.dtype(dtype).itemsize
                arrays[name] = data[at:at + size].view(dtype).reshape(shape)
                at += size
            kernels.append((kernel, arrays))
        return data, kernels

    def shard(self, layer: int, group: int, threads: int = 1) -> MlpShard:
        """The group as onnxruntime kernels (what a device with room for every candidate group holds)."""
        projections = []
        for kernel, arrays in self._read(layer, group)[1]:
            codes, scales, offsets = self._kernel(kernel, arrays).arrays()  # MatMulNBits' layout
            form = KernelForm(codes, scales, offsets, kernel["k"])
            rows = [form[a:b] for a, b in kernel["outputs"]]
            projections.append(KernelProjection(rows, threads, KernelSpec(*kernel["spec"]), _fill_from_form,
                                                open_session=False))
        return MlpShard.from_projections(self.layout, [group], *projections, threads=threads)

    @staticmethod
    def _kernel(kernel: dict, arrays: dict) -> DequantKernel:
        return DequantKernel(arrays["packed"], kernel["n"], kernel["k"], KernelSpec(*kernel["spec"]), kernel["scale_dtype"])

    def compact_group(self, layer: int, group: int, buffers: BufferPool | None = None) -> CompactMlpGroup:
        """The group as its compact arrays, the read buffer itself (what a memory-bounded device holds): a buffer
        from `buffers` (back to it when the group is garbage), or pages of its own."""
        data, kernels = self._read(layer, group, buffers)
        made = CompactMlpGroup(*(self._kernel(kernel, arrays) for kernel, arrays in kernels))
        if buffers is not None:
            buffers.return_with(made, data)
        return made


def _entry_problem(entry, file_bytes: int) -> str | None:
    """What is wrong with one group's manifest entry (None: its kernels' arrays are the shapes their specs imply and
    lie within the file), so that a damaged manifest is refused at start, not mid-generation."""
    try:
        total = 0
        for kernel in entry["kernels"]:
            bits, block, with_offsets = kernel["spec"][:3]
            n, k, units = int(kernel["n"]), int(kernel["k"]), -(-int(kernel["k"]) // int(block))
            if bits not in (4, 8) or block <= 0 or block * bits % 32 or n <= 0 or k <= 0:
                return f"kernel spec {kernel['spec']} (n {n}, k {k}) is not a MatMulNBits kernel"
            if kernel["scale_dtype"] not in ("float16", "float32"):
                return f"scale_dtype {kernel['scale_dtype']!r} is not float16 or float32"
            shape = packed_shape(n, units, block * bits // 8, np.dtype(kernel["scale_dtype"]).itemsize, with_offsets)
            want = {"packed": (list(shape), "uint8")}
            got = {name: (list(shape), dtype) for name, shape, dtype in kernel["arrays"]}
            if got != want:
                return f"arrays {got} where the kernel needs {want}"
            if [b - a for a, b in kernel["outputs"]] and sum(b - a for a, b in kernel["outputs"]) != n:
                return f"outputs {kernel['outputs']} do not cover {n} rows"
            total += sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in want.values())
        if total != entry["bytes"] or not 0 <= entry["offset"] <= file_bytes - total:
            return f"{entry['bytes']} bytes at {entry['offset']} where its arrays take {total}"
    except (KeyError, TypeError, ValueError) as e:
        return f"malformed ({e!r})"
    return None


def find_prepared(weights: ModelWeights, sha256: str, fmt: str, layout: GroupLayout) -> PreparedGroups | None:
    """The prepared groups for this model, format (as the session names it: resolved here) and group size, if
    `halo-agent prepare` wrote them; None for float32 too (its groups are the file's own pages, read in place)."""
    from halo.compute.linear import resolve_format

    fmt = resolve_format(fmt, weights)
    if fmt == "fp32":
        return None
    path = prepared_dir(sha256, fmt, layout.mlp_group_size)
    try:
        if not (path / "manifest.json").exists():
            return None
    except PermissionError:  # (a directory another user prepared for itself: a bare PermissionError ended the hello)
        raise ConfigError(f"{path}: this agent's user cannot read the prepared groups there; make them readable "
                          f"(chmod -R a+rX {path}) or prepare them as this user") from None
    return PreparedGroups(path, sha256, fmt, layout, weights.config.n_layers)
