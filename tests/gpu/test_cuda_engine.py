"""The CUDA engine on a real GPU: accuracy, graphs, pinned I/O, reporting.

Run by scripts/gpu_run.sh on the device machine; skipped where CUDA is absent.
References are float32 CPU outputs (tests/gpu/reference.py).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cuda.backend import CudaBackend, collect
from engine.cuda.forward import PDL_MAX_TOKENS, FusedForward
from engine.cuda.graphs import bucket_shapes, capturing, packed_tokens
from engine.cuda.pinned import HostBuffer
from tests.gpu.reference import Fixtures, fixtures, padded_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
# The engine's own capture list, with the batcher's defaults.
MAX_BATCH, TOKEN_BUDGET = 256, 16384


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> Fixtures:
    return fixtures(tmp_path_factory.mktemp("gpu_models"))


@pytest.fixture(scope="module")
def backend(refs: Fixtures) -> Iterator[CudaBackend]:
    cuda = CudaBackend("cuda:0")
    for name, entry in refs.entries.items():
        cuda.load(entry)
        cuda.warmup(name, bucket_shapes(entry.buckets, MAX_BATCH, TOKEN_BUDGET))
    yield cuda


def run_all(
    backend: CudaBackend,
    model: str,
    sequences: list[np.ndarray],
    buckets: list[int],
    rows: int,
) -> np.ndarray:
    """Every sequence through run_bytes, in bucket batches of up to rows."""
    out: list[np.ndarray] = [np.empty(0)] * len(sequences)
    for indices, ids, lengths in padded_batches(sequences, buckets, rows):
        result, _ = backend.run_bytes(
            model, ids.tobytes(), lengths.tobytes(), *ids.shape
        )
        for row, i in enumerate(indices):
            out[i] = result[row].copy()
    return np.stack(out)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def random_batch(
    rows: int, length: int, vocab: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(rows, length), dtype=np.int32)
    lengths = rng.integers(0, length + 1, size=rows, dtype=np.int32)
    lengths[0] = length
    return ids, lengths


def test_torch_on_a_gpu_is_the_graph_backend() -> None:
    from engine.backend import create_backend
    from engine.cuda.backend import CudaBackend
    from engine.torch_backend import TorchBackend

    assert isinstance(create_backend("torch", "cuda:0"), CudaBackend)
    eager = create_backend("torch-eager", "cuda:0")
    assert type(eager) is TorchBackend


def test_a_model_on_a_gpu_is_served_in_its_gpu_buckets() -> None:
    """The engine captures graphs for, and the batchers (--gpu-buckets) send,
    a model's gpu_buckets when its backend runs it on a GPU."""
    from engine.__main__ import as_served
    from engine.backends_by_model import create_model_router
    from services.repository import ModelEntry

    entry = ModelEntry(
        name="m", task="embed", checkpoint="/x", backend="torch",
        buckets=[12, 24, 512], gpu_buckets=[16, 512],
    )  # fmt: skip
    router = create_model_router({"m": entry}, "torch", "cuda:0")
    assert as_served({"m": entry}, router)["m"].buckets == [16, 512]


def test_embeddings_match_fp32_reference(backend: CudaBackend, refs: Fixtures) -> None:
    entry = refs.entries["minilm"]
    got = run_all(backend, "minilm", refs.text_ids, entry.buckets, 37)
    cos = cosine(got, refs.embeddings)
    print(f"minilm fp16 vs fp32 CPU: min cosine {cos.min():.6f} over {len(cos)} texts")
    assert np.isfinite(got).all()
    # Observed on the H200: 0.999993 (benchmarks/results/gpu_tests_h200.log).
    assert cos.min() >= 0.99998, f"worst text: {int(cos.argmin())}"


def test_intent_top1_matches_fp32_reference(
    backend: CudaBackend, refs: Fixtures
) -> None:
    entry = refs.entries["intent"]
    probs = run_all(backend, "intent", refs.utterance_ids, entry.buckets, 100)
    agree = float(np.mean(probs.argmax(axis=1) == refs.intent_top1))
    print(f"intent fp16 top-1 = fp32 top-1 on {agree:.2%} of {len(probs)} utterances")
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    assert agree >= 0.99


def test_graph_replay_equals_eager(backend: CudaBackend) -> None:
    runner = backend.runner("minilm")
    for rows, length in [(1, 32), (8, 128), (32, 512), (256, 64)]:
        ids, lengths = random_batch(rows, length, runner.vocab, seed=rows + length)
        graph, _ = backend.run_bytes(
            "minilm", ids.tobytes(), lengths.tobytes(), rows, length
        )
        # The same function eagerly: packed into as many tokens as the graph.
        tokens = runner.graphs.tokens_for(rows, length, packed_tokens(lengths, rows))
        with torch.inference_mode(), torch.cuda.stream(runner.stream):
            ids_d, lengths_d = torch.from_numpy(ids).cuda(), torch.from_numpy(lengths)
            eager = runner.forward(ids_d, lengths_d.cuda(), tokens)
            eager_np = eager.cpu().numpy()  # on the engine's stream, after forward
        print(
            f"{rows}x{length} ({tokens or 'padded'}): graph - eager max "
            f"{np.abs(graph - eager_np).max():.2e}"
        )
        np.testing.assert_allclose(graph, eager_np, rtol=1e-3, atol=2e-3)


class _Junk:
    """A dead reference cycle holding CUDA resources."""

    def __init__(self, graph: torch.cuda.CUDAGraph, pinned: HostBuffer) -> None:
        self.graph, self.pinned, self.me = graph, pinned, self


def test_a_capture_survives_garbage_that_frees_graphs_and_pinned_memory() -> None:
    """Dead cycles holding a captured graph and a pinned buffer, with the
    collector at its most eager: were they collected during the capture
    (cudaGraphExecDestroy, cudaFreeHost), CUDA would invalidate it and the
    next launch would fail. ``capturing`` holds the collector off."""
    x = torch.zeros(1024, device="cuda")

    def dead_cycle() -> weakref.ref[_Junk]:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            x.add_(1.0)
        return weakref.ref(_Junk(graph, HostBuffer(1 << 20, x.device)))

    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1 << 30)  # nothing collected before the capture starts
    dead = [dead_cycle() for _ in range(4)]
    try:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            gc.set_threshold(1, 1, 1)  # a full collection at nearly every allocation
            y = x
            for _ in range(50):
                y = y * 1.0 + 1.0
                [[] for _ in range(50)]  # noqa: B018 (allocations that would collect)
            survived = sum(ref() is not None for ref in dead)
    finally:
        gc.set_threshold(*thresholds)
    assert gc.isenabled()
    assert survived == len(dead), "collected during the capture"
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 50.0))
    gc.collect()
    assert all(ref() is None for ref in dead)  # garbage indeed, freed after


def test_packed_graphs_equal_padded_eager(backend: CudaBackend) -> None:
    """Large shapes run packed; their rows equal the padded computation's."""
    runner = backend.runner("minilm")
    for rows, length in [(256, 64), (32, 512), (100, 128)]:
        ids, lengths = random_batch(rows, length, runner.vocab, seed=rows * length)
        padded = runner.graphs.padded_batch(rows, length)
        assert padded is not None
        needed = packed_tokens(lengths, padded)
        tokens = runner.graphs.tokens_for(padded, length, needed)
        assert tokens is not None and needed <= tokens < padded * length, tokens
        graph, _ = backend.run_bytes(
            "minilm", ids.tobytes(), lengths.tobytes(), rows, length
        )
        with torch.inference_mode(), torch.cuda.stream(runner.stream):
            ids_d, lengths_d = torch.from_numpy(ids).cuda(), torch.from_numpy(lengths)
            eager = runner.forward(ids_d, lengths_d.cuda()).cpu().numpy()
        real = lengths > 0
        cos = cosine(graph[real], eager[real]).min()
        print(f"{rows}x{length} in {tokens} tokens: min cosine to padded {cos:.6f}")
        assert cos > 0.99999
        np.testing.assert_allclose(graph, eager, rtol=1e-2, atol=5e-3)


def test_full_rows_take_the_graph_without_a_mask(backend: CudaBackend) -> None:
    """A batch of full rows replays the top rung (attention with no mask);
    one row short of full replays the rung below it. Both equal the padded
    computation."""
    runner = backend.runner("minilm")
    rows, length = 256, 64
    assert runner.forward.full_rows[(rows, length)] in ("sdpa", "triton")
    ids, _ = random_batch(rows, length, runner.vocab, seed=11)
    ids[ids == 0] = 1000  # every position a real token
    for short in (0, 1):
        lengths = np.full(rows, length, dtype=np.int32)
        lengths[-1] -= short
        needed = packed_tokens(lengths, rows)
        tokens = runner.graphs.tokens_for(rows, length, needed)
        assert tokens == rows * length - short
        graph, _ = backend.run_bytes(
            "minilm", ids.tobytes(), lengths.tobytes(), rows, length
        )
        with torch.inference_mode(), torch.cuda.stream(runner.stream):
            ids_d, lengths_d = torch.from_numpy(ids).cuda(), torch.from_numpy(lengths)
            eager = runner.forward(ids_d, lengths_d.cuda()).cpu().numpy()
        cos = cosine(graph, eager).min()
        print(f"{rows}x{length}, {short} short, {tokens} tokens: min cosine {cos:.6f}")
        assert cos > 0.99999
        np.testing.assert_allclose(graph, eager, rtol=1e-2, atol=5e-3)


def test_every_output_element_is_written(backend: CudaBackend) -> None:
    runner = backend.runner("minilm")
    for slot in runner.ring.slots:
        slot.out[:] = np.nan
    with torch.inference_mode():
        for output in runner.graphs.outputs():
            output.fill_(float("nan"))
    shapes = [(b, n) for b, n in [(1, 32), (3, 32), (5, 128), (31, 512), (200, 64)]]
    for rows, length in shapes:
        ids, lengths = random_batch(rows, length, runner.vocab, seed=rows)
        out, _ = backend.run_bytes(
            "minilm", ids.tobytes(), lengths.tobytes(), rows, length
        )
        assert out.shape == (rows, runner.width)
        assert np.isfinite(out).all(), (rows, length)
        padded = runner.graphs.padded_batch(rows, length)
        statics = [
            captured.output
            for key, captured in runner.graphs._graphs.items()
            if key[1:3] == (padded, length)
        ]
        # The graph just replayed wrote every row, padding rows included.
        assert any(bool(torch.isfinite(s).all()) for s in statics), (rows, length)


def test_padding_rows_do_not_change_results(backend: CudaBackend) -> None:
    runner = backend.runner("minilm")
    ids, lengths = random_batch(5, 64, runner.vocab, seed=3)
    together, _ = backend.run_bytes("minilm", ids.tobytes(), lengths.tobytes(), 5, 64)
    together = together.copy()
    for row in range(5):
        alone, _ = backend.run_bytes(
            "minilm", ids[row].tobytes(), lengths[row : row + 1].tobytes(), 1, 64
        )
        np.testing.assert_allclose(alone[0], together[row], rtol=1e-2, atol=5e-3)


def test_double_buffering_keeps_batches_apart(backend: CudaBackend) -> None:
    runner = backend.runner("minilm")
    a_ids, a_len = random_batch(16, 128, runner.vocab, seed=1)
    b_ids, b_len = random_batch(16, 128, runner.vocab, seed=2)
    a_alone = backend.run("minilm", a_ids, a_len)
    b_alone = backend.run("minilm", b_ids, b_len)
    first = backend.submit("minilm", a_ids.tobytes(), a_len.tobytes(), 16, 128)
    second = backend.submit("minilm", b_ids.tobytes(), b_len.tobytes(), 16, 128)
    with pytest.raises(RuntimeError, match="uncollected"):
        backend.submit("minilm", a_ids.tobytes(), a_len.tobytes(), 16, 128)
    np.testing.assert_array_equal(collect(first)[0], a_alone)
    np.testing.assert_array_equal(collect(second)[0], b_alone)


@pytest.mark.parametrize("shape", [(1, 16), (8, 64), (128, 128)])
@pytest.mark.parametrize(
    ("what", "error"),
    [("id past the vocabulary", "token ids"), ("negative id", "token ids"),
     ("length past the bucket", "lengths"), ("negative length", "lengths")],
)  # fmt: skip
def test_bad_values_fail_the_batch_not_the_engine(
    backend: CudaBackend, shape: tuple[int, int], what: str, error: str
) -> None:
    """Checked before the launch (packed 128 x 128) or while the graph runs on
    clamped values (1 x 16's embedding kernel reads the mapped input itself,
    8 x 64's reads a device copy): either way the batch fails with its error,
    and the slots and the results of later batches are as before."""
    runner = backend.runner("minilm")
    rows, length = shape
    ids, lengths = random_batch(rows, length, runner.vocab, seed=4)
    good = backend.run("minilm", ids, lengths)
    bad_ids, bad_lengths = ids.copy(), lengths.copy()
    if what == "id past the vocabulary":
        bad_ids[rows - 1, 3] = runner.vocab
    elif what == "negative id":
        bad_ids[0, 0] = -1
    elif what == "length past the bucket":
        bad_lengths[rows - 1] = length + 1
    else:
        bad_lengths[0] = -1
    with pytest.raises(ValueError, match=error):
        backend.run("minilm", bad_ids, bad_lengths)
    for _ in range(3):  # both slots, and the one after
        np.testing.assert_array_equal(backend.run("minilm", ids, lengths), good)


def test_graphs_launch_through_cuda_python(backend: CudaBackend) -> None:
    """Zero-copy batches launch each graph's executable straight on the
    engine's stream (cuda-python is in the GPU image); the output is the
    one torch's replay gives."""
    runner = backend.runner("minilm")
    captured = list(runner.graphs._graphs.values())
    assert captured and all(c.executable is not None for c in captured)
    ids, lengths = random_batch(1, 16, runner.vocab, seed=6)
    launched = backend.run("minilm", ids, lengths)
    ticket = backend.submit("minilm", ids.tobytes(), lengths.tobytes(), 1, 16)
    collect(ticket)
    with torch.cuda.stream(backend.stream):  # the same slot again, by replay()
        runner.ring.slots[0].io[:16] = ids.reshape(-1)
        runner.ring.slots[0].io[16:17] = lengths
        runner.graphs.replay(0, 1, 16)
    backend.stream.synchronize()
    replayed = runner.ring.slots[0].out[: runner.width].reshape(1, -1)
    np.testing.assert_array_equal(replayed, launched)


def test_direct_submits_equal_the_general_way(backend: CudaBackend) -> None:
    """Unpacked zero-copy shapes take the Direct way (their graph's handles
    and output views found once per request shape); their outputs, padding
    rows included, equal the general way's bit for bit. Packed shapes take
    the general way."""
    runner = backend.runner("minilm")
    shapes = [(1, 16), (3, 16), (8, 64)]
    batches = {s: random_batch(*s, runner.vocab, seed=7) for s in shapes}
    direct = {s: backend.run("minilm", *batches[s]) for s in shapes}
    assert all(runner._direct[s] is not None for s in shapes)
    backend.run("minilm", *random_batch(128, 128, runner.vocab, seed=7))
    assert runner._direct[(128, 128)] is None
    runner._direct.update(dict.fromkeys(shapes))  # None: the general way
    try:
        for shape in shapes:
            general = backend.run("minilm", *batches[shape])
            np.testing.assert_array_equal(general, direct[shape])
    finally:
        runner._direct.clear()


@pytest.mark.parametrize(
    ("option", "floor"),
    # Observed on the H200: 0.999994, 0.999994, 0.999803, 0.999997.
    [({"input_mode": "zero-copy"}, 0.99998), ({"input_mode": "staging"}, 0.99998),
     ({"dtype": torch.bfloat16}, 0.9995), ({"gelu_epilogue": False}, 0.99998)],
)  # fmt: skip
def test_options_match_fp32_reference(
    refs: Fixtures, option: dict, floor: float
) -> None:
    cuda = CudaBackend("cuda:0", **option)
    entry = refs.entries["minilm"]
    cuda.load(entry)
    cuda.warmup("minilm", [(b, n) for b in (1, 8, 37, 64) for n in entry.buckets])
    got = run_all(cuda, "minilm", refs.text_ids, entry.buckets, 37)
    cos = cosine(got, refs.embeddings)
    print(f"{option}: min cosine {cos.min():.6f}")
    assert cos.min() >= floor


def test_preloading_linear_matches_torch() -> None:
    """Every PRELOAD_LINEAR tile on its projection's shape, at its token
    limit and 3 tokens short of it, equals torch's product (partials summed;
    bias and GELU where the projection has them), launched classic or
    dependent."""
    import torch.nn.functional as F

    from engine.cuda.kernels import ACT_GELU_TANH, ACT_NONE, linear, pdl_available
    from engine.cuda.tiles import PRELOAD_LINEAR

    g = torch.Generator(device="cuda").manual_seed(1)
    inner = {768: 3072, 384: 1536}
    for (name, hidden), rows in PRELOAD_LINEAR.items():
        n = {"qkv": 3 * hidden, "ffn_in": inner[hidden]}.get(name, hidden)
        k = inner[hidden] if name == "ffn_out" else hidden
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).half()
        b = torch.randn(n, device="cuda", generator=g).half()
        act = ACT_GELU_TANH if name == "ffn_in" else ACT_NONE
        for limit, config in rows:
            for m in (limit, limit - 3):
                x = torch.randn(m, k, device="cuda", generator=g).half()
                want = F.linear(x.float(), w.float(), b.float())
                if act == ACT_GELU_TANH:
                    want = F.gelu(want, approximate="tanh")
                for pdl in (False, True) if pdl_available(x) else (False,):
                    if config.split > 1:
                        got = linear(x, w, None, act, config, pdl).sum(0) + b.float()
                    else:
                        got = linear(x, w, b, act, config, pdl).float()
                    torch.testing.assert_close(
                        got, want, rtol=2e-2, atol=2e-2, msg=f"{name} {hidden} {m}"
                    )


def test_fused_kernels_match_torch() -> None:
    import torch.nn.functional as F

    from engine.cuda.kernels import add_layer_norm, add_layer_norm_partials, mean_pool

    g = torch.Generator(device="cuda").manual_seed(0)
    # Both sides of LN_ROWS's 2,048-row threshold, an odd row count past it.
    for rows, cols in [(1, 384), (4096, 768), (333, 1024), (2049, 768)]:
        x, r = (
            torch.randn(rows, cols, device="cuda", generator=g).half() for _ in "xr"
        )
        w, b = (torch.randn(cols, device="cuda", generator=g).half() for _ in "wb")
        got = add_layer_norm(x, r, w, b, 1e-12).float()
        want = F.layer_norm(x.float() + r.float(), (cols,), w.float(), b.float(), 1e-12)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        # The residual already added (cuBLAS's beta = 1): LayerNorm(x + bias).
        got = add_layer_norm_partials(None, b, x, w, b, 1e-12).float()
        want = F.layer_norm(x.float() + b.float(), (cols,), w.float(), b.float(), 1e-12)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    hidden = torch.randn(7, 128, 384, device="cuda", generator=g).half()
    lengths = torch.tensor([128, 0, 1, 64, 127, 3, 100], device="cuda")
    mask = (torch.arange(128, device="cuda")[None] < lengths[:, None]).float()
    want = (hidden.float() * mask[..., None]).sum(1) / lengths.clamp(min=1)[:, None]
    torch.testing.assert_close(mean_pool(hidden, lengths), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("batch", "length", "heads", "head"),
    [(1, 16, 12, 32), (3, 128, 12, 64), (2, 512, 12, 32), (40, 64, 12, 64)],
)
def test_triton_attention_matches_sdpa(
    batch: int, length: int, heads: int, head: int
) -> None:
    import torch.nn.functional as F

    from engine.cuda.kernels import attention

    g = torch.Generator(device="cuda").manual_seed(batch)
    qkv = torch.randn(batch * length, 3 * heads * head, device="cuda", generator=g)
    lengths = torch.randint(1, length + 1, (batch,), device="cuda", generator=g)
    lengths[0] = length
    got = attention(qkv.half(), lengths.int(), batch, length, heads).float()
    shaped = qkv.view(batch, length, 3, heads, head).permute(2, 0, 3, 1, 4)
    q, k, v = shaped.unbind(0)
    keys = torch.arange(length, device="cuda")[None] < lengths[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None])
    want = want.transpose(1, 2).reshape(batch * length, -1)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got - want).abs().mean() < 2e-3


def test_each_shape_has_a_chosen_attention_and_plan(
    backend: CudaBackend, refs: Fixtures
) -> None:
    """Every captured shape has its attention kernel and its GEMM plan
    chosen at capture; on Hopper, shapes past PRELOAD_LINEAR's table keep
    SMALL_LINEAR's."""
    forward = backend.runner("minilm").forward
    chosen = forward.chosen
    print({kind: list(chosen.values()).count(kind) for kind in set(chosen.values())})
    print(f"preloading GEMMs on {sum(forward.preloaded.values())} shapes")
    shapes = bucket_shapes(refs.entries["minilm"].buckets, MAX_BATCH, TOKEN_BUDGET)
    assert set(chosen.values()) <= set(forward.kinds)
    assert set(chosen) == set(shapes) == set(forward.preloaded)
    assert not any(forward.preloaded[(b, n)] for b, n in shapes if b * n > 128)


def test_service_reports_gpu_stats(backend: CudaBackend, refs: Fixtures) -> None:
    internal_pb2 = pytest.importorskip("services.proto.berth.v1.internal_pb2")
    from engine.service import EngineService

    service = EngineService(backend, refs.entries)
    ids, lengths = random_batch(9, 64, 30000, seed=9)
    batch = internal_pb2.Batch(
        id=7, model="minilm", batch_size=9, length=64,
        token_ids=ids.tobytes(), lengths=lengths.tobytes(),
    )  # fmt: skip
    result = service.run_batch(batch)
    assert result.code == 0, result.message
    out = np.frombuffer(result.output, dtype="<f4").reshape(9, result.width)
    np.testing.assert_array_equal(out, backend.run("minilm", ids, lengths))
    assert result.gpu_utilization >= 0.0 and result.gpu_memory_used > 0
    assert result.compute_us > 0
    print(
        f"utilization {result.gpu_utilization}%, memory "
        f"{result.gpu_memory_used / 2**30:.1f} GiB, compute {result.compute_us} us"
    )


def test_pipelined_service_matches_one_at_a_time(
    backend: CudaBackend, refs: Fixtures
) -> None:
    """Batch n+1 submitted before batch n is collected: same answers."""
    internal_pb2 = pytest.importorskip("services.proto.berth.v1.internal_pb2")
    from engine.service import EngineService

    service = EngineService(backend, refs.entries)
    batches = []
    for i, rows in enumerate((9, 3, 16, 1, 7)):
        ids, lengths = random_batch(rows, 32, 30000, seed=20 + i)
        batches.append(
            internal_pb2.Batch(
                id=i,
                model="minilm",
                batch_size=rows,
                length=32,
                token_ids=ids.tobytes(),
                lengths=lengths.tobytes(),
            )  # fmt: skip
        )
    alone = [service.run_batch(b).output for b in batches]
    started = service.start(batches[0])
    piped = []
    for b in batches[1:]:
        result, started = service._advance(started, b)
        piped.append(result.output)
    result, _ = service._advance(started, None)
    piped.append(result.output)
    assert piped == alone


def test_engine_worker_captures_before_serving(refs: Fixtures, tmp_path: Path) -> None:
    pytest.importorskip("services.proto.berth.v1.internal_pb2")
    from tests.stack import free_ports, health

    (port,) = free_ports(1)
    repo = Path(refs.entries["minilm"].root).parent
    log_file = tmp_path / "engine.log"
    with log_file.open("w") as log:
        engine = subprocess.Popen(
            [sys.executable, "-m", "engine", "--device", "cuda:0", "--port",
             str(port), "--metrics-port", "0", "--models", "minilm",
             "--model-repository", str(repo)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while health(f"127.0.0.1:{port}") != "SERVING":
            assert engine.poll() is None, log_file.read_text()
            assert time.monotonic() < deadline, log_file.read_text()
            time.sleep(0.5)
        text = log_file.read_text()
        print(text[-3000:])
        captured = text.index("CUDA graphs captured")
        assert captured < text.index("engine SERVING")
    finally:
        engine.terminate()
        engine.wait(60)


def test_few_token_gemms_match_cublas(backend: CudaBackend) -> None:
    """Small shapes use berth's Triton GEMMs where they measured faster; their
    output equals the cuBLAS path's."""
    runner = backend.runner("minilm")
    forward = runner.forward
    ids, lengths = random_batch(1, 128, runner.vocab, seed=9)
    assert forward._plan(128), "the H200 runs MiniLM's 128-token GEMMs in Triton"
    with torch.inference_mode(), torch.cuda.stream(runner.stream):
        ids_d, lengths_d = torch.from_numpy(ids).cuda(), torch.from_numpy(lengths)
        planned = forward(ids_d, lengths_d.cuda()).cpu().numpy()
        saved, forward._plans = forward._plans, {(128, False): {}, (128, True): {}}
        try:
            cublas = forward(ids_d, lengths_d.cuda()).cpu().numpy()
        finally:
            forward._plans = saved
    print(f"few-token GEMMs vs cuBLAS: max {np.abs(planned - cublas).max():.2e}")
    assert cosine(planned, cublas).min() > 0.99999
    np.testing.assert_allclose(planned, cublas, rtol=1e-2, atol=5e-3)


DEPENDENT = [(1, 128), (2, 128), (8, 32), (1, 256)]  # shapes launched dependent


def test_dependent_launches_replay_alike(backend: CudaBackend) -> None:
    """On Hopper a few-token forward's Triton kernels launch while their
    predecessor runs, each program waiting for its writes first: a missing
    wait would be a race, which shows as replays that differ from each other
    or from the classic launches. (64 x 128, over PDL_MAX_TOKENS, compares
    the classic launches with themselves: a control.)"""
    runner = backend.runner("minilm")
    if not runner.forward.pdl:
        pytest.skip("dependent launches need Hopper or later")
    classic = FusedForward(runner.forward.served, pdl=False)
    assert not classic.pdl
    assert all(rows * length <= PDL_MAX_TOKENS for rows, length in DEPENDENT)
    for rows, length in [*DEPENDENT, (64, 128)]:
        ids, lengths = random_batch(rows, length, runner.vocab, seed=rows * length)
        args = ("minilm", ids.tobytes(), lengths.tobytes(), rows, length)
        first = backend.run_bytes(*args)[0].copy()
        for _ in range(100):
            np.testing.assert_array_equal(backend.run_bytes(*args)[0], first)
        tokens = runner.graphs.tokens_for(rows, length, packed_tokens(lengths, rows))
        with torch.inference_mode(), torch.cuda.stream(runner.stream):
            ids_d, lengths_d = torch.from_numpy(ids).cuda(), torch.from_numpy(lengths)
            reference = classic(ids_d, lengths_d.cuda(), tokens).cpu().numpy()
        live = lengths > 0  # empty rows are zeros in both
        np.testing.assert_array_equal(first[~live], reference[~live])
        worst = cosine(first[live], reference[live]).min()
        print(f"{rows}x{length}: dependent vs classic launches, min cosine {worst:.7f}")
        assert worst > 0.99999


def test_preloading_gemms_replay_alike_and_match_the_other_plan(
    refs: Fixtures,
) -> None:
    """PRELOAD_LINEAR's GEMMs read their weights before waiting for the
    previous kernel (engine/cuda/kernels/). Forced on every shape that has the
    plan: replays equal each other bit for bit (a race would not) and equal
    the SMALL_LINEAR plan's forward to fp16 rounding; 64 x 128 is past the
    table (a control)."""
    cuda = CudaBackend("cuda:0")
    cuda.load(refs.entries["minilm"])
    runner = cuda.runner("minilm")
    forward = runner.forward
    if not forward.pdl:
        pytest.skip("dependent launches need Hopper or later")

    def always(batch: int, length: int, run: object = None) -> bool:
        eligible = forward.preload_eligible(batch * length)
        forward.preloaded[(batch, length)] = eligible
        return eligible

    forward.choose_plan = always  # type: ignore[method-assign]
    shapes = [(1, 16), (1, 64), (2, 64), (1, 128), (8, 16), (64, 128)]
    cuda.warmup("minilm", shapes)
    assert [forward.preloaded[s] for s in shapes] == [True] * 5 + [False]
    assert all(c.preload for c in forward._plan(128, True).values())
    for rows, length in shapes:
        ids, lengths = random_batch(rows, length, runner.vocab, seed=rows + length)
        args = ("minilm", ids.tobytes(), lengths.tobytes(), rows, length)
        first = cuda.run_bytes(*args)[0].copy()
        for _ in range(100):
            np.testing.assert_array_equal(cuda.run_bytes(*args)[0], first)
        forward.preloaded[(rows, length)] = False
        with torch.inference_mode(), torch.cuda.stream(runner.stream):
            ids_d, lengths_d = torch.from_numpy(ids).cuda(), torch.from_numpy(lengths)
            other = forward(ids_d, lengths_d.cuda()).cpu().numpy()
        live = lengths > 0
        worst = cosine(first[live], other[live]).min()
        print(f"{rows}x{length}: preloading vs the other plan, min cosine {worst:.7f}")
        assert worst > 0.99999


def test_fp8_entry_serves_from_graphs(refs: Fixtures) -> None:
    """quantize: fp8 swaps the encoder's linears for FP8 ones; the CUDA
    backend's fused forward calls them as modules inside its graphs."""
    entry = dataclasses.replace(refs.entries["minilm"], quantize="fp8")
    cuda = CudaBackend("cuda:0")
    cuda.load(entry)
    cuda.warmup("minilm", bucket_shapes(entry.buckets, 32, TOKEN_BUDGET))
    embeddings = run_all(cuda, "minilm", refs.text_ids, entry.buckets, 32)
    cos = cosine(embeddings, refs.embeddings)
    print(f"fp8 minilm vs fp32: cosine mean {cos.mean():.5f}, min {cos.min():.5f}")
    assert cos.mean() >= 0.996  # observed: mean 0.99719, min 0.98862
    assert cos.min() >= 0.985


def test_fp8_entry_runs_its_layers_as_fp8_layers(refs: Fixtures) -> None:
    """The served FP8 model's layers take the fused FP8 path (each product's
    e4m3 input written by the kernel before it), in graphs and eagerly alike."""
    entry = dataclasses.replace(refs.entries["intent"], quantize="fp8")
    cuda = CudaBackend("cuda:0")
    cuda.load(entry)
    runner = cuda.runner("intent")
    plans = runner.forward.fp8
    assert all(p is not None for p in plans), "FP8 layers fell back to module calls"
    cuda.warmup("intent", bucket_shapes(entry.buckets, 32, TOKEN_BUDGET))
    ids, lengths = random_batch(8, 32, runner.vocab, seed=11)
    graphed = cuda.run_bytes("intent", ids.tobytes(), lengths.tobytes(), 8, 32)[0]
    with torch.inference_mode():
        ids_d, lengths_d = (
            torch.from_numpy(ids).cuda(),
            torch.from_numpy(lengths).cuda(),
        )
        eager = runner.forward(ids_d, lengths_d).float().cpu().numpy()
    live = lengths > 0
    assert cosine(graphed[live], eager[live]).min() > 0.9999


@pytest.mark.parametrize("epilogue", ["gelu_tanh", "relu"])
def test_cublaslt_epilogue_equals_product_then_pass(epilogue: str) -> None:
    """FFN-in as one cuBLASLt call (activation, e4m3 out) computes what
    _scaled_mm then berth's activation pass compute, saturating, and reads
    its scales at each run (a graph replays with new ones)."""
    from engine import quant
    from engine.cuda import kernels, products

    torch.manual_seed(0)
    linear = torch.nn.Linear(768, 3072, device="cuda")
    x = torch.randn(4096, 768, device="cuda")
    fp8 = quant.Fp8Linear(linear, float(x.abs().max()))
    out_inv = torch.tensor(400.0, device="cuda")  # the largest saturate
    gemm = products.fp8_epilogue_gemm(fp8, out_inv, epilogue)
    assert gemm is not None
    act = kernels.ACT_GELU_TANH if epilogue == "gelu_tanh" else kernels.ACT_RELU
    x8 = kernels.quantize_e4m3(x.half(), fp8.input_inv_scale)
    for rows in (4096, 128, 7):
        got = gemm(x8[:rows]).float()
        want = kernels.quantize_e4m3(fp8(x8[:rows]), out_inv, act).float()
        # the fp16 product rounds before the pass; cuBLASLt does not
        assert ((got - want).abs() <= want.abs() / 8 + 2**-9).all()
        assert (got == want).float().mean() > 0.97
        assert torch.isfinite(got).all() and got.abs().max() == 448.0
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        captured = gemm(x8)
    out_inv.fill_(40.0)
    graph.replay()
    want = kernels.quantize_e4m3(fp8(x8), out_inv, act).float()
    assert (captured.float() == want).float().mean() > 0.97


def test_cublaslt_plain_product_equals_scaled_mm() -> None:
    """QKV / attention-out / FFN-out as one cuBLASLt call with a timed
    algorithm: what torch._scaled_mm computes (fp16 out, bias added), at
    token counts small and large, and in a graph."""
    from engine import quant
    from engine.cuda import kernels, products

    torch.manual_seed(1)
    linear = torch.nn.Linear(3072, 768, device="cuda")
    x = torch.randn(4096, 3072, device="cuda")
    fp8 = quant.Fp8Linear(linear, float(x.abs().max()))
    gemm = products.fp8_epilogue_gemm(fp8)
    assert gemm is not None and gemm.out_dtype == torch.float16
    x8 = kernels.quantize_e4m3(x.half(), fp8.input_inv_scale)
    for rows in (4096, 128, 7):
        # another algorithm may sum in another order: fp16 rounding apart
        torch.testing.assert_close(
            gemm(x8[:rows]).float(), fp8(x8[:rows]).float(), rtol=2e-3, atol=2e-2
        )
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        captured = gemm(x8)
    x8.copy_(kernels.quantize_e4m3(-x.half(), fp8.input_inv_scale))
    graph.replay()  # a graph reads the input's current rows
    torch.testing.assert_close(captured.float(), fp8(x8).float(), rtol=2e-3, atol=2e-2)


def test_cublaslt_products_release_their_descriptors() -> None:
    """close() destroys a product's descriptor and each plan's layouts through
    cuBLASLt's own calls (each checked: a failed destroy raises); a graph
    captured before still replays right, the closed product refuses new
    token counts, and products made and dropped by the hundred leave
    cuBLASLt working."""
    from engine import quant
    from engine.cuda import cublaslt, kernels, products

    torch.manual_seed(2)
    linear = torch.nn.Linear(768, 768, device="cuda")
    x = torch.randn(256, 768, device="cuda")
    fp8 = quant.Fp8Linear(linear, float(x.abs().max()))
    x8 = kernels.quantize_e4m3(x.half(), fp8.input_inv_scale)
    gemm = products.fp8_epilogue_gemm(fp8)
    assert gemm is not None
    first = gemm(x8).clone()
    gemm(x8[:7])
    assert set(gemm.plans) == {16, 256, 7}
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        captured = gemm(x8)
    gemm.close()
    gemm.close()  # a second close has nothing left to destroy
    assert gemm.desc is None and gemm.a_layout is None and not gemm.plans
    captured.zero_()
    graph.replay()
    torch.testing.assert_close(captured, first)
    with pytest.raises(cublaslt.CublasLtError, match="closed"):
        gemm(x8[:5])
    for _ in range(200):
        assert products.fp8_epilogue_gemm(fp8) is not None  # dropped: __del__
    gc.collect()
    again = products.fp8_epilogue_gemm(fp8)
    assert again is not None
    torch.testing.assert_close(again(x8), first)


def test_fp8_forward_with_the_cublaslt_epilogue_in_graphs(refs: Fixtures) -> None:
    """The served FP8 forward: FFN-in's activation in cuBLASLt's epilogue and
    the other products cuBLASLt's with timed algorithms, in every layer;
    graphs equal to its eager runs and close to the forward with neither
    (random ids: the intent head's probabilities near uniform)."""
    from engine import quant

    entry = refs.entries["intent"]
    cuda = CudaBackend("cuda:0")
    cuda.load(dataclasses.replace(entry, quantize="fp8"))
    served = cuda.runner("intent").forward.served
    fused = FusedForward(served, fp8_epilogue=True, fp8_tuned=True)  # the defaults
    assert all(p is not None and None not in p[1:] for p in fused.fp8)
    plain = FusedForward(served, fp8_epilogue=False, fp8_tuned=False)
    assert all(p is not None and p[1:] == (None,) * 4 for p in plain.fp8)
    assert isinstance(served.encoder.layers[0].ffn_in, quant.Fp8Linear)
    ids, lengths = random_batch(32, 128, cuda.runner("intent").vocab, seed=4)
    ids_d, lengths_d = torch.from_numpy(ids).cuda(), torch.from_numpy(lengths).cuda()
    with torch.inference_mode():
        eager = fused(ids_d, lengths_d).float()
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            captured = fused(ids_d, lengths_d)
        graph.replay()
        default = plain(ids_d, lengths_d).float()
    live = torch.from_numpy(lengths > 0).cuda()
    torch.testing.assert_close(captured.float(), eager)
    # two FP8 forwards that round to e4m3 at different points (the default
    # rounds FFN-in's output to fp16 first): as close as FP8 is to fp16
    cos = torch.nn.functional.cosine_similarity(eager[live], default[live])
    assert cos.min() > 0.99 and cos.mean() > 0.999


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gemms_equal_torchs_products(dtype: torch.dtype) -> None:
    """fp16/bf16 projections as cuBLASLt calls with timed algorithms compute
    torch's products: bias, bias + GELU (tanh form) or ReLU, and the residual
    added in place (beta 1), at token counts large and small, and in a graph
    that reads its input's current rows."""
    from engine.cuda import cublaslt, products

    torch.manual_seed(3)
    up = torch.nn.Linear(768, 3072, device="cuda", dtype=dtype)
    down = torch.nn.Linear(3072, 768, device="cuda", dtype=dtype)
    x = torch.randn(4096, 768, device="cuda", dtype=dtype)
    inner = torch.randn(4096, 3072, device="cuda", dtype=dtype) / 8
    plain = products.half_gemm(up)
    gelu = products.half_gemm(up, cublaslt.EPILOGUE_GELU_BIAS)
    relu = products.half_gemm(up, cublaslt.EPILOGUE_RELU_BIAS)
    adds = products.half_gemm(down, cublaslt.EPILOGUE_DEFAULT, accumulate=True)
    assert None not in (plain, gelu, relu, adds)
    assert plain and gelu and relu and adds  # for mypy
    # another algorithm may sum in another order: rounding apart
    tol = {"rtol": 2e-3, "atol": 4e-3}
    if dtype == torch.bfloat16:
        tol = {"rtol": 2e-2, "atol": 3e-2}
    w, b = up.weight.t(), up.bias
    for rows in (4096, 200, 7):
        xs = x[:rows]
        torch.testing.assert_close(plain(xs), torch.addmm(b, xs, w), **tol)
        want = torch._addmm_activation(b, xs, w, use_gelu=True)
        torch.testing.assert_close(gelu(xs), want, **tol)
        want = torch._addmm_activation(b, xs, w, use_gelu=False)
        torch.testing.assert_close(relu(xs), want, **tol)
        residual = torch.randn(rows, 768, device="cuda", dtype=dtype)
        want = residual + inner[:rows] @ down.weight.t()
        got = adds.add_to(inner[:rows], residual)
        assert got.data_ptr() == residual.data_ptr()
        torch.testing.assert_close(got, want, **tol)
    with pytest.raises(ValueError, match="residual"):
        adds(inner)
    with pytest.raises(ValueError, match="aligned"):
        plain(x.view(-1)[8 : 8 + 100 * 768].view(100, 768))
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        captured = gelu(x)
    x.neg_()
    graph.replay()
    want = torch._addmm_activation(b, x, w, use_gelu=True)
    torch.testing.assert_close(captured, want, **tol)


def test_tuned_products_serve_what_torchs_do(refs: Fixtures) -> None:
    """The fused forward with its cuBLAS products as timed cuBLASLt calls
    (the default) equals the one through torch where it takes them (at
    HALF_TUNED_MIN_TOKENS and more), eager and in graphs, and is the same
    forward below that."""
    from engine.cuda.layer_products import HALF_TUNED_MIN_TOKENS

    entry = refs.entries["intent"]
    cuda = CudaBackend("cuda:0")
    cuda.load(entry)
    served = cuda.runner("intent").forward.served
    tuned = FusedForward(served, fp16_tuned=True)
    plain = FusedForward(served, fp16_tuned=False)
    assert all(h is not None and None not in h for h in tuned.half)
    assert plain.half == [None] * len(plain.layers)
    vocab = cuda.runner("intent").vocab
    with torch.inference_mode():
        for rows, length in ((64, 64), (2, 64)):
            ids, lengths = random_batch(rows, length, vocab, seed=rows)
            ids_d = torch.from_numpy(ids).cuda()
            lengths_d = torch.from_numpy(lengths).cuda()
            eager = tuned(ids_d, lengths_d)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph):
                captured = tuned(ids_d, lengths_d)
            graph.replay()
            torch.testing.assert_close(captured, eager)
            want = plain(ids_d, lengths_d)
            if rows * length < HALF_TUNED_MIN_TOKENS:
                assert torch.equal(eager, want)
            else:
                cos = torch.nn.functional.cosine_similarity(eager.float(), want.float())
                assert cos.min() > 0.9999


def test_bf16_layers_add_the_residual_in_float32(refs: Fixtures) -> None:
    """bf16 layers take the timed QKV and FFN-in products but add their
    projections to the residual in the LayerNorm, in float32 (rounded to
    bf16 with the residual in cuBLAS, 3 intent answers of 784 flipped), and
    their forward at a tuned token count is the model's own."""
    from engine.model import load_served_model

    served = load_served_model(
        refs.entries["intent"], torch.device("cuda"), torch.bfloat16
    )
    forward = FusedForward(served)
    for half in forward.half:
        assert half is not None and half.qkv is not None and half.ffn_in is not None
        assert half.out is None and half.ffn_out is None
    ids, lengths = random_batch(64, 64, served.encoder.config.vocab_size, seed=3)
    ids_d, lengths_d = torch.from_numpy(ids).cuda(), torch.from_numpy(lengths).cuda()
    with torch.inference_mode():
        got, want = forward(ids_d, lengths_d).float(), served(ids_d, lengths_d).float()
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.999


@pytest.mark.parametrize("act", [0, 1, 2, 3])
def test_e4m3_kernels_equal_torchs_conversion(act: int) -> None:
    """engine/cuda/kernels' e4m3 writers round and saturate as torch's cast does,
    and read their scale from the device at each run (a graph sees a new one)."""
    from engine.cuda import kernels

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, 768, device="cuda", generator=gen, dtype=torch.float16) * 8
    inv = torch.tensor(30.0, device="cuda")
    want = kernels.to_e4m3(kernels.activate_reference(x.float(), act), inv)
    got = kernels.quantize_e4m3(x, inv, act)
    if act in (1, 2):  # GELU's float32 arithmetic differs from torch's by ulps:
        # a value at an e4m3 tie may round to the other neighbour
        close = (got.float() - want.float()).abs() <= want.float().abs() / 8 + 2**-9
        assert close.all() and (got.float() == want.float()).float().mean() > 0.99
    else:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.isfinite(got.float()).all() and got.float().abs().max() == 448.0
    r = torch.randn_like(x)
    w = torch.randn(768, device="cuda", dtype=torch.float16)
    b = torch.randn(768, device="cuda", dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    kernels.add_layer_norm_e4m3(x, r, w, b, 1e-12, inv)  # compile before capture
    with capturing(graph):
        out, out8 = kernels.add_layer_norm_e4m3(x, r, w, b, 1e-12, inv)
        replayed = kernels.quantize_e4m3(x, inv, act)
    inv.fill_(2.0)
    graph.replay()
    again = kernels.to_e4m3(kernels.activate_reference(x.float(), act), inv)
    close = (replayed.float() - again.float()).abs() <= again.float().abs() / 8 + 2**-9
    assert close.all() and (replayed.float() == again.float()).float().mean() > 0.99
    torch.testing.assert_close(out, kernels.add_layer_norm(x, r, w, b, 1e-12))
    # e4m3 of the float32 rows (the kernel quantizes before its fp16 rounding):
    # equal but where the two LayerNorms' float32 sums straddle an e4m3 tie
    exact = torch.nn.functional.layer_norm(
        x.float() + r.float(), (768,), w.float(), b.float(), 1e-12
    )
    want8 = kernels.to_e4m3(exact, 2.0).float()
    assert (out8.float() == want8).float().mean() > 0.999
    assert ((out8.float() - want8).abs() <= want8.abs() / 8 + 2**-9).all()


def test_a_batch_leaves_the_callers_stream_current(backend: CudaBackend) -> None:
    """Batches run on the engine's stream (set by id for the batch, not with
    torch's costlier context) and give the caller's stream back."""
    runner = backend.runner("minilm")
    side = torch.cuda.Stream()
    before = torch.cuda.current_stream()
    with torch.cuda.stream(side):
        for length in (32, 31):  # a captured shape, then one run eagerly
            ids, lengths = random_batch(2, length, runner.vocab, seed=5)
            backend.run_bytes("minilm", ids.tobytes(), lengths.tobytes(), 2, length)
            assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == before
    assert backend.stream != side
