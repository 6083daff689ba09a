"""Echo over HTTP keep-alive vs over the TCP socket, same server, same run:
``python bench/http.py``.

The benchmark lives in ``http_bench.py``; this file only launches it. It has to stay tiny:
its name shadows the standard ``http`` package for every script run from ``bench/`` (that
directory comes first on ``sys.path``), so when it is imported as ``http`` it replaces
itself with the real package and does nothing else.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "http":
    import importlib

    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    del sys.modules["http"]
    sys.modules["http"] = importlib.import_module("http")
elif __name__ == "__main__":
    import runpy

    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    runpy.run_path(os.path.join(_HERE, "http_bench.py"), run_name="__main__")
