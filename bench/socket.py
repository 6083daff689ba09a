"""Messages/s through the real server vs a bare trio server: ``python bench/socket.py``.

The benchmark lives in ``wire_bench.py``; this file only launches it. It has to stay tiny:
its name shadows the standard ``socket`` module for every script run from ``bench/`` (that
directory comes first on ``sys.path``), so when it is imported as ``socket`` it replaces
itself with the real module and does nothing else.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "socket":
    import importlib

    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    del sys.modules["socket"]
    sys.modules["socket"] = importlib.import_module("socket")
elif __name__ == "__main__":
    import runpy

    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    runpy.run_path(os.path.join(_HERE, "wire_bench.py"), run_name="__main__")
