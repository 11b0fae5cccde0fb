"""The compiled CUDA serial-sampling op, and when :func:`~dspark_hf.decoding.sampling.serial_sample` uses it.

On a GPU, the reference loop in :mod:`dspark_hf.decoding.sampling` costs gamma rounds of several small kernel
launches from Python (row lookup, the V x r bias product, add, softmax, sampling). The operator
``torch.ops.dspark_hf.serial_sample`` does the whole block in one call: for every position it fuses
the previous token's ``W1`` row, the gated head's gate, the ``W2`` projection, the add to ``U_k``,
the temperature, argmax or inverse-CDF sampling and the confidence head (see
``dspark_hf/decoding/csrc/serial_sample.h`` for the kernels). It is registered with ``torch.library`` (schema
and fake implementation here, CUDA kernel in C++), so it traces under ``torch.compile`` and can be
captured in CUDA graphs (no host synchronisation, no host-side randomness).

Build: the C++/CUDA sources in ``dspark_hf/decoding/csrc`` are compiled with
``torch.utils.cpp_extension.load`` on first use (about a minute, for the visible GPU's architecture
or ``TORCH_CUDA_ARCH_LIST``) and cached under ``$DSPARK_HF_EXTENSION_DIR``, else
``$DSPARK_HF_CACHE/torch_extensions``, else ``~/.cache/dspark_hf/torch_extensions``, in a folder per
torch/CUDA/Python version. It needs a CUDA build of PyTorch, a visible GPU, ``nvcc`` (``CUDA_HOME``),
a C++ compiler and ninja; otherwise :func:`load_extension` raises :class:`CudaOpUnavailable`
saying which is missing.

Launches: the op launches ``1 + 2 * gamma`` kernels per call. ``DSPARK_HF_CUDA_GRAPH=1`` (or
``serial_sample_cuda(..., graph=True)``) replays them as one captured CUDA graph per shape instead
(:mod:`dspark_hf.decoding.cuda_graphs`); off by default until ``tests/gpu/run_gpu_checks.sh`` has measured it.

Randomness: the op draws token k of row r as the inverse CDF of ``softmax(logits)`` at
``uniforms[r, k]``. The uniforms are an input: :func:`serial_sample_cuda` makes them with
``torch.rand(..., generator=generator)`` when the caller gives none, and returns them, so the
reference path can be fed the same numbers (``serial_sample(..., uniforms=...)``).

Supported (else the reference path runs, or ``backend="cuda"`` raises ``ValueError`` with the reason):
CUDA tensors; greedy, or sampling whose only logits processor is one ``TemperatureLogitsWarper``;
no Markov head, or the ``vanilla`` or ``gated`` head; any confidence head; one floating dtype
(float32, bfloat16 or float16) for logits, hidden states and head weights; no gradient recording.
The ``rnn`` head stays on the reference path: its GRU-like state adds a second serial recurrence
(a (2r + d) x 3r projection and three nonlinearities per position, each rounded like the reference
to match it), a different kernel from the low-rank bias, for a variant the paper does not deploy.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper
from transformers.utils import logging

from ..build_tools import cpp_toolchain_problem
from ..cache_dir import extension_dir
from .cuda_graphs import GraphCache, can_capture, graphs_enabled
from ..model.draft_vocab import cuda_op_markov_w2
from ..scheduling.policies import offer_until_refused
from .serial_block import SerialSample, admitted_sample, confidence_temperatures, position_confidence

logger = logging.get_logger(__name__)

OP_QUALNAME = "dspark_hf::serial_sample"
OP_SCHEMA = (
    "serial_sample(Tensor base_logits, Tensor hidden_states, Tensor anchor_ids, Tensor? markov_w1, "
    "Tensor? markov_w2, Tensor? gate_weight, Tensor? gate_bias, Tensor? confidence_weight, "
    "Tensor? confidence_bias, Tensor? confidence_temperatures, Tensor? uniforms, float temperature=1.0, "
    "int fused_max_rows=4) -> (Tensor tokens, Tensor logits, Tensor confidences)"
)
# Batches up to this many rows use the fused W2 pass; larger ones a cuBLAS GEMM for the bias (the
# kernels cap the fused pass at 4 rows: dspark_hf/decoding/csrc/serial_sample.h, kFusedMaxRows).
FUSED_MAX_ROWS = 4
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_HEADS = ("vanilla", "gated")
MAX_RANK = 4096

EXTENSION_NAME = "dspark_hf_serial_sample"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("serial_sample_op.cpp", "serial_sample_kernels.cu")
HEADERS = ("serial_sample.h",)


class CudaOpUnavailable(RuntimeError):
    """The CUDA op cannot be built or loaded here (no CUDA build of torch, no GPU, no nvcc, ...)."""


# ----------------------------------------------------------------------------- operator schema
def _define_operator() -> torch.library.Library | None:
    """Defines the schema and the fake (meta) implementation once per process."""
    try:
        torch.ops.dspark_hf.serial_sample  # noqa: B018 - already defined (module reloaded)
        return None
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("dspark_hf", "FRAGMENT")
    lib.define(OP_SCHEMA)

    def fake(base_logits, hidden_states, anchor_ids, markov_w1, markov_w2, gate_weight, gate_bias,
             confidence_weight, confidence_bias, confidence_temperatures, uniforms, temperature=1.0,
             fused_max_rows=FUSED_MAX_ROWS):
        rows, gamma, vocab = base_logits.shape
        tokens = base_logits.new_empty((rows, gamma), dtype=torch.long)
        logits = base_logits.new_empty((rows, gamma, vocab), dtype=torch.float32)
        shape = (rows, gamma) if confidence_weight is not None else (0,)
        return tokens, logits, base_logits.new_empty(shape, dtype=torch.float32)

    torch.library.register_fake(OP_QUALNAME, fake, lib=lib)
    return lib


_LIBRARY = _define_operator()  # kept alive: the registrations last as long as this object
_GRAPHS = GraphCache()  # captured op calls (serial_sample_cuda(graph=True)), per shape and weights


# ----------------------------------------------------------------------------- building
_state: dict = {"loaded": False, "error": None}
_lock = threading.Lock()
_warned: set[str] = set()


def build_problem() -> str | None:
    """Why the op cannot be built here, or None when everything it needs is present."""
    if getattr(torch.version, "hip", None):
        return f"this PyTorch is a ROCm build (HIP {torch.version.hip}); the op is CUDA-only"
    if torch.version.cuda is None:
        return (f"PyTorch {torch.__version__} was built without CUDA; the op needs a CUDA build of PyTorch "
                "and an NVIDIA GPU")
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    nvcc = Path(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not nvcc.exists():
        return (f"no CUDA compiler: nvcc was not found (CUDA_HOME={cuda_home!r}); install the CUDA toolkit "
                f"matching torch.version.cuda={torch.version.cuda} and set CUDA_HOME to its folder")
    return cpp_toolchain_problem("the op")


def load_extension(verbose: bool = False) -> None:
    """Builds (first use) and loads the CUDA op; raises :class:`CudaOpUnavailable` with the reason.

    A failure is remembered for the process, so ``backend="auto"`` does not retry a broken build
    on every call.
    """
    with _lock:
        if _state["loaded"]:
            return
        if _state["error"] is not None:
            raise CudaOpUnavailable(_state["error"])
        problem = build_problem()
        if problem is not None:
            _state["error"] = f"The dspark_hf CUDA serial-sampling op is unavailable: {problem}."
            raise CudaOpUnavailable(_state["error"])
        from torch.utils import cpp_extension

        build_dir = extension_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob(f"{EXTENSION_NAME}*.so")):
            logger.warning(
                f"dspark_hf: compiling the CUDA serial-sampling op (first use only, about a minute) in {build_dir} ..."
            )
        start = time.perf_counter()
        try:
            cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(CSRC_DIR / s) for s in SOURCES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"],
                extra_include_paths=[str(CSRC_DIR)],
                build_directory=str(build_dir),
                verbose=verbose,
                is_python_module=False,
            )
        except Exception as err:  # compiler errors, missing headers, load failures
            _state["error"] = (
                f"Building the dspark_hf CUDA serial-sampling op failed ({type(err).__name__}: {err}). "
                f"Build files are in {build_dir}; rerun dspark_hf.decoding.cuda_ops.load_extension(verbose=True) to see the "
                "compiler output, or use serial_sample(..., backend='reference')."
            )
            raise CudaOpUnavailable(_state["error"]) from err
        _state["loaded"] = True
        logger.info(f"dspark_hf: CUDA serial-sampling op ready ({time.perf_counter() - start:.1f} s).")


def is_loaded() -> bool:
    return bool(_state["loaded"])


# ----------------------------------------------------------------------------- dispatch
def _on_cuda(tensor: torch.Tensor) -> bool:
    """Device test used by :func:`unsupported_reason` (a seam for the CPU dispatch tests)."""
    return tensor.is_cuda


def processor_temperature(logits_processor: LogitsProcessorList | None) -> float | None:
    """The temperature of a processor list the op can apply: 1.0 for none, T for one
    ``TemperatureLogitsWarper``; None when the list holds anything else."""
    processors = list(logits_processor or [])
    if not processors:
        return 1.0
    if len(processors) == 1 and type(processors[0]) is TemperatureLogitsWarper:
        return float(processors[0].temperature)
    return None


def unsupported_reason(
    draft,
    base_logits: torch.Tensor,
    hidden_states: torch.Tensor,
    anchor_ids: torch.Tensor,
    *,
    logits_processor: LogitsProcessorList | None = None,
    uniforms: torch.Tensor | None = None,
) -> str | None:
    """Why the CUDA op cannot run this call (a sentence), or None when it can. Builds nothing.
    (``anchor_ids`` and ``uniforms`` may sit on another device: they are moved, as the reference does.)"""
    markov, confidence = draft.markov_head, draft.confidence_head
    if not _on_cuda(base_logits):
        return f"base_logits are on {base_logits.device}; the op runs on CUDA tensors only"
    if processor_temperature(logits_processor) is None:
        names = ", ".join(type(p).__name__ for p in logits_processor)
        return (f"the logits processors ({names}) go beyond one temperature warper; the op applies only a "
                "temperature (top-k/top-p, penalties and other processors run on the reference path)")
    if markov is not None and markov.head_type not in SUPPORTED_HEADS:
        return (f"the {markov.head_type!r} Markov head runs on the reference path (its recurrent state is not "
                "part of the op; supported heads: vanilla, gated, none)")
    if base_logits.dim() != 3 or hidden_states.dim() != 3 or base_logits.shape[:2] != hidden_states.shape[:2]:
        return (f"base_logits {tuple(base_logits.shape)} and hidden_states {tuple(hidden_states.shape)} must be "
                "(rows, gamma, vocab) and (rows, gamma, hidden)")
    if base_logits.dtype not in SUPPORTED_DTYPES:
        return f"base_logits have dtype {base_logits.dtype}; the op supports float32, bfloat16 and float16"
    tensors = {"hidden_states": hidden_states}
    for name, module in (("markov_head", markov), ("confidence_head", confidence)):
        if module is not None:
            tensors.update({f"{name}.{key}": value for key, value in module.named_parameters()})
    for name, tensor in tensors.items():
        if tensor.dtype != base_logits.dtype:
            return (f"{name} has dtype {tensor.dtype} but base_logits {base_logits.dtype}; the op needs one dtype "
                    "for logits, hidden states and head weights")
        if tensor.device != base_logits.device:
            return f"{name} is on {tensor.device} but base_logits on {base_logits.device}"
    if markov is not None and markov.markov_w1.weight.shape[0] != base_logits.shape[-1]:
        return f"the Markov head's vocabulary {markov.markov_w1.weight.shape[0]} differs from the logits' {base_logits.shape[-1]}"
    if markov is not None and markov.rank > MAX_RANK:
        return f"Markov rank {markov.rank} exceeds the op's limit {MAX_RANK}"
    if base_logits.shape[0] > 65535:
        return f"{base_logits.shape[0]} rows exceed the op's limit of 65535"
    if torch.is_grad_enabled() and any(t.requires_grad for t in [base_logits, *tensors.values()]):
        return ("gradients are being recorded and the op has no backward; call it under torch.no_grad() or "
                "torch.inference_mode()")
    return None


def _run_op(*args):
    """``torch.ops.dspark_hf.serial_sample`` (a seam: the CPU tests put the kernels' emulation here)."""
    return torch.ops.dspark_hf.serial_sample(*args)


def serial_sample_cuda(
    draft,
    base_logits: torch.Tensor,
    hidden_states: torch.Tensor,
    anchor_ids: torch.Tensor,
    *,
    do_sample: bool,
    temperature: float = 1.0,
    uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    fused_max_rows: int | None = None,
    graph: bool | None = None,
) -> SerialSample:
    """Runs the CUDA op on one block (no support checks: see :func:`unsupported_reason`).

    Args mirror :func:`~dspark_hf.decoding.sampling.serial_sample`; ``temperature`` replaces the processor
    list. With ``do_sample`` and no ``uniforms``, they are drawn with ``torch.rand`` from
    ``generator`` (or the default CUDA generator) and returned in the result. ``fused_max_rows``
    (default :data:`FUSED_MAX_ROWS`) picks the fused W2 pass for batches up to that size; 0 forces
    the cuBLAS bias path. ``graph`` replays the op's kernels as one CUDA graph per shape
    (:mod:`dspark_hf.decoding.cuda_graphs`: same kernels, same results, one launch instead of
    ``1 + 2 * gamma``); None (default) reads ``DSPARK_HF_CUDA_GRAPH`` (off unless set to 1).
    """
    load_extension()
    rows, gamma, _ = base_logits.shape
    device = base_logits.device
    markov, confidence = draft.markov_head, draft.confidence_head
    if do_sample and uniforms is not None:
        uniforms = uniforms.to(device=device, dtype=torch.float32)
    elif not do_sample:
        uniforms = None
    gated = markov is not None and markov.head_type == "gated"
    # W2 is vocabulary-wide: a reduced draft vocabulary's is padded with zero rows (its base logits
    # are -inf there), so the kernels need no change
    weights = (
        markov.markov_w1.weight if markov is not None else None,
        cuda_op_markov_w2(draft) if markov is not None else None,
        markov.gate_proj.weight if gated else None,
        markov.gate_proj.bias if gated else None,
        confidence.proj.weight if confidence is not None else None,
        confidence.proj.bias if confidence is not None else None,
        confidence_temperatures(draft, device) if confidence is not None else None,
    )
    settings = (float(temperature), FUSED_MAX_ROWS if fused_max_rows is None else int(fused_max_rows))
    anchor = anchor_ids.reshape(rows).to(device=device, dtype=torch.long)

    def op(U, H, x0, u):
        return _run_op(U, H, x0, *weights, u, *settings)

    if graphs_enabled(graph) and can_capture(device):
        key = (tuple(base_logits.shape), base_logits.dtype, tuple(hidden_states.shape), str(device), do_sample,
               settings, tuple(w.data_ptr() if w is not None else 0 for w in weights))
        example_u = uniforms if uniforms is not None else (
            torch.zeros((rows, gamma), device=device, dtype=torch.float32) if do_sample else None)
        captured = _GRAPHS.get(key, op, (base_logits, hidden_states, anchor, example_u))

        def draw(static):  # same numbers as torch.rand(..., generator=generator)
            static[3].uniform_(0.0, 1.0, generator=generator)

        fill = draw if do_sample and uniforms is None else None
        tokens, logits, confidences = captured.run((base_logits, hidden_states, anchor, uniforms), fill)
        if fill is not None:
            uniforms = captured.static_inputs[3].clone()
    else:
        if do_sample and uniforms is None:
            uniforms = torch.rand((rows, gamma), device=device, dtype=torch.float32, generator=generator)
        tokens, logits, confidences = op(base_logits, hidden_states, anchor, uniforms)
    return SerialSample(
        tokens=tokens, logits=logits, confidences=confidences if confidence is not None else None, uniforms=uniforms
    )


def op_applies(
    draft,
    base_logits: torch.Tensor,
    hidden_states: torch.Tensor,
    anchor_ids: torch.Tensor,
    *,
    logits_processor: LogitsProcessorList | None,
    uniforms: torch.Tensor | None,
    backend: str,
) -> bool:
    """Whether :func:`~dspark_hf.decoding.sampling.serial_sample` runs this call on the op (builds it on first use).

    ``backend="auto"``: True when :func:`unsupported_reason` finds nothing and the extension
    builds (a build failure warns once and falls back); ``DSPARK_HF_CUDA_OP=0`` in the environment
    turns this off. ``backend="cuda"``: True or an error, ``ValueError`` for an unsupported call,
    :class:`CudaOpUnavailable` (a ``RuntimeError``) when the op cannot be built here.
    ``base_logits`` may be a stand-in of the right shape, dtype and device (only those are read).
    """
    if backend == "reference":
        return False
    forced = backend == "cuda"
    if not forced and os.environ.get("DSPARK_HF_CUDA_OP", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    reason = unsupported_reason(
        draft, base_logits, hidden_states, anchor_ids, logits_processor=logits_processor, uniforms=uniforms
    )
    if reason is not None:
        if forced:
            raise ValueError(f"serial_sample(backend='cuda') cannot use the CUDA op: {reason}.")
        return False
    try:
        load_extension()
    except CudaOpUnavailable as err:
        if forced:
            raise
        message = str(err)
        if message not in _warned:
            _warned.add(message)
            logger.warning(f"{message} Falling back to the PyTorch serial-sampling loop.")
        return False
    return True


def _lazy_logits_stand_in(draft, hidden_states: torch.Tensor) -> torch.Tensor:
    """What the LM head would return for ``hidden_states`` (shape, dtype, device), without running
    it: one element, expanded (:func:`unsupported_reason` reads only those)."""
    weight = draft._lm_head().weight
    rows, gamma = hidden_states.shape[:2]
    return torch.empty((), dtype=weight.dtype, device=hidden_states.device).expand(rows, gamma, weight.shape[0])


def dispatch(
    draft,
    base_logits: torch.Tensor | None,
    hidden_states: torch.Tensor,
    anchor_ids: torch.Tensor,
    *,
    do_sample: bool,
    logits_processor: LogitsProcessorList | None,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None,
    backend: str,
    admission: Callable[[float], bool] | None = None,
    num_positions: int | None = None,
) -> SerialSample | None:
    """The op's result for :func:`~dspark_hf.decoding.sampling.serial_sample`, or None to run the reference
    loop (see :func:`op_applies` for when).

    Without ``admission`` the op draws the whole block. With ``admission`` (one request, decided by
    the verify policy's incremental ``offer``) the reference loop's economy is kept, see
    :func:`_draw_admitted`; ``base_logits`` may then be ``None`` (the LM head runs only once a
    first position is admitted) and ``num_positions`` caps the positions offered.
    """
    stand_in = base_logits if base_logits is not None else _lazy_logits_stand_in(draft, hidden_states)
    if not op_applies(draft, stand_in, hidden_states, anchor_ids, logits_processor=logits_processor,
                      uniforms=uniforms, backend=backend):
        return None
    temperature = processor_temperature(logits_processor)
    if admission is None:
        return serial_sample_cuda(draft, base_logits, hidden_states, anchor_ids, do_sample=do_sample,
                                  temperature=temperature, uniforms=uniforms, generator=generator)
    num_positions = hidden_states.shape[1] if num_positions is None else num_positions
    return _draw_admitted(draft, base_logits, hidden_states, anchor_ids, do_sample=do_sample, temperature=temperature,
                          generator=generator, uniforms=uniforms, admission=admission, num_positions=num_positions,
                          vocab_size=stand_in.shape[-1])


def _draw_admitted(draft, base_logits: torch.Tensor | None, hidden_states: torch.Tensor, anchor_ids: torch.Tensor, *,
                   do_sample: bool, temperature: float, generator: torch.Generator | None,
                   uniforms: torch.Tensor | None, admission: Callable[[float], bool], num_positions: int,
                   vocab_size: int) -> SerialSample:
    """The op path for one request decided by the verify policy's ``admission``.

    ``c_1`` (a dot product over the hidden state and the anchor's Markov feature) is computed and
    offered before anything vocabulary-sized runs, so a round that verifies nothing runs neither
    the LM head (``base_logits=None``: computed lazily) nor the op. Once ``c_1`` is admitted, the LM
    head runs on the ``num_positions`` positions of the length budget, the op draws them in one
    call, and its ``c_2, c_3, ...`` are offered in order up to the first refusal. Lossless like the
    reference: admitting position ``k`` depends on ``c_1..c_k`` only, each known before ``x_k`` is
    drawn; positions drawn past the refusal are discarded, and with them their uniforms.
    """
    device = hidden_states.device
    has_confidence = draft.confidence_head is not None
    anchor = anchor_ids.reshape(1).to(device)
    offered: list[float] = []
    keep, result, lm_head_seconds = 0, None, 0.0
    if num_positions > 0:
        temperatures = confidence_temperatures(draft, device) if has_confidence else None
        offered.append(position_confidence(draft, hidden_states, 0, anchor, temperatures))
    if offered and admission(offered[0]):
        if base_logits is None:
            start = time.perf_counter()
            base_logits = draft.base_logits(hidden_states[:, :num_positions])
            lm_head_seconds = time.perf_counter() - start
        result = serial_sample_cuda(
            draft, base_logits[:, :num_positions], hidden_states[:, :num_positions], anchor, do_sample=do_sample,
            temperature=temperature, uniforms=uniforms[:, :num_positions] if uniforms is not None else None,
            generator=generator,
        )
        later = result.confidences[0, 1:].tolist() if has_confidence else [1.0] * (num_positions - 1)
        # The op's confidences are not checked: a NaN is offered as it is and refused.
        keep = 1 + offer_until_refused(admission, later, validate=False, offered=offered)
    if result is None:
        return admitted_sample(None, None, offered, has_confidence=has_confidence, uniforms=uniforms,
                               lm_head_seconds=lm_head_seconds, vocab_size=vocab_size, device=device)
    # The same fields as the reference loop's (offered included: it carries a refused NaN to the warning).
    return admitted_sample(result.tokens[:, :keep], result.logits[:, :keep], offered, has_confidence=has_confidence,
                           uniforms=result.uniforms, lm_head_seconds=lm_head_seconds, vocab_size=vocab_size,
                           device=device)


__all__ = [
    "CudaOpUnavailable",
    "FUSED_MAX_ROWS",
    "OP_QUALNAME",
    "build_problem",
    "dispatch",
    "extension_dir",
    "is_loaded",
    "load_extension",
    "op_applies",
    "processor_temperature",
    "serial_sample_cuda",
    "unsupported_reason",
]
