"""py-cpuinfo's answer kept per CPU (snip_ds.runtime.cpuinfo_cache): asked once per CPU, never another CPU's, and the
flags DeepSpeed's CPU builders derive from it unchanged (else every cached op build would be redone)."""
import json
import subprocess
import sys

from snip_ds.runtime import cpuinfo_cache


def _core(n: int, mhz: str) -> str:
    """One core's block of /proc/cpuinfo on a 2-core AMD EPYC."""
    return (f"processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel name\t: AMD EPYC\n"
            f"cpu MHz\t\t: {mhz}\nflags\t\t: fpu sse sse2 avx avx2\nbogomips\t: 4890.81\n")


EPYC = _core(0, "2445.406") + "\n" + _core(1, "2399.998")


class Probe:
    """A stand-in for py-cpuinfo's get_cpu_info that counts its calls."""

    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def __call__(self):
        self.calls += 1
        return json.loads(json.dumps(self.answer))


def test_the_key_names_the_cpu_not_its_clock_or_core_numbering():
    key = cpuinfo_cache.cpu_key(EPYC, "9.0.0")
    assert key == cpuinfo_cache.cpu_key(EPYC.replace("2445.406", "3100.000").replace("4890.81", "4800.00"), "9.0.0")
    assert key == cpuinfo_cache.cpu_key(EPYC.split("\n\n")[0], "9.0.0")  # one core or two: the same CPU
    assert key != cpuinfo_cache.cpu_key(EPYC.replace("avx2", "avx2 avx512f"), "9.0.0")
    assert key != cpuinfo_cache.cpu_key(EPYC.replace("AMD EPYC", "AMD EPYC 9654"), "9.0.0")
    assert key != cpuinfo_cache.cpu_key(EPYC, "9.0.1")
    assert cpuinfo_cache.cpu_key("MemTotal: 1 kB\n", "9.0.0") is None


def test_asked_once_per_cpu_and_process_and_the_file_serves_the_next_process(tmp_path):
    proc = tmp_path / "cpuinfo"
    proc.write_text(EPYC)
    answer = {"arch": "X86_64", "flags": ["avx", "avx2"], "brand_raw": "AMD EPYC"}
    first = Probe(answer)
    get = cpuinfo_cache.cached(first, tmp_path / "root", "9.0.0", proc)
    got = get()
    assert got == answer and get() == answer and first.calls == 1
    got["flags"].append("mutated")  # a caller's change does not reach the next caller
    assert get() == answer
    (saved,) = (tmp_path / "root" / cpuinfo_cache.CACHE_DIR).iterdir()
    assert json.loads(saved.read_text()) == answer
    later = Probe({"arch": "never asked"})  # the next process on this CPU
    assert cpuinfo_cache.cached(later, tmp_path / "root", "9.0.0", proc)() == answer and later.calls == 0
    # another CPU sharing the root (a home directory shared by nodes): asked, kept beside the first
    proc.write_text(EPYC.replace("avx2", "avx2 avx512f"))
    other = Probe({"arch": "X86_64", "flags": ["avx512f"]})
    assert cpuinfo_cache.cached(other, tmp_path / "root", "9.0.0", proc)() == other.answer and other.calls == 1
    assert len(list((tmp_path / "root" / cpuinfo_cache.CACHE_DIR).iterdir())) == 2


def test_a_damaged_file_is_asked_again_and_a_failed_probe_is_not_kept(tmp_path):
    proc = tmp_path / "cpuinfo"
    proc.write_text(EPYC)
    folder = tmp_path / "root" / cpuinfo_cache.CACHE_DIR
    folder.mkdir(parents=True)
    path = folder / f"{cpuinfo_cache.cpu_key(EPYC, '9.0.0')}.json"
    for damaged in ('{"arch": "X86', "[]", "{}"):
        path.write_text(damaged)
        probe = Probe({"arch": "X86_64"})
        assert cpuinfo_cache.cached(probe, tmp_path / "root", "9.0.0", proc)() == {"arch": "X86_64"}
        assert probe.calls == 1 and json.loads(path.read_text()) == {"arch": "X86_64"}
    path.unlink()
    failed = Probe({})  # py-cpuinfo's answer when its probe process fails
    get = cpuinfo_cache.cached(failed, tmp_path / "root", "9.0.0", proc)
    assert get() == {} and get() == {} and failed.calls == 2 and not path.exists()


def test_without_proc_cpuinfo_only_this_process_keeps_the_answer(tmp_path):
    probe = Probe({"arch": "ARM_8"})
    get = cpuinfo_cache.cached(probe, tmp_path / "root", "9.0.0", tmp_path / "missing")
    assert get() == get() == {"arch": "ARM_8"} and probe.calls == 1
    assert not (tmp_path / "root").exists()


def test_deepspeeds_cpu_build_flags_are_the_same_with_the_kept_answer(tmp_path):
    """DeepSpeed's fused_adam builder computes the same compiler flags from the kept answer as from py-cpuinfo's
    own: in one fresh process from py-cpuinfo (which it then asks once more through the cache, keeping the
    answer), in the next from the kept file alone."""
    script = ("import sys, json\n"
              "from pathlib import Path\n"
              "from deepspeed.ops.op_builder.cpu import FusedAdamBuilder\n"
              "from snip_ds.runtime import cpuinfo_cache\n"
              "flags = []\n"
              "if sys.argv[1] == 'first': flags.append(FusedAdamBuilder().cxx_args())\n"
              "cpuinfo_cache.install(Path(sys.argv[2]))\n"
              "flags.append(FusedAdamBuilder().cxx_args())\n"
              "print(json.dumps(flags))\n")
    first, later = (json.loads(subprocess.run([sys.executable, "-c", script, mode, str(tmp_path)], capture_output=True,
                                              text=True, check=True).stdout.splitlines()[-1])
                    for mode in ("first", "later"))
    assert first[0] == first[1] == later[0]
    assert any("-D__AVX" in f or "-D__SCALAR__" in f or "-D__NEON__" in f or "-D__SVE__" in f for f in first[0])
    assert list((tmp_path / cpuinfo_cache.CACHE_DIR).iterdir())


def test_install_wraps_once_and_follows_the_build_root(tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("cpuinfo")
    fake.CPUINFO_VERSION = (9, 0, 0)
    fake.get_cpu_info = probe = Probe({"arch": "X86_64"})
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    assert cpuinfo_cache.install(tmp_path / "a")
    wrapper = fake.get_cpu_info
    assert cpuinfo_cache.install(tmp_path / "a") and fake.get_cpu_info is wrapper
    assert cpuinfo_cache.install(tmp_path / "b")  # $TORCH_EXTENSIONS_DIR changed: the new root, not a wrapper's wrapper
    assert fake.get_cpu_info.__wrapped__ is probe and fake.get_cpu_info.snip_ds_root == tmp_path / "b"
    monkeypatch.setitem(sys.modules, "cpuinfo", None)  # py-cpuinfo not installed
    assert cpuinfo_cache.install(tmp_path / "c") is False
