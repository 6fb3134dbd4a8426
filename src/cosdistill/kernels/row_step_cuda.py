"""The cosine loss's row step with each logit read once: a CUDA kernel for Hopper, compiled at run time by NVRTC.

The Triton row step (``row_step_triton.py``) reads every student and teacher logit twice, once for the
row's statistics and once for its gradient, because a row (0.5 MB at V = 128256) does not fit on one
SM. Here a cluster of 8 or 16 thread blocks on as many SMs holds one row in their shared memory: each
block copies its slice of the row in (cp.async), reduces its partial statistics, the blocks exchange
them through distributed shared memory, and each writes its slice's d loss / d s from shared memory.
Where it lets more blocks share an SM, part of each slice stays in the threads' registers instead
(``Layout.register_cols``).
HBM moves two reads and one write per logit pair instead of four reads and one write (docs/design.md,
The row step). Triton gives no access to a cluster's distributed shared memory; NVRTC ships with torch's
CUDA build (``torch.cuda._compile_kernel``), so users need no compiler.

Only the common case takes this path (``supported``): bf16 logits of one vocabulary size V (a multiple
of 8), gradients wanted, no softcap, logit scale, fp16 lifts or vocabulary split. Everything else, and
rows the kernel's fp32 sums or its one-FFMA exponent cannot take (row_step.cu: sums past fp32's range, a sum of
squares below 2^-100, zero included, a largest logit past 16384 in size; left untouched with NaN losses, as the
Triton kernel's first launch leaves its own), goes through the Triton kernels. The math is _row_step.py's, as in
the Triton twin.

Compiled with TEACHER 0 (``models=1``) it is the Gram path's row step (_teacher_gram.py, ``gram_row_step_cuda``):
the student's logits alone, each row's s.t and |t|^2 given, each row's coefficient of t written out;
no rescue there: a row whose sums overflow or whose largest logit passes 16384 gets NaN losses and gradient, as
_teacher_gram.py says (tiny sums are kept: the norms' clamp at eps T hides them but at tiny T).
"""

import contextlib
import ctypes
import functools
import importlib.resources
from typing import NamedTuple

import torch

from .._row_step import RowStepConstants, RowStepImpl
from .row_step_triton import row_grad_triton, row_stats_triton, row_step_triton
from .triton_common import FLOAT32_MAX, SMALLEST_PLAIN_SUM

MAX_SHARED_BYTES = 200 * 1024  # beside the static shared memory, under the H200's 227 KB per block
_LOCAL_SIZE_BYTES, _NUM_REGS, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 3, 4, 14  # CUfunction_attribute
_LABEL_TYPES = {torch.int64: "long long", torch.int32: "int"}


def cuda_source(name: str) -> str:
    """A kernel's CUDA C from the package: cluster.cuh (what the cluster kernels share), then the file."""
    files = importlib.resources.files(__package__)
    return (files / "cluster.cuh").read_text() + (files / name).read_text()


# The kernel's CUDA C, with the #defines of ``source`` prepended; compiled by NVRTC.
_SOURCE = cuda_source("row_step.cu")


class Layout(NamedTuple):
    """How one row spreads over a cluster: blocks, threads per block, and how many of each thread's
    vectors stay in its registers instead of shared memory."""
    cluster: int
    threads: int
    register_cols: int = 0


def candidate_layouts(vocab: int, models: int = 2) -> list[Layout]:
    """The layouts _fitting_kernel tries in turn, from the H200 layout sweeps (docs/design.md): about 32 KB of
    shared memory per block (several blocks share an SM and cover each other's idle phases), and where
    that leaves fewer than 8 blocks per SM, up to a third of each thread's vectors in registers: the
    layouts with the most blocks per SM first, then the most warps, then the fewest register vectors.
    Only ptxas knows which of them spill within the registers that __launch_bounds__ leaves, so _fitting_kernel
    compiles them in turn; the last has no register vectors, so no bound. 16 blocks is past the
    portable cluster size; Hopper allows it. ``models``: 2, or 1 for the Gram path's student logits alone
    (the same rules, not swept on their own)."""
    cluster = 8 if _shared_bytes(vocab, 8, tiles=models) <= 48 * 1024 else 16
    slice_vecs = _slice_vecs(vocab, cluster)
    plain = Layout(cluster, 128 if slice_vecs <= 1024 else 256)

    def blocks(layout):
        return _blocks_per_sm(_shared_bytes(vocab, *layout, tiles=models), layout.threads)

    if blocks(plain) >= 8:  # the synchronous register loads cost more than a ninth block gains
        return [plain]
    with_registers = [Layout(cluster, threads, register_cols) for threads in range(128, 257, 32)
                      for register_cols in range(1, -(-slice_vecs // threads) // 3 + 1)]
    # At least 32 registers and 4 more per model and register vector: ptxas's least without a spill.
    with_registers = [layout for layout in with_registers if _shared_bytes(vocab, *layout, tiles=models) >= 0
                      and (32 + 4 * models * layout.register_cols) * layout.threads * blocks(layout) <= 65536]
    with_registers.sort(key=lambda layout: (-blocks(layout), -blocks(layout) * layout.threads, layout.register_cols))
    return [layout for layout in with_registers[:3] if blocks(layout) > blocks(plain)] + [plain]


def _slice_vecs(vocab: int, cluster: int) -> int:
    """16-byte vectors (8 logits) of the row per block."""
    return -(-vocab // (8 * cluster))


def _shared_bytes(vocab: int, cluster: int, threads: int = 0, register_cols: int = 0, tiles: int = 2) -> int:
    """Dynamic shared memory per block: the slice but the vectors held in registers, ``tiles`` 16-byte tiles per
    vector (one per model's logits; the JSD's mixed step keeps a third)."""
    return tiles * 16 * (_slice_vecs(vocab, cluster) - register_cols * threads)


def _blocks_per_sm(shared_bytes: int, threads: int) -> int:
    """Blocks an SM holds by shared memory (Hopper: 228 KB per SM, 1 KB reserved per block), threads (2048)
    and blocks (32). With vectors in registers, __launch_bounds__ caps the registers so that they allow
    as many; without, ptxas picks the count itself."""
    static_bytes = -(-(threads // 32 * 5 + 5 + 6) * 4 // 16) * 16  # warp_parts, block_parts, row_coefs
    return max(1, min((228 * 1024) // (shared_bytes + 1024 + static_bytes), 2048 // threads, 32))


def layout_defines(vocab: int, label_dtype: torch.dtype, layout: Layout, tiles: int = 2) -> dict:
    """The #defines every cluster kernel takes (cluster.cuh's): the layout, the vocabulary, the label type;
    ``tiles``: _shared_bytes's."""
    shared = _shared_bytes(vocab, *layout, tiles=tiles)
    if shared < 0 or layout.register_cols < 0:
        raise ValueError(f"{layout} holds more vectors per block in registers than the {_slice_vecs(vocab, layout.cluster)} "
                         f"of a vocab-{vocab} slice")
    return dict(CLUSTER=layout.cluster, THREADS=layout.threads, REGISTER_COLS=layout.register_cols,
                MIN_BLOCKS=_blocks_per_sm(shared, layout.threads), VOCAB=vocab,
                SLICE_VECS=_slice_vecs(vocab, layout.cluster), LABEL_T=_LABEL_TYPES[label_dtype])


def with_defines(defines: dict, source_text: str) -> str:
    return "".join(f"#define {name} {value}\n" for name, value in defines.items()) + source_text


def source(vocab: int, label_dtype: torch.dtype, layout: Layout, models: int = 2) -> str:
    return with_defines(dict(layout_defines(vocab, label_dtype, layout, models), TEACHER=int(models == 2),
                             SMALLEST_PLAIN_SUM=f"{SMALLEST_PLAIN_SUM.value!r}f", FLOAT32_MAX=f"{FLOAT32_MAX.value!r}f"),
                        _SOURCE)


@functools.lru_cache(maxsize=None)  # asked every call; a device's capability never changes
def available(device: torch.device) -> bool:
    """NVRTC through torch, whose kernels take more than the default shared memory (not in every release that has
    ``_compile_kernel``), and a GPU with thread block clusters (Hopper or newer)."""
    kernel_class = getattr(getattr(torch.cuda, "_utils", None), "_CudaKernel", None)
    return (device.type == "cuda" and hasattr(torch.cuda, "_compile_kernel")
            and hasattr(kernel_class, "set_shared_memory_config") and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def applies(dtype: torch.dtype, vocab_student: int, vocab_teacher: int, constants: RowStepConstants) -> bool:
    """Whether the kernel computes _row_step.py's step for logits of this kind (layout and device aside)."""
    plain = (constants.student_softcap is None and constants.teacher_softcap is None and constants.student_logit_scale == 1.0
             and constants.teacher_logit_scale == 1.0 and constants.vocab_start == 0
             and constants.vocab_student_total in (None, vocab_student) and -2**31 <= constants.ignore_index < 2**31)
    return (plain and dtype == torch.bfloat16 and vocab_student == vocab_teacher and vocab_student % 8 == 0
            and _shared_bytes(vocab_student, 16) <= MAX_SHARED_BYTES)


def supported(student_logits, teacher_logits, labels, constants: RowStepConstants, write_grad, grad_lifts) -> bool:
    """Whether this kernel computes exactly what _row_step.py asks for these arguments."""
    rows, vocab = student_logits.shape
    return (write_grad and grad_lifts is None and rows > 0 and teacher_logits.dtype == student_logits.dtype
            and teacher_logits.shape[0] == rows and applies(student_logits.dtype, vocab, teacher_logits.shape[1], constants)
            and labels.dtype in _LABEL_TYPES and labels.is_contiguous()
            and student_logits.stride(1) == teacher_logits.stride(1) == 1
            and student_logits.stride(0) % 8 == 0 and teacher_logits.stride(0) % 8 == 0
            and student_logits.data_ptr() % 16 == 0 and teacher_logits.data_ptr() % 16 == 0
            and available(student_logits.device))


class _CuLaunchConfig(ctypes.Structure):  # the driver's CUlaunchConfig, for the occupancy query
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _kernel(vocab: int, label_dtype: torch.dtype, device_index: int, layout: Layout, models: int = 2):
    """The compiled kernel, or None where it does not fit (compile_cluster_kernel)."""
    return compile_cluster_kernel(source(vocab, label_dtype, layout, models), "cluster_row_step", layout,
                                  _shared_bytes(vocab, *layout, tiles=models), device_index)


def compile_cluster_kernel(source_text: str, name: str, layout: Layout, shared_bytes: int, device_index: int):
    """A cluster kernel compiled by NVRTC for the device, or None where not one cluster of it fits on the device
    (16 blocks need a GPC with 16 free SMs, which a MIG slice may not have) or where this NVRTC spills its
    registers to local memory within the __launch_bounds__ of the register vectors."""
    driver, check = _driver(), torch.cuda._utils._check_cuda
    with torch.cuda.device(device_index):
        try:
            kernel = torch.cuda._compile_kernel(source_text, name, nvcc_options=["-std=c++17"])
        except RuntimeError as error:
            raise RuntimeError(f"compiling the CUDA kernel {name} failed; impl='triton' runs without it: "
                               f"{error}") from error
        kernel.set_shared_memory_config(shared_bytes)
        if layout.cluster > 8:  # past the portable size the launch must opt in
            check(driver.cuFuncSetAttribute(kernel.func, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
        fits = max_active_clusters(kernel, layout, shared_bytes) > 0 and kernel_attribute(kernel, _LOCAL_SIZE_BYTES) == 0
    return kernel if fits else None


def kernel_attribute(kernel, attribute: int) -> int:
    """A compiled kernel's CUfunction_attribute (benchmarks/diagnose.py prints its registers, _NUM_REGS)."""
    driver, check = _driver(), torch.cuda._utils._check_cuda
    value = ctypes.c_int()
    check(driver.cuFuncGetAttribute(ctypes.byref(value), attribute, kernel.func))
    return value.value


def max_active_clusters(kernel, layout: Layout, shared_bytes: int) -> int:
    """Clusters of this compiled kernel the current device holds at once (the driver's occupancy query)."""
    driver, check = _driver(), torch.cuda._utils._check_cuda
    config = _CuLaunchConfig((layout.cluster, 1, 1), (layout.threads, 1, 1), shared_bytes, None, None, 0)
    clusters = ctypes.c_int()
    check(driver.cuOccupancyMaxActiveClusters(ctypes.byref(clusters), kernel.func, ctypes.byref(config)))
    return clusters.value


@functools.lru_cache(maxsize=None)
def _fitting_kernel(vocab: int, label_dtype: torch.dtype, device_index: int, models: int = 2):
    """(kernel, layout) at the first of candidate_layouts' layouts that fits without a spill; else at 8 blocks
    of 256 threads (where 16 blocks do not fit); None where none does (the Triton step runs instead)."""
    layouts = candidate_layouts(vocab, models)
    for layout in layouts + [Layout(8, 256)] if layouts[0].cluster > 8 else layouts:
        if _shared_bytes(vocab, *layout, tiles=models) <= MAX_SHARED_BYTES:
            kernel = _kernel(vocab, label_dtype, device_index, layout, models)
            if kernel is not None:
                return kernel, layout
    return None


def cluster_kernel(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses,
                   layout: Layout | None = None) -> None:
    """The kernel alone, for ``supported`` arguments (layout: _fitting_kernel's unless given): rows it cannot take
    (the module's docstring) are left with NaN losses and their logits."""
    vocab = student_logits.shape[1]
    device = student_logits.device
    if layout:
        kernel = _kernel(vocab, labels.dtype, device.index, layout)
        if kernel is None:
            raise ValueError(f"no cluster of {layout} fits on {device}, or it spills registers")
    else:
        kernel, layout = _fitting_kernel(vocab, labels.dtype, device.index)
    launch(kernel, layout, student_logits, teacher_logits, labels, constants, token_losses)


def launch(kernel, layout: Layout, student_logits, teacher_logits, labels, constants, token_losses,
           teacher_products=None, teacher_coefs=None) -> None:
    """One launch of a compiled kernel of this source (benchmarks/diagnose.py row-step times variants);
    teacher_logits None: the one-model kernel with teacher_products and teacher_coefs (gram_row_step_cuda)."""
    rows, vocab = student_logits.shape
    device = student_logits.device
    models = 1 if teacher_logits is None else 2
    if teacher_logits is None:  # never read: the one-model kernel takes no teacher pointer's rows
        teacher_logits = student_logits
    else:  # never read either: the two-model kernel leaves these alone
        teacher_products = teacher_coefs = token_losses
    launch_rows(kernel, layout, rows, _shared_bytes(vocab, *layout, tiles=models), device,
                [student_logits, teacher_logits, labels, token_losses, student_logits.stride(0),
                 teacher_logits.stride(0), constants.ignore_index, float(constants.weight_hard), float(constants.weight_soft),
                 float(constants.beta), float(constants.norm_clamp), teacher_products, teacher_coefs])


@functools.cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver library, opened once for the launches and the kernels' set-up (torch's helper opens it
    again at every call)."""
    return torch.cuda._utils._get_gpu_runtime_library()


def _packed(args: list) -> tuple[list, ctypes.Array]:
    """The kernel's arguments as the driver takes them, by torch._compile_kernel's conventions, which the kernels'
    signatures follow: tensors as device pointers, ints as C ints, floats as doubles. The values come back with
    the array of their addresses, to outlive the launch."""
    values = [ctypes.c_void_p(arg.data_ptr()) if isinstance(arg, torch.Tensor)
              else ctypes.c_double(arg) if isinstance(arg, float) else ctypes.c_int(arg) for arg in args]
    return values, (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))


def launch_rows(kernel, layout: Layout, rows: int, shared_bytes: int, device: torch.device, args: list) -> None:
    """A cluster kernel's launch, one cluster per row, on the tensors' device and its current stream, whichever
    device is current. Straight through the driver: torch's launch wrapper costs more host time than the kernel
    takes at small vocabularies, where the host is what the GPU waits for (docs/design.md, Host latency)."""
    values, pointers = _packed(args)
    switch = contextlib.nullcontext() if torch.cuda.current_device() == device.index else torch.cuda.device(device)
    with switch:
        stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(device.index))
        torch.cuda._utils._check_cuda(_driver().cuLaunchKernel(
            kernel.func, rows * layout.cluster, 1, 1, layout.threads, 1, 1, shared_bytes, stream, pointers, None))
    del values  # kept alive until here: the driver reads the arguments through their addresses at the launch


def row_step_cuda(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses, write_grad,
                  grad_lifts=None) -> None:
    """_row_step.row_step_torch: this kernel and the Triton RESCUE launch where ``supported``, else Triton."""
    if not (supported(student_logits, teacher_logits, labels, constants, write_grad, grad_lifts)
            and token_losses.is_contiguous() and _fitting_kernel(student_logits.shape[1], labels.dtype,
                                                          student_logits.device.index) is not None):
        row_step_triton(student_logits, teacher_logits, labels, constants, token_losses, write_grad, grad_lifts)
        return
    cluster_kernel(student_logits, teacher_logits, labels, constants, token_losses)
    row_step_triton(student_logits, teacher_logits, labels, constants, token_losses, write_grad, rescue_only=True)


def gram_row_step_cuda(student_logits, labels, constants: RowStepConstants, token_losses, teacher_products,
                       teacher_coefs) -> bool:
    """The Gram path's row step (_teacher_gram.py) in one launch of the one-model kernel, where it applies: the
    losses, d L / d s without its teacher term in place, and each row's coefficient of t (0 for ignored
    rows) into teacher_coefs, from each row's raw s.t and |t|^2 in teacher_products [n, 2]. A row it cannot
    take (the module's docstring) gets NaN losses and gradient (no rescue; _teacher_gram.py). Whether it ran."""
    rows, vocab = student_logits.shape
    runs = (rows > 0 and applies(student_logits.dtype, vocab, vocab, constants) and labels.dtype in _LABEL_TYPES
            and labels.is_contiguous() and token_losses.is_contiguous() and teacher_products.is_contiguous()
            and teacher_coefs.is_contiguous() and student_logits.stride(1) == 1 and student_logits.stride(0) % 8 == 0
            and student_logits.data_ptr() % 16 == 0 and available(student_logits.device)
            and _fitting_kernel(vocab, labels.dtype, student_logits.device.index, 1) is not None)
    if runs:
        kernel, layout = _fitting_kernel(vocab, labels.dtype, student_logits.device.index, 1)
        launch(kernel, layout, student_logits, None, labels, constants, token_losses, teacher_products, teacher_coefs)
    return runs


COSINE_CUDA_ROW_STEP = RowStepImpl(row_step_cuda, row_stats_triton, row_grad_triton, gram_step=gram_row_step_cuda)
