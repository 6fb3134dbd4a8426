"""Values derived from a teacher weight and kept across calls (its Gram matrix, _teacher_gram.py; its FP8 copy,
_teacher_fp8.py), used only while they are provably those of the weight as it is now.

A value is reused only for the same weight with the same contents, checked two ways:

* Identity, on the host: the same storage, offset, shape, strides, dtype, negative bit and version
  counter, and the same settings the value depends on beside the bits (``built_under``). Any change
  rebuilds the value: an in-place op on the weight, ``weight.data = other``, ``load_state_dict``,
  ``torch.nn.utils.vector_to_parameters``, TF32 switched on or off for an fp32 head's Gram matrix.
* Contents, on the device: writes that keep the identity (in-place ops through ``weight.data``, a
  fused optimizer step, a weight made under ``torch.inference_mode``, which has no version counter)
  change the weight's hash (_fingerprint.py), taken when the value is built and again at every reuse.
  On the CPU a changed hash raises at once. On a GPU the comparison stays on the device, since
  reading it on the host would stall the queue: that call's loss and gradients come out NaN
  (``Cached.poison``) and the next call with the weight raises ``StaleWeightError`` saying why. A weight passed
  as ``parameter.data`` has a fresh counter at every call, so a change made on the parameter, which a
  counter would show, is found this way too.

A value and its hash are built on the caller's CUDA stream. A call on another stream waits for that build (an
event recorded after it) before its first read, and the value's memory is marked as in use by that stream, so
that the allocator does not hand it out while the stream may still read it after the cache lets the value go.
"""

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._device import HostCopy
from ._fingerprint import hash_differs

PREVIOUS_CALL = "the previous call with it (whose loss and gradients are NaN)"  # where a pending comparison is read


# Storages whose values are not cached: those of student heads some call trained, while the head still requires grad
# (a weak reference to it), and those of teacher weights once found changed behind their version counter (None).
# Held weakly, as the caches' entries.
_changing_storages = WeakIdKeyDictionary()


def note_trained(weight: torch.Tensor) -> None:
    """Records a head being trained (this call's student head; a teacher parameter the Trainer's student shares):
    another call's teacher it may be (mutual distillation), not to be cached while it requires grad."""
    _changing_storages[weight.untyped_storage()] = weakref.ref(weight)


def kept_across_calls(teacher_weight: torch.Tensor, student_weight: torch.Tensor) -> bool:
    """Whether a value derived from the teacher weight may be cached: not for a head that is being trained, which its
    optimizer changes at every step, a fused one without moving its version counter, so that a cached value would
    be stale at every reuse and save nothing: this call's student head where it requires grad (self-distillation
    through the student's own head), or a head another call trains while it still requires grad (mutual
    distillation through each other's detached heads; frozen since, as a stage's student becomes the next stage's
    teacher, it is cached again); nor for a weight once found changed that way."""
    storage = teacher_weight.untyped_storage()
    if student_weight.requires_grad and storage.data_ptr() == student_weight.untyped_storage().data_ptr():
        return False
    if storage not in _changing_storages:
        return True
    trained = _changing_storages[storage]
    head = None if trained is None else trained()
    return trained is not None and (head is None or not head.requires_grad)


class StaleWeightError(ValueError):
    """teacher_weight's contents changed behind its version counter while a value derived from it was cached."""


@dataclass(frozen=True)
class LaterCheck:
    """A reuse's content check whose hash the caller takes, along with work of its own (the JSD's cluster row
    step reads the weight beside its exponentials, kernels/row_step_jsd_cuda.py): ``finish(partials)``, with the
    hash of ``weight`` (_fingerprint.lanes_of's partial lanes, or the lanes), queues the comparison and returns
    the poison."""

    weight: torch.Tensor
    finish: Callable[[torch.Tensor], torch.Tensor | None]


@dataclass(frozen=True)
class Cached:
    value: Any
    # 0-d fp32 on the weight's device: NaN if the weight's contents changed since the value was built, else
    # 0; None where nothing is left to check (a fresh build, or a comparison read at once) or the check is later's
    poison: torch.Tensor | None
    later: LaterCheck | None = None  # ``get(..., hash_later=True)`` on a GPU: the check the caller finishes


def compared_on_host(weight: torch.Tensor) -> bool:
    """Whether a reuse reads the hash comparison at once: on the CPU, where the read costs nothing."""
    return not weight.is_cuda


@dataclass
class _Entry:
    identity: tuple
    value: Any = None  # None: seen, not built
    hash: torch.Tensor | None = None
    pending: HostCopy | None = None  # the last reuse's mismatch flag, read by the next lookup
    # [whether the storage was looked up again after its first value was built], shared with its finalizer
    outlived: list = field(default_factory=lambda: [False])
    built: torch.cuda.Event | None = None  # recorded on the building stream after the value and its hash (CUDA)
    streams: list = field(default_factory=list)  # the CUDA streams ordered after ``built``, the building one first

    def share_with_current_stream(self, device: torch.device) -> None:
        """Orders the caller's stream after the value's build, the first time it reads a value built on another."""
        if self.built is None:
            return
        stream = torch.cuda.current_stream(device)
        if stream in self.streams:
            return
        stream.wait_event(self.built)
        for tensor in _tensors_in((self.value, self.hash)):
            tensor.record_stream(stream)
        self.streams.append(stream)


def _tensors_in(value) -> list:
    """The tensors of a value built for the cache: a tensor, or tuples of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [tensor for part in value for tensor in _tensors_in(part)]


class WeightCache:
    """One derived value per weight storage, ``build(weight)``, reused under the rules above. Keyed on
    the storage, held weakly: aliases such as ``weight.detach()`` share the value, and a storage that
    is freed takes its value with it (so its address, reused, never matches)."""

    def __init__(self, what: str, build: Callable[[torch.Tensor], Any],
                 built_under: Callable[[torch.Tensor], Any] = lambda weight: None):
        self.what, self.build, self.built_under = what, build, built_under
        self.entries = WeakIdKeyDictionary()
        # Whether the last storage freed with a value built for it had been looked up again (True before any):
        # a weight made anew for every call (a cast, a gather) frees each value unused, and so new ones are not held.
        self.values_outlive_calls = True

    def get(self, weight: torch.Tensor, backend, hash_later: bool = False, compare_later: bool = False,
            keep: bool = True) -> Cached:
        """The value for the weight as it is now, rebuilt where its identity changed. ``backend``: its
        ``fingerprint`` hashes the weight (every backend's gives the same numbers), its ``stale_check``
        compares on the device (_backends.Backend). ``hash_later``: a reuse on a GPU leaves the hash and
        comparison to the caller (``Cached.later``). ``compare_later``: the comparison stays on the device on
        the CPU too, for a caller that shares its poison with other ranks before anyone raises, then reads it
        (``raise_if_stale``). ``keep=False`` (``kept_across_calls``): a value built for this call alone."""
        if not keep:  # a value kept before is dropped, after its last reuse's pending check is read
            storage, _ = self._lookup(weight)
            self.entries.pop(storage, None)
            with torch.no_grad():
                return Cached(self.build(weight), None)
        storage, entry = self._lookup(weight)
        if entry is None or entry.value is None or entry.identity != self._identity(weight):
            built = _Entry(self._identity(weight))
            with torch.no_grad():
                built.value, built.hash = self.build(weight), backend.fingerprint(weight)
            if weight.is_cuda:
                stream = torch.cuda.current_stream(weight.device)
                built.built, built.streams = torch.cuda.Event(), [stream]
                built.built.record(stream)
            if entry is None:
                weakref.finalize(storage, self._freed, built.outlived)
            else:
                built.outlived = entry.outlived
            self.entries[storage] = built
            return Cached(built.value, None)
        entry.share_with_current_stream(weight.device)
        return self.check_contents(weight, storage, entry, backend, hash_later, compare_later)

    def check_contents(self, weight: torch.Tensor, storage, entry: _Entry, backend, hash_later=False,
                       compare_later=False) -> Cached:
        """The reused value with its content check: the poison, or None after a comparison read at once (which
        raises if the hash differs); with ``hash_later`` on a GPU, the check for the caller to finish."""
        compare = functools.partial(self._compare, weight, storage, entry, backend.stale_check, compare_later)
        if hash_later and not compared_on_host(weight):
            return Cached(entry.value, None, LaterCheck(weight, compare))
        return Cached(entry.value, compare(backend.fingerprint(weight)))

    def _compare(self, weight: torch.Tensor, storage, entry: _Entry, stale_check, compare_later: bool,
                 partials: torch.Tensor):
        """The poison for the weight's hash (``partials``, as _fingerprint.lanes_of takes them), or None after a
        comparison read at once; raises if it differs."""
        if compared_on_host(weight) and not compare_later:
            if hash_differs(partials, entry.hash):
                del self.entries[storage]
                _changing_storages[storage] = None
                raise StaleWeightError(self._message(weight, "this call"))
            return None
        changed, poison = stale_check(partials, entry.hash)
        entry.pending = HostCopy(changed)
        return poison

    def _identity(self, weight: torch.Tensor) -> tuple:
        version = None if weight.is_inference() else weight._version  # inference tensors have no version counter
        # the negative bit: a lazily negated view (z.conj().imag) reads its storage's bits the other way round
        return (weight.storage_offset(), tuple(weight.shape), weight.stride(), weight.dtype, weight.is_neg(), version,
                self.built_under(weight))

    def _freed(self, outlived: list) -> None:
        """A storage with a value built for it was freed (weakref.finalize)."""
        self.values_outlive_calls = outlived[0]

    def will_hold(self, weight: torch.Tensor) -> bool:
        """Whether a value built now is likely to be reused: the cache holds one for the weight as it is, or
        the weight is unchanged since it last saw it, or new to it while the values built so far outlived their
        first call. Records the weight as seen, so that one that changes between calls counts as changing, one
        that stops changing is cached again, and a weight made anew for every call counts as not held from its
        second call on."""
        storage, entry = self._lookup(weight)
        if entry is not None and entry.identity == self._identity(weight):
            return True
        if entry is None and self.values_outlive_calls:
            return True
        self.entries[storage] = _Entry(self._identity(weight), outlived=[False] if entry is None else entry.outlived)
        return False

    def raise_if_stale(self, weight: torch.Tensor, when: str = PREVIOUS_CALL) -> None:
        """Reads the last reuse's comparison left on the device, if not read yet: raises (and drops the value) if it
        found the weight changed. ``when``: that reuse, for the message."""
        self._lookup(weight, when)

    def _lookup(self, weight: torch.Tensor, when: str = PREVIOUS_CALL):
        """(storage, its entry or None); raises if the last reuse of the entry found the weight changed."""
        storage = weight.untyped_storage()
        entry = self.entries.get(storage)
        if entry is not None and not entry.outlived[0]:  # looked up again: not made for one call
            # once per entry: a long-lived teacher's every call reset what another teacher, made anew per call, showed
            entry.outlived[0] = self.values_outlive_calls = True
        if entry is not None and entry.pending is not None:
            pending, entry.pending = entry.pending, None
            if pending.get().item():
                del self.entries[storage]
                _changing_storages[storage] = None
                raise StaleWeightError(self._message(weight, when))
        return storage, entry

    def _message(self, weight: torch.Tensor, when: str) -> str:
        return (
            f"teacher_weight {tuple(weight.shape)} changed while cosdistill held its {self.what}, without its "
            f"version counter moving, so {when} found that copy stale. Writes through `.data`, fused optimizer "
            f"steps and weights made under torch.inference_mode do this, and so does passing `weight.data` to the "
            f"loss: each `.data` is a new tensor with a counter of its own, which changes made on the parameter do "
            f"not move. Pass the parameter itself (or `weight.detach()`, which shares its counter) and change it in "
            f"place under torch.no_grad() (its version then moves and the copy is rebuilt), or pass "
            f"cosine_via='logits' and teacher_precision=None, which keep no copy. This process builds the copy of "
            f"this weight afresh at each call from now on."
        )
