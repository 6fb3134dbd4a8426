"""Launching NVRTC-compiled kernels (``torch.cuda._compile_kernel``) straight through the driver, opened once.

torch's launch wrapper reopens the driver library with ``ctypes.CDLL`` and enters a device context at every
launch, and a Triton launch binds and specializes its arguments in Python: either costs more host time than a
small kernel takes, and at small vocabularies the host is what the GPU waits for (docs/design.md, Host latency).
"""

import contextlib
import ctypes
import functools

import torch


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver library, for the launches and the kernels' set-up (torch's helper opens it again at every
    call)."""
    return torch.cuda._utils._get_gpu_runtime_library()


def check(result: int) -> None:
    torch.cuda._utils._check_cuda(result)


def make_context_current(device_index: int) -> None:
    """The device's primary context made current on a thread that has none yet, as the runtime would make it at
    its first call: autograd's device thread may reach a compile or launch here before any other CUDA work."""
    context = ctypes.c_void_p()
    check(driver().cuCtxGetCurrent(ctypes.byref(context)))
    if context.value is None:
        device = ctypes.c_int()
        check(driver().cuDeviceGet(ctypes.byref(device), device_index))
        check(driver().cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
        check(driver().cuCtxSetCurrent(context))


def compile_kernel(source_text: str, name: str, device_index: int):
    """NVRTC's build of ``name`` in ``source_text`` (C++17), loaded on the device, from any thread."""
    with torch.cuda.device(device_index):
        make_context_current(device_index)
        return torch.cuda._compile_kernel(source_text, name, nvcc_options=["-std=c++17"])


def _packed(args: list) -> tuple[list, ctypes.Array]:
    """The kernel's arguments as the driver takes them, by torch._compile_kernel's conventions, which the kernels'
    signatures follow: tensors as device pointers, ints as C ints, floats as doubles, ctypes values as they are
    (``ctypes.c_longlong`` for sizes past 2^31). The values come back with the array of their addresses, to
    outlive the launch."""
    values = [arg if isinstance(arg, ctypes.c_longlong) else ctypes.c_void_p(arg.data_ptr())
              if isinstance(arg, torch.Tensor) else ctypes.c_double(arg) if isinstance(arg, float) else ctypes.c_int(arg)
              for arg in args]
    return values, (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))


def launch(function, blocks: int, threads: int, shared_bytes: int, device: torch.device, args: list) -> None:
    """One launch of a compiled kernel's ``function`` (a CUfunction), a 1-D grid, on the tensors' device and its
    current stream, whichever device is current."""
    values, pointers = _packed(args)
    switch = contextlib.nullcontext() if torch.cuda.current_device() == device.index else torch.cuda.device(device)
    with switch:
        make_context_current(device.index)
        stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(device.index))
        check(driver().cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, shared_bytes, stream, pointers, None))
    del values  # kept alive until here: the driver reads the arguments through their addresses at the launch
