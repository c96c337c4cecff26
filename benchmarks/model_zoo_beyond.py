"""A second zoo, of models that are not transformers, each compiled with cgcompile and compared with eager.

Every model has random, seeded weights (torch.manual_seed(0) before it is built) and is as
small as its family allows. It is compiled the way a user would
(`model.forward = torch.compile(model.forward, backend=cgcompile.Backend(config))`), once,
and then runs the size sequence 1, 3, 8, 1 on that one compiled model (--sequence sets
another), every call with its own inputs (seeded by the call's place in the sequence), and
is compared with the same model uncompiled. Each call is one row. The size is:

    torchvision      classification  images [N, 3, 64, 64]: resnet18, mobilenet_v3_small,
                                     efficientnet_b0, a 2-layer ViT (patches 16)
                     detection       a list of N images [3, 96, 128] in [0, 1] (score
                                     thresholds 0 and at most 10-20 detections an image, so
                                     that random weights still detect): Faster R-CNN
                                     (MobileNetV3 320 FPN), Mask R-CNN and RetinaNet (ResNet-50
                                     FPN, resized to 128), SSDlite 320
                     segmentation    images [N, 3, 64, 64]: DeepLabV3 and LR-ASPP (MobileNetV3),
                                     FCN (ResNet-50)
                     video           clips [N, 3, 4, 32, 32]: r3d_18, mc3_18
                     optical flow    two images [N, 3, 128, 128] (RAFT's smallest: its
                                     correlation pyramid needs 16x16 features at 1/8 scale):
                                     RAFT small, 2 flow updates
    torchaudio       audio           waveforms [N, 1600] with lengths (row i is 160 * (i % 8)
                                     samples shorter): wav2vec2, HuBERT (2 layers, hidden 64);
                                     WavLM likewise but without lengths (its attention takes
                                     no padding mask); features [N, 20, 32] with lengths: Conformer,
                                     Emformer (segments of 4, right context 2); ConvTasNet on
                                     [N, 1, 800]; DeepSpeech on spectrograms [N, 1, 20, 32]
    torch_geometric  graph           N random graphs of 6 to 12 nodes (16 features, two edges a
                                     node) in one Batch.from_data_list: GCN, GAT, GraphSAGE,
                                     GIN (2 layers, hidden 32)
    timm             image           images [N, 3, 64, 64]: resnet18, vit_tiny_patch16 (64
                                     pixels), convnext_atto, efficientnet_b0
    diffusers        diffusion       a UNet2DConditionModel (latents [N, 4, 16, 16], a timestep
                                     each, 8 text tokens of 32 for cross-attention), a DiT
                                     (latents [N, 4, 16, 16], timesteps, class labels), an
                                     AutoencoderKL's decode() (latents [N, 4, 8, 8])

A family whose package is missing (or does not import) is a "skip" row saying so; so is a call
that eager itself fails (RAFT in bfloat16: its grid_sample gets a float32 grid), with eager's error.

    max err   max |compiled - eager| / max |eager| over every output tensor (nested tuples,
              lists, dicts and model outputs flattened; empty tensors, such as a detection
              list with no boxes, are left out, and outputs of another shape are an error).
              Fails above 1e-4 in float32, 5e-2 in bfloat16 (the transformers zoo's bounds).
    graphs, pieces, capt, cuda, pad   backend.stats after that row, as in benchmarks/model_zoo.py.
    ref err   with --reference inductor: plain torch.compile(model.forward) (Inductor, no
              cgcompile) on the same inputs, one compiled model through the same sequence. A
              row whose error is over the bound is "upstream" (not a failure) when plain
              torch.compile's error is over it too and at least a tenth of cgcompile's: the
              bug is not cgcompile's (docs/upstream.md lists the known ones).

A model that fails is a row with its error; the run goes on and exits non-zero at the end.
The piece compiler is Inductor on CUDA and "eager" on CPU unless --compiler says.

    python benchmarks/model_zoo_beyond.py --list
    python benchmarks/model_zoo_beyond.py --device cpu --models gcn,dit      # names, kinds or families
    python benchmarks/model_zoo_beyond.py --device cuda --models torchvision --json beyond.json
    python benchmarks/model_zoo_beyond.py --device cuda --models graph --reference inductor
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from torch.utils._pytree import tree_map_only

import cgcompile

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, also when loaded by a test
import model_zoo as zoo  # noqa: E402  (the error measure, backend stats and scopes the zoos share)

SEQUENCE = (1, 3, 8, 1)
FAMILIES = ("torchvision", "torchaudio", "torch_geometric", "timm", "diffusers")
UPSTREAM_SHARE = 0.1  # plain torch.compile's error, as a share of cgcompile's, that makes a row "upstream"


def package(name: str):
    return importlib.import_module(name)


class Bound(torch.nn.Module):
    """`module.<method>(*args, **kwargs)` as a forward: what the zoo compiles when the call to
    test is not the module's own forward (a VAE's decode(), RAFT with fewer flow updates)."""

    def __init__(self, module: torch.nn.Module, method: str = "forward", **kwargs):
        super().__init__()
        self.module, self.method, self.kwargs = module, method, kwargs

    def forward(self, *args):
        return getattr(self.module, self.method)(*args, **self.kwargs)


# -- inputs: (size, generator) -> the forward's positional arguments, on the CPU -------------


def images(size: int, g: torch.Generator, side: int = 64) -> tuple:
    return (torch.randn(size, 3, side, side, generator=g),)


def image_list(size: int, g: torch.Generator) -> tuple:
    """Detection models take a list of images [3, H, W] with values in [0, 1]."""
    return ([torch.rand(3, 96, 128, generator=g) for _ in range(size)],)


def clips(size: int, g: torch.Generator) -> tuple:
    return (torch.randn(size, 3, 4, 32, 32, generator=g),)


def image_pairs(size: int, g: torch.Generator, side: int = 128) -> tuple:
    """RAFT downsamples by 8 and its correlation pyramid halves 3 more times from at least
    16x16, so 128 pixels is the smallest side it takes."""
    return (torch.rand(size, 3, side, side, generator=g), torch.rand(size, 3, side, side, generator=g))


def shorter_rows(size: int, full: int, step: int) -> torch.Tensor:
    """[size] lengths: row i is step * (i % 8) shorter than `full` (row 0 is full, as the max)."""
    return full - step * (torch.arange(size) % 8)


def waveforms(size: int, g: torch.Generator) -> tuple:
    return torch.randn(size, 1600, generator=g), shorter_rows(size, 1600, 160)


def full_waveforms(size: int, g: torch.Generator) -> tuple:
    """Waveforms without lengths: lengths become an attention mask, which WavLM's attention
    rejects (`assert attention_mask is None` in torchaudio's wavlm_attention.py)."""
    return (torch.randn(size, 1600, generator=g),)


def features(size: int, g: torch.Generator, frames: int = 20) -> tuple:
    return torch.randn(size, frames, 32, generator=g), shorter_rows(size, frames, 1)


def emformer_features(size: int, g: torch.Generator) -> tuple:
    """16 utterance frames and 2 right-context frames; lengths count the utterance only."""
    return torch.randn(size, 18, 32, generator=g), shorter_rows(size, 16, 1)


def mixtures(size: int, g: torch.Generator) -> tuple:
    return (torch.randn(size, 1, 800, generator=g),)


def spectrograms(size: int, g: torch.Generator) -> tuple:
    return (torch.randn(size, 1, 20, 32, generator=g),)


def graphs(size: int, g: torch.Generator) -> tuple:
    """`size` random graphs of 6 to 12 nodes in one batch: (x [nodes, 16], edge_index [2, edges])."""
    data = package("torch_geometric.data")
    graph_list = []
    for _ in range(size):
        nodes = int(torch.randint(6, 13, (), generator=g))
        edge_index = torch.randint(0, nodes, (2, 2 * nodes), generator=g)
        graph_list.append(data.Data(x=torch.randn(nodes, 16, generator=g), edge_index=edge_index))
    batch = data.Batch.from_data_list(graph_list)
    return batch.x, batch.edge_index


def unet_inputs(size: int, g: torch.Generator) -> tuple:
    # sample [N, 4, 16, 16], timestep [N], encoder_hidden_states [N, 8, 32]
    return (torch.randn(size, 4, 16, 16, generator=g), torch.randint(0, 1000, (size,), generator=g),
            torch.randn(size, 8, 32, generator=g))


def dit_inputs(size: int, g: torch.Generator) -> tuple:
    # hidden_states [N, 4, 16, 16], timestep [N], class_labels [N]
    return (torch.randn(size, 4, 16, 16, generator=g), torch.randint(0, 1000, (size,), generator=g),
            torch.randint(0, 1000, (size,), generator=g))


def latents(size: int, g: torch.Generator) -> tuple:
    return (torch.randn(size, 4, 8, 8, generator=g),)


# -- the models -----------------------------------------------------------------------------


def tv(kind: str, name: str, **kwargs) -> Callable[[], torch.nn.Module]:
    """A torchvision builder with no pretrained weights (nothing is downloaded)."""
    no_weights = dict(weights=None) | (dict(weights_backbone=None) if kind in ("detection", "segmentation") else {})
    submodule = {"detection": ".detection", "segmentation": ".segmentation", "video": ".video",
                 "optical_flow": ".optical_flow"}.get(kind, "")
    return lambda: getattr(package("torchvision.models" + submodule), name)(**no_weights, **kwargs)


def tiny_vit() -> torch.nn.Module:
    return package("torchvision.models").VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=10)


def raft_small() -> torch.nn.Module:
    # The flow-update loop unrolls into the graph: fewer updates, a smaller graph to compile.
    return Bound(tv("optical_flow", "raft_small")(), num_flow_updates=2)


_W2V = dict(extractor_conv_layer_config=[(32, 10, 5), (32, 3, 2)], extractor_conv_bias=False,
            encoder_embed_dim=64, encoder_projection_dropout=0.0, encoder_pos_conv_kernel=16,
            encoder_pos_conv_groups=4, encoder_num_layers=2, encoder_num_heads=4, encoder_attention_dropout=0.0,
            encoder_ff_interm_features=128, encoder_ff_interm_dropout=0.0, encoder_dropout=0.0,
            encoder_layer_drop=0.0, aux_num_out=None)


def audio(name: str, **kwargs) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(package("torchaudio.models"), name)(**kwargs)


def gnn(name: str, **kwargs) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(package("torch_geometric.nn.models"), name)(
        in_channels=16, hidden_channels=32, num_layers=2, out_channels=8, **kwargs)


def timm_model(name: str, **kwargs) -> Callable[[], torch.nn.Module]:
    return lambda: package("timm").create_model(name, pretrained=False, num_classes=10, **kwargs)


def tiny_unet() -> torch.nn.Module:
    return package("diffusers").UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16)


def tiny_dit() -> torch.nn.Module:
    return package("diffusers").DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=16, patch_size=2,
        norm_num_groups=4)


def vae_decoder() -> torch.nn.Module:
    vae = package("diffusers").AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), latent_channels=4, norm_num_groups=16)
    return Bound(vae, "decode")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One zoo model: its package (`family`), what it does (`kind`), how to build it with
    random weights, and its inputs at a size."""

    name: str
    family: str
    kind: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int, torch.Generator], tuple]


_DETECT = dict(box_score_thresh=0.0, box_detections_per_img=20)  # random weights score low: keep the top 20
_RESIZED = dict(min_size=128, max_size=160)  # the ResNet-50 detectors resize to 800 by default

ENTRIES = [
    Entry("resnet18", "torchvision", "classification", tv("", "resnet18", num_classes=10), images),
    Entry("mobilenet_v3_small", "torchvision", "classification", tv("", "mobilenet_v3_small", num_classes=10), images),
    Entry("efficientnet_b0", "torchvision", "classification", tv("", "efficientnet_b0", num_classes=10), images),
    Entry("vit", "torchvision", "classification", tiny_vit, images),
    Entry("fasterrcnn_mobilenet", "torchvision", "detection",
          tv("detection", "fasterrcnn_mobilenet_v3_large_320_fpn", **_DETECT), image_list),
    Entry("maskrcnn_resnet50", "torchvision", "detection",
          tv("detection", "maskrcnn_resnet50_fpn", **_RESIZED, box_score_thresh=0.0, box_detections_per_img=10),
          image_list),
    Entry("retinanet_resnet50", "torchvision", "detection", tv(
        "detection", "retinanet_resnet50_fpn", **_RESIZED, score_thresh=0.0, detections_per_img=20,
        topk_candidates=100), image_list),
    Entry("ssdlite320", "torchvision", "detection", tv(
        "detection", "ssdlite320_mobilenet_v3_large", score_thresh=0.0, detections_per_img=20, topk_candidates=100),
        image_list),
    Entry("deeplabv3_mobilenet", "torchvision", "segmentation",
          tv("segmentation", "deeplabv3_mobilenet_v3_large", num_classes=5, aux_loss=False), images),
    Entry("lraspp_mobilenet", "torchvision", "segmentation",
          tv("segmentation", "lraspp_mobilenet_v3_large", num_classes=5), images),
    Entry("fcn_resnet50", "torchvision", "segmentation",
          tv("segmentation", "fcn_resnet50", num_classes=5, aux_loss=False), images),
    Entry("r3d_18", "torchvision", "video", tv("video", "r3d_18", num_classes=10), clips),
    Entry("mc3_18", "torchvision", "video", tv("video", "mc3_18", num_classes=10), clips),
    Entry("raft_small", "torchvision", "optical_flow", raft_small, image_pairs),
    # wav2vec2 with a layer-norm extractor and pre-norm layers (as the large models), HuBERT
    # with group norm and post-norm (as hubert_base), WavLM with its bucketed position bias.
    Entry("wav2vec2", "torchaudio", "audio", audio(
        "wav2vec2_model", extractor_mode="layer_norm", encoder_layer_norm_first=True, **_W2V), waveforms),
    Entry("hubert", "torchaudio", "audio", audio(
        "wav2vec2_model", extractor_mode="group_norm", encoder_layer_norm_first=False, **_W2V), waveforms),
    Entry("wavlm", "torchaudio", "audio", audio(
        "wavlm_model", extractor_mode="group_norm", encoder_layer_norm_first=False, encoder_num_buckets=32,
        encoder_max_distance=64, **_W2V), full_waveforms),
    Entry("conformer", "torchaudio", "audio", audio(
        "Conformer", input_dim=32, num_heads=4, ffn_dim=64, num_layers=2, depthwise_conv_kernel_size=7), features),
    Entry("emformer", "torchaudio", "audio", audio(
        "Emformer", input_dim=32, num_heads=4, ffn_dim=64, num_layers=2, segment_length=4, right_context_length=2),
        emformer_features),
    Entry("conv_tasnet", "torchaudio", "audio", audio(
        "ConvTasNet", num_sources=2, enc_kernel_size=16, enc_num_feats=64, msk_kernel_size=3, msk_num_feats=32,
        msk_num_hidden_feats=64, msk_num_layers=2, msk_num_stacks=1), mixtures),
    Entry("deepspeech", "torchaudio", "audio", audio("DeepSpeech", n_feature=32, n_hidden=64, n_class=10),
          spectrograms),
    Entry("gcn", "torch_geometric", "graph", gnn("GCN"), graphs),
    Entry("gat", "torch_geometric", "graph", gnn("GAT", heads=2), graphs),
    Entry("graphsage", "torch_geometric", "graph", gnn("GraphSAGE"), graphs),
    Entry("gin", "torch_geometric", "graph", gnn("GIN"), graphs),
    Entry("timm_resnet18", "timm", "image", timm_model("resnet18"), images),
    Entry("timm_vit_tiny", "timm", "image", timm_model("vit_tiny_patch16_224", img_size=64), images),
    Entry("timm_convnext_atto", "timm", "image", timm_model("convnext_atto"), images),
    Entry("timm_efficientnet_b0", "timm", "image", timm_model("efficientnet_b0"), images),
    Entry("unet2d_condition", "diffusers", "diffusion", tiny_unet, unet_inputs),
    Entry("dit", "diffusers", "diffusion", tiny_dit, dit_inputs),
    Entry("vae_decoder", "diffusers", "diffusion", vae_decoder, latents),
]
BY_NAME = {entry.name: entry for entry in ENTRIES}
KINDS = tuple(dict.fromkeys(entry.kind for entry in ENTRIES))


# -- options, rows ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    compiler: str = "eager"  # cgcompile.Config.compiler
    sequence: tuple[int, ...] = SEQUENCE
    padding: bool | None = None  # cgcompile.Config.padding (True: pads on CPU too)
    reference: str | None = None  # "inductor": also run plain torch.compile on the same inputs

    @property
    def tolerance(self) -> float:
        return zoo.TOLERANCE[self.dtype]


@dataclasses.dataclass
class Row(zoo.Row):
    """The transformers zoo's row (one call of one model) with the model's package, and plain
    torch.compile's result on the same inputs when --reference asks for it."""

    family: str = ""
    reference_err: float | None = None
    reference_error: str | None = None  # plain torch.compile's exception, class and first line


def unavailable(family: str) -> str | None:
    """Why `family` cannot run here, or None when it imports."""
    try:
        package(family)
    except ModuleNotFoundError as e:
        return f"{family} not installed" + ("" if e.name == family else f" ({e.name} missing)")
    except Exception as e:  # a wheel built for another torch fails here with an OSError or RuntimeError
        return f"{family} does not import: {zoo.describe(e)}"
    return None


def build(entry: Entry, options: Options) -> torch.nn.Module:
    """The model with random weights (seed 0), in eval mode, on the device, in the dtype."""
    torch.manual_seed(0)
    return entry.build().to(device=options.device, dtype=options.dtype).eval()


def make_inputs(entry: Entry, row: Row, options: Options) -> tuple:
    """`row.size` items on the device, floating-point ones in the dtype; seeded by the call's
    place in the sequence, so that two calls at one size get different inputs."""
    args = entry.inputs(row.size, torch.Generator().manual_seed(row.call))
    return tree_map_only(torch.Tensor, lambda t: t.to(
        options.device, dtype=options.dtype if t.is_floating_point() else None), args)


def compare(got, expected) -> float:
    """max |got - expected| / max |expected| over every non-empty output tensor."""
    got, expected = zoo.output_tensors(got), zoo.output_tensors(expected)
    shapes = [tuple(t.shape) for t in got], [tuple(t.shape) for t in expected]
    if shapes[0] != shapes[1]:
        raise ValueError(f"expected output shapes {shapes[1]} (eager), got {shapes[0]}")
    errors = [zoo.relative_error(g, e) for g, e in zip(got, expected) if e.numel()]
    if not errors:
        raise ValueError("expected a non-empty output tensor, got only empty ones; lower the model's thresholds")
    return max(errors)


# -- one model ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Session:
    """The model's compiled forwards: cgcompile's, and plain torch.compile's with --reference."""

    backend: cgcompile.Backend
    forward: Callable
    reference: Callable | None


def compile_model(model: torch.nn.Module, options: Options) -> Session:
    config = cgcompile.Config(compiler=options.compiler, capture_sizes=zoo.CAPTURE_SIZES, padding=options.padding)
    backend = cgcompile.Backend(config)
    reference = torch.compile(model.forward, backend=options.reference) if options.reference else None
    return Session(backend, torch.compile(model.forward, backend=backend), reference)


def run_model(entry: Entry, options: Options) -> list[Row]:
    """The entry's size sequence on one compiled model; errors become rows."""
    rows = [Row(entry.name, entry.kind, size, call, family=entry.family) for call, size in enumerate(options.sequence)]
    reason = unavailable(entry.family)
    if reason:
        for row in rows:
            row.status, row.note = "skip", reason
        return rows
    torch._dynamo.reset()
    try:
        model = build(entry, options)
    except Exception as e:
        traceback.print_exc()
        for row in rows:
            row.error = f"build: {zoo.describe(e)}"
            judge(row, options)
        return rows
    session = compile_model(model, options)
    for row in rows:
        run_row(entry, model, row, session, options)
    del session  # its graphs and pool go with the compiled frames
    zoo.release()
    return rows


def run_row(entry: Entry, model: torch.nn.Module, row: Row, session: Session, options: Options) -> None:
    """One call: eager, cgcompile and (with --reference) plain torch.compile on the same inputs."""
    start = time.perf_counter()
    try:
        args = make_inputs(entry, row, options)
        expected = call(model, model.forward, args)
    except Exception as e:  # nothing to compare with: the model does not run in this dtype or on these inputs
        row.status, row.note = "skip", f"eager fails: {zoo.describe(e)}"
        row.wall_s = time.perf_counter() - start
        return
    try:
        row.max_err = compare(call(model, session.forward, args), expected)
        if session.reference:
            run_reference(model, row, session.reference, args, expected)
    except Exception as e:
        traceback.print_exc()
        row.error = zoo.describe(e)
    row.wall_s = time.perf_counter() - start
    zoo.record_stats(row, session.backend)
    judge(row, options)


def call(model: torch.nn.Module, forward: Callable, args: tuple):
    """`forward(*args)` installed as the model's forward (as a user compiles), under inference_mode."""
    with zoo.compiled([model], [forward]), torch.inference_mode():
        return model(*args)


def run_reference(model: torch.nn.Module, row: Row, reference: Callable, args: tuple, expected) -> None:
    try:
        row.reference_err = compare(call(model, reference, args), expected)
    except Exception as e:
        row.reference_error = zoo.describe(e)


def judge(row: Row, options: Options) -> None:
    """FAIL on an error or an error above tolerance; "upstream" when plain torch.compile's
    error on the same inputs is over the tolerance too, and of the same size."""
    if row.error:
        row.status, row.note = "FAIL", row.error
    elif row.max_err is not None and not row.max_err <= options.tolerance:
        row.status, row.note = "FAIL", f"max err {row.max_err:.2e} > {options.tolerance:g}"
        if shares_error(row, options.tolerance):
            row.status, row.note = "upstream", row.note + f"; plain torch.compile {row.reference_err:.2e}"
    if row.reference_error:
        row.note = (row.note + "; " if row.note else "") + f"plain torch.compile: {row.reference_error}"


def shares_error(row: Row, tolerance: float) -> bool:
    ref = row.reference_err
    return ref is not None and ref > tolerance and ref >= UPSTREAM_SHARE * row.max_err


def run_zoo(names: list[str], options: Options, on_row: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """Every named model, one after another; `on_row` sees each row as it is done."""
    rows = []
    with torch._dynamo.config.patch(recompile_limit=64), zoo.exact_float32(options):
        for name in names:
            for row in run_model(BY_NAME[name], options):
                on_row(row)
                rows.append(row)
    return rows


# -- report ---------------------------------------------------------------------------------------

TABLE_WIDTH = 140
HEADER = (f"{'model':<20} {'family':<15} {'call':>4} {'size':>4} {'status':<8} {'graphs':>6} {'pieces':>6} "
          f"{'capt':>4} {'cuda':>4} {'pad':>3} {'max err':>8} {'ref err':>8} {'wall s':>6}  note")


def format_row(row: Row) -> str:
    fmt = zoo.fmt
    line = (f"{row.model:<20} {row.family:<15} {row.call:>4} {row.size:>4} {row.status:<8} {fmt(row.graphs, '6d')} "
            f"{fmt(row.pieces, '6d')} {fmt(row.capturable, '4d')} {fmt(row.graphs_captured, '4d')} "
            f"{fmt(row.padded_graphs, '3d')} {fmt(row.max_err, '8.1e')} {fmt(row.reference_err, '8.1e')} "
            f"{fmt(row.wall_s, '6.1f')}  {row.note or ''}")
    return line[:TABLE_WIDTH]


def print_report(rows: list[Row]) -> None:
    print("\n" + HEADER)
    for row in rows:
        print(format_row(row))
    counts = {status: sum(row.status == status for row in rows) for status in ("ok", "skip", "upstream", "FAIL")}
    print(f"\n{len({row.model for row in rows})} models, {len(rows)} rows: "
          + ", ".join(f"{n} {status}" for status, n in counts.items()))
    for row in rows:
        if row.status in ("FAIL", "upstream"):
            print(f"{row.status} {row.model} call {row.call} size {row.size}: {row.note}")


def versions() -> dict:
    found = {}
    for family in FAMILIES:
        try:
            found[family] = package(family).__version__
        except Exception:  # reported as a skip row by the model's run
            found[family] = None
    return found


def environment(options: Options) -> dict:
    device = torch.cuda.get_device_name() if options.device == "cuda" else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, **versions(), "python": platform.python_version(),
            "dtype": str(options.dtype).removeprefix("torch."), "compiler": options.compiler,
            "capture_sizes": zoo.CAPTURE_SIZES, "sequence": options.sequence, "padding": options.padding,
            "reference": options.reference, "tolerance": options.tolerance}


def write_json(path: str, rows: list[Row], options: Options) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment(options), "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


# -- command line -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default=None,
                        help="cgcompile's piece compiler; default inductor on CUDA, eager on CPU")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated names (see --list), kinds {KINDS} or families {FAMILIES}; default: all")
    parser.add_argument("--sequence", default=None, help="comma-separated sizes every model runs in turn "
                                                         f"(default {','.join(map(str, SEQUENCE))})")
    parser.add_argument("--padding", action="store_true", help="compile with Config(padding=True): pads on CPU too")
    parser.add_argument("--reference", choices=("inductor",), default=None,
                        help="also run plain torch.compile (Inductor) and mark errors it shares 'upstream'")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--list", action="store_true", help="print the models and exit")
    args = parser.parse_args(argv)
    try:
        args.names = select(args.models.split(",") if args.models else list(FAMILIES))
    except KeyError as e:
        parser.error(f"--models: unknown {e.args[0]!r}; expected names from --list, kinds {KINDS} "
                     f"or families {FAMILIES}")
    return args


def select(words: list[str]) -> list[str]:
    """Model names for a list of names, kinds and families, in the zoo's order, each once."""
    for word in words:
        if word not in BY_NAME and word not in KINDS and word not in FAMILIES:
            raise KeyError(word)
    return [e.name for e in ENTRIES if e.name in words or e.kind in words or e.family in words]


def options_from(args: argparse.Namespace) -> Options:
    sequence = tuple(int(s) for s in args.sequence.split(",")) if args.sequence else SEQUENCE
    return Options(device=args.device, dtype=getattr(torch, args.dtype), sequence=sequence,
                   compiler=args.compiler or ("inductor" if args.device == "cuda" else "eager"),
                   padding=True if args.padding else None, reference=args.reference)


def print_list() -> None:
    reasons = {family: unavailable(family) for family in FAMILIES}
    for entry in ENTRIES:
        reason = reasons[entry.family]
        print(f"{entry.name:<21} {entry.family:<16} {entry.kind:<15}{f'  ({reason})' if reason else ''}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print_list()
        return 0
    options = options_from(args)
    print(environment(options), HEADER, sep="\n", flush=True)
    done = []

    def on_row(row: Row) -> None:
        print(format_row(row), flush=True)
        done.append(row)
        if args.json:  # after every row: a run cut short keeps what it measured
            write_json(args.json, done, options)

    rows = run_zoo(args.names, options, on_row)
    print_report(rows)
    if args.json:
        print(f"wrote {args.json}")
    return 1 if any(row.status == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
