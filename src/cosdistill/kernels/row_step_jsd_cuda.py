"""The generalized JSD's row step with each logit read once: a CUDA kernel for Hopper clusters
(``row_step_jsd.cu``), compiled at run time by NVRTC as the cosine loss's (``row_step_cuda.py``, whose
layouts, compilation and launch rules it shares: read that first).

The Triton JSD step (``row_step_jsd_triton.py``) reads both logits buffers up to three times per row: for
the log-sum-exps, for the soft sums, and (beta > 0 with gradients) for the gradient, which needs the row's
finished sum. Here a cluster holds the row in its blocks' shared memory and registers, so HBM moves one
read of each logit and one write of the gradient; the three passes run from on-chip memory, with two
exchanges of per-row numbers between the cluster's blocks. With 0 < beta < 1 the sums' pass also keeps each
pair's gap to the mixture (fp32, a third shared tile) for the gradient's pass, which then needs one exponential
per pair instead of two and a logarithm.

Only the common case takes this path (``supported``): the gradient asked for, bf16 logits of one vocabulary
size (a multiple of 8) that fits the cluster, no softcaps or logit scales, no vocabulary split, on Hopper or
newer. Everything else runs the Triton twin, which the tests hold equal to the spec; without gradients that
twin reads the row twice and is as fast as a cluster, whose sums are then what limits it (docs/design.md,
The generalized JSD).
"""

import functools

import torch

from .._fingerprint import LANE_KEYS, MASK, MIX
from .._row_step import RowStepConstants, RowStepImpl
from . import row_step_cuda
from .row_step_cuda import MAX_SHARED_BYTES, Layout, _blocks_per_sm, _shared_bytes, _slice_vecs
from .row_step_jsd_triton import MIXED, MIXED_PRECISE, _check_constants, mode_of, row_step_jsd_triton, split_jsd_row_step_triton
from .triton_common import LOG2E

_SOURCE = row_step_cuda.cuda_source("row_step_jsd.cu")
# The most weight rows a block hashes when a launch takes a weight's hash along (``row_step_jsd_cuda_hashing``):
# a launch of fewer rows is too short to hide the weight's read, which the hash alone does as fast.
HASH_ROWS_PER_BLOCK = 64


def _tiles(mode: int) -> int:
    """16-byte shared tiles per vector: the two models' logits, and MIXED's kept gaps (row_step_jsd.cu)."""
    return 3 if mode == MIXED.value else 2


def candidate_layouts(vocab: int, mode: int) -> list[Layout]:
    """The layouts _fitting_kernel tries in turn, from H200 sweeps (docs/design.md, The generalized JSD). Longer slices
    than the cosine loss's suit this kernel: its three passes and two exchanges cost each block more.

    FORWARD and REVERSE: clusters of 8 blocks (16 only where 8 cannot hold the row), 128 to 512 threads as the
    slice grows, and as many of each thread's vectors in registers (3 down to 0) as ptxas keeps without a spill.
    MIXED, whose kept gaps make a third of its shared memory: 16 blocks where 8 would leave one per SM, 512
    threads from longer slices on, and register vectors only where they let more blocks share an SM, the most
    blocks first."""
    if mode != MIXED.value:
        cluster = 8 if _shared_bytes(vocab, 8) <= MAX_SHARED_BYTES else 16
        slice_vecs = _slice_vecs(vocab, cluster)
        threads = 128 if slice_vecs <= 512 else 256 if slice_vecs <= 2560 else 512
        return [Layout(cluster, threads, cols) for cols in (3, 2, 1, 0) if cols * threads < slice_vecs]

    def blocks(layout):
        return _blocks_per_sm(_shared_bytes(vocab, *layout, _tiles(mode)), layout.threads)

    cluster = 8 if blocks(Layout(8, 128)) > 1 else 16
    slice_vecs = _slice_vecs(vocab, cluster)
    threads = 128 if slice_vecs <= 512 else 256 if slice_vecs <= 2048 else 512
    layouts = [Layout(cluster, threads)]
    for cols in range(1, 4):
        if cols * threads < slice_vecs and blocks(Layout(cluster, threads, cols)) > blocks(layouts[-1]):
            layouts.append(Layout(cluster, threads, cols))
    return layouts[::-1]


def source(vocab: int, label_dtype: torch.dtype, layout: Layout, mode: int, shared: bool, hash_row_vecs: int = 0) -> str:
    """The kernel's CUDA C for one vocabulary, layout and form: ``mode`` FORWARD / REVERSE / MIXED (mode_of),
    ``shared`` T == 1 (the hard term's softmax is p), ``hash_row_vecs`` > 0: it also hashes a weight whose rows
    hold that many 16-byte vectors of 32-bit words (_fingerprint.py's mix and keys)."""
    if mode == MIXED_PRECISE.value:
        raise ValueError("the cluster step has no MIXED_PRECISE form: those betas and logits run the Triton step")
    keys = {}
    if hash_row_vecs:
        keys = {f"HASH_KEY_{lane}{k}": f"{key & MASK}u" for lane, lane_keys in enumerate(LANE_KEYS)
                for k, key in enumerate(lane_keys)}
        keys.update(HASH_MIX_MULTIPLIER_0=f"{MIX[0] & MASK}u", HASH_MIX_SHIFT_0=MIX[1],
                    HASH_MIX_MULTIPLIER_1=f"{MIX[2] & MASK}u", HASH_MIX_SHIFT_1=MIX[3])
    return row_step_cuda.with_defines(dict(row_step_cuda.layout_defines(vocab, label_dtype, layout, _tiles(mode)),
                                           MODE=mode, SHARED=int(shared), HASH_ROW_VECS=hash_row_vecs, **keys), _SOURCE)


def supported(student_logits, teacher_logits, labels, constants: RowStepConstants, write_grad, grad_lifts) -> bool:
    """Whether this kernel computes exactly what _row_step_jsd.py asks for these arguments: where the cosine
    loss's cluster kernel would run (bf16 logits, the same layouts and device), at a beta it has a form for (a
    beta within EDGE_MARGIN of 0 or 1 runs the Triton step's MIXED_PRECISE: mode_of)."""
    return (teacher_logits is not None and mode_of(constants.beta, student_logits.dtype) != MIXED_PRECISE.value
            and row_step_cuda.supported(student_logits, teacher_logits, labels, constants, write_grad, grad_lifts))


@functools.lru_cache(maxsize=None)
def _kernel(vocab: int, label_dtype: torch.dtype, device_index: int, layout: Layout, mode: int, shared: bool,
            hash_row_vecs: int = 0):
    return row_step_cuda.compile_cluster_kernel(source(vocab, label_dtype, layout, mode, shared, hash_row_vecs),
                                                "cluster_jsd_row_step", layout,
                                                _shared_bytes(vocab, *layout, _tiles(mode)), device_index)


@functools.lru_cache(maxsize=None)
def _fitting_kernel(vocab: int, label_dtype: torch.dtype, device_index: int, mode: int, shared: bool, hash_row_vecs: int = 0):
    """(kernel, layout) at the first of candidate_layouts' layouts that fits without a spill; None where none
    does (the Triton step runs instead)."""
    for layout in candidate_layouts(vocab, mode):
        if _shared_bytes(vocab, *layout, _tiles(mode)) <= MAX_SHARED_BYTES:
            kernel = _kernel(vocab, label_dtype, device_index, layout, mode, shared, hash_row_vecs)
            if kernel is not None:
                return kernel, layout
    return None


def launch(kernel, layout: Layout, student_logits, teacher_logits, labels, constants: RowStepConstants,
           token_losses, hash_args=()) -> None:
    """One launch of a compiled kernel of this source (benchmarks/diagnose.py times variants); ``hash_args``
    (words, rows, row stride in vectors, partials) for a kernel compiled to hash a weight."""
    rows, vocab = student_logits.shape
    row_step_cuda.launch_rows(
        kernel, layout, rows, _shared_bytes(vocab, *layout, _tiles(mode_of(constants.beta, student_logits.dtype))),
        student_logits.device,
        [student_logits, teacher_logits, labels, token_losses, student_logits.stride(0), teacher_logits.stride(0),
         constants.ignore_index, float(constants.weight_hard), constants.weight_soft / constants.temperature,
         LOG2E.value / constants.temperature, 1.0 - constants.beta, float(constants.beta), *hash_args])


def _found(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses, write_grad, grad_lifts,
           hash_row_vecs: int = 0):
    """_fitting_kernel's (kernel, layout) for these arguments where this kernel computes the spec for them, else None."""
    if not (supported(student_logits, teacher_logits, labels, constants, write_grad, grad_lifts)
            and token_losses.is_contiguous()):
        return None
    _check_constants(constants)
    return _fitting_kernel(student_logits.shape[1], labels.dtype, student_logits.device.index,
                   mode_of(constants.beta, student_logits.dtype), constants.temperature == 1.0, hash_row_vecs)


def row_step_jsd_cuda(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses, write_grad,
                      grad_lifts=None) -> None:
    """_row_step_jsd.row_step_jsd_torch: this kernel where ``supported``, else the Triton step."""
    found = _found(student_logits, teacher_logits, labels, constants, token_losses, write_grad, grad_lifts)
    if found is None:
        row_step_jsd_triton(student_logits, teacher_logits, labels, constants, token_losses, write_grad, grad_lifts)
        return
    launch(*found, student_logits, teacher_logits, labels, constants, token_losses)


def row_step_jsd_cuda_hashing(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses, write_grad,
                              grad_lifts=None, *, words) -> torch.Tensor | None:
    """row_step_jsd_cuda in this kernel, taking along the hash of ``words`` (_fingerprint.as_words of a weight):
    the hash's partial lanes [blocks, 2] (_fingerprint.lanes_of sums them). None, with nothing run, where the
    kernel does not take these arguments or the launch has too few rows for the weight (HASH_ROWS_PER_BLOCK)."""
    hashable = (words.dtype == torch.int32 and words.dim() == 2 and words.device == student_logits.device
                and words.stride(1) == 1 and words.shape[1] % 4 == 0 and words.stride(0) % 4 == 0
                and words.data_ptr() % 16 == 0)
    found = _found(student_logits, teacher_logits, labels, constants, token_losses, write_grad, grad_lifts,
                   words.shape[1] // 4) if hashable else None
    rows = student_logits.shape[0]
    if found is None or rows * found[1].cluster * HASH_ROWS_PER_BLOCK < words.shape[0]:
        return None
    partials = torch.empty(rows * found[1].cluster, 2, dtype=torch.int32, device=student_logits.device)
    launch(*found, student_logits, teacher_logits, labels, constants, token_losses,
           hash_args=[words, words.shape[0], words.stride(0) // 4, partials])
    return partials


# A vocabulary split over ranks runs the Triton step's three stages (the cluster kernel has no split form).
JSD_CUDA_ROW_STEP = RowStepImpl(row_step_jsd_cuda, None, None, split=split_jsd_row_step_triton,
                                hashing_step=row_step_jsd_cuda_hashing)
