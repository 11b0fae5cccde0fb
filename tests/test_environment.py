"""What the machine is and has, as the shared helpers read it (dspark_hf.machine, dspark_hf.build_tools: used by
the core and the CPU engine), and the benchmark environment record that names the CPU and the instruction sets
its kernels can use."""

from dspark_hf.benchmarks.environment import ISA_FLAGS, capture_environment, describe_environment
from dspark_hf.machine import cpu_isa_flags, transparent_huge_pages_mode


def test_isa_flags_are_read_from_cpuinfo_in_a_fixed_order(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: fpu sse amx_bf16 avx2 avx512f avx512_bf16 amx_tile xyz\n")
    assert cpu_isa_flags(str(cpuinfo)) == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert cpu_isa_flags(str(tmp_path / "missing")) is None


def test_the_huge_page_mode_is_the_bracketed_word_of_its_setting(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert transparent_huge_pages_mode(setting) == "madvise"
    setting.write_text("always madvise never\n")
    assert transparent_huge_pages_mode(setting) is None
    assert transparent_huge_pages_mode(tmp_path / "absent") is None


def test_environment_records_cpu_flags_and_describes_them():
    env = capture_environment()
    assert "cpu_isa_flags" in env and "torch_cpu_capability" in env
    assert env["transparent_huge_pages"] in (None, "always", "madvise", "never")
    if env["cpu_isa_flags"] is not None:
        assert set(env["cpu_isa_flags"]) <= set(ISA_FLAGS)
    env = {**env, "cpu_model": "Test CPU", "cpu_isa_flags": ["avx2", "amx_bf16"]}
    assert "Test CPU [avx2 amx_bf16]" in describe_environment(env)


def test_the_multiply_add_rate_is_a_plausible_throughput(monkeypatch):
    from dspark_hf.benchmarks import environment

    rate = environment.multiply_add_rate(size=64, calls=5)
    assert 0.01 < rate < 1e5  # GFLOP/s: a CPU of this era, neither a unit slip nor a zero time
    clock = iter([0.0, 0.5] * 3)
    monkeypatch.setattr(environment.time, "perf_counter", lambda: next(clock))
    assert environment.multiply_add_rate(size=10, calls=5) == 2 * 10**3 * 5 / 0.5 / 1e9  # flops over the best batch


def test_a_missing_toolchain_is_named(monkeypatch):
    from torch.utils import cpp_extension

    from dspark_hf.build_tools import cpp_toolchain_problem

    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert "no C++ compiler: 'no-such-compiler-xyz'" in cpp_toolchain_problem("the kernel")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    assert "ninja is not installed (pip install ninja)" in cpp_toolchain_problem("the kernel")
    assert "to build the kernel" in cpp_toolchain_problem("the kernel")
