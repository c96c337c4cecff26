"""The LM heads of `TensorParallelDecoder` on 2 gloo ranks (run by
tests/parallel/test_vocab_parallel_head.py under torchrun): split by vocabulary and
replicated, eager and compiled, against the single-process model in fp32. Each scenario
prints `rank <r>: <name>: ok`, or raises."""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cgcompile  # noqa: E402
from benchmarks import distributed_bench as bench  # noqa: E402
from cgcompile.testing.decode_model import MODEL_CONFIGS, HostLengthDecoder, Llama, StaticMaskDecoder  # noqa: E402
from cgcompile.testing.parallel_model import TensorParallelDecoder, greedy_reference, seeded_llama  # noqa: E402

FILL, MODEL = 8, "tiny"  # tiny: vocab 256, hidden 64


def piecewise_backend():
    """The example's Config (examples/tensor_parallel.py): host-length attention split out."""
    return cgcompile.Backend(cgcompile.Config(splitting_ops=["cgbench::decode_attention"], capture_sizes=(1, 2, 4, 8),
                                              compiler="eager", capture_error_mode="thread_local"))


def full_backend():
    """distributed_bench's full-graph Config: static attention declared capturable."""
    return cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",), capture_sizes=(1, 2, 4, 8),
                                              compiler="eager", capture_error_mode="thread_local"))


def models(head, reference=HostLengthDecoder):
    """This rank's TensorParallelDecoder and the single-process model, from one seed each."""
    return (TensorParallelDecoder(seeded_llama(MODEL, "cpu", FILL), head=head),
            reference(seeded_llama(MODEL, "cpu", FILL)))


def check_logits(run, reference, batch, start):
    """run's logits [batch, vocab] equal the reference's to fp32 rounding (the all-reduces sum
    partial products in another order), as one plain contiguous tensor."""
    ids = torch.arange(batch) * 37 % MODEL_CONFIGS[MODEL].vocab
    logits = run(ids, start)
    assert type(logits) is torch.Tensor and logits.is_contiguous(), (type(logits), logits.stride())
    assert logits.shape == (batch, MODEL_CONFIGS[MODEL].vocab), logits.shape
    torch.testing.assert_close(logits, reference(ids, start))


def vocab_shard_is_a_parameter():
    model, _ = models("vocab")
    head, whole = model.lm_head.weight, seeded_llama(MODEL, "cpu", FILL).lm_head.weight  # [256, 64]
    assert head.shape == (128, 64), head.shape
    assert torch.equal(head, whole[128 * dist.get_rank():128 * (dist.get_rank() + 1)])
    assert any(p is head for p in model.parameters())
    return "vocab shard"


def meta_shard_counts_its_head_rows():
    """build_shard's meta-device path, and its weight-bytes floor: the layers' shards and this
    rank's half of the head, not the embedding (the replicated head: all of it)."""
    cfg = MODEL_CONFIGS[MODEL]
    for head, rows in (("vocab", cfg.vocab // 2), ("replicated", cfg.vocab)):
        model = bench.build_shard(cfg, torch.device("cpu"), torch.float32, head)
        assert model.lm_head.weight.shape == (rows, cfg.hidden) and model.lm_head.weight.device.type == "cpu"
        layers = sum(p.numel() for p in model.layers.parameters()) + cfg.hidden  # + the final norm
        assert bench.weight_bytes(model) == 4 * (layers + rows * cfg.hidden), head
    return "meta shard"


def vocab_eager_equals_single_process():
    model, reference = models("vocab")
    for batch in (3, 1):  # eager hands batch 1's gather back unwaited: the head waits for it
        check_logits(model, reference, batch, FILL)
    return "vocab eager"


def vocab_compiled_equals_single_process():
    model, reference = models("vocab")
    backend = piecewise_backend()
    compiled = torch.compile(model, backend=backend)
    for batch in (3, 1, 4):
        check_logits(compiled, reference, batch, FILL)
    assert "all_gather" in backend.pieces[-1].graph.code and backend.pieces[-1].capturable
    return "vocab compiled"


def vocab_full_graph_equals_single_process():
    model, reference = models("vocab", StaticMaskDecoder)
    compiled = torch.compile(model, backend=full_backend(), dynamic=False)
    for batch in (3, 1):
        check_logits(compiled, reference, batch, torch.tensor([FILL]))
    return "vocab full graph"


def vocab_greedy_tokens_equal_reference():
    model, steps = TensorParallelDecoder(seeded_llama(MODEL, "cpu", FILL)), 4
    ids = first = torch.tensor([3, 100, 255])
    compiled, tokens = torch.compile(model, backend=piecewise_backend()), []
    for step in range(steps):
        ids = compiled(ids, FILL + step).argmax(-1)
        tokens.append(ids)
    assert torch.equal(torch.stack(tokens), greedy_reference(seeded_llama(MODEL, "cpu", FILL), first, FILL, steps))
    return "vocab tokens"


def replicated_equals_single_process():
    model, reference = models("replicated")
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.shape == (256, 64)
    check_logits(model, reference, 3, FILL)
    check_logits(torch.compile(model, backend=piecewise_backend()), reference, 3, FILL)
    return "replicated"


def vocab_must_divide_by_the_world():
    torch.manual_seed(0)
    llama = Llama(dataclasses.replace(MODEL_CONFIGS[MODEL], vocab=255))
    with pytest.raises(ValueError, match=r'head="vocab": expected a vocabulary divisible by the world size 2, '
                                         r'got 255; head="replicated" takes any vocabulary'):
        TensorParallelDecoder(llama)
    assert TensorParallelDecoder(llama, head="replicated").lm_head.weight.shape == (255, 64)
    return "indivisible vocab"


SCENARIOS = [vocab_shard_is_a_parameter, meta_shard_counts_its_head_rows, vocab_eager_equals_single_process,
             vocab_compiled_equals_single_process, vocab_full_graph_equals_single_process,
             vocab_greedy_tokens_equal_reference, replicated_equals_single_process, vocab_must_divide_by_the_world]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with torch.inference_mode():
        for scenario in SCENARIOS:
            torch._dynamo.reset()
            name = scenario()
            print(f"rank {dist.get_rank()}: {name}: ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()
