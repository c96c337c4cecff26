"""cgcompile::decode_attention: its kernels (on the GPU, and under Triton's interpreter on the
CPU), its checks and fallback, and the lowering that puts it in full graphs."""

import copy

import pytest
import torch
import torch.nn.functional as F

import cgcompile
from cgcompile.build.compiler import lower_attention
from cgcompile.kernels import decode_attention as op
from cgcompile.passes.small_query import grouped_small_query_attention, small_query_attention
from cgcompile.testing.models import StaticCacheDecoder

BF16 = torch.bfloat16


def test_the_kernels_equal_sdpa_under_the_interpreter(run_interpreted):
    assert "decode_attention interpreted: ok" in run_interpreted("decode_attention_interpret_worker.py")


def _operands(device="cpu", dtype=BF16, batch=1, heads=8, key_heads=2, tokens=1, length=40, head_dim=16):
    return (torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype),
            torch.randn(batch, key_heads, length, head_dim, device=device, dtype=dtype),
            torch.randn(batch, key_heads, length, head_dim, device=device, dtype=dtype))


@pytest.mark.parametrize("change, why", [
    (lambda q, k, v, m: (q, k, v, m), "the query is on cpu"),
    (lambda q, k, v, m: (q.float(), k.float(), v.float(), m), "dtypes torch.float32"),
    (lambda q, k, v, m: (q.repeat(1, 9, 8, 1), k, v, m), "288 query rows a key head; the kernels take up to 64"),
    (lambda q, k, v, m: (q[..., :12], k, v, m), "the kernels take [B, H, T, D]"),
    (lambda q, k, v, m: (q, k, v, m.float()[None]), "a mask of torch.float32 and 5 dims"),
    (lambda q, k, v, m: (q, k.repeat(1, 1, 110, 1), v.repeat(1, 1, 110, 1), None), "a cache of 4400 positions"),
])
def test_the_checks_say_why_the_matmuls_run(change, why):
    q, k, v = _operands()
    mask = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    problem = op.kernel_problem(*change(q, k, v, mask))
    assert problem is not None and why in problem, problem


def test_inputs_that_require_grad_keep_the_matmuls():
    q, k, v = _operands()
    problem = op.kernel_problem(q.requires_grad_(), k, v, None)
    assert problem is not None and "require" in problem


def test_the_op_equals_the_matmuls_where_it_falls_back():
    q, k, v = _operands(length=33)
    mask = torch.rand(1, 1, 1, 33) < 0.6
    mask[..., 0] = True
    torch.testing.assert_close(torch.ops.cgcompile.decode_attention(q, k, v, mask, 0.25),
                               small_query_attention(q, k, v, mask, 0.25))


def test_the_op_lays_its_output_out_in_the_dim_order_its_fake_promises():
    """The lowering passes SDPA's traced layout ([B, T, H, D] in memory) to the op: where it
    falls back to the matmuls, the result has the strides the fake tensor had."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _operands(tokens=3, length=33)
    order = [0, 2, 1, 3]
    got = torch.ops.cgcompile.decode_attention(q, k, v, None, 0.25, order)
    with FakeTensorMode() as mode:
        fake = torch.ops.cgcompile.decode_attention(*(mode.from_tensor(t) for t in (q, k, v)), None, 0.25, order)
    assert got.stride() == fake.stride() == (8 * 3 * 16, 16, 8 * 16, 1)
    torch.testing.assert_close(got, small_query_attention(q, k, v, None, 0.25))


def test_an_order_that_moves_the_last_dim_keeps_the_matmuls():
    problem = op.kernel_problem(*_operands(), None, dim_order=(0, 1, 3, 2))
    assert problem is not None and "dim order (0, 1, 3, 2)" in problem


def test_the_grouped_op_falls_back_to_the_grouped_layout():
    q, k, v = _operands(batch=2, length=33)
    mask = torch.rand(2, 1, 1, 33) < 0.6
    mask[..., 0] = True
    got = torch.ops.cgcompile.grouped_decode_attention(q, k, v, mask, 0.25)
    want = grouped_small_query_attention(q, k, v, mask, 0.25)
    assert got.shape == (2, 2, 4, 16) and got.stride() == want.stride() == (128, 16, 32, 1)  # rows outer
    torch.testing.assert_close(got, want)


def test_the_grouped_op_falls_back_to_the_heads_in_order():
    q, k, v = _operands(batch=1, length=33)
    mask = torch.randn(1, 8, 1, 33)
    got = torch.ops.cgcompile.grouped_decode_attention(q, k, v, mask, 0.25, True)
    want = grouped_small_query_attention(q, k, v, mask, 0.25, heads_outer=True)
    assert got.shape == (1, 2, 4, 16) and got.is_contiguous() and want.is_contiguous()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got.reshape(1, 8, 1, 16), small_query_attention(q, k, v, mask, 0.25))


def test_the_grouped_op_takes_one_token():
    q, k, v = _operands(tokens=2)
    with pytest.raises(ValueError, match=r"takes a query \[B, H, 1, D\], not \(1, 8, 2, 16\)"):
        torch.ops.cgcompile.grouped_decode_attention(q, k, v, None, 0.25)


def test_the_lowering_keeps_the_matmuls_on_the_cpu():
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True) * 2

    graphs = []
    q, k, v = _operands()
    mask = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    torch.compile(attend, backend=lambda gm, _: graphs.append(gm) or gm)(q, k, v, mask)
    (gm,) = graphs
    assert lower_attention(gm, kernel=True) == 1
    torch.testing.assert_close(gm(q, k, v, mask)[0], attend(q, k, v, mask), rtol=2e-2, atol=2e-2)


def test_splits_are_one_block_unless_programs_would_crowd_the_gpu():
    device = torch.device("cpu")  # the interpreter's 8 multiprocessors: up to 64 programs
    assert op.choose_splits(programs=1, length=4096, device=device) == op.BLOCK_L  # 64 programs
    assert op.choose_splits(programs=2, length=4096, device=device) == 2 * op.BLOCK_L  # 128 blocks: 2 a split
    assert op.choose_splits(programs=32, length=100, device=device) == op.BLOCK_L  # 2 blocks: 64 programs
    assert op.choose_splits(programs=64, length=100, device=device) == 2 * op.BLOCK_L  # the whole cache


def _reference(q, k, v, mask, scale):
    groups = q.shape[-3] // k.shape[-3]
    k, v = (t.double().repeat_interleave(groups, dim=-3) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, scale=scale)


@pytest.mark.cuda
@pytest.mark.parametrize("batch, heads, key_heads, tokens, length, head_dim", [
    (1, 32, 8, 1, 256, 128),  # an 8B layer, decode
    (1, 16, 8, 1, 4096, 64),  # the longest cache the op gives the kernels
    (8, 8, 2, 1, 300, 128),  # a TP=4 rank at batch 8
    (2, 12, 12, 4, 77, 64),  # no grouping, a few tokens
])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_the_kernels_equal_sdpa_on_the_gpu(batch, heads, key_heads, tokens, length, head_dim, dtype):
    torch.manual_seed(0)
    q, k, v = _operands("cuda", dtype, batch, heads, key_heads, tokens, length, head_dim)
    filled = length // 2  # a static cache half written: the rest masked, never read
    mask = torch.zeros(batch, 1, tokens, length, dtype=torch.bool, device="cuda")
    mask[..., :filled] = True
    k[..., filled:, :] = float("nan")  # a read of the hidden positions would show
    v[..., filled:, :] = float("nan")
    assert op.kernel_problem(q, k, v, mask) is None
    got = op.decode_attention_kernel_call(q, k, v, mask, head_dim ** -0.5)
    want = _reference(q[..., :], k[..., :filled, :], v[..., :filled, :], mask[..., :filled], head_dim ** -0.5)
    exact_sdpa_error = (F.scaled_dot_product_attention(
        q, k[..., :filled, :].repeat_interleave(heads // key_heads, 1),
        v[..., :filled, :].repeat_interleave(heads // key_heads, 1)).double() - want).abs().max()
    error = (got.double() - want).abs().max()
    assert error <= 2 * exact_sdpa_error + 2e-3, (error, exact_sdpa_error)  # of the order of SDPA's own rounding


@pytest.mark.cuda
@pytest.mark.parametrize("chunk", [None, 512])  # the chosen splits, and one split
@pytest.mark.parametrize("heads_outer", [False, True])
def test_the_grouped_layout_on_the_gpu(chunk, heads_outer):
    torch.manual_seed(0)
    batch = 1 if heads_outer else 2
    q, k, v = _operands("cuda", BF16, batch, 32, 8, 1, 300, 128)
    mask = torch.zeros(batch, 1, 1, 300, dtype=torch.bool, device="cuda")
    mask[..., :200] = True
    got = op.decode_attention_kernel_call(q, k, v, mask, 0.1, chunk, grouped=True, heads_outer=heads_outer)
    want = grouped_small_query_attention(q, k, v, mask, 0.1, heads_outer=heads_outer)
    assert got.shape == want.shape and got.stride() == want.stride() and got.is_contiguous() == heads_outer
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask, 0.1).view(batch, 8, 4, 128),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_an_additive_mask_and_one_split_on_the_gpu():
    torch.manual_seed(0)
    q, k, v = _operands("cuda", BF16, 2, 16, 4, 1, 200, 128)
    mask = torch.randn(2, 16, 1, 200, device="cuda", dtype=BF16)
    mask[..., 150:] = float("-inf")
    for chunk in (None, 256):  # the chosen splits, and one split (no combine)
        got = op.decode_attention_kernel_call(q, k, v, mask, 0.1, chunk)
        torch.testing.assert_close(got.double(), _reference(q, k, v, mask.double(), 0.1), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", [True, False])
@torch.no_grad()
def test_a_full_graph_decoder_at_batch_sizes_in_turn_equals_eager(kernel, monkeypatch):
    """The default full graph lowers decode attention to the op (`kernel`) or to the matmuls;
    both equal eager at every step, and the kernels run only where asked."""
    calls = []
    real = op.decode_attention_kernel_call
    monkeypatch.setattr(op, "decode_attention_kernel_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = StaticCacheDecoder(hidden=256, heads=4, max_len=256).to("cuda", BF16).eval()
    reference = copy.deepcopy(model)
    prompt = [(torch.arange(1, 6, device="cuda"), torch.arange(5, device="cuda"))]
    steps = prompt + [(torch.tensor([s], device="cuda"), torch.tensor([5 + s], device="cuda")) for s in range(6)]
    expected = [reference(*c).float() for c in steps]
    backend = cgcompile.Backend(cgcompile.Config(decode_attention_kernel=kernel))
    compiled = torch.compile(model, backend=backend, dynamic=False)
    for i, (c, e) in enumerate(zip(steps, expected)):
        torch.testing.assert_close(compiled(*c).float(), e, rtol=3e-2, atol=3e-2, msg=lambda m: f"step {i}: {m}")
    assert backend.stats.full_graph_calls >= 4
    assert bool(calls) is kernel  # captured once per layer; replays call no Python


@pytest.mark.cuda
@torch.no_grad()
def test_a_full_graph_whose_attention_rows_are_outer_equals_eager_without_a_layout_copy():
    """The project's decoder attends a key head's query heads as its rows ([B, KV, G, D]), so
    SDPA's CUDA kernels were traced laying the output out as [B, G, KV, D]: the lowered op
    writes that layout itself, and the piece after it reads it without a copy."""
    from cgcompile.testing.decode_model import Llama, ModelConfig, StaticMaskDecoder

    torch.manual_seed(0)
    cfg = ModelConfig(hidden=256, layers=2, heads=8, kv_heads=2, intermediate=512, vocab=512, max_batch=4,
                      max_len=256)
    llama = Llama(cfg).to("cuda", BF16).eval()
    llama.fill_caches(40)
    reference = StaticMaskDecoder(copy.deepcopy(llama))
    backend = cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",), small_query_attention=True))
    compiled = torch.compile(StaticMaskDecoder(llama), backend=backend, dynamic=False)
    for step in range(6):
        ids, pos = torch.arange(3, device="cuda") + step, torch.tensor([40 + step], device="cuda")
        torch.testing.assert_close(compiled(ids, pos).float(), reference(ids, pos).float(), rtol=3e-2, atol=3e-2,
                                   msg=lambda m: f"step {step}: {m}")
    assert backend.stats.full_graph_calls >= 4
    assert backend.stats.layout_copies == 0


def _traced_targets(monkeypatch, dtype=BF16, length=40, attention=op.attention_with_kernel):
    """The ops of `attention` traced on fake CUDA tensors, as AOT traces a full graph for the
    GPU (Triton taken as present: CI has none)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(op, "triton_available", lambda: True)
    with FakeTensorMode():
        q, k, v = (torch.empty(1, heads, rows, 16, dtype=dtype, device="cuda")
                   for heads, rows in ((8, 1), (2, length), (2, length)))
        mask = torch.empty(1, 1, 1, length, dtype=torch.bool, device="cuda")
        gm = make_fx(lambda q, k, v, m: attention(q, k, v, m))(q, k, v, mask)
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_a_traced_gpu_call_holds_the_op(monkeypatch):
    assert _traced_targets(monkeypatch) == {torch.ops.cgcompile.decode_attention.default}


def test_a_traced_grouped_gpu_call_holds_the_grouped_op_and_no_copy(monkeypatch):
    targets = _traced_targets(monkeypatch, attention=op.grouped_attention_with_kernel)
    assert targets == {torch.ops.cgcompile.grouped_decode_attention.default}


@pytest.mark.parametrize("why", ["float32", "a long cache"])  # grad: see test_inputs_that_require_grad_...
def test_a_traced_gpu_call_the_kernels_cannot_serve_holds_the_matmuls(monkeypatch, why):
    targets = _traced_targets(monkeypatch, dtype=torch.float32 if why == "float32" else BF16,
                              length=op.MAX_LENGTH + 1 if why == "a long cache" else 40)
    assert torch.ops.cgcompile.decode_attention.default not in targets
    assert torch.ops.aten.bmm.default in targets  # the batched matmuls
