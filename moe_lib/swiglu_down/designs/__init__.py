"""P1's designs, one file each, behind one interface (:mod:`.base`: ``name``, ``supports``, ``run``).

    few_tokens.py        one launch, two phases waiting on each other per I-block: T ≤ 128 (the weights streamed once)
    gluon.py             two Gluon launches, TMA-fed and warp-specialised (Hopper, 16-bit, rows TMA can address)
    library_gemms.py     cuBLAS's four products around one Triton dSwiGLU pass (any CUDA GPU, 16-bit)
    chained.py           the two Triton launches' tiles as one launch, ordered by tickets (no host gap between them)
    triton_launches.py   two Triton launches of pointer-based tiles: any dtype, any device Triton runs on
    engine.py            the fast path as three launches of the grouped GEMM engine with one expert (Hopper, bf16;
                         the saved σ and silu read by its epilogue); chosen only where ``choose.ENGINE_FROM`` says

Adding a design: a file here with a frozen dataclass implementing the interface, an entry in :data:`DESIGNS`, and
a rule in :mod:`..choose`.
"""

from .base import Design, Inputs, Outputs
from .chained import ChainedConfig
from .engine import EngineDesign
from .few_tokens import FewTokensConfig
from .gluon import GluonLaunches
from .library_gemms import LibraryGemmsConfig
from .triton_launches import TileConfig

DESIGNS = {
    design.name: design
    for design in (FewTokensConfig, GluonLaunches, LibraryGemmsConfig, ChainedConfig, TileConfig, EngineDesign)
}

__all__ = [
    "DESIGNS",
    "ChainedConfig",
    "Design",
    "EngineDesign",
    "FewTokensConfig",
    "GluonLaunches",
    "Inputs",
    "LibraryGemmsConfig",
    "Outputs",
    "TileConfig",
]
