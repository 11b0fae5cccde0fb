"""The CUDA serial-sampling op, checked without a GPU.

* The CUDA sources compile with nvcc for sm_80 and sm_90 (no register spills), and the host code
  compiles against this torch's headers (skipped, with the reason, where nvcc or g++ is absent).
* The operator's schema and fake implementation (what torch.compile traces with) work on meta and
  fake tensors.
* Dispatch: which path runs for which configuration and device, with the device test and the build
  stubbed (``backend="auto"`` / ``"reference"`` / ``"cuda"``, fallbacks, errors naming the reason).
* The reference path's inverse-CDF sampling (how the reference is fed the op's random numbers).
* The GPU test module's checks, run here against a PyTorch emulation of the kernels' algorithm
  (same roundings, 256-entry tiles, fp64 scan over tiles, fp32 scan inside the tile), and shown to
  fail on broken variants of it.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils import cpp_extension
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper

import dspark_hf
from dspark_hf.decoding import cuda_graphs
from dspark_hf.decoding import cuda_ops
from dspark_hf.decoding.sampling import SerialSample, inverse_cdf_sample, serial_sample
from cuda_op_fakes import pretend_cuda_op_is_built

CSRC = Path(cuda_ops.__file__).parent / "csrc"
GPU_TESTS = Path(__file__).parent / "gpu" / "test_cuda_op.py"


def _gpu_module():
    spec = importlib.util.spec_from_file_location("gpu_test_cuda_op", GPU_TESTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


gpu = _gpu_module()


# ----------------------------------------------------------------------------- compile checks
def _cuda_home() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME, "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").exists():
            return Path(c)
    return None


def _nvcc_compile(nvcc, std, archs, out):
    """nvcc as torch.utils.cpp_extension runs it for the JIT build (its common flags, which turn off
    the implicit half/bfloat16 conversions, and -fPIC), plus a ptxas resource report."""
    gencode = [a for arch in archs for a in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    cmd = [nvcc, *cpp_extension.COMMON_NVCC_FLAGS, f"-std={std}", "-O3", "-lineinfo", "--compiler-options", "-fPIC",
           "-c", "-Xptxas", "-v", *gencode, f"-I{CSRC}", str(CSRC / "serial_sample_kernels.cu"), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_kernels_compile_with_nvcc_for_sm80_and_sm90(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here; the CUDA sources were not compiled")
    std = "c++20" if "-std=c++20" in inspect.getsource(cpp_extension) else "c++17"
    result = _nvcc_compile(nvcc, std, ("80", "90"), tmp_path / "kernels.o")
    assert result.returncode == 0, result.stderr[-4000:]
    report = result.stdout + result.stderr
    assert "warning" not in report.lower(), report[-4000:]
    for arch in ("sm_80", "sm_90"):
        assert f"for '{arch}'" in report, f"no {arch} code in the build report"
    # every kernel instantiation (3 dtypes x logits fused/unfused + select/prepare) for both archs
    assert report.count("Compiling entry function") == 2 * 9, report[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert spills and all(int(s) == 0 for s in spills), "register spills in the kernels:\n" + report[-3000:]
    # older torch builds compile extensions as C++17
    if std != "c++17":
        result = _nvcc_compile(nvcc, "c++17", ("90",), tmp_path / "kernels17.o")
        assert result.returncode == 0, result.stderr[-4000:]


def test_host_code_compiles_against_torch_headers(tmp_path):
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    cuda_home = _cuda_home()
    if compiler is None or cuda_home is None:
        pytest.skip(f"needs a C++ compiler and the CUDA headers (compiler={compiler}, CUDA={cuda_home})")
    includes = cpp_extension.include_paths()  # torch's own headers
    macros = Path(includes[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not macros.exists():  # a CPU build of torch lacks this generated header; supply the CUDA build's one
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [str(tmp_path / "stub"), *includes]
    std = "-std=c++20" if "-std=c++20" in inspect.getsource(cpp_extension) else "-std=c++17"
    cmd = [compiler, std, "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
           *[f"-isystem{p}" for p in [*includes, str(cuda_home / "include")]], f"-I{CSRC}",
           str(CSRC / "serial_sample_op.cpp")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def test_sources_ship_with_the_package():
    for name in (*cuda_ops.SOURCES, *cuda_ops.HEADERS):
        assert (CSRC / name).is_file(), name
    import fnmatch
    import tomllib

    pyproject = tomllib.loads((Path(dspark_hf.__file__).parent.parent / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    patterns = package_data.get("dspark_hf.decoding", [])  # relative to dspark_hf/decoding, where csrc/ lives
    for name in (*cuda_ops.SOURCES, *cuda_ops.HEADERS):
        assert any(fnmatch.fnmatch(f"csrc/{name}", p) for p in patterns), f"{name} is not in the wheel's package data"


# ----------------------------------------------------------------------------- operator schema
def _op_args(device="meta", dtype=torch.bfloat16, rows=3, gamma=5, vocab=1000, hidden=32, rank=16,
             confidence=True, uniforms=True):
    def t(*shape, dt=dtype):
        return torch.empty(shape, device=device, dtype=dt)

    return (t(rows, gamma, vocab), t(rows, gamma, hidden), t(rows, dt=torch.long), t(vocab, rank), t(vocab, rank),
            None, None, t(1, hidden + rank) if confidence else None, t(1) if confidence else None, None,
            t(rows, gamma, dt=torch.float32) if uniforms else None, 0.7, 4)


def test_operator_schema_and_meta_shapes():
    op = torch.ops.dspark_hf.serial_sample.default
    assert [a.name for a in op._schema.arguments][:3] == ["base_logits", "hidden_states", "anchor_ids"]
    tokens, logits, conf = torch.ops.dspark_hf.serial_sample(*_op_args())
    assert (tokens.shape, tokens.dtype) == ((3, 5), torch.long)
    assert (logits.shape, logits.dtype) == ((3, 5, 1000), torch.float32)
    assert (conf.shape, conf.dtype) == ((3, 5), torch.float32)
    _, _, conf = torch.ops.dspark_hf.serial_sample(*_op_args(confidence=False))
    assert conf.shape == (0,)


def test_operator_fake_tensor_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = _op_args(device="cpu", dtype=torch.float16, rows=2, gamma=7, vocab=151936)
        tokens, logits, conf = torch.ops.dspark_hf.serial_sample(*args)
    assert tokens.shape == (2, 7) and logits.shape == (2, 7, 151936) and conf.shape == (2, 7)


def test_operator_has_no_cpu_kernel():
    with pytest.raises(NotImplementedError):
        torch.ops.dspark_hf.serial_sample(*_op_args(device="cpu", dtype=torch.float32))


# ----------------------------------------------------------------------------- build errors / cache dir
def test_load_extension_explains_missing_cuda(monkeypatch):
    monkeypatch.setattr(cuda_ops, "_state", {"loaded": False, "error": None})
    if torch.version.cuda is None:
        with pytest.raises(cuda_ops.CudaOpUnavailable, match="built without CUDA"):
            cuda_ops.load_extension()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device" in cuda_ops.build_problem()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert "no CUDA compiler" in cuda_ops.build_problem()


def test_build_failure_is_remembered_and_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_HF_EXTENSION_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_ops, "_state", {"loaded": False, "error": None})
    monkeypatch.setattr(cuda_ops, "build_problem", lambda: None)
    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("Error building extension 'dspark_hf_serial_sample'")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    for _ in range(2):
        with pytest.raises(cuda_ops.CudaOpUnavailable, match="Building the dspark_hf CUDA serial-sampling op failed"):
            cuda_ops.load_extension()
    assert len(calls) == 1  # not retried
    kwargs = calls[0]
    assert kwargs["is_python_module"] is False and Path(kwargs["build_directory"]).parent == tmp_path
    assert sorted(Path(s).name for s in kwargs["sources"]) == sorted(cuda_ops.SOURCES)


def test_extension_dir_follows_cache_settings(monkeypatch, tmp_path):
    monkeypatch.delenv("DSPARK_HF_EXTENSION_DIR", raising=False)
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))
    assert cuda_ops.extension_dir().parent == tmp_path / "cache" / "torch_extensions"
    monkeypatch.delenv("DSPARK_HF_CACHE")
    assert cuda_ops.extension_dir().parent == Path.home() / ".cache" / "dspark_hf" / "torch_extensions"
    monkeypatch.setenv("DSPARK_HF_EXTENSION_DIR", str(tmp_path / "ext"))
    assert cuda_ops.extension_dir().parent == tmp_path / "ext"
    assert torch.__version__.split("+")[0] in cuda_ops.extension_dir().name


# ----------------------------------------------------------------------------- dispatch
def _small_case(**overrides):
    base = dict(name="small", vocab=300, rank=16, head="vanilla", confidence="markov", dtype=torch.float32, rows=2,
                gamma=4, sample=False, hidden=32)
    base.update(overrides)
    return gpu.Case(**base)


def _setup(case=None):
    case = case or _small_case()
    heads = gpu.make_heads(case, "cpu")
    U, H, anchor, _ = gpu.make_inputs(case, "cpu")
    return heads, U, H, anchor


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretends CPU tensors are CUDA tensors and the extension is built; records op calls, which
    return a marker result."""
    calls = []

    def fake_op(draft, U, H, anchor, **kwargs):
        calls.append(kwargs)
        rows, gamma, vocab = U.shape
        return SerialSample(tokens=torch.zeros(rows, gamma, dtype=torch.long), logits=torch.zeros(rows, gamma, vocab),
                            confidences=None, uniforms="op")

    pretend_cuda_op_is_built(monkeypatch, "serial_sample_cuda", fake_op)
    return calls


def test_cpu_tensors_take_the_reference_path_unchanged(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the CUDA op path was used for CPU tensors")

    monkeypatch.setattr(cuda_ops, "dispatch", must_not_run)
    heads, U, H, anchor = _setup()
    with torch.no_grad():
        for do_sample in (False, True):
            a = serial_sample(heads, U, H, anchor, do_sample=do_sample, generator=torch.Generator().manual_seed(1))
            b = serial_sample(heads, U, H, anchor, do_sample=do_sample, generator=torch.Generator().manual_seed(1),
                              backend="reference")
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
            assert a.uniforms is None


def test_forcing_cuda_on_cpu_tensors_raises():
    heads, U, H, anchor = _setup()
    with torch.no_grad(), pytest.raises(ValueError, match=r"backend='cuda'.*on cpu.*CUDA tensors only"):
        serial_sample(heads, U, H, anchor, do_sample=False, backend="cuda")


def test_unknown_backend_raises():
    heads, U, H, anchor = _setup()
    with pytest.raises(ValueError, match="backend must be one of"):
        serial_sample(heads, U, H, anchor, do_sample=False, backend="triton")


def test_auto_uses_the_op_for_supported_configurations(fake_cuda):
    prefix = torch.tensor([[1], [2]])
    with torch.no_grad():
        for head, confidence in (("vanilla", "markov"), ("gated", "plain"), ("vanilla", None)):
            heads, U, H, anchor = _setup(_small_case(head=head, confidence=confidence))
            out = serial_sample(heads, U, H, anchor, do_sample=False)
            assert out.uniforms == "op"
        heads, U, H, anchor = _setup(_small_case(rank=0, head=None, confidence="plain"))  # DFlash
        assert serial_sample(heads, U, H, anchor, do_sample=True).uniforms == "op"
        heads, U, H, anchor = _setup()
        warm = LogitsProcessorList([TemperatureLogitsWarper(0.6)])
        out = serial_sample(heads, U, H, anchor, do_sample=True, logits_processor=warm, prefix_ids=prefix,
                            generator="gen")
        assert out.uniforms == "op"
        for dtype in (torch.bfloat16, torch.float16):
            h2, U2, H2, a2 = _setup(_small_case(dtype=dtype))
            assert serial_sample(h2, U2, H2, a2, do_sample=False).uniforms == "op"
    assert len(fake_cuda) == 7
    assert fake_cuda[4]["temperature"] == 0.6 and fake_cuda[4]["generator"] == "gen" and fake_cuda[4]["do_sample"]
    assert all(c["temperature"] == 1.0 for i, c in enumerate(fake_cuda) if i != 4)


UNSUPPORTED = {
    "top-k": (dict(), "processors", "TopKLogitsWarper"),
    "repetition penalty": (dict(), "penalty", "RepetitionPenaltyLogitsProcessor"),
    "two temperature warpers": (dict(), "two_temps", "TemperatureLogitsWarper, TemperatureLogitsWarper"),
    "rnn head": (dict(head="rnn"), None, "'rnn' Markov head"),
    "float64": (dict(dtype=torch.float64), None, "float32, bfloat16 and float16"),
    "mixed dtypes": (dict(), "mixed", "needs one dtype"),
    "gradients": (dict(), "grad", "gradients are being recorded"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_configurations_fall_back_or_raise(fake_cuda, name):
    overrides, variant, message = UNSUPPORTED[name]
    heads, U, H, anchor = _setup(_small_case(**overrides))
    kwargs = {}
    prefix = anchor[:, None]
    if variant == "processors":
        kwargs = dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]),
                      prefix_ids=prefix)
    elif variant == "penalty":
        kwargs = dict(logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]), prefix_ids=prefix)
    elif variant == "two_temps":
        kwargs = dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.7)] * 2), prefix_ids=prefix)
    elif variant == "mixed":
        U = U.to(torch.bfloat16)
    grad = variant == "grad"
    with torch.set_grad_enabled(grad):
        auto = serial_sample(heads, U, H, anchor, do_sample=True, **kwargs)
        reference = serial_sample(heads, U, H, anchor, do_sample=True, backend="reference", **kwargs)
        with pytest.raises(ValueError, match=re.escape(message)):
            serial_sample(heads, U, H, anchor, do_sample=True, backend="cuda", **kwargs)
    assert fake_cuda == []  # the op never ran
    assert auto.uniforms is None and reference.uniforms is None
    assert auto.tokens.shape == reference.tokens.shape


def test_reference_backend_never_calls_the_op(fake_cuda):
    heads, U, H, anchor = _setup()
    with torch.no_grad():
        serial_sample(heads, U, H, anchor, do_sample=False, backend="reference")
    assert fake_cuda == []


def test_forced_cuda_runs_the_op(fake_cuda):
    heads, U, H, anchor = _setup()
    with torch.no_grad():
        assert serial_sample(heads, U, H, anchor, do_sample=False, backend="cuda").uniforms == "op"
    assert len(fake_cuda) == 1


def test_environment_switch_disables_auto(fake_cuda, monkeypatch):
    heads, U, H, anchor = _setup()
    monkeypatch.setenv("DSPARK_HF_CUDA_OP", "0")
    with torch.no_grad():
        assert serial_sample(heads, U, H, anchor, do_sample=False).uniforms is None
        assert serial_sample(heads, U, H, anchor, do_sample=False, backend="cuda").uniforms == "op"
    assert len(fake_cuda) == 1


def test_build_failure_falls_back_under_auto_and_raises_when_forced(fake_cuda, monkeypatch, caplog):
    def broken(verbose=False):
        raise cuda_ops.CudaOpUnavailable("The dspark_hf CUDA serial-sampling op is unavailable: no CUDA compiler.")

    monkeypatch.setattr(cuda_ops, "load_extension", broken)
    monkeypatch.setattr(cuda_ops, "_warned", set())
    heads, U, H, anchor = _setup()
    with torch.no_grad():
        auto = serial_sample(heads, U, H, anchor, do_sample=False)
        serial_sample(heads, U, H, anchor, do_sample=False)
        with pytest.raises(cuda_ops.CudaOpUnavailable, match="no CUDA compiler"):
            serial_sample(heads, U, H, anchor, do_sample=False, backend="cuda")
    ref = serial_sample(heads, U, H, anchor, do_sample=False, backend="reference")
    assert torch.equal(auto.tokens, ref.tokens) and fake_cuda == []
    assert len(cuda_ops._warned) == 1  # warned once


def test_processor_temperature():
    assert cuda_ops.processor_temperature(None) == 1.0
    assert cuda_ops.processor_temperature(LogitsProcessorList()) == 1.0
    assert cuda_ops.processor_temperature(LogitsProcessorList([TemperatureLogitsWarper(0.25)])) == 0.25
    assert cuda_ops.processor_temperature(LogitsProcessorList([TopKLogitsWarper(3)])) is None


# ----------------------------------------------------------------------------- reference inverse CDF
def test_inverse_cdf_sample_rule():
    logits = torch.log(torch.tensor([[0.2, 0.0, 0.5, 0.3]]))  # a zero-probability token in the middle
    cases = {0.0: 0, 0.19: 0, 0.2001: 2, 0.6999: 2, 0.7001: 3, 0.999999: 3}
    for u, token in cases.items():
        assert inverse_cdf_sample(logits, torch.tensor([u])).item() == token, u


def test_reference_with_uniforms_is_deterministic_and_follows_softmax():
    case = _small_case(vocab=40, rows=1, gamma=1, sample=True)
    heads, U, H, anchor = _setup(case)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(40)
    with torch.no_grad():
        u = torch.rand(1, 1, generator=gen)
        a = serial_sample(heads, U, H, anchor, do_sample=True, uniforms=u)
        b = serial_sample(heads, U, H, anchor, do_sample=True, uniforms=u)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.uniforms, u)
        for _ in range(4000):
            out = serial_sample(heads, U, H, anchor, do_sample=True, uniforms=torch.rand(1, 1, generator=gen))
            counts[out.tokens[0, 0]] += 1
    assert gpu.chi_square_p_value(counts, torch.softmax(out.logits[0, 0].double(), -1)) > 1e-3
    with pytest.raises(ValueError, match="uniforms must have shape"):
        serial_sample(heads, U, H, anchor, do_sample=True, uniforms=torch.rand(2, 1))


# ----------------------------------------------------------------------------- GPU checks vs an emulation
def tiled_inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor, tile: int = 256) -> torch.Tensor:
    """The kernels' sampling: per-tile max and sum of exp in fp32, an fp64 scan over tile weights,
    then an fp32 scan inside the chosen tile (with the same fallbacks)."""
    rows, vocab = logits.shape
    num_tiles = -(-vocab // tile)
    padded = F.pad(logits, (0, num_tiles * tile - vocab), value=float("-inf")).view(rows, num_tiles, tile)
    tile_max = padded.max(-1).values
    finite = tile_max > float("-inf")
    tile_sum = torch.where(finite, torch.exp(padded - tile_max[..., None].where(finite[..., None], 0)).sum(-1), 0)
    m = tile_max.max(-1).values
    weights = torch.where(finite, tile_sum * torch.exp(tile_max - m[:, None]), 0).double()
    cum = weights.cumsum(-1)
    target = uniforms.double() * cum[:, -1]
    tokens = torch.zeros(rows, dtype=torch.long)
    for r in range(rows):
        passed = torch.nonzero((cum[r] > target[r]) & (weights[r] > 0)).flatten()
        if len(passed):
            t = int(passed[0])
            residual = float(target[r] - (cum[r, t - 1] if t > 0 else 0.0))
        else:
            positive = torch.nonzero(weights[r] > 0).flatten()
            if not len(positive):
                continue
            t, residual = int(positive[-1]), float("inf")
        e = torch.exp(padded[r, t] - m[r])
        inclusive = e.cumsum(0)
        hit = torch.nonzero((e > 0) & (inclusive > torch.tensor(residual, dtype=torch.float32))).flatten()
        local = int(hit[0]) if len(hit) else int(torch.nonzero(e > 0).flatten()[-1])
        tokens[r] = t * tile + local
    return tokens


def emulated_op(heads, U, H, anchor, *, do_sample, temperature, uniforms, fused_max_rows, mutation=None):
    """A PyTorch emulation of the CUDA kernels (fp32 accumulation, results rounded to the dtype
    where the reference rounds them). ``mutation`` plants a bug, to show the checks catch it."""
    rows, gamma, vocab = U.shape
    dtype = U.dtype
    markov, confidence = heads.markov_head, heads.confidence_head
    hidden = H.shape[-1]
    inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    if mutation == "no_temperature":
        inv_t = torch.tensor(1.0)
    tokens = torch.zeros(rows, gamma, dtype=torch.long)
    logits = torch.zeros(rows, gamma, vocab)
    confs = torch.zeros(rows, gamma) if confidence is not None else None
    temps = heads.config.confidence_temperatures
    prev = anchor.clone()
    for k in range(gamma):
        h = H[:, k].float()
        bias = 0.0
        raw = markov.markov_w1.weight[prev].float() if markov is not None else None
        if markov is not None:
            feature = raw
            if markov.head_type == "gated":
                w = markov.gate_proj.weight.float()
                pre = (h @ w[:, :hidden].T + raw @ w[:, hidden:].T + markov.gate_proj.bias.float()).to(dtype).float()
                feature = (torch.sigmoid(pre).to(dtype).float() * raw).to(dtype).float()
            bias = (feature @ markov.markov_w2.weight.float().T).to(dtype).float()
        if confidence is not None:
            w = confidence.proj.weight.float().flatten()
            acc = h @ w[:hidden] + confidence.proj.bias.float()
            if confidence.with_markov:
                acc = acc + raw @ w[hidden:]
            c_logit = acc.to(dtype).float()
            if temps is not None:
                c_logit = c_logit / torch.tensor(temps[k])
            confs[:, k] = torch.sigmoid(c_logit)
        row_logits = U[:, k].float() + bias
        if mutation != "fp32_add":  # DeepSpec's order: the sum is rounded to the dtype, then widened
            row_logits = row_logits.to(dtype).float()
        row_logits = row_logits * inv_t
        logits[:, k] = row_logits
        if do_sample and mutation != "argmax_instead_of_sampling":
            tokens[:, k] = tiled_inverse_cdf(row_logits, uniforms[:, k])
        else:
            tokens[:, k] = row_logits.argmax(-1)
        prev = tokens[:, k] if mutation != "stale_previous_token" else anchor
    if mutation == "confidence_sees_current":  # c_k from x_k instead of x_{k-1}
        w = confidence.proj.weight.float().flatten()
        feats = markov.markov_w1.weight[tokens].float()
        acc = H.float() @ w[:hidden] + feats @ w[hidden:] + confidence.proj.bias.float()
        confs = torch.sigmoid(acc.to(dtype).float())
    return SerialSample(tokens=tokens, logits=logits, confidences=confs, uniforms=uniforms)


CPU_CASES = [
    gpu.Case("cpu-vanilla-fp32-sample", 1000, 64, "vanilla", "markov", torch.float32, 3, 5, True, 0.7, hidden=64),
    gpu.Case("cpu-gated-bf16-greedy", 600, 32, "gated", "markov", torch.bfloat16, 4, 7, False, hidden=64),
    gpu.Case("cpu-gated-bf16-sample", 513, 16, "gated", "plain", torch.bfloat16, 2, 6, True, 1.3, hidden=48),
    gpu.Case("cpu-vanilla-fp16-sample-calibrated", 257, 8, "vanilla", "markov", torch.float16, 5, 4, True,
             calibrated=True, hidden=32),
    gpu.Case("cpu-dflash-fp32-greedy", 300, 0, None, "plain", torch.float32, 2, 3, False, hidden=32),
    gpu.Case("cpu-no-heads-bf16-sample", 256, 0, None, None, torch.bfloat16, 3, 1, True, hidden=32),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_gpu_checks_pass_on_the_emulated_kernels(case):
    summary = gpu.run_case(case, "cpu", run_op=emulated_op)
    assert summary["rows_identical"] >= case.rows - max(1, case.rows // 4)


@pytest.mark.parametrize("mutation", ["no_temperature", "stale_previous_token", "argmax_instead_of_sampling",
                                      "confidence_sees_current"])
def test_gpu_checks_catch_broken_kernels(mutation):
    case = gpu.Case("mutant", 600, 32, "vanilla", "markov", torch.float32, 3, 5, True, 0.7, hidden=32)

    def broken(*args, **kwargs):
        return emulated_op(*args, mutation=mutation, **kwargs)

    with pytest.raises(AssertionError):
        gpu.run_case(case, "cpu", run_op=broken)


def test_gpu_checks_catch_a_float32_add_in_bf16():
    """The kernels must add U + bias in the dtype (DeepSpec's order); an fp32 add stays within the
    logit tolerance, so the check that catches it is that bf16 logits are bf16 values."""
    case = gpu.Case("mutant-bf16", 600, 32, "vanilla", "markov", torch.bfloat16, 3, 5, False, hidden=32)
    gpu.run_case(case, "cpu", run_op=emulated_op)

    def broken(*args, **kwargs):
        return emulated_op(*args, mutation="fp32_add", **kwargs)

    with pytest.raises(AssertionError, match="rounded to the draft's dtype"):
        gpu.run_case(case, "cpu", run_op=broken)


def test_distribution_check_on_the_emulated_kernels():
    summary = gpu.check_distribution("cpu", run_op=emulated_op, calls=40)
    assert summary["samples"] == 40 * 64



# ----------------------------------------------------------------------------- op path with admission
@pytest.fixture
def emulated_cuda(monkeypatch):
    """Pretends CPU tensors are CUDA tensors and the op is built; the op is the PyTorch emulation
    of the kernels. Records the shape of U for every op call."""
    calls = []

    def op(draft, U, H, anchor, *, do_sample, temperature=1.0, uniforms=None, generator=None, fused_max_rows=None):
        calls.append(tuple(U.shape))
        if do_sample and uniforms is None:
            uniforms = torch.rand(U.shape[:2], generator=generator)
        return emulated_op(draft, U, H, anchor.reshape(-1), do_sample=do_sample, temperature=temperature,
                           uniforms=uniforms, fused_max_rows=4)

    pretend_cuda_op_is_built(monkeypatch, "serial_sample_cuda", op)
    return calls


def _lazy_case(seed=0, gamma=7, calibrated=False):
    case = _small_case(vocab=512, rank=16, rows=1, gamma=gamma, hidden=32, seed=seed, calibrated=calibrated,
                       sample=True)
    heads = gpu.make_heads(case, "cpu")
    _, H, anchor, uniforms = gpu.make_inputs(case, "cpu")
    return gpu.LazyHeads(heads, case.vocab, case.hidden, case.dtype).eval(), H, anchor, uniforms


class CountingPolicy:
    """Wraps a policy's offers, counting them (a policy must never be offered c_1 twice)."""

    def __init__(self, policy):
        self.policy, self.offers = policy, []

    def start_round(self):
        offer = self.policy.start_round()

        def counted(c):
            self.offers.append(c)
            return offer(c)

        return counted


def test_op_path_refusing_c1_runs_neither_the_lm_head_nor_the_op(emulated_cuda):
    draft, H, anchor, uniforms = _lazy_case()
    offers = []

    def refuse(c):
        offers.append(c)
        return False

    with torch.no_grad():
        out = serial_sample(draft, None, H, anchor, do_sample=True, uniforms=uniforms, admission=refuse)
        ref = serial_sample(draft, None, H, anchor, do_sample=True, uniforms=uniforms, admission=lambda c: False,
                            backend="reference")
    assert out.num_admitted == 0 and out.tokens.shape == (1, 0) and out.logits.shape == (1, 0, 512)
    assert emulated_cuda == [] and draft.lm_head_calls == []  # the whole economy of a zero round
    assert len(offers) == 1
    torch.testing.assert_close(out.confidences, ref.confidences)


POLICIES = {
    "scheduler": lambda: dspark_hf.PrefixScheduler([1.0, 0.9, 0.85, 0.8, 0.78, 0.76, 0.75, 0.74]),
    "threshold": lambda: dspark_hf.ThresholdPolicy(0.2),
    "per-position": lambda: dspark_hf.PerPositionThresholdPolicy(0.45),
    "fixed": lambda: dspark_hf.FixedLengthPolicy(3),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_op_path_keeps_admission_and_the_lazy_lm_head(emulated_cuda, name):
    """Same admitted block as the reference admission loop fed the same uniforms; the LM head runs
    once, on the budget's positions, only in rounds that admit c_1; each c_k is offered once."""
    admitted, zero_rounds = set(), 0
    for seed in range(10):
        draft, H, anchor, uniforms = _lazy_case(seed=seed, calibrated=seed % 2 == 1)
        budget = 5 if seed % 3 == 0 else 7
        op_policy, ref_policy = CountingPolicy(POLICIES[name]()), CountingPolicy(POLICIES[name]())
        calls_before = len(emulated_cuda)
        with torch.no_grad():
            out = serial_sample(draft, None, H, anchor, do_sample=True, uniforms=uniforms,
                                admission=op_policy.start_round(), max_positions=budget)
            head_calls = list(draft.lm_head_calls)
            ref = serial_sample(draft, None, H, anchor, do_sample=True, uniforms=uniforms,
                                admission=ref_policy.start_round(), max_positions=budget, backend="reference")
        assert out.num_admitted == ref.num_admitted
        assert out.tokens.tolist() == ref.tokens.tolist()
        torch.testing.assert_close(out.logits, ref.logits)
        torch.testing.assert_close(torch.tensor(op_policy.offers), torch.tensor(ref_policy.offers))
        torch.testing.assert_close(out.confidences, ref.confidences)
        if out.num_admitted == 0:
            zero_rounds += 1
            assert head_calls == [] and len(emulated_cuda) == calls_before
        else:
            assert head_calls == [budget] and emulated_cuda[calls_before:] == [(1, budget, 512)]
        admitted.add(out.num_admitted)
    if name == "fixed":
        assert admitted == {3}
    else:
        assert len(admitted) >= 3 and zero_rounds > 0, f"the cases should admit several lengths, got {admitted}"


def test_generation_through_the_op_path_is_lossless_and_lazy(emulated_cuda, monkeypatch):
    """target.generate(assistant_model=draft) with the (emulated) op: greedy output identical to the
    target alone; rounds that verify nothing never ran the LM head or the op."""
    from dspark_hf import DSparkDraftModel, PrefixScheduler
    from tiny_models import random_target

    target = random_target(vocab_size=64, context_scale=0.3)
    draft = DSparkDraftModel.from_target(target, block_size=4, markov_rank=8).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    head_calls = []
    original = draft.base_logits
    monkeypatch.setattr(draft, "base_logits", lambda h: head_calls.append(h.shape[1]) or original(h))
    draft.generation_config.dspark_verify_policy = PrefixScheduler([1.0, 0.6, 0.5, 0.45, 0.4])  # admits x_1 only when c_1 > 2/3
    draft.generation_config.dspark_adaptive_drafting = False
    prompt = torch.tensor([[3, 7, 11, 2, 9]])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    out = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=draft)
    assert out.tolist() == expected.tolist()
    rounds = [r for r in draft.last_generation_stats.rounds if r.drafted]
    verifying = sum(1 for r in rounds if r.verified > 0)
    assert verifying > 0 and len(emulated_cuda) == verifying and len(head_calls) == verifying
    assert any(r.verified == 0 for r in rounds), "the scheduler should refuse some rounds outright"


def test_a_nan_confidence_on_the_op_path_is_warned_about(emulated_cuda, monkeypatch, caplog):
    """A draft whose confidence head gives NaN, on the (emulated) op path: the scheduler refuses
    c_1 every round (plain steps, output unchanged), and the NaN reaches the non-finite warning
    through ``SerialSample.offered``, which the op path sets as the reference loop does."""
    from dspark_hf import DSparkDraftModel, PrefixScheduler
    from dspark_hf.decoding.serial_block import NON_FINITE_DRAFT_WARNING
    from tiny_models import random_target

    admitted_calls = []
    draw_admitted = cuda_ops._draw_admitted
    monkeypatch.setattr(cuda_ops, "_draw_admitted", lambda *a, **k: admitted_calls.append(1) or draw_admitted(*a, **k))
    target = random_target(vocab_size=64, context_scale=0.3)
    draft = DSparkDraftModel.from_target(target, block_size=4, markov_rank=8).eval()
    with torch.no_grad():
        draft.confidence_head.proj.bias.fill_(float("nan"))
    draft.generation_config.dspark_verify_policy = PrefixScheduler([1.0, 0.6, 0.5, 0.45, 0.4])
    draft.generation_config.dspark_adaptive_drafting = False
    prompt = torch.tensor([[3, 7, 11, 2, 9]])
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)
    with caplog.at_level(logging.WARNING):
        out = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=draft)
    assert out.tolist() == expected.tolist()
    assert admitted_calls, "the rounds should take the op path"
    assert emulated_cuda == [] and draft.last_generation_stats.verified_tokens == 0
    assert sum(NON_FINITE_DRAFT_WARNING in r.getMessage() for r in caplog.records) == 1  # once per call


# ----------------------------------------------------------------------------- CUDA-graph replay (plumbing)
def _raw_emulation(heads):
    """The operator's raw signature over the kernels' emulation of ``heads``."""

    def run(U, H, anchor, w1, w2, gate_w, gate_b, conf_w, conf_b, conf_temp, uniforms, temperature, fused):
        out = emulated_op(heads, U, H, anchor, do_sample=uniforms is not None, temperature=temperature,
                          uniforms=uniforms, fused_max_rows=fused)
        return out.tokens, out.logits, out.confidences if out.confidences is not None else torch.empty(0)

    return run


class ReplayingGraph:
    """A CPU model of a captured CUDA graph: replay reruns the captured work on the static input
    buffers and writes the results into the same output tensors."""

    def __init__(self, fn, inputs):
        self.fn, self.inputs, self.replays = fn, inputs, 0
        self.outputs = tuple(t.clone() for t in fn(*inputs))

    def replay(self):
        self.replays += 1
        for out, new in zip(self.outputs, self.fn(*self.inputs)):
            out.copy_(new)


@pytest.fixture
def fake_graphs(monkeypatch):
    captures = []

    def capture(fn, inputs):
        graph = ReplayingGraph(fn, inputs)
        captures.append(graph)
        return graph, graph.outputs

    monkeypatch.setattr(cuda_graphs.StaticGraph, "_capture", staticmethod(capture))
    monkeypatch.setattr(cuda_ops, "can_capture", lambda device: True)
    monkeypatch.setattr(cuda_ops, "load_extension", lambda verbose=False: None)
    monkeypatch.setattr(cuda_ops, "_GRAPHS", cuda_graphs.GraphCache(max_graphs=2))
    monkeypatch.delenv(cuda_graphs.ENV_SWITCH, raising=False)
    return captures


@torch.no_grad()
def test_graphed_op_gives_the_eager_results_and_captures_once_per_shape(fake_graphs, monkeypatch):
    case = gpu.Case("graph", 600, 32, "gated", "markov", torch.bfloat16, 1, 7, True, 0.7, hidden=32, calibrated=True)
    heads = gpu.make_heads(case, "cpu")
    monkeypatch.setattr(cuda_ops, "_run_op", _raw_emulation(heads))
    results = []
    for seed in range(3):
        U, H, anchor, _ = gpu.make_inputs(replace(case, seed=seed), "cpu")
        kwargs = dict(do_sample=True, temperature=0.7)
        eager = cuda_ops.serial_sample_cuda(heads, U, H, anchor, generator=torch.Generator().manual_seed(seed),
                                            graph=False, **kwargs)
        graphed = cuda_ops.serial_sample_cuda(heads, U, H, anchor, generator=torch.Generator().manual_seed(seed),
                                              graph=True, **kwargs)
        assert torch.equal(graphed.uniforms, torch.rand(1, 7, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(eager.uniforms, graphed.uniforms)
        for name in ("tokens", "logits", "confidences"):
            assert torch.equal(getattr(eager, name), getattr(graphed, name)), name
        results.append((graphed, eager))
    # one capture for the shape, replayed for every call; earlier results are not overwritten
    assert len(fake_graphs) == 1 and fake_graphs[0].replays == 3
    for graphed, eager in results:
        assert torch.equal(graphed.logits, eager.logits) and torch.equal(graphed.tokens, eager.tokens)
    # given uniforms and greedy calls are other keys; the cache keeps the two most recent
    U, H, anchor, uniforms = gpu.make_inputs(case, "cpu")
    given = cuda_ops.serial_sample_cuda(heads, U, H, anchor, do_sample=True, temperature=0.7, uniforms=uniforms,
                                        graph=True)
    assert torch.equal(given.uniforms, uniforms) and len(fake_graphs) == 1  # same key: replayed
    greedy = cuda_ops.serial_sample_cuda(heads, U, H, anchor, do_sample=False, graph=True)
    assert greedy.uniforms is None and torch.equal(greedy.tokens, greedy.logits.argmax(-1))
    assert len(fake_graphs) == 2 and len(cuda_ops._GRAPHS) == 2
    cuda_ops.serial_sample_cuda(heads, U[:, :4].contiguous(), H[:, :4].contiguous(), anchor, do_sample=False,
                                graph=True)
    assert len(fake_graphs) == 3 and len(cuda_ops._GRAPHS) == 2


@torch.no_grad()
def test_graphs_follow_the_environment_switch(fake_graphs, monkeypatch):
    case = gpu.Case("graph-env", 300, 16, "vanilla", "plain", torch.float32, 1, 3, False, hidden=32)
    heads = gpu.make_heads(case, "cpu")
    monkeypatch.setattr(cuda_ops, "_run_op", _raw_emulation(heads))
    U, H, anchor, _ = gpu.make_inputs(case, "cpu")
    cuda_ops.serial_sample_cuda(heads, U, H, anchor, do_sample=False)
    assert fake_graphs == []  # off by default
    monkeypatch.setenv(cuda_graphs.ENV_SWITCH, "1")
    cuda_ops.serial_sample_cuda(heads, U, H, anchor, do_sample=False)
    assert len(fake_graphs) == 1 and fake_graphs[0].replays == 1
    monkeypatch.setattr(cuda_ops, "can_capture", lambda device: False)  # e.g. inside an outer capture
    cuda_ops.serial_sample_cuda(heads, U, H, anchor, do_sample=False)
    assert fake_graphs[0].replays == 1 and len(fake_graphs) == 1
