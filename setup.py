"""The one compiled part: index/_amxscan.c, the fused int8 MaxSim scans on AMX tiles, on
AVX-512 VNNI and on AVX2 (index/amxscan.py). An extension module with an empty Python module (index/amxscan.py loads
its file with ctypes); it needs a C compiler and Python's headers. Optional:
where no C compiler is found the install goes on without it and AMX / VNNI / AVX2 CPUs take the library
kernels, as CPUs without them do."""

import platform

from setuptools import Extension, setup

ext_modules = []
if platform.machine().lower() in ("x86_64", "amd64") and platform.system() == "Linux":
    # no -m flags for the whole file: the AMX / AVX-512 / AVX2 code is confined to functions with a
    # target attribute, so importing the module is safe on every x86-64 CPU
    ext_modules.append(Extension("embedpool.index._amxscan", ["index/_amxscan.c"],
                                 extra_compile_args=["-O2", "-std=gnu11"], optional=True))

setup(ext_modules=ext_modules)
