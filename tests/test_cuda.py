"""Every CUDA-only path, on a CPU, under a strict fake of CUDA's driver layer (tests/cuda_fake.py):
torch.cuda's own functions run with their own argument checks, so a call that a GPU refuses is
refused here. The run names its device once, with its index; each way of naming a device
("cuda", "cuda:0", torch.device("cuda"), 0) reaches every torch.cuda call as cuda:0. The last test
lists every torch.cuda call in the project and fails on one that no test here reached: keep it last
(pytest-xdist runs a file in one process, --dist loadfile)."""
import json

import pytest
import torch

import eval as eval_py
import train
from conftest import rows
from cuda_fake import GiB, FakeCuda, call_sites, reached
from machinery import config, memory, model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

DEVICES = ["cuda", "cuda:0", torch.device("cuda"), 0]  # every way to name the one GPU
SMALL = dict(steps=2, prompts_per_step=2, group_size=4, eval_size=2, eval_every=0, save_every=0,
             lr=1e-4, updates_per_batch=1)
CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


def on_the_cpu(monkeypatch, *modules):
    """load_model as on the (fake) GPU, but onto the CPU: the dtype is model.load_dtype's for the
    device asked for, the tensors go where tensors can go. Returns [(name, dtype)] of each load."""
    real, loads = model.load_model, []

    def load(name, device="auto", dtype="auto", cache_dir="out", lora=None):
        loads.append((str(name), model.load_dtype(name, device, dtype, lora, cache_dir)))
        return real(name, "cpu", loads[-1][1], cache_dir, lora)
    for module in modules:
        monkeypatch.setattr(module, "load_model", load)
    return loads


def cublas_fails(monkeypatch, rows_over):
    """train.py's model raises a cuBLAS allocation failure (a RuntimeError, not
    torch.OutOfMemoryError) in a gradient forward of more than rows_over rows."""
    real = train.load_model

    def load(*a, **k):
        policy, tokenizer = real(*a, **k)

        def check(module, args, kwargs):
            if torch.is_grad_enabled() and kwargs["input_ids"].shape[0] > rows_over:
                raise RuntimeError(CUBLAS)
        policy.get_decoder().register_forward_pre_hook(check, with_kwargs=True)
        return policy, tokenizer
    monkeypatch.setattr(train, "load_model", load)


# ----------------------------------------------------------------------------- the device


def test_the_fake_keeps_torch_cudas_own_checks(monkeypatch):
    """What crashed the first GPU run: torch's own check refuses "cuda" without an index, as on a
    GPU; and the fake's driver refuses what the C++ binding would."""
    gpu = FakeCuda(monkeypatch)
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        torch.cuda.get_per_process_memory_fraction("cuda")
    assert torch.cuda.get_per_process_memory_fraction("cuda:0") == 1.0
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.mem_get_info(1)
    assert ("getMemoryFraction", 0) in gpu.calls


@pytest.mark.parametrize("device", DEVICES, ids=repr)
def test_a_device_is_named_once_with_its_index(monkeypatch, device):
    gpu = FakeCuda(monkeypatch, count=2)
    assert model.resolve_device(device) == torch.device("cuda", 0)
    torch.cuda.set_device(1)  # "cuda" is the current device, whichever it is
    assert model.resolve_device(device) == torch.device("cuda", 0 if device in (0, "cuda:0")
                                                        else 1)
    assert model.resolve_device("auto") == torch.device("cuda", 1) and gpu.current == 1
    with pytest.raises(ValueError, match=r"^device='cuda:2' but torch sees 2 CUDA GPU\(s\), "
                                         r"cuda:0 to cuda:1; pass one of them$"):
        model.resolve_device("cuda:2")


def test_without_cuda_a_cuda_device_is_one_line():
    assert model.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="^device='cuda:0' but torch sees no CUDA GPU; use "
                                         "--device cpu or auto$"):
        model.resolve_device(0)


@pytest.mark.parametrize("device", DEVICES, ids=repr)
def test_free_bytes_reads_the_card_for_every_name_of_it(monkeypatch, device):
    """free_bytes: free now plus what this process holds, at most its share of the card: by hand,
    min(50 + 3, 0.25 * 80) GiB."""
    FakeCuda(monkeypatch, total=80 * GiB, free=50 * GiB, reserved=3 * GiB)
    assert memory.free_bytes(device) == 53 * GiB
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    assert memory.free_bytes(device) == 20 * GiB


@pytest.mark.parametrize("device", DEVICES, ids=repr)
@pytest.mark.parametrize("capability, cast", [((9, 0), torch.bfloat16), ((7, 5), torch.float16)])
def test_the_dtypes_are_the_cards(monkeypatch, device, capability, cast):
    """The capability the card reports decides autocast (bf16 from 8.0, else float16 with a
    scaler) and a LoRA base's dtype; torch.autocast itself accepts it (its bf16 check asks the
    card)."""
    FakeCuda(monkeypatch, capability=capability)
    assert model.autocast_dtype(device, "auto") == cast
    assert model.weight_dtype("auto", device, lora=True) == cast
    assert model.weight_dtype("auto", device) == torch.float32
    with model.autocast(device, "auto"):
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == cast
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert model.grad_scaler(optimizer, device, "auto").is_enabled() == (cast == torch.float16)


@pytest.mark.parametrize("device", DEVICES, ids=repr)
def test_bench_speed_reads_the_peak_of_the_card(monkeypatch, device):
    from experiments import bench_speed
    FakeCuda(monkeypatch, allocated=3 * GiB, reserved=4 * GiB)
    torch.cuda.init()
    assert bench_speed.peak_memory(device) == 3.0
    assert bench_speed.resolved_device(device) == "cuda:0"


@pytest.mark.parametrize("device", DEVICES, ids=repr)
def test_gpu_check_reads_and_sizes_the_card_for_every_name_of_it(monkeypatch, device):
    """experiments/gpu_check.py's calls into torch.cuda: the card as it reports itself (an H100's
    bf16 peak from the table), 24 GiB of 80 simulated (a fraction of 0.3, which free_bytes and so
    `auto` see) and put back, the cache emptied, the peaks reset to what is held then and read."""
    from experiments import gpu_check
    gpu = FakeCuda(monkeypatch, total=80 * GiB, free=70 * GiB, reserved=3 * GiB,
                   allocated=1 * GiB)
    gpu.peak = {"allocated": 9 * GiB, "reserved": 12 * GiB}
    assert gpu_check.card(device) == {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0],
                                      "total_gib": 80.0, "free_gib": 70.0,
                                      "bf16_peak_tflops": 989.0}
    gpu_check.simulate_card(device, 24)
    assert torch.cuda.get_per_process_memory_fraction(0) == 0.3
    assert memory.free_bytes(device) == 24 * GiB
    gpu_check.simulate_card(device, None)
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    assert gpu_check.peaks(device) == {"allocated": 9 * GiB, "reserved": 12 * GiB}
    gpu_check.empty(device)
    assert ("emptyCache",) in gpu.calls and ("resetPeakMemoryStats", 0) in gpu.calls
    assert gpu_check.peaks(device) == {"allocated": 1 * GiB, "reserved": 1 * GiB}


def test_gpu_check_runs_train_py_on_a_simulated_card(tmp_path, tiny_dir, monkeypatch):
    """gpu_check's run of train.py on a (fake) 80 GiB card, 24 GiB simulated: auto sizes for 24 GiB
    free, the peaks are read, the card is whole again afterwards, and the steps are split into
    warm-up and steady ones."""
    from types import SimpleNamespace
    from experiments import gpu_check
    FakeCuda(monkeypatch, total=80 * GiB, free=70 * GiB, allocated=GiB, reserved=2 * GiB)
    on_the_cpu(monkeypatch, train)
    monkeypatch.setitem(gpu_check.RUNS, "card", ("tiny", [], 24, False, 0))
    check = SimpleNamespace(model=lambda name: tiny_dir, out=str(tmp_path), data_dir="",
                            device=model.resolve_device("cuda"), cuda=True, steps=2,
                            micro_batch_size=2, dry_run=False,
                            rest=["--dataset", "tiny", "--prompts_per_step", "2", "--group_size",
                                  "4", "--eval_size", "2", "--lr", "1e-4"])
    r = gpu_check.train_run(check, "card")
    assert r["status"] == "done", r.get("error")
    assert r["auto"].endswith(" of 24.0 GiB free") and r["simulated"]
    assert r["peak_gib"] == {"allocated": 1.0, "reserved": 1.0}  # the fake's, after empty()
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    assert [r["warm_up"]["step"]] + [s["step"] for s in r["steady"]] == [0, 1]


# ----------------------------------------------------------------------------- whole runs


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:0"])
def test_a_run_on_the_gpu_sizes_itself_and_survives_a_cublas_failure(tmp_path, tiny_dir,
                                                                      monkeypatch, device):
    """train.py on a (fake) 80 GiB card, 50 free, 3 held, at most a quarter of it: the run names
    cuda:0; its memory knobs are sized by free_bytes' real body (20 GiB); forward passes autocast to
    bf16; a cuBLAS allocation failure in a gradient forward is out of memory: the micro-batch
    halves, the cache is emptied, and the run finishes."""
    gpu = FakeCuda(monkeypatch, total=80 * GiB, free=50 * GiB, reserved=3 * GiB)
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    on_the_cpu(monkeypatch, train)
    cublas_fails(monkeypatch, rows_over=2)
    autocasts = []
    real_autocast = train.autocast
    monkeypatch.setattr(train, "autocast", lambda *a: autocasts.append(
        model.autocast_dtype(*a)) or real_autocast(*a))
    lines = []
    cfg = train.Config(model=tiny_dir, device=device, out_dir=str(tmp_path / "run"), **SMALL)
    train.train(cfg, log=lines.append)
    assert lines[0].startswith(f"run {tmp_path / 'run'} | {tiny_dir} on cuda:0, ")
    auto = next(line for line in lines if line.startswith("memory auto: "))
    assert auto.endswith(" of 20.0 GiB free")
    assert set(autocasts) == {torch.bfloat16}
    assert any(line.startswith("out of memory: --micro_batch_size ") for line in lines)
    assert ("emptyCache",) in gpu.calls
    saved = json.load(open(tmp_path / "run" / "config.json"))
    assert saved["micro_batch_size"] <= 2 and len(rows(tmp_path / "run")) == 2


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_eval_py_on_the_gpu_autocasts_and_halves_after_a_cublas_failure(tmp_path, tiny_dir,
                                                                         monkeypatch, capsys,
                                                                         device):
    FakeCuda(monkeypatch, capability=(8, 6), name="NVIDIA A10")
    on_the_cpu(monkeypatch, model)
    real = eval_py.generate_groups

    def generate(policy, tokenizer, prompts, n, *a, **k):
        if len(prompts) * n > 2:
            raise RuntimeError(CUBLAS)
        return real(policy, tokenizer, prompts, n, *a, **k)
    monkeypatch.setattr(eval_py, "generate_groups", generate)
    assert eval_py.main(["--model", tiny_dir, "--benchmarks", "tiny", "--limit", "4", "--device",
                         device, "--max_new_tokens", "4", "--batch_size", "4", "--out",
                         str(tmp_path / "e.jsonl")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith(f"model {tiny_dir} | cuda:0 torch.float32 + "
                                          f"torch.bfloat16 autocast | ")
    assert "tiny: out of memory: --batch_size 4 -> 2, the batch redone" in err


def test_a_lora_checkpoint_loads_in_one_dtype_for_train_py_and_eval_py(tmp_path, tiny_dir,
                                                                       monkeypatch):
    """On a GPU a LoRA run holds its frozen base in bf16: its resume (train.py) and eval.py load the
    checkpoint's base in that same dtype (model.load_dtype), so eval.py's accuracy is computed
    with the arithmetic of train.py's held-out evaluation."""
    FakeCuda(monkeypatch)
    loads = on_the_cpu(monkeypatch, train, model)
    run_dir = tmp_path / "lora"
    train.train(train.Config(model=tiny_dir, device="cuda", out_dir=str(run_dir), lora_rank=4,
                             **{**SMALL, "steps": 1}), log=lambda *a: None)
    ckpt = str(run_dir / "checkpoint")
    train.train(train.Config(resume=str(run_dir)), log=lambda *a: None)  # complete: it loads
    assert eval_py.main(["--model", ckpt, "--benchmarks", "tiny", "--limit", "2", "--device",
                         "cuda", "--max_new_tokens", "4", "--out", str(tmp_path / "e.jsonl")]) == 0
    assert loads[0] == (tiny_dir, torch.bfloat16)  # the fresh run's base
    assert [d for name, d in loads if name == ckpt] == [torch.bfloat16] * 2  # resume, eval.py


def test_config_asks_torch_whether_auto_is_a_gpu(monkeypatch):
    FakeCuda(monkeypatch)
    assert config.on_gpu(train.Config(device="auto")) and not config.on_gpu(
        train.Config(device="cpu"))


# ----------------------------------------------------------------------------- keep it last

@pytest.mark.last  # after the file's other tests, whatever the shuffled order (conftest.py)
def test_every_torch_cuda_call_is_reached_by_a_test_under_the_fake():
    """Every torch.cuda.<name>(...) in the project (outside tests/) ran in a test of this file, with
    torch.cuda's real argument checks. Run with the whole file: the tests above do the reaching."""
    missed = [f"{path}:{first} torch.cuda.{name}" for path, first, last, name in call_sites()
              if not reached((path, first, last, name))]
    assert not missed, f"no strict test reached: {', '.join(missed)}"
