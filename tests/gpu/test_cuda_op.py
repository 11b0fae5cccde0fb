"""GPU checks of the compiled serial-sampling op against the PyTorch reference loop.

Skipped without CUDA. Run on a GPU machine with ``bash tests/gpu/run_gpu_checks.sh`` (tests and
benchmark, results written to tests/gpu/results/) or ``python -m pytest tests/gpu -q``.

What is checked, for every case of :data:`CASES` (vocabularies 1000 .. 151936, some not multiples
of the 256-entry tile; ranks 0 .. 512; gamma 1 .. 16; batch 1 .. 64; float32/bfloat16/float16;
vanilla, gated and no Markov head; confidence head with/without the Markov feature, calibrated or
not; fused W2 pass and cuBLAS bias path):

1. the returned logits equal the reference equations evaluated along the op's own tokens
   (teacher forcing), within a dtype tolerance; the same for the confidences;
2. the tokens are drawn from the returned logits: greedy tokens are exactly their argmax, sampled
   tokens are exactly the inverse CDF at the op's uniforms (up to 1e-5 of CDF rounding);
3. the reference loop fed the same uniforms gives the same tokens; where a row differs, the first
   difference is explained by float rounding (a near-tie, or a uniform within rounding of a CDF
   boundary, bounded by the logits' measured difference at that position).

Further tests: the sampled distribution (chi-square, with a power check), reproducibility from a
torch generator, CUDA-graph capture, the op's own graphed replay (``graph=True``), torch.compile,
the dispatch (auto / forced / fallbacks), the op path with a verify policy's admission (early stop
and lazy LM head kept), and speed against the loop at 1 and 64 rows.

The check functions take a device and an optional op runner, so tests/test_cuda_op_cpu.py runs them
on CPU against an emulation of the kernels' algorithm (that is how this module was checked before a
GPU ran it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from dspark_hf.decoding import cuda_ops
from dspark_hf.benchmarks.measuring import mean_call_ms
from dspark_hf.configuration_dspark import DSparkConfig
from dspark_hf.model.heads import ConfidenceHead, MarkovHead
from dspark_hf.decoding.sampling import SerialSample, serial_sample

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run bash tests/gpu/run_gpu_checks.sh on one)")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# Returned logits vs the reference equations: 16-bit runs may differ where the bias (rounded to the
# dtype by both) lands on the other side of a rounding boundary (one bf16 ulp of ~2 is 0.016).
LOGIT_TOL = {F32: dict(atol=1e-4, rtol=1e-5), BF16: dict(atol=5e-2, rtol=1e-2), F16: dict(atol=1e-2, rtol=2e-3)}
LOGIT_MEAN_ABS = {F32: 1e-5, BF16: 2e-3, F16: 5e-4}
CONF_ATOL = {F32: 1e-5, BF16: 1.5e-2, F16: 3e-3}
CDF_TOL = 1e-5  # fp32 tile sums against the fp64 CDF of the same logits


# ----------------------------------------------------------------------------- problem set-up
class Heads(torch.nn.Module):
    """The parts of a DSpark draft that serial sampling reads (no backbone: the tests feed U and h)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = config
        self.markov_head = MarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None


class LazyHeads(torch.nn.Module):
    """Test heads plus an LM head whose calls are recorded (how many positions each call covered)."""

    def __init__(self, heads, vocab: int, hidden: int, dtype):
        super().__init__()
        self.config, self.markov_head, self.confidence_head = heads.config, heads.markov_head, heads.confidence_head
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype)
        torch.nn.init.normal_(self.lm_head.weight, std=hidden ** -0.5 * 3)
        self.lm_head_calls: list[int] = []

    def _lm_head(self):
        return self.lm_head

    def base_logits(self, hidden_states):
        self.lm_head_calls.append(hidden_states.shape[1])
        return self.lm_head(hidden_states)


@dataclass(frozen=True)
class Case:
    name: str
    vocab: int
    rank: int                 # 0 = no Markov head
    head: str | None          # "vanilla" / "gated" / None
    confidence: str | None    # "markov" (with W1 feature) / "plain" / None
    dtype: torch.dtype
    rows: int
    gamma: int
    sample: bool
    temperature: float = 1.0
    fused_max_rows: int = cuda_ops.FUSED_MAX_ROWS
    calibrated: bool = False
    hidden: int = 512
    seed: int = 0

    def __str__(self):
        return self.name


CASES = [
    Case("qwen-vanilla-bf16-b1-g16-greedy", 151936, 256, "vanilla", "markov", BF16, 1, 16, False),
    Case("qwen-vanilla-bf16-b1-g16-sample-T0.7", 151936, 256, "vanilla", "markov", BF16, 1, 16, True, 0.7),
    Case("qwen-vanilla-bf16-b64-g16-sample", 151936, 256, "vanilla", "markov", BF16, 64, 16, True),
    Case("qwen-gated-bf16-b32-g7-greedy-d2560", 151936, 256, "gated", "markov", BF16, 32, 7, False, hidden=2560),
    Case("qwen-gated-bf16-b4-g7-sample-fused", 151936, 256, "gated", "markov", BF16, 4, 7, True, 0.7),
    Case("qwen-vanilla-bf16-b4-g7-sample-cublas", 151936, 256, "vanilla", "plain", BF16, 4, 7, True, fused_max_rows=0),
    Case("qwen-vanilla-fp16-b64-g16-greedy-r64", 151936, 64, "vanilla", "markov", F16, 64, 16, False),
    Case("qwen-gated-fp32-b1-g16-sample", 151936, 256, "gated", "markov", F32, 1, 16, True),
    Case("qwen-calibrated-bf16-b2-g7-greedy", 151936, 256, "vanilla", "markov", BF16, 2, 7, False, calibrated=True),
    Case("qwen-dflash-bf16-b16-g7-sample", 151936, 0, None, "plain", BF16, 16, 7, True, 0.7),
    Case("v49152-vanilla-fp16-b3-g4-sample", 49152, 256, "vanilla", "markov", F16, 3, 4, True, 0.7),
    Case("v49152-gated-fp32-b8-g4-greedy", 49152, 256, "gated", "plain", F32, 8, 4, False),
    Case("v1000-fp32-b1-g1-sample", 1000, 64, "vanilla", "markov", F32, 1, 1, True),
    Case("v50001-bf16-r8-b2-g5-greedy", 50001, 8, "vanilla", "markov", BF16, 2, 5, False),
    Case("v32003-gated-bf16-r100-b2-g6-sample-T1.3", 32003, 100, "gated", "markov", BF16, 2, 6, True, 1.3),
    Case("v32000-bf16-r512-b1-g8-sample-fused", 32000, 512, "vanilla", "markov", BF16, 1, 8, True),
    Case("v32000-fp32-r512-b2-g3-greedy-cublas", 32000, 512, "vanilla", None, F32, 2, 3, False),
    Case("v4099-dflash-fp32-b5-g3-greedy-no-heads", 4099, 0, None, None, F32, 5, 3, False),
]


def make_heads(case: Case, device) -> Heads:
    """Deterministic random heads: W1 ~ N(0, 1), W2 ~ N(0, 1/r) (bias ~ N(0, 1)), linear layers
    ~ N(0, 1/fan_in) with gate weights doubled so gates spread over (0, 1)."""
    temperatures = [0.5 + 0.25 * k for k in range(case.gamma)] if case.calibrated else None
    config = DSparkConfig(
        vocab_size=case.vocab, hidden_size=case.hidden, intermediate_size=case.hidden, num_attention_heads=4,
        block_size=case.gamma, markov_rank=case.rank, markov_head_type=case.head or "vanilla",
        enable_confidence_head=case.confidence is not None,
        confidence_head_with_markov=case.confidence == "markov", confidence_temperatures=temperatures,
    )
    with torch.device(device):
        heads = Heads(config)
    gen = torch.Generator(device).manual_seed(1000 + case.seed)
    with torch.no_grad():
        for name, param in heads.named_parameters():
            if name.endswith("markov_w1.weight"):
                std = 1.0
            elif name.endswith("markov_w2.weight"):
                std = case.rank ** -0.5
            elif param.dim() == 2:
                std = (2.0 if "gate_proj" in name else 1.0) * param.shape[1] ** -0.5
            else:
                std = 0.5
            param.copy_(torch.randn(param.shape, generator=gen, device=device) * std)
    return heads.to(case.dtype).eval()


def make_inputs(case: Case, device):
    """Backbone logits U ~ N(0, 9) (peaked like a language model's), hidden states, anchors, uniforms."""
    gen = torch.Generator(device).manual_seed(case.seed)
    U = (3.0 * torch.randn(case.rows, case.gamma, case.vocab, generator=gen, device=device)).to(case.dtype)
    H = torch.randn(case.rows, case.gamma, case.hidden, generator=gen, device=device).to(case.dtype)
    anchor = torch.randint(0, case.vocab, (case.rows,), generator=gen, device=device)
    uniforms = torch.rand(case.rows, case.gamma, generator=gen, device=device) if case.sample else None
    return U, H, anchor, uniforms


def processors(temperature: float) -> LogitsProcessorList | None:
    return LogitsProcessorList([TemperatureLogitsWarper(temperature)]) if temperature != 1.0 else None


def run_cuda_op(heads, U, H, anchor, *, do_sample, temperature, uniforms, fused_max_rows) -> SerialSample:
    """The op under test (the CPU tests substitute an emulation)."""
    return cuda_ops.serial_sample_cuda(heads, U, H, anchor, do_sample=do_sample, temperature=temperature,
                                       uniforms=uniforms, fused_max_rows=fused_max_rows)


def run_reference(heads, U, H, anchor, *, do_sample, temperature, uniforms) -> SerialSample:
    return serial_sample(heads, U, H, anchor, do_sample=do_sample, logits_processor=processors(temperature),
                         prefix_ids=anchor[:, None], uniforms=uniforms, backend="reference")


def rollout(heads, U, H, anchor, tokens, temperature):
    """The reference equations evaluated along a given token path (all positions at once)."""
    markov, confidence = heads.markov_head, heads.confidence_head
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
    logits = U.float()
    if markov is not None:
        feature = markov.markov_w1(prev)
        if markov.head_type == "gated":
            feature = torch.sigmoid(markov.gate_proj(torch.cat([H, feature], dim=-1))) * feature
        logits = (U + markov.markov_w2(feature)).float()  # added in the dtype, as DeepSpec does
    if temperature != 1.0:
        logits = logits / temperature
    confidences = None
    if confidence is not None:
        features = markov.markov_w1(prev) if confidence.with_markov else None
        conf_logits = confidence.logits(H, features).float()
        temperatures = heads.config.confidence_temperatures
        if temperatures is not None:
            conf_logits = conf_logits / torch.tensor(temperatures, device=conf_logits.device)[: U.shape[1]]
        confidences = torch.sigmoid(conf_logits)
    return logits, confidences


# ----------------------------------------------------------------------------- checks
def cdf_interval(logits_row: torch.Tensor, token: int) -> tuple[float, float]:
    """[CDF(token - 1), CDF(token)] of softmax(logits_row), in float64."""
    cdf = torch.softmax(logits_row.double(), dim=-1).cumsum(-1)
    cdf = cdf / cdf[-1]
    return (cdf[token - 1].item() if token > 0 else 0.0), cdf[token].item()


def check_inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor, tokens: torch.Tensor, tol: float = CDF_TOL):
    """Every token is the inverse CDF of softmax(its logits) at its uniform (up to ``tol``)."""
    rows, gamma, _ = logits.shape
    for k in range(gamma):
        probs = torch.softmax(logits[:, k].double(), dim=-1)
        cdf = probs.cumsum(-1)
        cdf = cdf / cdf[:, -1:]
        tok = tokens[:, k]
        hi = cdf.gather(1, tok[:, None]).squeeze(1)
        lo = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(hi))
        u = uniforms[:, k].double()
        bad = (u < lo - tol) | (u > hi + tol) | (probs.gather(1, tok[:, None]).squeeze(1) <= 0)
        assert not bool(bad.any()), (
            f"position {k}: tokens {tok[bad].tolist()} are not the inverse CDF at u={u[bad].tolist()} "
            f"(intervals {list(zip(lo[bad].tolist(), hi[bad].tolist()))})")


def explain_divergences(op: SerialSample, ref: SerialSample, uniforms, do_sample: bool) -> list[str]:
    """Rows whose tokens differ from the reference: at the first difference (where both saw the
    same prefix) the op's token must be a near-tie (greedy) or its CDF interval must lie within
    rounding of the uniform (sampling); the allowance is set by how much the two paths' logits
    differ at that position. Returns a description per differing row."""
    notes = []
    differs = (op.tokens != ref.tokens)
    for row in torch.nonzero(differs.any(1)).flatten().tolist():
        k = int(torch.nonzero(differs[row]).flatten()[0])
        tok = int(op.tokens[row, k])
        delta = (op.logits[row, k] - ref.logits[row, k]).abs().max().item()
        ref_row = ref.logits[row, k]
        if do_sample:
            lo, hi = cdf_interval(ref_row, tok)
            u = float(uniforms[row, k])
            distance = max(lo - u, u - hi, 0.0)
            allowed = CDF_TOL + 2.0 * delta
            assert distance <= allowed, (
                f"row {row}, position {k}: op token {tok} (reference {int(ref.tokens[row, k])}) has CDF interval "
                f"[{lo}, {hi}], {distance:.3g} away from u={u}; logits differ by at most {delta:.3g} there")
            notes.append(f"row {row} pos {k}: u within {distance:.2g} of a boundary (logit diff {delta:.2g})")
        else:
            gap = (ref_row.max() - ref_row[tok]).item()
            allowed = 2.0 * delta + 1e-6
            assert gap <= allowed, (
                f"row {row}, position {k}: op token {tok} is {gap:.3g} below the reference maximum "
                f"(token {int(ref.tokens[row, k])}); logits differ by at most {delta:.3g} there")
            notes.append(f"row {row} pos {k}: near-tie gap {gap:.2g} (logit diff {delta:.2g})")
    return notes


def run_case(case: Case, device, run_op=run_cuda_op) -> dict:
    """Runs one case through the op and the reference and checks everything listed in the module
    docstring; returns a summary (used by the benchmark log and the CPU tests)."""
    heads = make_heads(case, device)
    U, H, anchor, uniforms = make_inputs(case, device)
    with torch.no_grad():
        op = run_op(heads, U, H, anchor, do_sample=case.sample, temperature=case.temperature, uniforms=uniforms,
                    fused_max_rows=case.fused_max_rows)
        ref = run_reference(heads, U, H, anchor, do_sample=case.sample, temperature=case.temperature,
                            uniforms=uniforms)
        expected_logits, expected_conf = rollout(heads, U, H, anchor, op.tokens, case.temperature)

    shape = (case.rows, case.gamma)
    assert op.tokens.shape == shape and op.tokens.dtype == torch.long
    assert op.logits.shape == (*shape, case.vocab) and op.logits.dtype == torch.float32
    assert bool(((op.tokens >= 0) & (op.tokens < case.vocab)).all())

    # 1. Returned logits and confidences against the equations along the op's own path. In 16-bit
    # dtypes U_k + B_k is rounded to the dtype before widening (DeepSpec's arithmetic): at
    # temperature 1 every returned logit is a value of that dtype (an fp32 add would break this
    # almost everywhere, while staying within the tolerance below).
    if case.dtype != F32 and case.rank > 0 and case.temperature == 1.0:
        assert torch.equal(op.logits, op.logits.to(case.dtype).float()), (
            "returned logits are not rounded to the draft's dtype: U + bias was added in float32")
    torch.testing.assert_close(op.logits, expected_logits, **LOGIT_TOL[case.dtype])
    mean_abs = (op.logits - expected_logits).abs().mean().item()
    assert mean_abs <= LOGIT_MEAN_ABS[case.dtype], f"mean |logit difference| {mean_abs:.3g}"
    if case.confidence is None:
        assert op.confidences is None
    else:
        assert op.confidences.shape == shape and op.confidences.dtype == torch.float32
        torch.testing.assert_close(op.confidences, expected_conf, atol=CONF_ATOL[case.dtype], rtol=0)

    # 2. Tokens come from the returned logits.
    if case.sample:
        assert op.uniforms is not None and torch.equal(op.uniforms, uniforms)
        check_inverse_cdf(op.logits, uniforms, op.tokens)
    else:
        assert torch.equal(op.tokens, op.logits.argmax(-1)), "greedy tokens are not the argmax of the returned logits"

    # 3. Same tokens as the reference fed the same uniforms, up to explained rounding divergences.
    notes = explain_divergences(op, ref, uniforms, case.sample)
    assert len(notes) <= max(1, case.rows // 4), f"{len(notes)} of {case.rows} rows diverge: {notes}"
    if case.confidence is not None:  # confidences agree up to the first divergence
        same_prefix = torch.cumprod((op.tokens == ref.tokens).long(), dim=1).bool()
        same_prefix = torch.cat([torch.ones_like(same_prefix[:, :1]), same_prefix[:, :-1]], dim=1)
        torch.testing.assert_close(op.confidences[same_prefix], ref.confidences[same_prefix],
                                   atol=CONF_ATOL[case.dtype], rtol=0)
    return {"case": case.name, "rows_identical": case.rows - len(notes), "rows": case.rows, "divergences": notes,
            "logit_max_abs_diff": (op.logits - expected_logits).abs().max().item(), "logit_mean_abs_diff": mean_abs}


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value, categories with expected count < min_expected pooled."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    expected = counts.sum() * probs / probs.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if bool(small.any()) else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if bool(small.any()) else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    return torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0, dtype=torch.float64), chi2 / 2).item()


def check_distribution(device, run_op=run_cuda_op, calls: int = 200, rows: int = 64, case: Case | None = None) -> dict:
    """Identical rows sampled many times (uniforms from torch.rand): position 1 follows
    softmax(returned logits) (and not the logits without the temperature: power check); position 2,
    given the most frequent first token, follows its returned logits. ``case`` (default: V = 300,
    fp32, T = 0.7) sets the problem; its rows, gamma and sampling are set here."""
    if case is None:
        case = Case("distribution", 300, 16, "vanilla", "markov", F32, rows, 2, True, 0.7, seed=5)
    case = replace(case, rows=rows, gamma=2, sample=True)
    heads = make_heads(case, device)
    U, H, anchor, _ = make_inputs(replace(case, rows=1), device)
    U, H, anchor = U.expand(rows, -1, -1).contiguous(), H.expand(rows, -1, -1).contiguous(), anchor.expand(rows)
    gen = torch.Generator(device).manual_seed(7)
    first, second, logits1, logits2 = [], [], None, {}
    with torch.no_grad():
        for _ in range(calls):
            u = torch.rand(rows, 2, generator=gen, device=device)
            out = run_op(heads, U, H, anchor, do_sample=True, temperature=case.temperature, uniforms=u,
                         fused_max_rows=case.fused_max_rows)
            first.append(out.tokens[:, 0])
            second.append(out.tokens[:, 1])
            logits1 = out.logits[0, 0]
            for r, x1 in enumerate(out.tokens[:, 0].tolist()):  # position 2's logits depend on x1 only
                if x1 not in logits2:
                    logits2[x1] = out.logits[r, 1]
    first, second = torch.cat(first), torch.cat(second)
    counts1 = torch.bincount(first, minlength=case.vocab)
    p1 = chi_square_p_value(counts1, torch.softmax(logits1.double(), -1))
    p1_wrong = chi_square_p_value(counts1, torch.softmax(logits1.double() * case.temperature, -1))
    mode = int(counts1.argmax())
    counts2 = torch.bincount(second[first == mode], minlength=case.vocab)
    p2 = chi_square_p_value(counts2, torch.softmax(logits2[mode].double(), -1))
    assert p1 > 1e-3, f"position 1 does not follow softmax(returned logits): p={p1:.3g}"
    assert p1_wrong < 1e-6, f"the test cannot tell the temperature apart: p={p1_wrong:.3g}"
    assert p2 > 1e-3, f"position 2 given x1={mode} does not follow its returned logits: p={p2:.3g}"
    return {"samples": int(first.numel()), "p_position1": p1, "p_position1_without_temperature": p1_wrong,
            "p_position2_given_mode": p2, "mode_count": int(counts1[mode])}


# ----------------------------------------------------------------------------- GPU tests
@pytest.fixture(scope="module")
def built():
    cuda_ops.load_extension()  # a build failure here fails the module with the compiler's reason
    return True


@pytest.fixture(autouse=True, scope="module")
def _full_precision_reductions():
    """The reference side's bf16/fp16 GEMMs reduce in fp32 (cuBLAS may otherwise split K with
    16-bit partial sums), so differences measure the op, not the reference's shortcuts."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_tf32)
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_tf32 = False
    yield
    (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction,
     matmul.allow_tf32) = saved


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op_matches_reference(built, case):
    run_case(case, "cuda")
    torch.cuda.synchronize()


def test_sampled_distribution(built):
    check_distribution("cuda")


def test_generator_reproducible_and_uniforms_exposed(built):
    case = Case("gen", 49152, 256, "vanilla", "markov", BF16, 3, 7, True)
    heads = make_heads(case, "cuda")
    U, H, anchor, _ = make_inputs(case, "cuda")
    with torch.no_grad():
        a = serial_sample(heads, U, H, anchor, do_sample=True, generator=torch.Generator("cuda").manual_seed(3),
                          backend="cuda")
        b = serial_sample(heads, U, H, anchor, do_sample=True, generator=torch.Generator("cuda").manual_seed(3),
                          backend="cuda")
        ref = serial_sample(heads, U, H, anchor, do_sample=True, uniforms=a.uniforms, backend="reference")
    expected_u = torch.rand(3, 7, generator=torch.Generator("cuda").manual_seed(3), device="cuda")
    assert torch.equal(a.uniforms, expected_u)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    explain_divergences(a, ref, a.uniforms, True)


def _raw_op_args(heads, U, H, anchor, uniforms, temperature=0.7, fused_max_rows=4):
    m, c = heads.markov_head, heads.confidence_head
    return (U, H, anchor, m.markov_w1.weight, m.markov_w2.weight, None, None, c.proj.weight, c.proj.bias, None,
            uniforms, temperature, fused_max_rows)


@pytest.mark.parametrize("rows", [1, 8])
def test_cuda_graph_capture(built, rows):
    case = Case("graph", 151936, 256, "vanilla", "markov", BF16, rows, 7, True)
    heads = make_heads(case, "cuda")
    U, H, anchor, uniforms = make_inputs(case, "cuda")
    with torch.no_grad():
        eager = torch.ops.dspark_hf.serial_sample(*_raw_op_args(heads, U, H, anchor, uniforms))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                torch.ops.dspark_hf.serial_sample(*_raw_op_args(heads, U, H, anchor, uniforms))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.dspark_hf.serial_sample(*_raw_op_args(heads, U, H, anchor, uniforms))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0])
        torch.testing.assert_close(captured[1], eager[1], atol=1e-6, rtol=0)
        # New inputs in the same buffers: the replay reads them.
        U2, H2, anchor2, uniforms2 = make_inputs(replace(case, seed=9), "cuda")
        U.copy_(U2), H.copy_(H2), anchor.copy_(anchor2), uniforms.copy_(uniforms2)
        graph.replay()
        fresh = torch.ops.dspark_hf.serial_sample(*_raw_op_args(heads, U, H, anchor, uniforms))
        torch.cuda.synchronize()
        assert torch.equal(captured[0], fresh[0])
        torch.testing.assert_close(captured[2], fresh[2], atol=1e-6, rtol=0)


def test_torch_compile(built):
    case = Case("compile", 49152, 256, "vanilla", "markov", BF16, 2, 7, True)
    heads = make_heads(case, "cuda")
    U, H, anchor, uniforms = make_inputs(case, "cuda")
    w1, w2 = heads.markov_head.markov_w1.weight, heads.markov_head.markov_w2.weight
    cw, cb = heads.confidence_head.proj.weight, heads.confidence_head.proj.bias

    def step(U, H, anchor, uniforms):
        tokens, logits, conf = torch.ops.dspark_hf.serial_sample(U, H, anchor, w1, w2, None, None, cw, cb, None,
                                                                 uniforms, 0.7, 4)
        return tokens, logits.softmax(-1), conf * 2  # traced around the op

    with torch.no_grad():
        eager = step(U, H, anchor, uniforms)
        compiled = torch.compile(step, fullgraph=True)(U, H, anchor, uniforms)
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1])
    torch.testing.assert_close(compiled[2], eager[2])


def test_dispatch_on_gpu(built, monkeypatch):
    calls = []
    original = cuda_ops.serial_sample_cuda

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(cuda_ops, "serial_sample_cuda", spy)
    case = Case("dispatch", 4099, 64, "vanilla", "markov", BF16, 2, 4, True)
    heads = make_heads(case, "cuda")
    U, H, anchor, _ = make_inputs(case, "cuda")
    prefix = anchor[:, None]
    with torch.no_grad():
        serial_sample(heads, U, H, anchor, do_sample=False)  # auto, greedy: the op
        serial_sample(heads, U, H, anchor, do_sample=True, logits_processor=processors(0.5), prefix_ids=prefix)
        assert len(calls) == 2 and calls[1]["temperature"] == 0.5
        top_k = LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(5)])
        out = serial_sample(heads, U, H, anchor, do_sample=True, logits_processor=top_k, prefix_ids=prefix)
        assert len(calls) == 2 and out.uniforms is None  # top-k: the reference loop
        serial_sample(heads, U, H, anchor, do_sample=False, backend="reference")
        assert len(calls) == 2
        with pytest.raises(ValueError, match="TopKLogitsWarper"):
            serial_sample(heads, U, H, anchor, do_sample=True, logits_processor=top_k, prefix_ids=prefix,
                          backend="cuda")
        rnn = make_heads(replace(case, head="vanilla"), "cuda")
        rnn.markov_head.head_type = "rnn"  # the dispatch reads the head type only
        with pytest.raises(ValueError, match="rnn"):
            serial_sample(rnn, U, H, anchor, do_sample=False, backend="cuda")
    with pytest.raises(ValueError, match="gradients"):
        serial_sample(heads, U, H, anchor, do_sample=False, backend="cuda")  # grad mode, params require grad


@pytest.mark.parametrize("rows", [1, 64])
def test_op_is_faster_than_the_loop(built, rows):
    """Not a benchmark: the op at gamma 16, vocab 151936 finishes and is faster than the loop, at one
    row (the fused W2 pass, what generate() uses; also replayed as a CUDA graph) and at 64 rows
    (the cuBLAS bias path)."""
    case = Case("speed", 151936, 256, "vanilla", "markov", BF16, rows, 16, False)
    heads = make_heads(case, "cuda")
    U, H, anchor, _ = make_inputs(case, "cuda")

    def timed(fn, repeats=5):
        return mean_call_ms(fn, repeats, warmup=1)

    with torch.no_grad():
        op_ms = timed(lambda: serial_sample(heads, U, H, anchor, do_sample=False, backend="cuda"))
        ref_ms = timed(lambda: serial_sample(heads, U, H, anchor, do_sample=False, backend="reference"))
        assert math.isfinite(op_ms) and op_ms < ref_ms, f"op {op_ms:.3f} ms vs reference {ref_ms:.3f} ms"
        if rows == 1:
            graph_ms = timed(lambda: cuda_ops.serial_sample_cuda(heads, U, H, anchor, do_sample=False, graph=True))
            assert math.isfinite(graph_ms) and graph_ms < ref_ms, f"graphed op {graph_ms:.3f} ms vs {ref_ms:.3f} ms"


@pytest.mark.parametrize("gamma,do_sample", [(7, True), (16, False)])
def test_graphed_op_matches_the_eager_op(built, gamma, do_sample):
    """serial_sample_cuda(graph=True) replays the same kernels: bit-identical results, also for new
    inputs in later calls and with uniforms drawn from a generator."""
    case = Case("graphed", 151936, 256, "gated", "markov", BF16, 1, gamma, do_sample, 0.7)
    heads = make_heads(case, "cuda")
    cuda_ops._GRAPHS.clear()
    with torch.no_grad():
        for seed in range(3):
            U, H, anchor, _ = make_inputs(replace(case, seed=seed), "cuda")
            kwargs = dict(do_sample=do_sample, temperature=case.temperature)
            eager = cuda_ops.serial_sample_cuda(heads, U, H, anchor, graph=False,
                                                generator=torch.Generator("cuda").manual_seed(seed), **kwargs)
            graphed = cuda_ops.serial_sample_cuda(heads, U, H, anchor, graph=True,
                                                  generator=torch.Generator("cuda").manual_seed(seed), **kwargs)
            torch.cuda.synchronize()
            assert torch.equal(eager.tokens, graphed.tokens) and torch.equal(eager.logits, graphed.logits)
            assert torch.equal(eager.confidences, graphed.confidences)
            if do_sample:
                assert torch.equal(eager.uniforms, graphed.uniforms)
    assert len(cuda_ops._GRAPHS) == 1


def test_admission_on_the_op_path(built):
    """The op path with a policy's incremental admission gives the reference admission loop's block
    (same uniforms), runs the LM head only in rounds that admit c_1, and only on the budget."""
    from dspark_hf import PrefixScheduler

    admitted = set()
    for seed in range(6):
        case = Case("admission", 151936, 256, "vanilla", "markov", BF16, 1, 7, True, seed=seed, hidden=256)
        draft = LazyHeads(make_heads(case, "cuda"), case.vocab, case.hidden, case.dtype).cuda().eval()
        _, H, anchor, uniforms = make_inputs(case, "cuda")
        policy = PrefixScheduler([1.0, 0.7, 0.6, 0.55, 0.5, 0.45, 0.42, 0.4])
        with torch.no_grad():
            op = serial_sample(draft, None, H, anchor, do_sample=True, uniforms=uniforms,
                               admission=policy.start_round(), max_positions=5, backend="cuda")
            head_calls = list(draft.lm_head_calls)
            ref = serial_sample(draft, None, H, anchor, do_sample=True, uniforms=uniforms,
                                admission=policy.start_round(), max_positions=5, backend="reference")
        keep = min(op.num_admitted, ref.num_admitted)
        if not torch.equal(op.tokens[:, :keep], ref.tokens[:, :keep]):  # only float rounding may explain it
            explain_divergences(SerialSample(op.tokens[:, :keep], op.logits[:, :keep], None),
                                SerialSample(ref.tokens[:, :keep], ref.logits[:, :keep], None), uniforms, True)
        else:  # same tokens: same confidences up to rounding, so the same decisions
            assert op.num_admitted == ref.num_admitted
        assert head_calls == ([5] if op.num_admitted > 0 else [])
        admitted.add(op.num_admitted)
    assert len(admitted) >= 2, admitted
