"""Where DP noise comes from: generators no other party can replay, and Opacus' secure
noise drawn in parallel.

Secure noise (``secure-mode``) is Opacus': each value a sum of four Gaussian draws, halved
(Holohan and Braghin 2021, against floating-point attacks). :class:`SecureNoise` draws
them for a whole step at once on parallel OS-seeded generators, not serially per tensor.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

#: Entries drawn per call inside a chunk: bounds the scratch buffer each stream holds.
_SCRATCH = 1 << 20


def secure_generator(device: torch.device | str = "cpu") -> tuple[torch.Generator, str]:
    """A generator on ``device`` that nobody can replay, and what it is: ``torchcsprng``
    where installed (CPU only; no build for current PyTorch), else PyTorch's seeded with
    64 bits of ``os.urandom``: unpredictable, but not itself a CSPRNG (docs/privacy.md)."""
    device = torch.device(device)
    if device.type == "cpu":
        with contextlib.suppress(ImportError):
            import torchcsprng

            gen: torch.Generator = torchcsprng.create_random_device_generator("/dev/urandom")
            return gen, "torchcsprng"
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return gen, f"torch generator on {device} seeded from os.urandom"


def seeded_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A reproducible generator on ``device`` (insecure-reproducible-noise, tests only)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def _fill(out: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """``out`` filled with sums of four N(0, std^2) draws, halved (so N(0, std^2)), from
    ``generator`` alone; the first draw thrown away, as Opacus does."""
    torch.normal(0.0, std, size=(1, 1), device=out.device, generator=generator)
    scratch = torch.empty(min(out.numel(), _SCRATCH), dtype=out.dtype, device=out.device)
    for start in range(0, out.numel(), _SCRATCH):
        part = out[start : start + _SCRATCH]
        draw = scratch[: part.numel()]
        part.normal_(0.0, std, generator=generator)
        for _ in range(3):
            part.add_(draw.normal_(0.0, std, generator=generator))
        part.mul_(0.5)


class SecureNoise:
    """Secure noise for a step's tensors from ``streams`` OS-seeded generators, one thread
    each on the CPU, one on an accelerator: which drew an entry changes nothing of it."""

    def __init__(self, first: torch.Generator, streams: int = 1) -> None:
        count = max(1, streams) if first.device.type == "cpu" else 1
        self.generators = [first] + [secure_generator(first.device)[0] for _ in range(count - 1)]
        self._pool = ThreadPoolExecutor(count) if count > 1 else None

    def draw(self, std: float, references: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One noise tensor shaped like each of ``references`` (their dtype and device)."""
        if not references:
            return []
        sizes = [r.numel() for r in references]
        dtypes = {r.dtype for r in references}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        flat = torch.zeros(sum(sizes), dtype=dtype, device=references[0].device)
        if std != 0:
            per = -(-flat.numel() // len(self.generators))
            chunks = [(flat[i * per : (i + 1) * per], g) for i, g in enumerate(self.generators)]
            if self._pool is None:
                for chunk, gen in chunks:
                    _fill(chunk, std, gen)
            else:
                work = [self._pool.submit(_fill, c, std, g) for c, g in chunks if c.numel()]
                for done in work:
                    done.result()
        parts = zip(torch.split(flat, sizes), references, strict=True)
        return [part.view(r.shape).to(r.dtype) for part, r in parts]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
