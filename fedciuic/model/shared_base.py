"""One read-only copy of a frozen base per machine, memory-mapped by every process.

Every process maps the one safetensors file read-only, so the page cache holds one copy
and a stray write to a frozen weight faults instead of forking the base. A preset is
built once per machine into ``$FEDCIUIC_CACHE/bases`` under a lock, its SHA-256 in a
sidecar; a checkpoint already holding the model's tensors in the run's dtype is mapped in
place, any other converted once into that cache. Adapters and buffers stay private.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import mmap
import os
import re
import struct
import tempfile
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from fedciuic.digests import DigestCache, cache_dir
from fedciuic.errors import ModelError

#: ``0`` (or ``off``/``false``/``no``) builds a private base per model, for comparison.
SHARE_ENV = "FEDCIUIC_SHARED_BASE"
#: Bumped when the cached file's layout changes, so that old files are not read.
_FORMAT = "fedciuic-base-v1"
_SIDECAR = ".json"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

log = logging.getLogger(__name__)


class DamagedBase(ModelError):
    """A safetensors file that cannot be mapped as it claims to be."""


def sharing_enabled() -> bool:
    """Whether frozen bases are mapped from one shared file (the default)."""
    return os.environ.get(SHARE_ENV, "1").strip().lower() not in {"0", "off", "false", "no"}


def bases_dir() -> Path:
    return cache_dir() / "bases"


# -- mapping ------------------------------------------------------------------------------


@dataclass(eq=False)
class MappedFile:
    """A safetensors file mapped read-only; its tensors view the mapping (no copy)."""

    path: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)


#: Per process: a file mapped once however many models use it (models hold it strongly).
_MAPPED: weakref.WeakValueDictionary[tuple[str, int, int, int], MappedFile] = (
    weakref.WeakValueDictionary()
)


def map_safetensors(path: Path) -> MappedFile:
    """Map ``path`` read-only; :class:`DamagedBase` if its header or offsets do not fit."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if (found := _MAPPED.get(key)) is not None:
        return found
    mapped = _map(path, stat.st_size)
    _MAPPED[key] = mapped
    return mapped


def _map(path: Path, size: int) -> MappedFile:
    fix = "delete it to rebuild it"
    if size < 8:
        raise DamagedBase(f"{path}: {size} bytes is no safetensors file; {fix}")
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if 8 + length > size:
            raise DamagedBase(f"{path}: the header runs past the end of the file; {fix}")
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            raise DamagedBase(f"{path}: the header is not JSON; {fix}") from None
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    if not isinstance(header, dict):
        raise DamagedBase(f"{path}: the header is not a JSON object; {fix}")
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + length
    tensors: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # The buffer is read-only on purpose: a write to a frozen weight must fault.
        warnings.filterwarnings("ignore", message=".*buffer is not writable.*")
        for name, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = [int(n) for n in info["shape"]]
                begin, end = (int(n) for n in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise DamagedBase(f"{path}: tensor {name!r} is described badly; {fix}") from None
            count = math.prod(shape)
            if end - begin != count * dtype.itemsize or start + end > size or begin < 0:
                raise DamagedBase(f"{path}: tensor {name!r} does not fit the file; {fix}")
            flat = (
                torch.frombuffer(buffer, dtype=dtype, count=count, offset=start + begin)
                if count
                else torch.empty(0, dtype=dtype)
            )
            tensors[name] = flat.view(shape)
    return MappedFile(path, tensors, dict(metadata))


def mapping_of(tensor: torch.Tensor) -> Path | None:
    """The file a tensor's memory is mapped from (per ``/proc/self/maps``), if any."""
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in parts[0].split("-"))
            if low <= address < high:
                name = parts[5].strip() if len(parts) == 6 else ""
                return Path(name) if name.startswith("/") else None  # not [heap], [anon]
    return None


# -- the cache of built bases -------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_base_file(
    fingerprint: str, dtype: torch.dtype, build: Callable[[], Mapping[str, torch.Tensor]]
) -> Path:
    """Base ``fingerprint``'s cache file in ``dtype``, built once per machine under a lock."""
    file = bases_dir() / f"{fingerprint[:40]}-{_NAMES[dtype].lower()}.safetensors"
    with _locked(file.with_name(file.name + ".lock")):
        # Read under the lock: the process that built the file has recorded its digest.
        digests = DigestCache(cache_dir() / "file-digests.json")
        if _intact(file, fingerprint, digests):
            return file
        if file.exists():
            log.warning("fedciuic: %s is damaged; rebuilding it", file)
        _write(file, fingerprint, build(), digests)
    return file


def _intact(file: Path, fingerprint: str, digests: DigestCache) -> bool:
    try:
        recorded = json.loads(file.with_name(file.name + _SIDECAR).read_text(encoding="utf-8"))
        if recorded.get("fingerprint") != fingerprint or recorded.get("format") != _FORMAT:
            return False
        ok = bool(digests.digest(file) == recorded.get("sha256"))
        digests.save()
        if ok:
            map_safetensors(file)  # the header and offsets are sound too
        return ok
    except (OSError, ValueError, AttributeError, DamagedBase):
        return False


def _write(
    file: Path, fingerprint: str, tensors: Mapping[str, torch.Tensor], digests: DigestCache
) -> None:
    """Tensors that share memory (tied weights) are written once and named as aliases."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[object, ...], str] = {}
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = tensor.contiguous()
    metadata = {"format": _FORMAT, "fingerprint": fingerprint, "aliases": json.dumps(aliases)}
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.")
    os.close(fd)
    try:
        save_file(unique, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, file)
    finally:
        Path(tmp).unlink(missing_ok=True)
    sidecar = {"format": _FORMAT, "fingerprint": fingerprint, "sha256": digests.digest(file)}
    digests.save()
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}{_SIDECAR}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(sidecar, handle)
    os.chmod(tmp, 0o644)
    os.replace(tmp, file.with_name(file.name + _SIDECAR))


def mapped_tensors(files: list[Path]) -> tuple[dict[str, torch.Tensor], list[MappedFile]]:
    """Every tensor of ``files`` (aliases resolved), and the mappings that back them."""
    mapped = [map_safetensors(f) for f in files]
    tensors: dict[str, torch.Tensor] = {}
    for one in mapped:
        tensors.update(one.tensors)
        for alias, source in json.loads(one.metadata.get("aliases", "{}")).items():
            tensors[alias] = one.tensors[source]
    return tensors, mapped


def checkpoint_weight_files(
    path: Path, names: Mapping[str, torch.dtype], dtype: torch.dtype
) -> list[Path] | None:
    """A checkpoint's own safetensors files, if they hold exactly ``names`` (the state
    dict), floating tensors in ``dtype``, and no pickle file is beside them."""
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("adapter_"))
    if not files or any(path.glob("*.bin")):
        return None
    try:
        tensors, _ = mapped_tensors(files)
    except (OSError, ValueError, DamagedBase):
        return None
    if set(tensors) != set(names) or any(
        t.dtype != (dtype if names[n].is_floating_point else names[n]) for n, t in tensors.items()
    ):
        return None
    return files


# -- a model over mapped tensors ----------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters on ``meta`` but real buffers: non-persistent ones (rotary) are in no file."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            held = module._parameters[name]
            assert held is not None
            module._parameters[name] = torch.nn.Parameter(
                held.to("meta"), requires_grad=held.requires_grad
            )

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def skeleton(config: PretrainedConfig, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The model of ``config``, parameters on ``meta``, built in ``dtype`` (as loaded)."""
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with _parameters_on_meta():
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, trust_remote_code=False, **kwargs
        )
    return model


def state_names(config: PretrainedConfig) -> dict[str, torch.dtype]:
    """The names (and fp32-build dtypes) of the state dict a model of ``config`` loads."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)  # type: ignore[no-untyped-call]
    return {name: t.dtype for name, t in model.state_dict().items()}


def assign(model: PreTrainedModel, tensors: Mapping[str, torch.Tensor], source: Path) -> None:
    """Put ``tensors`` into ``model`` as they are (no copy), frozen."""
    result = model.load_state_dict(dict(tensors), strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ModelError(
            f"{source}: the weights do not match the model (missing {result.missing_keys[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}); delete the file to rebuild it"
        )
    model.requires_grad_(False)


# -- a rank's slice of a checkpoint's tensors (a sharded base) ----------------------------


@dataclass
class Slicer:
    """Which checkpoint tensors make each model tensor, per transformers' conversion mapping
    (a renamed key, or per-expert tensors fused into rows), so a rank reads only its rows.
    A tensor it says nothing of is stored under the model's own name."""

    #: model tensor -> checkpoint tensor, where the names differ
    direct: dict[str, str] = field(default_factory=dict)
    #: fused model tensor -> for each of its parts (in order), expert -> checkpoint tensor
    experts: dict[str, list[dict[int, str]]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: PreTrainedModel, keys: Collection[str]) -> Slicer:
        """How checkpoint tensors ``keys`` make ``model``'s (a skeleton is enough)."""
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        names = model.state_dict()
        slicer = cls()
        for key in keys:
            target, pattern = rename_source_key(
                key, renamings, converters, model.base_model_prefix, names
            )
            if pattern is None:
                # A renaming that misses (V4's ``.norm.`` rule on the final norm): as stored.
                found = target if target in names else key if key in names else None
                if found is not None:
                    slicer.direct[found] = key
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            expert = re.search(r"\.experts\.(\d+)\.", key)
            if expert is None or not _stacks_experts(converter):
                continue
            parts = slicer.experts.setdefault(target, [{} for _ in converter.source_patterns])
            parts[converter.source_patterns.index(pattern)][int(expert.group(1))] = key
        return slicer

    def feeds(self, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        """Whether every one of a model's tensors (name and shape) can be read."""
        for name, shape in shapes.items():
            if name in self.direct:
                continue
            parts = self.experts.get(name)
            if not parts or not shape or any(set(range(shape[0])) - set(p) for p in parts):
                return False
        return True

    def rows(
        self, tensors: Mapping[str, torch.Tensor], name: str, start: int, count: int
    ) -> torch.Tensor | None:
        """``count`` rows from ``start`` of model tensor ``name`` from checkpoint ``tensors``
        (a scalar whole; None where they do not hold it)."""
        if (parts := self.experts.get(name)) is not None:
            return torch.stack(
                [
                    torch.cat([tensors[part[e]] for part in parts])
                    for e in range(start, start + count)
                ]
            )
        source = tensors.get(self.direct.get(name, name))
        return source if source is None or source.dim() == 0 else source[start : start + count]


def _stacks_experts(converter: WeightConverter) -> bool:
    """A converter stacking experts (``MergeModulelist(dim=0)``), perhaps then joining their
    parts along each expert's first dimension (``Concatenate(dim=1)``)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
