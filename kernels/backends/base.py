"""The backend Protocol, the registry and what every backend shares; the package docstring says how to use them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch


class BackendAbsent(RuntimeError):
    """A backend that cannot run here; its message is the one line that says why."""


class AttentionBackend(Protocol):
    name: str
    sparse: bool  # takes a kept fraction (our kernel); a dense backend computes every causal block
    # Its call does work on the host beside its kernels that the GPU waits on (fa4_sparse: padding the documents,
    # building a BlockMask, a compiled function's dispatch): the busy clock, which sums kernel times, leaves it out.
    host_work: bool

    def version(self) -> str:
        """The package (and library) versions that a calibration of this backend records."""

    def documents(self, lengths: Sequence[int], device: torch.device | str) -> object:
        """What :meth:`attention` takes for these documents, built once per micro-batch outside any timing."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: object) -> torch.Tensor:
        """Causal attention within each document; ``[T, Hq, D]`` in q's dtype."""


# name -> a class whose instances meet AttentionBackend and have check(); a sparse one takes the block size
BACKENDS: dict[str, Any] = {}


def register(name: str):
    """Class decorator: the backend ``name`` is built by ``cls()`` and checked by its ``check()``."""
    def add(cls):
        cls.name = name
        BACKENDS[name] = cls
        return cls
    return add


def is_sparse_backend(name: str) -> bool:
    """Whether ``name`` is a sparse backend of the registry (ours, a sparse peer); a name it does not know is
    not."""
    return name in BACKENDS and BACKENDS[name].sparse


def has_host_work(name: str) -> bool:
    """Whether ``name`` is a backend of the registry whose call does host work the busy clock does not time."""
    return name in BACKENDS and BACKENDS[name].host_work


def load(name: str, block_size: int | None = None) -> AttentionBackend:
    """The backend ``name`` ready to run: its package imported and its device checked; a sparse one selecting at
    ``block_size`` where given (a profile's or a calibration's), else at its own default. An unknown name is a
    ValueError; a backend that cannot run here raises BackendAbsent with one line naming it and the reason."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; allowed: {', '.join(BACKENDS)}")
    cls = BACKENDS[name]
    try:
        backend = cls(block_size) if cls.sparse and block_size is not None else cls()
        backend.check()
    except (ImportError, RuntimeError, OSError) as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        raise BackendAbsent(f"{name}: absent ({reason})") from None
    return backend


def load_all(names: Sequence[str] | None = None,
             block_size: int | None = None) -> tuple[dict[str, AttentionBackend], list[str]]:
    """The backends of ``names`` (default: every registered one) that run here (the sparse ones at
    ``block_size``, as :func:`load`), and one line for each that does not (``fa4: absent (ModuleNotFoundError:
    No module named 'flash_attn')``)."""
    loaded, absent = {}, []
    for name in BACKENDS if names is None else names:
        try:
            loaded[name] = load(name, block_size)
        except BackendAbsent as exc:
            absent.append(str(exc))
    return loaded, absent


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32 on the host."""
    import torch

    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU here")

