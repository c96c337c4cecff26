"""The Lamport kernels compile for a Hopper GPU, checked without one: Triton's front end and
PTX code generation run on any machine, so a kernel that cannot compile (a global that is not
a `tl.constexpr`, a misnamed argument) fails here rather than at its first call on a GPU,
where the group would fall back to another all-reduce with a log line. Needs Triton (CI has
none: skipped there)."""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

CONSTANTS = dict(RANK=0, WORLD=2, PHASES=3, SLOT=65536, ROW=8192, BLOCK=4096, VEC=8, SENTINEL=-32768, PDL=True,
                 BLOCK_N=8, BLOCK_K=512, HAS_BIAS=False, EVEN_K=True, GATED=True)
POINTERS = {"peers_ptr": "*i64", "phase_ptr": "*i32"}  # every other pointer: bf16


def hopper_ptx(fn) -> str:
    """fn's PTX for sm_90: pointers (names ending in _ptr) bf16 but the peers' and phases',
    eps fp32, other arguments i32, constexprs from CONSTANTS."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = {**CONSTANTS, "BITS": tl.int16}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={name: value for name, value in constants.items() if name in fn.arg_names})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("name", ["lamport_all_reduce_kernel", "lamport_add_rms_norm_kernel",
                                  "linear_publish_kernel", "lamport_gather_add_rms_norm_kernel"])
def test_each_kernel_compiles_for_hopper_with_dependent_launch(name):
    from cgcompile.parallel import lamport_kernel

    ptx = hopper_ptx(getattr(lamport_kernel, name))
    assert "griddepcontrol.wait" in ptx  # PDL=True: the wait before the first access is there
