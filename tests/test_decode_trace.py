"""The decode step as a GPU runs it, proven on a CPU by counting: its graph, traced with
torch.compile (a backend that records aot_autograd's ATen graph, what inductor compiles), at
Qwen2.5-0.5B's shape under bf16 autocast with float32 master weights (--dtype auto). Each key and
value of the cache is read once, never repeated to every query head; no weight is cast inside the
step; the weights and the cache are the step's static inputs (a CUDA graph replays on them) and
the only ones it writes; the bytes experiments/bench_decode.py's roofline counts are, for a perfect
fusion, the weights and the cache by hand. The traced step as the loop ran before (transformers'
attention, autocast's casts) shows each of these failures, so the checks can fail. And the
counters the step's log row carries: CUDA-graph recordings (from torch's own callbacks), and a
train.py run whose compiles and caches all fall in its first step."""
import pytest
import torch

from experiments import bench_decode
from machinery import memory, sampling

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
S = memory.SHAPES["Qwen2.5-0.5B"]
ROWS, COLUMNS, LAYERS = 3, 768, 2  # 256 + 512 columns; Qwen2.5-0.5B's widths, 2 of its layers


@pytest.fixture(scope="module")
def qwen():
    return bench_decode.build(layers=LAYERS)


@pytest.fixture(scope="module")
def traced(qwen):
    """The step traced as the loop runs it, and as it ran before (static shapes: ROWS x COLUMNS)."""
    return {before: bench_decode.trace_step(qwen, ROWS, COLUMNS, dynamic=False, before=before)
            for before in (False, True)}


def inputs(record):
    """{dynamo's name of each graph input: its node}."""
    return dict(zip(record["names"], bench_decode._placeholders(record["graph"])))


def materialised(record):
    """The shapes of every tensor the graph creates (views excluded)."""
    return [tuple(t.shape) for node in record["graph"].graph.nodes
            if node.op == "call_function" and bench_decode._op(node) not in bench_decode.VIEWS
            for t in bench_decode._tensors(node)]


def weight_casts(record):
    """The graph inputs that are weights (a parameter, or the lm_head's decode copy) and that the
    graph casts to another dtype."""
    weights = {node: name for name, node in inputs(record).items()
               if "_parameters_" in name or "decode_weight" in name}
    return sorted({weights[bench_decode._source(node.args[0])]
                   for node in record["graph"].graph.nodes
                   if node.op == "call_function" and bench_decode._op(node) in (
                       "_to_copy", "convert_element_type")
                   and bench_decode._source(node.args[0]) in weights})


def test_no_key_or_value_is_repeated_and_no_weight_is_cast(traced):
    """No tensor of the cache's size times the group count g = heads / kv_heads = 7 is made (the
    largest the step makes is the sampler's float32 copy of the logits, under a quarter of that
    here), and no weight is cast: the weights it reads are already bf16. Before: K and V repeated
    to (rows, 2, 7, columns, 64) in every layer, and every weight cast at every step."""
    g, d = S["heads"] // S["kv_heads"], S["hidden"] // S["heads"]
    repeated = ROWS * S["kv_heads"] * COLUMNS * d * g  # (rows, heads, columns, head_dim)
    now, before = (materialised(traced[b]) for b in (False, True))
    assert max(torch.Size(s).numel() for s in now) == ROWS * S["vocab"] < repeated / 4
    assert [s for s in before if torch.Size(s).numel() >= repeated and COLUMNS in s] == \
        [(ROWS, S["kv_heads"], g, COLUMNS, d)] * (2 * LAYERS)  # keys and values, every layer
    assert weight_casts(traced[False]) == []
    cast = weight_casts(traced[True])
    assert len(cast) == LAYERS * 10 + 1  # q, k, v (weights and biases), o, gate, up, down; head
    assert all("proj" in name or "lm_head" in name for name in cast)


def test_the_weights_and_the_cache_are_static_inputs_and_only_they_are_written(traced):
    """What a CUDA graph needs: every weight, the lm_head's copy and every cache tensor is a static
    input (kept at its address, never copied in at a replay), every input the step writes (the
    cache's keys, values and lengths) is one of those, and the inputs copied in at each replay are
    small: the padding mask (rows x columns) and a few (rows,) tensors."""
    record = traced[False]
    names = record["names"]
    static = {names[i] for i in record["static"]}
    weights = {n for n in names if "_parameters_" in n or "decode_weight" in n or "_buffers_" in n}
    cache = {n for n in names if n.startswith("l_cache_layers_")}
    assert len(cache) == 3 * LAYERS and len(weights) > 10 * LAYERS
    assert weights | cache <= static
    assert {names[i] for i in record["mutated"]} == cache
    copied = [node.meta["val"] for name, node in inputs(record).items() if name not in static]
    assert max(t.numel() for t in copied) == ROWS * COLUMNS


def test_the_bytes_inputs_once_are_the_weights_and_the_cache(qwen):
    """bench_decode.step_bytes on the step traced with symbolic rows and columns, evaluated at 5
    rows x 100 columns and 7 x 64, against the bytes by hand: the bf16 weights (every linear and
    the lm_head), the float32 norms and rotary frequencies, the cache's keys and values, the
    gathered embedding rows, the padding mask and the (rows,) inputs; written, the new token's key
    and value in every layer and the three outputs. Op by op counts more (every op's inputs and
    outputs: the sampler's passes over the vocabulary among them)."""
    record = bench_decode.trace_step(qwen, ROWS, 77)
    counts = bench_decode.step_bytes(record)
    H, I, V, d, kv = S["hidden"], S["intermediate"], S["vocab"], S["hidden"] // S["heads"], \
        S["kv_heads"]
    linear = H * H + H + 2 * (kv * d * H + kv * d) + H * H + 3 * H * I  # q, k, v, o, MLP
    for rows, columns in ((5, 100), (7, 64)):
        read = (2 * (LAYERS * linear + V * H) + 4 * (LAYERS * 2 * H + H) + 4 * d // 2
                + LAYERS * 2 * rows * kv * columns * d * 2  # the cache
                + LAYERS * 8  # its lengths
                + rows * H * 4 + rows * columns + 3 * rows * 8 + 8)  # embedding rows, mask, ...
        written = LAYERS * (2 * rows * kv * d * 2 + 8) + rows * (8 + 4 + 1)
        once = [bench_decode.at(x, record, rows, columns) for x in counts["inputs once"]]
        assert once == [read, written]
        op_by_op = [bench_decode.at(x, record, rows, columns) for x in counts["op by op"]]
        assert op_by_op[0] > read + 10 * rows * V  # the sampler: float32 passes over (rows, V)


def test_lora_adapters_are_read_in_bf16_too(monkeypatch):
    """--lora_rank with --dtype auto: the base held in bf16 (as on a GPU), float32 adapters. The
    traced step casts no parameter, the adapters' included (their bf16 copies are read)."""
    pytest.importorskip("peft")
    from machinery.model import with_lora
    model = bench_decode.build(layers=1, vocab=512)
    model.to(torch.bfloat16)
    model = with_lora(model, 8, "Qwen2.5-0.5B", 0)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    record = bench_decode.trace_step(model, ROWS, 70, dynamic=False)
    assert any("lora_a" in n for n in record["names"]) and weight_casts(record) == []
    before = bench_decode.trace_step(model, ROWS, 70, dynamic=False, before=True)
    assert any("lora_a" in n for n in weight_casts(before))


def test_cuda_graph_recordings_are_counted_from_torchs_callbacks(monkeypatch):
    """The count of CUDA-graph recordings follows torch's own callback, fired by cudagraph trees
    each time they record a graph (here fired by hand: no GPU); dynamo's compiles are not
    recordings."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler
    monkeypatch.setattr(sampling, "_recording", [])
    monkeypatch.setitem(sampling.COUNTS, "cudagraph_records", 0)
    before = list(callback_handler.start_callbacks)
    try:
        sampling._count_recordings()
        for trigger in (CallbackTrigger.CUDAGRAPH_RECORDING, CallbackTrigger.DYNAMO,
                        CallbackTrigger.CUDAGRAPH_RECORDING):
            with callback_handler.install_callbacks(trigger, "0/0"):
                pass
        assert sampling.counters()["decode_cudagraph_records"] == 2
    finally:
        callback_handler.start_callbacks[:] = before


def test_train_py_logs_the_decode_steps_costs(tiny_dir, tmp_path, monkeypatch):
    """train.py with the decode step compiled (the eager backend, as on a CPU) and an evaluation
    every step: each step's log row carries the decode step's counts, and every compile and cache
    falls in the first step (its evaluation and its rollouts), none after."""
    from conftest import rows
    from machinery import config
    import train
    sampling.reset()
    monkeypatch.setattr(sampling, "COMPILE", "eager")
    out = tmp_path / "run"
    try:
        config.main(train.Config, train.train, [
            "--model", str(tiny_dir), "--steps", "3", "--prompts_per_step", "2", "--group_size",
            "4", "--eval_size", "6", "--eval_every", "1", "--save_every", "0",
            "--out_dir", str(out)])
    finally:
        sampling.reset()
    log = rows(out)
    counts = [{k: r[k] for k in r if k.startswith("decode_")} for r in log]
    assert counts[0] == {"decode_compiles": 2, "decode_cudagraph_records": 0,
                         "decode_cudagraph_skips": 0, "decode_caches": 2}
    assert counts[0] == counts[1] == counts[2]
