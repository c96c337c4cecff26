"""benchmarks/step_kernels.py on a hand-made profiler trace: classes, bandwidth, gaps."""

import pytest

from benchmarks.step_kernels import classify, format_breakdown, trace_of


def _launch(name, ts, corr):
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "args": {"correlation": corr}}


def _kernel(name, ts, dur, corr, cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


# One step: a graph replay (a GEMV and a Triton norm), the eager attention op (a bmm
# and a softmax), an input copy, and a second replay (a cuBLAS GEMM).
TRACE = {"traceEvents": [
    _launch("cudaGraphLaunch", 0, 1),
    _kernel("gemv2T_kernel_val", 10, 100, 1),
    _kernel("triton_red_fused_mean_mul_0", 110, 10, 1),
    {"cat": "cpu_op", "name": "cgbench::decode_attention", "ts": 20, "dur": 30},
    _launch("cudaLaunchKernel", 25, 2),
    _kernel("ampere_bf16_s16816gemm_bf16_64x64", 125, 20, 2),  # a bmm, but inside attention
    _launch("cudaLaunchKernel", 30, 3),
    _kernel("softmax_warp_forward", 150, 10, 3),
    _launch("cudaMemcpyAsync", 60, 4),
    _kernel("Memcpy DtoD (Device -> Device)", 170, 5, 4, cat="gpu_memcpy"),
    _launch("cudaGraphLaunch", 70, 5),
    _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 180, 200, 5),
]}


def test_kernels_are_classified_with_bandwidth_and_gaps():
    b = classify(TRACE, 1, ("decode_attention",), {"gemm": 300_000_000, "attention": 1_000_000}, peak_gbs=3000)
    classes = {c.name: c for c in b.classes}
    assert {n: round(c.ms_per_step, 3) for n, c in classes.items()} == {
        "attention": 0.03, "copy": 0.005, "elementwise": 0.01, "gemm": 0.3}
    assert classes["gemm"].gbs == pytest.approx(1000.0)  # 300 MB in 0.3 ms
    assert classes["gemm"].of_peak == pytest.approx(1 / 3)
    assert classes["elementwise"].gbs is None
    assert b.kernel_ms_per_step == pytest.approx(0.345)
    assert b.span_ms_per_step == pytest.approx(0.37)
    # idle: 120->125 graph->eager 5 us, 145->150 eager->eager 5 us, 160->170 eager->eager
    # 10 us, 175->180 eager->graph 5 us
    assert b.gap_ms_per_step == pytest.approx({"graph->eager": 0.005, "eager->eager": 0.015, "eager->graph": 0.005})
    text = format_breakdown(b, floor_ms=0.1, peak_gbs=3000)
    assert "gemm" in text and "33%" in text and "graph->eager 0.005 ms" in text


def test_no_kernels_gives_an_empty_breakdown():
    b = classify({"traceEvents": []}, 2, ("attention",), {}, peak_gbs=1000)
    assert (b.classes, b.kernel_ms_per_step, b.gap_ms_per_step) == ([], 0.0, {})


def test_attention_kernels_inside_a_graph_are_attention_by_name():
    # A full graph replays attention with the rest: no host op brackets its launch.
    trace = {"traceEvents": [
        _launch("cudaGraphLaunch", 0, 1),
        _kernel("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 10, 40, 1),  # CUTLASS, yet attention
        _kernel("void pytorch_flash::flash_fwd_splitkv_kernel", 50, 10, 1),
        _kernel("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 60, 25, 1),
    ]}
    b = classify(trace, 1, ("decode_attention",), {}, peak_gbs=3000)
    assert {c.name: round(c.ms_per_step, 3) for c in b.classes} == {"attention": 0.05, "gemm": 0.025}


def test_collective_kernels_are_their_own_class():
    # NCCL's, symmetric memory's and cgcompile's all-reduce kernels (the Lamport one fused with
    # the residual add and RMS norm too): neither a matmul nor elementwise work.
    trace = {"traceEvents": [
        _launch("cudaGraphLaunch", 0, 1),
        _kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 10, 20, 1),
        _kernel("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>", 40, 7, 1),
        _kernel("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 60, 25, 1),
        _kernel("triton_red_fused_add_mean_mul_pow_rsqrt_0", 90, 3, 1),
        _kernel("lamport_all_reduce_kernel", 100, 2, 1),
        _kernel("lamport_add_rms_norm_kernel", 110, 4, 1),
    ]}
    b = classify(trace, 1, ("decode_attention",), {}, peak_gbs=3000)
    assert {c.name: round(c.ms_per_step, 3) for c in b.classes} == {
        "collective": 0.033, "gemm": 0.025, "elementwise": 0.003}


def test_products_written_as_reductions_are_matmuls_and_dtype_casts_are_not_copies():
    trace = {"traceEvents": [
        _launch("cudaGraphLaunch", 0, 1),
        _kernel("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_sum_unsqueeze_3", 10, 20, 1),  # norm + matvec
        _kernel("triton_red_fused__to_copy_add_mean_pow_2", 40, 4, 1),  # a norm alone
        _kernel("triton_poi_fused_index_copy_0", 50, 2, 1),  # a cache write: a copy
    ]}
    b = classify(trace, 1, ("decode_attention",), {}, peak_gbs=3000)
    assert {c.name: round(c.ms_per_step, 3) for c in b.classes} == {"gemm": 0.02, "elementwise": 0.004, "copy": 0.002}


def test_the_skinny_kernels_are_matmuls_the_gated_one_too():
    trace = {"traceEvents": [
        _launch("cudaGraphLaunch", 0, 1),
        _kernel("skinny_linear_kernel", 10, 5, 1),
        _kernel("silu_mul_linear_kernel", 20, 7, 1),  # a down projection that makes its own gated input
        _kernel("triton_poi_fused_mul_silu_0", 30, 1, 1),  # the gating as its own kernel: elementwise
    ]}
    b = classify(trace, 1, ("decode_attention",), {}, peak_gbs=3000)
    assert {c.name: round(c.ms_per_step, 3) for c in b.classes} == {"gemm": 0.012, "elementwise": 0.001}


def test_a_profiler_runs_trace_is_read_for_classify():
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4) + 1
    trace = trace_of(prof)
    assert any(e.get("cat") == "cpu_op" and e.get("name") == "aten::add" for e in trace["traceEvents"])
    assert classify(trace, steps=1, attention_ops=(), bytes_per_class={}, peak_gbs=1.0).kernel_ms_per_step == 0
