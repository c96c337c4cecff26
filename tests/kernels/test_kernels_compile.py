"""Every Triton kernel of the library compiles for a Hopper GPU, checked without one: Triton's
front end and PTX generation run on any machine. A kernel that cannot compile (a global that is
not a `tl.constexpr`, a misnamed argument, an API a new Triton dropped) fails here rather than
at its first call on a GPU, where the op would fall back (the skinny and attention ops to
torch, a Lamport group to another all-reduce) behind a log line. Needs Triton (CI has none:
skipped there); the interpreter tests beside these check what the kernels compute."""

import importlib
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

LINEAR = dict(BLOCK_N=8, BLOCK_K=512, HAS_BIAS=True, EVEN_K=True, PDL=True)
LAMPORT = dict(RANK=0, WORLD=2, PHASES=3, SLOT=65536, ROW=8192, BLOCK=4096, VEC=8, SENTINEL=-32768, PDL=True,
               BLOCK_N=8, BLOCK_K=512, HAS_BIAS=False, EVEN_K=True, GATED=True)
ATTENTION = dict(BLOCK_R=16, BLOCK_L=64, BLOCK_D=128, BLOCK_DV=128, HAS_MASK=True, MASK_BOOL=True, SPLIT=True,
                 PDL=True, BLOCK_S=16)
# Pointer arguments that are not bf16 tensors; every other pointer (a name ending in _ptr, or
# a grouped kernel's w0..w3, b0..b3) is.
POINTERS = {"peers_ptr": "*i64", "phase_ptr": "*i32", "mask_ptr": "*i1", "part_out_ptr": "*fp32",
            "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
KERNELS = [
    ("cgcompile.kernels.skinny_linear_kernel", "skinny_linear_kernel", LINEAR),
    ("cgcompile.kernels.skinny_linear_kernel", "silu_mul_linear_kernel", LINEAR),
    ("cgcompile.kernels.skinny_linear_kernel", "grouped_skinny_linear_kernel", LINEAR),
    ("cgcompile.kernels.decode_attention_kernel", "decode_attention_kernel", ATTENTION),
    ("cgcompile.kernels.decode_attention_kernel", "combine_splits_kernel", ATTENTION),
    ("cgcompile.parallel.lamport_kernel", "lamport_all_reduce_kernel", LAMPORT),
    ("cgcompile.parallel.lamport_kernel", "lamport_add_rms_norm_kernel", LAMPORT),
    ("cgcompile.parallel.lamport_kernel", "linear_publish_kernel", LAMPORT),
    ("cgcompile.parallel.lamport_kernel", "lamport_gather_add_rms_norm_kernel", LAMPORT),
]


def _argument_type(name: str) -> str:
    if name.endswith("_ptr") or (len(name) == 2 and name[0] in "wb" and name[1].isdigit()):
        return POINTERS.get(name, "*bf16")
    return "fp32" if name in ("eps", "scale") else "i32"


def hopper_ptx(fn, constants: dict) -> str:
    """fn's PTX for sm_90, its arguments typed by name (`_argument_type`), its constexprs from
    `constants` (BITS: int16, the Lamport kernels' bf16 bit patterns)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = {**constants, "BITS": tl.int16}
    chosen = {name: value for name, value in constants.items() if name in fn.arg_names}
    signature = {name: "constexpr" if name in chosen else _argument_type(name) for name in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=chosen),
                          target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("module, name, constants", KERNELS, ids=[name for _, name, _ in KERNELS])
def test_the_kernel_compiles_for_hopper_with_dependent_launch(module, name, constants):
    fn = getattr(importlib.import_module(module), name)
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constants and p.name != "BITS"]
    assert not missing, f"constexprs this test does not set: {missing}"
    ptx = hopper_ptx(fn, constants)
    assert "griddepcontrol.wait" in ptx  # PDL=True: each kernel waits for the one before it
