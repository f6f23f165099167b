"""A compiled Gluon kernel launched in two steps, so that little host work falls between two launches.

NVIDIA's harness times eager calls from the first kernel's start to the last one's end: where a call issues a
second kernel, the host time between the two launch calls beyond the first kernel's GPU time shows in that span.
Triton's ``kernel[grid](...)`` binds and specialises every argument and encodes each host TMA descriptor (a
CUtensorMap) on every call: ~180 µs for 14 descriptors on the H200's machine. :class:`EncodedLaunch` splits that
into :meth:`~EncodedLaunch.encode` (the arguments as Triton's C launcher takes them; run it before the first kernel
is issued) and :meth:`~EncodedLaunch.launch` (one call into that launcher, ~10 µs), from the kernel Triton compiled
on its first call. It uses Triton's own launcher and descriptor encoder (``triton.backends.nvidia.driver``, triton 3.6).
:class:`KernelLaunches` keeps one kernel's encoded launches per specialisation (:func:`specialization`): the grouped
engine's launches (``moe_lib/engine/``) go through it, and keep a call's encoded arguments under what they are made
of (:meth:`KernelLaunches.memoised`, :func:`signature`), so that a training step's repeated calls skip encoding.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import threading
import warnings

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: gl.dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout of a TMA block, built once: building it takes ~20 µs of host time."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def descriptor(tensor, block: tuple[int, ...]) -> TensorDescriptor:
    """A host TMA descriptor of a 16-bit contiguous ``tensor`` in ``block`` tiles, in the swizzled layout."""
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"tensor: the Gluon launches take bf16 or fp16 operands, not {tensor.dtype}")
    return TensorDescriptor.from_tensor(tensor, list(block), shared_layout(tuple(block), dtype))


class EncodedLaunch:
    """A kernel once compiled (what ``kernel[grid](...)`` returned), launched in two steps: :meth:`encode` turns a
    call's arguments into what Triton's C launcher takes (each host descriptor a CUtensorMap encoded by Triton's own
    encoder, followed by its shape and strides) and :meth:`launch` hands them to that launcher."""

    def __init__(self, compiled):
        from triton.backends.nvidia import driver as cuda_driver  # the launcher Triton builds for this kernel
        from triton.runtime.build import compile_module_from_src

        metadata = compiled.metadata
        if metadata.profile_scratch_size:
            raise RuntimeError(f"{compiled.name} needs profile scratch memory: EncodedLaunch does not allocate it")
        # global scratch (descriptors made on the device) is allocated per launch, as Triton's launcher does
        self.scratch_bytes, self.scratch_align = metadata.global_scratch_size, metadata.global_scratch_align
        self.ctas = getattr(metadata, "num_ctas", 1)
        compiled._init_handles()
        source, names = compiled.src, compiled.src.fn.arg_names
        constants = {(names.index(k),) if isinstance(k, str) else k: v for k, v in source.constants.items()}
        self.descriptor_metadata = metadata.tensordesc_meta  # per descriptor argument: swizzle, element type, block
        launcher_source = cuda_driver.make_launcher(constants, dict(source.signature), self.descriptor_metadata)
        self.c_launch = compile_module_from_src(
            src=launcher_source,
            name="__triton_launcher",
            library_dirs=cuda_driver.library_dirs(),
            include_dirs=cuda_driver.include_dirs,
            libraries=cuda_driver.libraries,
        ).launch
        self.encode_descriptor = cuda_driver.make_tensordesc_arg
        self.function, self.packed_metadata = compiled.function, compiled.packed_metadata
        self.cooperative, self.pdl = metadata.launch_cooperative_grid, metadata.launch_pdl

    def encode(self, *arguments) -> list:
        """The launcher's arguments from the kernel's, in its order (constexprs included): each host descriptor
        encoded (one given for several arguments, once), tensors and scalars as they are."""
        descriptors = sum(isinstance(argument, TensorDescriptor) for argument in arguments)
        if descriptors != len(self.descriptor_metadata):
            raise ValueError(f"arguments: {descriptors} descriptors, the kernel takes {len(self.descriptor_metadata)}")
        encoded, metadata, done = [], iter(self.descriptor_metadata), {}  # done: id → (its metadata, its encoding)
        for argument in arguments:
            if isinstance(argument, TensorDescriptor):
                meta = next(metadata)
                before = done.get(id(argument))
                if before is None or before[0] != meta:
                    if not done and argument.base.is_cuda:
                        context_current_on_this_thread()
                    before = done[id(argument)] = (meta, self.encode_descriptor(argument, meta))
                encoded.extend(before[1])
            else:
                encoded.append(argument)
        return encoded

    def global_scratch(self, programs: int, stream: int):
        """The kernel's global scratch for a launch of ``programs`` programs, as Triton's launcher allocates it
        (``triton/backends/nvidia/driver.py``, ``CudaLauncher``): programs × CTAs × the compiled size, at the
        compiled alignment, from the allocator ``triton.set_allocator`` set; None where the kernel needs none."""
        if not self.scratch_bytes:
            return None
        from triton.runtime import _allocation  # the allocator triton.set_allocator set, in this context

        return _allocation._allocator.get()(programs * self.ctas * self.scratch_bytes, self.scratch_align, stream)

    def launch(self, programs: int, arguments: list, stream: int) -> None:
        """One launch of ``programs`` programs on ``stream`` (a CUDA stream handle), no launch hooks."""
        scratch = self.global_scratch(programs, stream)  # held until the launch is issued (stream-ordered reuse)
        self.c_launch(
            programs,
            1,
            1,
            stream,
            self.function,
            self.cooperative,
            self.pdl,
            scratch,
            None,
            self.packed_metadata,
            None,
            None,
            None,
            *arguments,
        )


_THREAD = threading.local()  # .context_ready: a CUDA context was found or made current on this thread


def context_current_on_this_thread() -> None:
    """Make the current device's primary CUDA context current on this thread where none is, as Triton's launcher does
    before it launches. The descriptor encoder calls the driver directly and fails without one ("invalid device
    context"), which a thread torch starts can lack: autograd's device thread, where a backward's first CUDA call is
    a descriptor's encoding (torch leaves the device unset there where it is the thread's default already)."""
    if getattr(_THREAD, "context_ready", False):
        return
    driver, context = cuda_driver_api(), ctypes.c_void_p()
    _check(driver.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    if not context.value:
        device = ctypes.c_int()
        _check(driver.cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()), "cuDeviceGet")
        _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    _THREAD.context_ready = True


def specialization(argument):
    """What Triton's JIT (3.6: ``native_specialize_impl`` in ``triton/runtime/jit.py``'s binder) compiles a run-time
    argument for, as a key: a host descriptor's dtype, block and layout; a tensor's dtype and whether it starts on a
    16-byte boundary; an integer's width (i32, i64, u64) and whether it is a multiple of 16, or 1 itself (which the
    JIT makes a constant); a bool's or a float's type alone (their values are not specialised); None. Cheaper than
    Triton's own for a descriptor (which builds its type's string, ~1.5 µs); anything else goes through Triton's."""
    if isinstance(argument, TensorDescriptor):
        return argument.base.dtype, tuple(argument.block_shape), argument.layout
    if isinstance(argument, torch.Tensor):
        return argument.dtype, argument.data_ptr() % 16 == 0
    if isinstance(argument, bool) or argument is None:
        return type(argument)
    if isinstance(argument, int):
        if argument == 1:
            return 1
        width = "i32" if -(2**31) <= argument < 2**31 else "i64" if -(2**63) <= argument < 2**63 else "u64"
        return width, argument % 16 == 0
    if isinstance(argument, float):
        return float
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, argument, False, True, True)


def signature(value):
    """What one argument of a call contributes to the launch's encoded arguments, as a key: a tensor's address,
    shape, strides and dtype (its host descriptors and its pointer are made of nothing else); a sequence's items'
    signatures; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr(), tuple(value.shape), value.stride(), value.dtype
    if isinstance(value, (tuple, list)):
        return tuple(signature(item) for item in value)
    return value


class KernelLaunches:
    """One kernel's launches ``kernel[(programs,)](**arguments, maxnreg=maxnreg)``: the first per key through
    Triton's JIT (which compiles the kernel), kept as an :class:`EncodedLaunch` of what it compiled; later ones with
    the same key encode their arguments and go to the compiled kernel's launcher. The key fixes what the JIT compiles
    for: the device, ``maxnreg``, every constexpr's value (``num_warps`` included) and each run-time argument's
    :func:`specialization` (never coarser than the JIT's: where a kernel's ``do_not_specialize`` makes the JIT's
    coarser, two keys hold the one kernel it compiled)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = tuple(kernel.arg_names)
        self.constexprs = tuple(parameter.is_constexpr for parameter in kernel.params)
        self.compiled: dict = {}  # key → EncodedLaunch
        self.memo: collections.OrderedDict = collections.OrderedDict()  # call key → (launch, programs, arguments)

    def key(self, values, maxnreg: int, device) -> tuple:
        """The compile key of a launch with the kernel's arguments ``values`` (in its order)."""
        pairs = zip(values, self.constexprs, strict=True)
        return (device, maxnreg, *(value if constexpr else specialization(value) for value, constexpr in pairs))

    def __call__(self, programs: int, arguments: dict, *, maxnreg: int, device) -> None:
        """One launch of ``programs`` programs on ``device``'s current stream; ``arguments``: every kernel argument
        by name, constexprs and ``num_warps`` included."""
        values = [arguments[name] for name in self.names]
        key = self.key(values, maxnreg, device)
        encoded = self.compiled.get(key)
        if encoded is None:
            self.compiled[key] = EncodedLaunch(self.kernel[(programs,)](**arguments, maxnreg=maxnreg))
            return
        encoded.launch(programs, encoded.encode(*values), torch.cuda.current_stream(device).cuda_stream)

    MEMO_ENTRIES = 256  # calls kept: a training step's launches of every layer, repeated step after step

    def memoised(self, call_key, make, *, maxnreg: int, device) -> None:
        """One launch whose arguments ``make()`` builds, as ``(programs, every kernel argument by name)``, its encoded
        arguments kept under ``call_key``. ``call_key`` must fix them: every tensor's :func:`signature` and every
        other value that reaches the arguments (in a training loop they repeat from step to step, the allocator
        handing out the same addresses). A key seen before launches what was encoded, without building, keying or
        encoding anything again; tensors are kept as their addresses, so nothing is held alive."""
        stream = torch.cuda.current_stream(device).cuda_stream
        kept = self.memo.get(call_key)
        if kept is not None:
            encoded, programs, arguments = kept
            encoded.launch(programs, arguments, stream)
            return
        programs, by_name = make()
        values = [by_name[name] for name in self.names]
        key = self.key(values, maxnreg, device)
        encoded = self.compiled.get(key)
        if encoded is None:  # the first of its kind: compiled by Triton's JIT, which launches it
            self.compiled[key] = EncodedLaunch(self.kernel[(programs,)](**by_name, maxnreg=maxnreg))
            return
        arguments = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in encoded.encode(*values)]
        if len(self.memo) >= self.MEMO_ENTRIES:
            self.memo.popitem(last=False)
        self.memo[call_key] = encoded, programs, arguments
        encoded.launch(programs, arguments, stream)


def prepared_launch(
    cache: dict,
    key,
    kernel,
    programs: int,
    arguments: tuple,
    *,
    warps: int,
    maxnreg: int,
    device,
    options: dict | None = None,
):
    """The callable that runs ``kernel[(programs,)](*arguments, num_warps=warps, maxnreg=maxnreg, **options)`` on
    ``device``'s current stream, made ready now. ``arguments``: every kernel argument in order except its last,
    ``num_warps``; ``options``: further compile options (``launch_pdl=True``: issued by programmatic dependent
    launch, which the compiled kernel's launcher then keeps).
    The first call per ``key`` goes through Triton's JIT (which compiles the kernel) and keeps an
    :class:`EncodedLaunch` of it in ``cache``; later calls encode the arguments now and launch through it. ``key``
    must fix everything the JIT specialises on (dtypes, descriptor blocks and layouts, pointer alignment, the
    integers it is not told not to specialise)."""
    encoded = cache.get(key)
    if encoded is None:

        def first_launch():
            cache[key] = EncodedLaunch(
                kernel[(programs,)](*arguments, num_warps=warps, maxnreg=maxnreg, **(options or {}))
            )

        return first_launch
    encoded_arguments = encoded.encode(*arguments, warps)
    stream = torch.cuda.current_stream(device).cuda_stream

    def launch(on_stream: int = stream):  # ``on_stream``: another stream's handle (a side stream being captured)
        encoded.launch(programs, encoded_arguments, on_stream)

    launch.compiled = True  # its kernel is compiled: it can be captured into a graph (the first call cannot)
    return launch


# --- launches submitted as one CUDA graph ---------------------------------------------------------------------------
# Two kernels issued one after the other from the host reach the GPU as far apart as the host's time between the two
# launch calls: where the first kernel is shorter than that, the GPU waits for the second (NVIDIA's harness counts
# that wait). Captured into one CUDA graph and launched with one call, both are on the GPU before the first starts.
# The graph is captured on a side stream (nothing runs there during a capture), kept executable per key and brought
# up to each call's arguments (cuGraphExecUpdate: a few µs, where instantiating anew takes tens), then launched on the
# caller's stream. CUDA's driver API through ctypes (libcuda, present wherever a CUDA GPU is).
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
GRAPH_EXECS_KEPT = 64  # executable graphs kept (one per key: design and token count), the oldest dropped beyond


class _GraphExecUpdateResultInfo(ctypes.Structure):  # CUgraphExecUpdateResultInfo
    _fields_ = [("result", ctypes.c_int), ("error_node", ctypes.c_void_p), ("error_from_node", ctypes.c_void_p)]


@functools.cache
def cuda_driver_api():
    """libcuda's graph, capture and context functions, typed (OSError or AttributeError where libcuda or one of them is
    missing: see :func:`one_graph_available`)."""
    lib = ctypes.CDLL("libcuda.so.1")
    handle, pointer = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    for name, argtypes in (
        ("cuStreamBeginCapture_v2", [handle, ctypes.c_int]),
        ("cuStreamEndCapture", [handle, pointer]),
        ("cuGraphInstantiateWithFlags", [pointer, handle, ctypes.c_ulonglong]),
        ("cuGraphExecUpdate_v2", [handle, handle, ctypes.POINTER(_GraphExecUpdateResultInfo)]),
        ("cuGraphLaunch", [handle, handle]),
        ("cuGraphDestroy", [handle]),
        ("cuGraphExecDestroy", [handle]),
        ("cuCtxGetCurrent", [pointer]),
        ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
        ("cuDevicePrimaryCtxRetain", [pointer, ctypes.c_int]),
        ("cuCtxSetCurrent", [handle]),
    ):
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


@functools.cache
def one_graph_available() -> bool:
    """Whether this machine's CUDA driver has what :func:`launch_as_one_graph` calls (CUDA 12's graph updates); where
    not, a warning once, and the callers issue their launches one after the other (the same results)."""
    try:
        cuda_driver_api()
    except (OSError, AttributeError) as exc:
        warnings.warn(
            f"the CUDA driver cannot update graphs ({exc}): kernel launches go one after the other",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def can_launch_as_one_graph(launches) -> bool:
    """Whether :func:`launch_as_one_graph` can take ``launches`` now: each of a compiled kernel (a first call compiles
    through Triton's JIT, which cannot be captured), the current stream not being captured by the caller (whose graph
    then takes the launches as they are), and a driver that updates graphs."""
    return (
        all(getattr(launch, "compiled", False) for launch in launches)
        and not torch.cuda.is_current_stream_capturing()
        and one_graph_available()
    )


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUresult {result}")


GRAPH_EXECS: collections.OrderedDict = collections.OrderedDict()  # key → CUgraphExec handle
_SIDE_STREAMS: dict = {}  # (device, thread) → the stream graphs are captured on (one capture per stream at a time)
# held from a kept executable's update to its launch: another thread's update in between would launch its arguments
_GRAPH_EXECS_LOCK = threading.Lock()


def launch_as_one_graph(key, launches, device) -> None:
    """Runs ``launches`` (callables taking a stream handle, each from :func:`prepared_launch` of a compiled kernel)
    in order as one CUDA graph on ``device``'s current stream. ``key`` names the graph's shape (which kernels, how
    many programs each): calls with the same key update one kept executable graph."""
    driver = cuda_driver_api()
    side = _SIDE_STREAMS.get((device, threading.get_ident()))
    if side is None:
        side = _SIDE_STREAMS[device, threading.get_ident()] = torch.cuda.Stream(device)
    capture = ctypes.c_void_p(side.cuda_stream)
    _check(driver.cuStreamBeginCapture_v2(capture, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
    graph = ctypes.c_void_p()
    try:
        for launch in launches:
            launch(side.cuda_stream)
    finally:  # the capture ends whatever happened, so that the side stream is usable again
        ended = driver.cuStreamEndCapture(capture, ctypes.byref(graph))
    _check(ended, "cuStreamEndCapture")
    try:
        with _GRAPH_EXECS_LOCK:
            executable = GRAPH_EXECS.pop(key, None)
            update = _GraphExecUpdateResultInfo()
            if executable is not None and driver.cuGraphExecUpdate_v2(executable, graph, ctypes.byref(update)) != 0:
                driver.cuGraphExecDestroy(executable)  # a shape the update cannot take: instantiated anew below
                executable = None
            if executable is None:
                executable = ctypes.c_void_p()
                _check(driver.cuGraphInstantiateWithFlags(ctypes.byref(executable), graph, 0), "cuGraphInstantiate")
            GRAPH_EXECS[key] = executable
            while len(GRAPH_EXECS) > GRAPH_EXECS_KEPT:  # an evicted one still running is freed when it completes
                driver.cuGraphExecDestroy(GRAPH_EXECS.popitem(last=False)[1])
            stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
            _check(driver.cuGraphLaunch(executable, stream), "cuGraphLaunch")
    finally:
        driver.cuGraphDestroy(graph)
