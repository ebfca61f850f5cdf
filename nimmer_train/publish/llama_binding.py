"""llama.cpp through the ``llama-cpp-cffi`` wheel's prebuilt CPU library (no source build).

Only the wheel's compiled ``_llama_cpp_cpu`` module is loaded, never its Python package (which
pins transformers < 5 and probes for CUDA): ``lib`` and ``ffi`` are llama.cpp's C API as is.
Publish quantizes with it (``llama_model_quantize``); Ring A decodes with it
(:mod:`nimmer_train.runtime.llama_engine`).

The wheel's library was linked against a newer libstdc++ than Debian 12's (one symbol,
``__cxa_call_terminate``, GCC 13+); where the system's lacks it, it is taken from a library
already installed that exports it (greenlet's, a dependency of MLflow's SQLAlchemy) before the
module loads. A CPU without AVX2 (the wheel's minimum) and a missing wheel are one clear line each.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from functools import cache
from pathlib import Path
from typing import Any

from nimmer_train.errors import NimmerError

DIST = "llama-cpp-cffi"
INSTALL = "run `make install` (it installs llama-cpp-cffi with --no-deps)"
_lock = threading.Lock()


class EngineUnavailable(NimmerError):
    """The quantized engine cannot run here (wheel missing, library not loadable, CPU too old)."""


def _module_path() -> Path:
    spec = importlib.util.find_spec("llama")
    if spec is None or not spec.submodule_search_locations:
        raise EngineUnavailable(f"the quantized engine is not installed ({DIST}); {INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("_llama_cpp_cpu.*.so"))
    if not found:
        raise EngineUnavailable(f"{folder} has no _llama_cpp_cpu library; reinstall {DIST}: {INSTALL}")
    return found[0]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _preload_cxa_call_terminate() -> None:
    """Make ``__cxa_call_terminate`` global from an installed library that exports it."""
    import greenlet._greenlet as provider  # noqa: PLC0415 (ships with MLflow's SQLAlchemy)

    ctypes.CDLL(provider.__file__, mode=ctypes.RTLD_GLOBAL)


def _exec(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("_llama_cpp_cpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def binding() -> tuple[Any, Any]:
    """``(lib, ffi)``: llama.cpp's C API, its backend initialised and its log silenced."""
    flags = _cpu_flags()
    if flags and not {"avx2", "fma", "f16c"} <= flags:
        raise EngineUnavailable(
            "this CPU lacks AVX2/FMA/F16C, which the llama-cpp-cffi CPU library needs; "
            "use runtime.engine=torch"
        )
    path = _module_path()
    try:
        module = _exec(path)
    except ImportError as err:
        if "__cxa_call_terminate" not in str(err):
            raise EngineUnavailable(f"{path.name} does not load ({err}); {INSTALL}") from None
        try:
            _preload_cxa_call_terminate()
            module = _exec(path)
        except (ImportError, OSError) as again:
            raise EngineUnavailable(
                f"{path.name} needs a newer libstdc++ (GCC 13+) than this system has ({again})"
            ) from None
    lib, ffi = module.lib, module.ffi

    @ffi.def_extern(name="llama_cpp_cffi_ggml_log_callback")
    def _quiet(level: Any, text: Any, user_data: Any) -> None:  # llama.cpp's log: dropped
        return None

    lib.llama_log_set(lib.llama_cpp_cffi_ggml_log_callback, ffi.NULL)
    lib.llama_backend_init()
    return lib, ffi


def lock() -> threading.Lock:
    """Held around model loads and frees (llama.cpp's loader is not reentrant)."""
    return _lock


def system_info() -> str:
    lib, ffi = binding()
    return ffi.string(lib.llama_print_system_info()).decode()
