"""Import stand-ins that let SGLang 0.5.23 start on a CPU-only machine.

SGLang imports four packages that have no CPU build here, or that text serving never uses:
- triton: SGLang ships a mock for macOS (`sglang/_platform_stubs.py`); we load that file by
  path (importing `sglang` first would need triton already) and install its meta-path mock.
- torchvision: the PyPI wheel needs a CUDA torch; SGLang only needs the module to import and
  `transforms.InterpolationMode` to be a real enum.
- sgl_kernel: a meta-path mock whose every attribute is a mock (no kernel is ever called on
  the CPU path with the torch_native attention backend).
- soundfile: the HTTP server imports it for its audio endpoints (transcription), which a
  text model never serves; the stand-in spares a C library (libsndfile).
The last three are `StandIn` packages: importing works, calling anything raises. Each
stand-in is installed only when the real package cannot be imported, so on a machine that
has them (a GPU host) this file changes nothing.

SGLang spawns processes, so this file must run in every one of them, before SGLang is
imported. Two ways:
- `mrp serve` runs SGLang as `python -m mrp_dlm.serving.server`, which runs this file at
  import; the `spawn` start method imports a child's main module before anything else, so
  every SGLang subprocess gets the stand-ins too;
- any other program (the tests' in-process `sglang.Engine`): `.ci/install_sglang.sh`
  writes a `.pth` hook that runs this file in every Python process when
  MRP_SGLANG_CPU_STANDINS names it. Nothing happens when that variable is unset.
It imports nothing of mrp_dlm (the hook runs it at interpreter start).

Deliberately not here: anything that changes numerics.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path


def sglang_stub_module() -> types.ModuleType | None:
    """sglang/_platform_stubs.py loaded by path, or None when sglang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "_platform_stubs.py"
    file_spec = importlib.util.spec_from_file_location("mrp_sglang_platform_stubs", path)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[file_spec.name] = module  # its dataclasses look their module up by name
    file_spec.loader.exec_module(module)
    return module


def install_triton(stubs: types.ModuleType) -> None:
    """SGLang's macOS triton mock, installed on any platform."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    sys.meta_path.insert(0, stubs._TritonFinder())
    triton = stubs._make_mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv, triton.next_power_of_2, triton.Config = (stubs._cdiv, stubs._next_power_of_2,
                                                          stubs._Config)
    language = stubs._make_mock("triton.language")

    class constexpr:
        def __init__(self, value=None):
            self.value = value

    language.constexpr = constexpr
    triton.language = language
    jit = stubs._make_mock("triton.runtime.jit")
    jit.JITFunction = type("JITFunction", (), {})
    jit.KernelInterface = type("KernelInterface", (stubs._StubBase,), {})
    autotuner = stubs._make_mock("triton.runtime.autotuner")
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {})
    autotuner.PTXASError = type("PTXASError", (Exception,), {})
    cache = stubs._make_mock("triton.runtime.cache")
    cache.triton_key = stubs._triton_key
    compiler = stubs._make_mock("triton.compiler.compiler")
    compiler.triton_key = stubs._triton_key
    compiler.ASTSource = type("ASTSource", (stubs._StubBase,), {})
    stubs._make_mock("triton.compiler").CompiledKernel = type("CompiledKernel",
                                                              (stubs._StubBase,), {})
    stubs._make_mock("triton.backends.compiler").GPUTarget = type("GPUTarget",
                                                                   (stubs._StubBase,), {})


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class StandIn(types.ModuleType):
    """A package whose every attribute is another stand-in: CamelCase names are empty
    classes (they may be subclassed or used in isinstance), others are sub-stand-ins that
    raise when called. Only importing and defining things works; nothing runs."""

    def __init__(self, name: str, loader: importlib.abc.Loader | None) -> None:
        super().__init__(name)
        self.__path__ = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, loader, is_package=True)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if name[:1].isupper():
            child = type(name, (), {"__module__": self.__name__})
        else:
            child = sys.modules.setdefault(full, StandIn(full, self.__spec__.loader))
        setattr(self, name, child)
        return child

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a CPU import stand-in and cannot run")


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every import of `root` and its submodules with a StandIn."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return StandIn(spec.name, self)

    def exec_module(self, module):
        if module.__name__ == "torchvision":
            module.__version__ = "0.0.0+cpu-standin"
        if module.__name__ == "torchvision.transforms":
            module.InterpolationMode = InterpolationMode


def install_stand_in(root: str) -> None:
    if root not in sys.modules and importlib.util.find_spec(root) is None:
        sys.meta_path.append(StandInFinder(root))


def install() -> None:
    stubs = sglang_stub_module()
    if stubs is None:
        return
    install_triton(stubs)
    install_stand_in("torchvision")
    install_stand_in("sgl_kernel")
    install_stand_in("soundfile")


install()
