"""
How fast is step 1? Two answers: rollout.py's decode loop against transformers' generate (the hf
engine) timed side by side on this machine, and the bytes a GPU's decode step moves, counted on
the graph torch.compile builds, against an H200's bandwidth (the roofline; no timing).

    python experiments/bench_decode.py --tokenizer ../shared/tokenizers/qwen2.5 \\
        --data_dir ../shared/data                 # both worlds below, 3 rounds, 2 threads
    python experiments/bench_decode.py --world tiny --rounds 5 --threads 1
    python experiments/bench_decode.py --world real --compile inductor ...   # the loop compiled
    python experiments/bench_decode.py --roofline             # Qwen2.5-0.5B's step, bytes counted
    python experiments/bench_decode.py --world tiny --against /tmp/before   # and another checkout

Timed, two worlds:
  real  a Qwen2 of the real vocabulary (the tokenizer's 151,936 tokens) with 2 layers of width 64
        and random weights (seed 0), the real Qwen2.5 tokenizer, the first --prompts GSM8K training
        prompts (data.format_prompt) x --group_size rows, --max_new_tokens tokens at temperature 1:
        the lm_head and the sampler over 151,936 tokens are nearly all of a decode step here, as
        for a 0.5B model on a GPU. Random weights rarely stop: most rows run to the budget.
  tiny  the offline tiny world's model (out/tiny) and prompts at train.py's tiny defaults (16
        prompts x 8 rows, 32 new tokens), where rows stop early.
Each round runs the loop, then hf (the order reversed every other round), after one warm-up call of
each; the table has the medians: seconds, of them the prefill's (the decoder's calls on more than
one token: the prompts), the rest per decoded token (ms a step, over all rows), generated tokens per
second (completion tokens, the stop included, over the seconds), each engine's seconds over hf's,
and the padding share (decoded row-positions after a row had stopped over all decoded: rows x decode
steps). The rows whose tokens are the same as the loop's are counted too: equal up to the rounding
of the logits (machinery/sampling.py), and the real world's random model has a nearly flat
distribution, each of its 151,936 tokens ~7e-6 wide, where the engines' few-ulp differences move a
uniform across a token's edge now and then. --compile BACKEND compiles the loop's step with that
torch.compile backend (machinery/sampling.COMPILE; the warm-up round pays the compile). --against
PATH adds the loop of another checkout (the code before a change, in a git worktree), imported
beside this one and timed in the same rounds and process: no two processes to compare.

The roofline (--roofline): Qwen2.5-0.5B's architecture (random weights, float32 masters as
--dtype auto holds them), its decode step compiled with a backend that records the ATen graph
aot_autograd hands to inductor (before inductor fuses it), traced on this CPU under bf16 autocast
with the rows and columns symbolic, and its bytes counted from the graph's tensors at 64, 256 and
512 rows x (256 + 512) columns (GSM8K's prompt width and 512 new tokens; a static cache reads every
column at every step), twice: op by op (every op reads its inputs and writes its output: no
fusion, an upper bound) and inputs once (every graph input read once, every output and cache write
written once: what a perfect fusion moves). Tokens/s bound = rows / (bytes / 4.8 TB/s).
"""
import argparse
import operator
import os
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from machinery import data, memory, sampling  # noqa: E402
from rollout import generate_groups  # noqa: E402

H200_BYTES_PER_S = 4.8e12  # HBM3e, NVIDIA's H200 data sheet
ROOFLINE_ROWS, PROMPT_WIDTH, NEW_TOKENS = (64, 256, 512), 256, 512


def real_world(args):
    """(model, tokenizer, prompts) of the real world: see the module docstring."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"),
                                            tok.convert_tokens_to_ids("<|endoftext|>")]
    rows = data.load_problems("gsm8k", "train", limit=args.prompts, data_dir=args.data_dir)
    return model, tok, [data.format_prompt(tok, r["prompt"]) for r in rows]


def tiny_world(args):
    from machinery.model import load_model
    model, tok = load_model("tiny", device="cpu", dtype="float32")
    rows = data.load_problems("tiny", "train", limit=16)
    return model, tok, [data.format_prompt(tok, r["prompt"]) for r in rows]


class PrefillClock:
    """Seconds the decoder spends on calls of more than one token (the prompts' prefill), summed."""

    def __init__(self, model):
        self.seconds, decoder = 0.0, model.get_decoder()
        decoder.register_forward_pre_hook(self.start, with_kwargs=True)
        decoder.register_forward_hook(self.stop, with_kwargs=True)

    def start(self, module, args, kwargs):
        self.t0 = time.perf_counter() if kwargs["input_ids"].shape[1] > 1 else None

    def stop(self, module, args, kwargs, out):
        if self.t0 is not None:
            self.seconds += time.perf_counter() - self.t0


def measure(model, tok, prompts, G, N, rounds, engines):
    """{engine: [(seconds, prefill seconds, tokens, decode steps, padding share)] per round}, and
    {engine: [rows whose tokens agreed with the loop's, rows]} over all rounds; engines: {name:
    generate_groups(..., engine=...)}, run in turn, the order reversed every other round."""
    times, clock = {e: [] for e in engines}, PrefillClock(model)
    same = {e: [0, 0] for e in list(engines)[1:]}
    for r in range(rounds + 1):  # round 0 warms up
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        got = {}
        for engine in order:
            clock.seconds, t0 = 0.0, time.perf_counter()
            got[engine] = out = engines[engine](model, tok, prompts, G, N, seed=r)
            seconds = time.perf_counter() - t0
            tokens = int(out.completion_mask.sum())
            if r:
                times[engine].append((seconds, clock.seconds, tokens, out.decoded // len(out.texts),
                                      1 - tokens / out.decoded))
        for engine in same:
            a, b = got["loop"], got[engine]
            T = max(a.completion_ids.shape[1], b.completion_ids.shape[1])
            a, b = (torch.nn.functional.pad(x.completion_ids, (0, T - x.completion_ids.shape[1]))
                    for x in (a, b))
            same[engine][0] += int((a == b).all(dim=1).sum())
            same[engine][1] += len(a)
    return times, same


def engines(against=None):
    """The loop and hf, and with a checkout's path the loop of that checkout (its rollout.py and
    machinery, imported beside these: bench_update.load_tree), timed in the same rounds."""
    run = {e: partial(generate_groups, engine=e) for e in ("loop", "hf")}
    if against:
        from experiments.bench_update import load_tree
        run["loop " + os.path.basename(os.path.abspath(against))] = partial(
            load_tree(against)["rollout"].generate_groups, engine="loop")
    return run

# -----------------------------------------------------------------------------
# the roofline: a decode step's bytes, counted on the graph torch.compile builds


def build(name="Qwen2.5-0.5B", layers=None, vocab=None):
    """A Qwen2 of memory.SHAPES[name]'s architecture (layers and vocab overridable) with random
    float32 weights, on the CPU, eos ids set."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    s = memory.SHAPES[name]
    config = Qwen2Config(vocab_size=vocab or s["vocab"], hidden_size=s["hidden"],
                         intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                         num_hidden_layers=layers or s["layers"], num_key_value_heads=s["kv_heads"],
                         tie_word_embeddings=s["tied"], max_position_embeddings=32768)
    with torch.device("meta"):  # no init pass over 0.5B weights: drawn once below
        model = Qwen2ForCausalLM(config)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
        model.get_decoder().rotary_emb.inv_freq.copy_(  # a buffer: to_empty left it unset
            model.get_decoder().rotary_emb.compute_default_rope_parameters(config)[0])
    model.generation_config.eos_token_id = [0]
    return model


def trace_step(model, rows, columns, temperature=1.0, dynamic=True, autocast=True, before=False):
    """The decode step (sampling.one_token) as torch.compile hands it to a backend: the ATen graph
    of aot_autograd (what inductor fuses and compiles on a GPU, the same for greedy and sampling
    but for the sampler), for `rows` rows and a static cache of `columns`, traced on this CPU as a
    GPU's --dtype auto runs it (bf16 autocast, float32 masters, generation_mode's weights), with
    the rows and columns symbolic when dynamic. before: as the loop ran before gqa_attention and
    decode_weights (the model's own attention; autocast's casts). -> {graph, names: dynamo's name
    of each input, static: the inputs a CUDA graph keeps at fixed addresses, mutated: those the
    step writes, mutations: how many outputs are their new values, rows, columns: each one's
    symbol or size}."""
    from contextlib import nullcontext
    from torch._dynamo.backends.common import aot_autograd
    record, device, weights = {}, torch.device("cpu"), sampling.decode_weights

    def backend(gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

        def keep(graph, inputs):
            meta = torch._guards.TracingContext.try_get().fw_metadata
            record.update(graph=graph, names=names, static=set(meta.static_input_indices),
                          mutated={i for i, x in enumerate(meta.input_info) if x.mutates_data},
                          mutations=meta.num_mutated_inp_runtime_indices)
            return graph.forward
        return aot_autograd(fw_compiler=keep)(gm, example_inputs)

    torch.compiler.reset()
    step = torch.compile(sampling.one_token, fullgraph=True, backend=backend, dynamic=dynamic)
    sampling.decode_weights = (lambda *a: lambda: None) if before else weights
    try:  # floats (a norm's epsilon) stay constants, as they do at static shapes
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                torch._dynamo.config.patch(specialize_float=True), \
                sampling.generation_mode(model, device), \
                (nullcontext() if before else sampling.gqa_decoding(model)):
            dtype = torch.bfloat16 if autocast else model.get_output_embeddings().weight.dtype
            cache = sampling._static_cache(model, rows, columns, dtype, device)
            for layer in cache.layers:
                layer.cumulative_length.fill_(columns // 2)
            keys = sampling.row_keys(0, torch.arange(rows)) if temperature > 0 else None
            step(model, cache, torch.ones(rows, columns, dtype=torch.bool),
                 torch.zeros(rows, dtype=torch.long), torch.arange(rows), keys, torch.tensor(3),
                 temperature)
    finally:
        sampling.decode_weights = weights
    inputs = dict(zip(record["names"], _placeholders(record["graph"])))
    record["rows"] = inputs["l_token_"].meta["val"].shape[0]
    record["columns"] = inputs["l_pad_"].meta["val"].shape[1]
    return record


def _placeholders(graph):
    return [n for n in graph.graph.nodes if n.op == "placeholder"]


VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
         "squeeze", "slice", "select", "alias", "as_strided", "detach", "split", "unbind",
         "split_with_sizes"}  # no bytes moved
GATHERS = {"embedding", "index", "gather", "index_select"}  # read only what they return
WRITES = {"index_copy", "index_put"}  # into a cache: in place (inductor reinplaces them)


def _op(node):
    target = node.target
    return getattr(getattr(target, "_overloadpacket", target), "__name__", str(target))


def _tensors(x):
    """The fake tensors of a node's value (a tensor, or a tuple of them)."""
    x = x.meta.get("val") if hasattr(x, "meta") else x
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in x if isinstance(t, torch.Tensor)] if isinstance(x, (tuple, list)) else []


def touched(t):
    """The bytes a tensor's elements span: a broadcast (stride 0) dimension counted once."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride()):
        n = n * (1 if isinstance(stride, int) and stride == 0 else size)
    return n


def _args(node):
    """The nodes among a node's arguments, lists flattened."""
    out = []
    for a in node.args:
        out += [x for x in (a if isinstance(a, (list, tuple)) else [a]) if hasattr(x, "op")]
    return out


def node_bytes(node, mutated):
    """(read, written) bytes of one op of the graph, by what it does: a view moves nothing; a
    gather reads what it returns (and its index); a write into a mutated input (the cache) reads
    and writes the new values only; any other op reads its inputs and writes its outputs."""
    op, out = _op(node), sum(touched(t) for t in _tensors(node))
    if node.op != "call_function" or node.target is operator.getitem or op in VIEWS:
        return 0, 0
    ins = _args(node)
    if op in GATHERS:
        return out + sum(touched(t) for x in ins[1:] for t in _tensors(x)), out
    if op in WRITES and ins[0] in mutated:
        new = sum(touched(t) for x in ins[1:] for t in _tensors(x))
        return new, sum(touched(t) for t in _tensors(ins[-1]))
    return sum(touched(t) for x in ins for t in _tensors(x)), out


def _source(node):
    """The graph input a view chain starts from, or the node itself."""
    while node.op == "call_function" and _op(node) in VIEWS and _args(node):
        node = _args(node)[0]
    return node


def step_bytes(record):
    """{"op by op": (read, written), "inputs once": (read, written)} bytes of the traced step, as
    expressions of its rows and columns when traced dynamic (evaluate with at())."""
    graph, placeholders = record["graph"], _placeholders(record["graph"])
    mutated = {placeholders[i] for i in record["mutated"]}
    read = written = 0
    for node in graph.graph.nodes:
        r, w = node_bytes(node, mutated)
        read, written = read + r, written + w
    # inputs once: each input read once (a gathered one: the rows gathered), the cache's new
    # columns and the outputs written once
    once_read = once_written = 0
    users = {p: [] for p in placeholders}
    for node in graph.graph.nodes:
        if node.op == "call_function" and _op(node) not in VIEWS:
            for x in _args(node):
                if _source(x) in users:
                    users[_source(x)].append(node)
    for p, consumers in users.items():
        if not _tensors(p) or not consumers:
            continue
        gathered = all(_op(c) in GATHERS and _source(_args(c)[0]) is p for c in consumers)
        once_read += (sum(touched(t) for c in consumers for t in _tensors(c)) if gathered
                      else touched(_tensors(p)[0]))
    outputs = [x for x in graph.graph.find_nodes(op="output")[0].args[0] if hasattr(x, "op")]
    for x in outputs:  # the new values of the inputs it writes first, then its outputs
        new = x in outputs[:record["mutations"]] and _op(x) in WRITES
        once_written += node_bytes(x, mutated)[1] if new else sum(touched(t) for t in _tensors(x))
    return {"op by op": (read, written), "inputs once": (once_read, once_written)}


def at(expr, record, rows, columns):
    """A byte count of step_bytes (an int or a symbolic size) at rows x columns."""
    if isinstance(expr, int):
        return expr
    sizes = {record[k].node.expr: v for k, v in (("rows", rows), ("columns", columns))
             if not isinstance(record[k], int)}
    return int(expr.node.expr.xreplace(sizes))


def roofline(args):
    """The roofline's table (see the module docstring)."""
    t0 = time.time()
    model = build(layers=args.layers)
    record = trace_step(model, 3, 77, before=args.before)  # sizes no other dimension has
    counts = step_bytes(record)
    s, width = memory.SHAPES["Qwen2.5-0.5B"], PROMPT_WIDTH + NEW_TOKENS
    layers = args.layers or s["layers"]
    cache = layers * 2 * s["kv_heads"] * (s["hidden"] // s["heads"]) * 2  # bytes a row-column
    print(("Before gqa_attention and decode_weights: " if args.before else "") +
          f"Qwen2.5-0.5B's decode step ({layers} layers, random weights), traced on this CPU in "
          f"{time.time() - t0:.0f} s: {len(record['graph'].graph.nodes)} ATen nodes; bound at "
          f"{H200_BYTES_PER_S / 1e12:.1f} TB/s (an H200), {PROMPT_WIDTH} + {NEW_TOKENS} columns")
    print("rows | count | read GB | written GB | bytes / (weights + cache) | tokens/s bound")
    weights = sum(_copies_bytes(model))
    for rows in ROOFLINE_ROWS:
        for name, (read, written) in counts.items():
            total = at(read, record, rows, width) + at(written, record, rows, width)
            ideal = weights + rows * width * cache
            print(f"{rows} | {name} | {at(read, record, rows, width) / 1e9:.2f} | "
                  f"{at(written, record, rows, width) / 1e9:.2f} | {total / ideal:.2f} | "
                  f"{rows * H200_BYTES_PER_S / total:,.0f}")
    print(f"(weights + cache: the bf16 weights the step reads, {weights / 1e9:.2f} GB, and the "
          f"cache, {cache * width / 1e6:.2f} MB a row)")


def _copies_bytes(model):
    """The bytes of the weights a decode step reads under autocast: every nn.Linear's in bf16
    (the lm_head's among them), the norms in float32; the embedding is gathered."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            yield sum(p.numel() * 2 for p in m.parameters(recurse=False))
        elif type(m).__name__.endswith("RMSNorm"):
            yield sum(p.numel() * 4 for p in m.parameters(recurse=False))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--world", default="both", choices=("both", "real", "tiny"))
    p.add_argument("--tokenizer", default="Qwen/Qwen2.5-0.5B")
    p.add_argument("--data_dir", default=None, help="gsm8k/train.jsonl inside (default: the hub)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", default="off", help="the loop's step: off, or a torch.compile "
                                                    "backend (inductor, eager)")
    p.add_argument("--roofline", action="store_true", help="count the step's bytes, time nothing")
    p.add_argument("--layers", type=int, default=0, help="--roofline: layers (0: the model's 24)")
    p.add_argument("--before", action="store_true",
                   help="--roofline: the step with transformers' attention and autocast's casts")
    p.add_argument("--against", default=None, help="another checkout (the code before a change): "
                   "its loop timed in the same process and rounds, a row 'loop FOLDER'")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.roofline:
        return roofline(args)
    sampling.COMPILE = args.compile
    worlds = ("real", "tiny") if args.world == "both" else (args.world,)
    print(f"torch threads {args.threads}, {args.rounds} rounds (medians), the loop's step "
          f"compiled: {args.compile}, torch {torch.__version__}")
    print("world | rows x tokens | engine | seconds | prefill s | ms a step | tokens/s | "
          "s / hf's | padding")
    for world in worlds:
        model, tok, prompts = real_world(args) if world == "real" else tiny_world(args)
        G, N = (args.group_size, args.max_new_tokens) if world == "real" else (8, 32)
        times, same = measure(model, tok, prompts, G, N, args.rounds, engines(args.against))
        med = {e: [statistics.median(x[i] for x in v) for i in range(5)]
               for e, v in times.items()}
        for engine in times:
            s, prefill, n, steps, pad = med[engine]
            print(f"{world} | {len(prompts) * G} x {N} | {engine} | {s:.2f} | {prefill:.2f} | "
                  f"{1000 * (s - prefill) / steps:.1f} | {n / s:,.0f} | "
                  f"{s / med['hf'][0]:.2f} | {pad:.3f}")
        for engine, (n, rows) in same.items():
            print(f"{world}: rows with the same tokens from the loop and {engine}: {n} of {rows}; "
                  f"its seconds / the loop's {med[engine][0] / med['loop'][0]:.2f}")


if __name__ == "__main__":
    main()
