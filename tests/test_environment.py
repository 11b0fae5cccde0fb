"""The benchmark environment record names the CPU and the instruction sets its kernels can use."""

from dspark_hf.benchmarks.environment import ISA_FLAGS, capture_environment, describe_environment
from dspark_hf.kernels.cpu_identity import cpu_isa_flags


def test_isa_flags_are_read_from_cpuinfo_in_a_fixed_order(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: fpu sse amx_bf16 avx2 avx512f avx512_bf16 amx_tile xyz\n")
    assert cpu_isa_flags(str(cpuinfo)) == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert cpu_isa_flags(str(tmp_path / "missing")) is None


def test_environment_records_cpu_flags_and_describes_them():
    env = capture_environment()
    assert "cpu_isa_flags" in env and "torch_cpu_capability" in env
    if env["cpu_isa_flags"] is not None:
        assert set(env["cpu_isa_flags"]) <= set(ISA_FLAGS)
    env = {**env, "cpu_model": "Test CPU", "cpu_isa_flags": ["avx2", "amx_bf16"]}
    assert "Test CPU [avx2 amx_bf16]" in describe_environment(env)
