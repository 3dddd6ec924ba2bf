"""Import stand-ins that let SGLang 0.5.23 start on a CPU-only machine.

- triton: SGLang's macOS mock (`sglang/_platform_stubs.py`), installed on any platform
  through `sglang_process.triton_mock_finder`, the one name of that module the plugin uses;
- torchvision (its wheel needs a CUDA torch; SGLang needs `transforms.InterpolationMode`),
  sgl_kernel (no kernel runs on the CPU path) and soundfile (audio endpoints only):
  `StandIn` packages, which import but raise when called.
Each is installed only when the real package cannot be imported (a GPU host: nothing).

SGLang spawns processes, so this file runs in each of them before SGLang is imported:
`mrp serve` runs `python -m mrp_dlm.serving.server`, which runs it at import, and `spawn`
children import that main module first; any other program (the tests' `sglang.Engine`)
gets it from the `.pth` hook `.ci/install_sglang.sh` writes, when MRP_SGLANG_CPU_STANDINS
names this file. Of mrp_dlm it imports only the process door (standard library at import).

Deliberately not here: anything that changes numerics.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


def install_triton() -> None:
    """SGLang's macOS triton mock (a meta-path finder answering every `triton.*` import with
    a pass-through mock), on any platform, with the few values SGLang and torch read."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    from mrp_dlm.serving.sglang_process import triton_mock_finder

    finder = triton_mock_finder()
    if finder is None:  # no SGLang
        return
    sys.meta_path.insert(0, finder)

    def mock(name: str) -> types.ModuleType:
        finder.find_spec(name)  # makes the module, as an import would
        return sys.modules[name]

    triton = mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv = lambda a, b: -(a // -b)
    triton.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 1
    triton.Config = TritonConfig
    mock("triton.language").constexpr = Constexpr
    jit = mock("triton.runtime.jit")
    jit.JITFunction = type("JITFunction", (), {})
    jit.KernelInterface = type("KernelInterface", (), {})
    autotuner = mock("triton.runtime.autotuner")
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {})
    autotuner.PTXASError = type("PTXASError", (Exception,), {})
    compiler = mock("triton.compiler.compiler")
    compiler.ASTSource = type("ASTSource", (), {})
    mock("triton.runtime.cache").triton_key = compiler.triton_key = lambda: "triton-stub"
    mock("triton.compiler").CompiledKernel = type("CompiledKernel", (), {})
    mock("triton.backends.compiler").GPUTarget = type("GPUTarget", (), {})


class TritonConfig:
    """`triton.Config` of `@triton.autotune` lists: kept, never used."""

    def __init__(self, kwargs=None, num_warps=4, num_stages=2, **extra):
        self.kwargs, self.num_warps, self.num_stages = kwargs or {}, num_warps, num_stages


class Constexpr:
    """`triton.language.constexpr`, as an annotation and a value wrapper."""

    def __init__(self, value=None):
        self.value = value


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
    if importlib.util.find_spec("sglang") is None:
        return
    install_triton()
    install_stand_in("torchvision")
    install_stand_in("sgl_kernel")
    install_stand_in("soundfile")


install()
