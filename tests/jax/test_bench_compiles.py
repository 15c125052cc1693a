"""``kmgpu bench``'s JAX workers record what the persistent compilation cache did in each
run: programs loaded and compiled, and why an entry was not written or not read (JAX
only says so in a log line or a warning, which the worker otherwise hides). In a process
of its own: the cache is switched on before a process's first compile or never."""

import json
import subprocess
import sys

from tests.common.test_bench import ROOT, _clean_env

CODE = r"""
import json, tempfile, warnings
from kmgpu.bench import compile_log

warnings.filterwarnings("ignore")  # as the worker: the cache's own warnings still shown
compile_log.share_compiled_code(tempfile.mkdtemp())
import jax, jax.numpy as jnp
from jax._src import compilation_cache

x = jnp.ones(3)
compile_log.LOG.take()
takes = []
jax.jit(lambda v: v * 2)(x)
takes.append(compile_log.LOG.take())
jax.jit(lambda v: v * 2)(x)  # another function object, the same program
takes.append(compile_log.LOG.take())


@jax.jit
def printing(v):
    jax.debug.print("{}", v.sum())
    return v + 1


printing(x)
takes.append(compile_log.LOG.take())


def broken(*args, **kwargs):
    raise OSError("disk full")


compilation_cache.put_executable_and_time = broken
jax.jit(lambda v: v - 5)(x)
takes.append(compile_log.LOG.take())
print("TAKES " + json.dumps(takes))
"""


def test_the_cache_s_hits_misses_and_trouble_per_run():
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env=_clean_env(KERAS_BACKEND="jax", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("TAKES "))
    first, again, printing, broken = json.loads(line[len("TAKES "):])
    assert first["cache_misses"] == 1 and first["cache_hits"] == 0
    assert first["cache_trouble"] == []
    assert again["cache_hits"] == 1 and again["cache_misses"] == 0
    assert printing["cache_misses"] == 1
    assert printing["cache_trouble"] == [
        "Not writing persistent cache entry for 'jit_printing' because it uses host "
        "callbacks (e.g. from jax.debug.print or breakpoint)"]
    assert broken["cache_misses"] == 1
    assert broken["cache_trouble"] == [
        "Error writing persistent compilation cache entry for 'jit__lambda': "
        "OSError: disk full"]
    assert "Error writing persistent compilation cache entry" in proc.stderr
