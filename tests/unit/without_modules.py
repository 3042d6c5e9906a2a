"""Run Python with some top-level packages made unimportable, as on a machine that lacks them:

    python tests/unit/without_modules.py ray,vllm -m pytest ...     (or: ... ray,vllm -c "code")

An import of a listed package (or any of its submodules) raises ModuleNotFoundError, as it would there; everything
else imports as usual. test_gpu_check_script.py runs the prepared GPU check's import and fixture paths this way."""

from __future__ import annotations

import importlib.abc
import runpy
import sys


class _Absent(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] not in ("-m", "-c"):
        raise SystemExit("usage: without_modules.py NAME[,NAME...] (-m MODULE [ARGS...] | -c CODE)")
    names = {n for n in argv[0].split(",") if n}
    for n in names:
        sys.modules.pop(n, None)
    sys.meta_path.insert(0, _Absent(names))
    if argv[1] == "-c":
        sys.argv = ["-c", *argv[3:]]
        exec(compile(argv[2], "<without_modules -c>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
