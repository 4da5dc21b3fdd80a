"""Batches: collate samples (pad to the longest in the batch), move them, prefetch them.

Inside a DataLoader worker, :func:`collate` writes every tensor of a batch into one
reusable shared-memory arena (see :mod:`mmvl.data.shm` for why and how).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping

import torch

from mmvl.data import shm
from mmvl.errors import UserError

#: the batch key collate sets: True when some text token or region of the batch is masked out
#: (padded); a model passes BERT no attention mask when it is False, so attention may take the
#: fused (flash) kernel. A plain bool, decided here on the host: no model reads the mask's values.
PADDED = "padded"
#: the per-sample masks (1: a real token or region) whose zeros :data:`PADDED` reports
MASK_KEYS = ("attention_mask", "feature_mask")


def collate(items: list[dict[str, Any]],
            pad_values: Mapping[str, float | int | bool] | None = None) -> dict[str, Any]:
    """Collate a list of sample dicts into one batch dict.

    Tensors with equal shapes are stacked; tensors whose shapes differ (text
    tokens, region features) are padded to the longest in the batch, so a batch
    of short questions gives short tensors. Padding is 0 (``False`` for bool
    masks) unless ``pad_values`` names the key, e.g. ``{"labels": -100}``; a
    nested key can be named by its dotted path (``"text.input_ids"``) or its
    last part. Nested dicts are collated recursively. Numbers become tensors;
    strings, ``None`` and anything else stay lists (as does a key where any
    sample has ``None``).

    ``batch["padded"]`` (:data:`PADDED`) says, as a Python bool, whether any
    ``attention_mask`` or ``feature_mask`` of the batch has a 0: text of different
    lengths, a region count below the longest, or a sample's own masked entries.

    In a DataLoader worker every CPU tensor of the batch lands in one reusable
    shared-memory arena (the batch is a ``dict`` subclass that the DataLoader's
    queue sends by reference); elsewhere the batch is a plain dict of new tensors.
    """
    if not items:
        raise ValueError("collate() got an empty list of samples")
    if PADDED in items[0]:
        raise UserError(f"collate(): the samples have a {PADDED!r} key, which collate sets itself; rename that "
                        "field in the dataset's items.")
    slots: list[_Slot] = []
    batch = _materialise(_collate_dicts(items, dict(pad_values or {}), "", slots), slots)
    batch[PADDED] = _has_padding(items, batch)
    return batch


def _has_padding(items: list[dict[str, Any]], batch: dict[str, Any]) -> bool:
    """Whether a mask of the collated batch has a 0: from the samples' lengths, else one read of each
    collated host mask (a mask that is not a CPU tensor counts as padded: it is never read)."""
    for key in MASK_KEYS:
        if key not in batch:
            continue
        mask = batch[key]
        if not isinstance(mask, torch.Tensor) or mask.device.type != "cpu":
            return True
        if any(item[key].shape != items[0][key].shape for item in items) or not bool(mask.all()):
            return True
    return False


class _Slot:
    """One output tensor of a batch, filled once its memory is known."""

    __slots__ = ("shape", "like", "fill", "parent", "key", "offset")

    def __init__(self, shape: tuple[int, ...], like: torch.Tensor, fill: Any):
        self.shape, self.like, self.fill = shape, like, fill
        self.parent: dict[str, Any] = {}
        self.key = ""
        self.offset = 0

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.like.element_size()


def _collate_dicts(items: list[Mapping[str, Any]], pad_values: dict[str, Any], prefix: str,
                   slots: list[_Slot]) -> dict[str, Any]:
    batch: dict[str, Any] = {}
    for key in items[0]:
        path = f"{prefix}{key}"
        try:
            values = [item[key] for item in items]
        except KeyError:
            raise ValueError(f"collate(): key {path!r} is missing from some samples") from None
        value = _collate_values(values, pad_values, path, slots)
        if isinstance(value, _Slot):
            value.parent, value.key = batch, key
            slots.append(value)
        batch[key] = value
    return batch


def _collate_values(values: list[Any], pad_values: dict[str, Any], path: str, slots: list[_Slot]) -> Any:
    first = values[0]
    if any(v is None for v in values):
        return values
    if isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) for v in values):
        pad = pad_values.get(path, pad_values.get(path.rsplit(".", 1)[-1], 0))
        return _stack_or_pad(values, pad, path)
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) for v in values):
        return _collate_dicts(values, pad_values, path + ".", slots)
    if all(isinstance(v, bool) for v in values):
        return _small(torch.tensor(values, dtype=torch.bool))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return _small(torch.tensor(values, dtype=torch.long))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return _small(torch.tensor(values, dtype=torch.float32))
    return list(values)


def _small(t: torch.Tensor) -> _Slot:
    return _Slot(tuple(t.shape), t, lambda out: out.copy_(t))


def _stack_or_pad(values: list[torch.Tensor], pad: Any, path: str) -> _Slot:
    shape = values[0].shape
    if all(v.shape == shape for v in values):
        if values[0].numel() * values[0].element_size() < _ROW_COPY_BYTES:
            return _Slot((len(values), *shape), values[0], lambda out: torch.stack(values, out=out))
        return _Slot((len(values), *shape), values[0], lambda out: _copy_rows(out, values))
    if any(v.dim() != values[0].dim() for v in values) or values[0].dim() == 0:
        raise ValueError(f"collate(): tensors of {path!r} have different numbers of dimensions")
    max_shape = [max(v.shape[d] for v in values) for d in range(values[0].dim())]
    return _Slot((len(values), *max_shape), values[0], lambda out: _pad_into(out, values, pad))


#: samples at least this large are copied one by one rather than by ``torch.stack``
_ROW_COPY_BYTES = 1 << 16


def _copy_rows(out: torch.Tensor, values: list[torch.Tensor]) -> None:
    """``torch.stack(values, out=out)`` for large samples: ``copy_`` keeps its vectorised loop on any
    source alignment, where ``stack`` (like ``memmove``) ran 5x slower here reading region features
    viewed in a file map at 56 bytes past a 64-byte boundary (the LMDB reader's zero-copy views)."""
    for i, v in enumerate(values):
        out[i].copy_(v)


def _pad_into(out: torch.Tensor, values: list[torch.Tensor], pad: Any) -> None:
    if all(v.shape[1:] == out.shape[2:] for v in values):  # only the first axis varies: pad each tail
        for i, v in enumerate(values):
            out[i, :len(v)] = v
            out[i, len(v):] = pad
        return
    out.fill_(pad)
    for i, v in enumerate(values):
        out[(i, *[slice(0, s) for s in v.shape])] = v


def _new_batch(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An empty batch tensor; inside a DataLoader worker without arenas (no ``memfd``) it lives in
    torch's shared memory, so the batch reaches the main process without another copy."""
    if torch.utils.data.get_worker_info() is None or like.device.type != "cpu":
        return like.new_empty(shape)
    numel = 1
    for n in shape:
        numel *= n
    storage = like.untyped_storage()._new_shared(numel * like.element_size())
    return like.new_empty(0).set_(storage).view(shape) if numel else like.new_empty(shape)


def _materialise(batch: dict[str, Any], slots: list[_Slot]) -> dict[str, Any]:
    """Give every slot its memory (one arena in a worker, else one tensor each) and fill it."""
    if slots and shm.ARENAS and torch.utils.data.get_worker_info() is not None and all(
            s.like.device.type == "cpu" and s.like.layout == torch.strided and not s.like.is_quantized
            for s in slots):
        return shm.into_arena(batch, slots)
    for s in slots:
        out = _new_batch(s.like, s.shape)
        s.fill(out)
        s.parent[s.key] = out
    return batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in a (nested) batch to ``device``, keeping each dtype.

    Dtypes are kept on purpose: region features stored fp16 on the host cross
    the bus at half the bytes; casting them is the model's job, on the device.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def batch_size_of(batch: dict[str, Any]) -> int:
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
        if isinstance(v, list):
            return len(v)
    return 0


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


_END = object()


class DevicePrefetcher:
    """Yields ``iterable``'s batches on ``device``, copying batch n+1 while step n computes.

    On CUDA the copy runs on a side stream: tensors pinned by the loader
    (``pin_memory=True``) are copied ``non_blocking``; before a batch is handed
    out the compute stream waits for the side stream, and each tensor is
    ``record_stream``-ed on the compute stream so the caching allocator does not
    reuse its memory (allocated on the side stream) while compute still reads
    it. Dtypes are kept (fp16 features stay fp16; the model casts on device).
    On CPU the same look-ahead runs with a plain move (a no-op for CPU tensors),
    so the bookkeeping below is the code the CPU tests exercise.

    The look-ahead pulls one batch before it is used, so ``state_dict()``
    returns the source's state from *before* that pull: resuming from it
    replays the prefetched, never-used batch instead of skipping it.
    Other attributes (``epoch``, ``batches_per_epoch``, ...) are the source's.
    """

    def __init__(self, iterable: Iterable[Any], device: torch.device | str):
        self.source = iterable
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._side = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._it: Iterator[Any] | None = None
        self._next: Any = _END
        self._state: Any = None  # source state before ``_next`` was pulled

    def _preload(self) -> None:
        if self._it is None:  # _preload runs only after __iter__ started the source
            raise RuntimeError("DevicePrefetcher._preload called before iteration started")
        if hasattr(self.source, "state_dict"):
            self._state = self.source.state_dict()
        try:
            batch = next(self._it)
        except StopIteration:
            self._next = _END
            return
        copy = torch.cuda.stream(self._side) if self._cuda else contextlib.nullcontext()
        with copy:
            self._next = to_device(batch, self.device, non_blocking=True)

    def _hand_over(self, batch: Any) -> None:
        """Make the compute stream wait for the copy and own the batch's memory."""
        if not self._cuda:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._side)
        for t in _tensors(batch):
            if t.is_cuda:
                t.record_stream(current)

    def __iter__(self) -> "DevicePrefetcher":
        """Start (or, once exhausted, restart) the source; mid-way it continues, losing nothing."""
        if self._it is None or self._next is _END:
            self._it = iter(self.source)
            self._preload()
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self.__iter__()
        batch = self._next
        if batch is _END:
            raise StopIteration
        self._hand_over(batch)
        self._preload()
        return batch

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def state_dict(self) -> Any:
        if self._it is None or self._state is None:
            return self.source.state_dict()  # type: ignore[attr-defined]
        return self._state

    def load_state_dict(self, state: Any) -> None:
        """Restore the source; the prefetched batch is dropped and fetched again from there."""
        self.source.load_state_dict(state)  # type: ignore[attr-defined]
        self._it, self._next, self._state = None, _END, None

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not yet set (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)
