"""vLLM's CPU runtime (tcmalloc preloaded): when the command line re-executes itself, with what
LD_PRELOAD, and that a process started with it runs with the library."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bubblespec.cpu_runtime import (
    LIBRARIES,
    PRELOAD_ENV,
    preload_value,
    runtime_libraries,
)

LIBS = [Path("/venv/lib/libtcmalloc_minimal.so.4"), Path("/venv/lib/libother.so")]


def test_preload_adds_what_is_missing_and_keeps_what_is_there():
    assert preload_value({}, LIBS, cpu_build=True) == ":".join(map(str, LIBS))
    assert preload_value({"LD_PRELOAD": "/x/libfoo.so"}, LIBS, cpu_build=True) == \
        ":".join(["/x/libfoo.so", *map(str, LIBS)])
    # already preloaded (from anywhere): nothing to do, so a re-executed process stops there
    assert preload_value({"LD_PRELOAD": "/a/libtcmalloc_minimal.so.4:/b/libother.so"}, LIBS,
                         cpu_build=True) is None
    assert preload_value({"LD_PRELOAD": "/a/libother.so"}, LIBS, cpu_build=True) == \
        f"/a/libother.so:{LIBS[0]}"


def test_switched_off_or_not_the_cpu_build_or_no_libraries():
    assert preload_value({PRELOAD_ENV: "0"}, LIBS, cpu_build=True) is None
    assert preload_value({}, LIBS, cpu_build=False) is None
    assert preload_value({}, [], cpu_build=True) is None


@pytest.mark.slow
def test_a_process_started_with_the_runtime_maps_its_libraries():
    libraries = runtime_libraries()
    if len(libraries) != len(LIBRARIES):
        pytest.skip(f"this .venv has {[p.name for p in libraries]} of {LIBRARIES} (make setup)")
    value = preload_value({}, libraries, cpu_build=True)
    probe = "import torch; print(open('/proc/self/maps').read())"
    maps = subprocess.run([sys.executable, "-c", probe],
                          env={"LD_PRELOAD": value, "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, check=True).stdout
    assert all(name in maps for name in LIBRARIES)
