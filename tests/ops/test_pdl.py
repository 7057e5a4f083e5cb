"""The PDL rule of the Triton backend (shoal/ops/triton/pdl.py), checked on the source: every
kernel (a function that reads `tl.program_id`) waits for its producers before anything else,
and every kernel launch passes `**PDL_LAUNCH`. A PDL launch of a kernel that read its inputs
before `pdl_wait()` would race with the kernel writing them, so this cannot be left to review.
"""

from __future__ import annotations

import ast
import pathlib

import shoal.ops.triton as backend

MODULES = sorted(pathlib.Path(backend.__file__).parent.glob("*.py"))


def _kernels_and_launches(tree: ast.Module):
    kernels, launches = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and "tl.program_id" in ast.unparse(node):
            kernels.append(node)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and not isinstance(node.func.slice, ast.Constant)):  # kernel[grid](...)
            launches.append(node)
    return kernels, launches


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
           and isinstance(body[0].value.value, str))
    return body[1] if doc else body[0]


def test_every_kernel_waits_first_and_every_launch_is_pdl() -> None:
    seen_kernels = seen_launches = 0
    for path in MODULES:
        if path.name in ("pdl.py", "aot.py"):
            continue
        kernels, launches = _kernels_and_launches(ast.parse(path.read_text()))
        for fn in kernels:
            first = _first_statement(fn)
            assert ast.unparse(first) == "pdl_wait()", (
                f"{path.name}:{fn.lineno} {fn.name}: the first statement must be pdl_wait()")
        for call in launches:
            pdl = [kw for kw in call.keywords
                   if kw.arg is None and ast.unparse(kw.value) == "PDL_LAUNCH"]
            assert pdl, f"{path.name}:{call.lineno}: launch without **PDL_LAUNCH"
        seen_kernels += len(kernels)
        seen_launches += len(launches)
    assert seen_kernels >= 39 and seen_launches >= 40, (seen_kernels, seen_launches)


def test_pdl_is_off_under_the_interpreter(monkeypatch) -> None:
    """The interpreter runs no inline PTX: the module turns PDL off there (and with
    SHOAL_PDL=0), and a launch then passes no PDL option."""
    import importlib

    from shoal.ops.triton import pdl

    try:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert importlib.reload(pdl).PDL_LAUNCH == {}
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setenv("SHOAL_PDL", "0")
        assert importlib.reload(pdl).PDL_LAUNCH == {}
        monkeypatch.setenv("SHOAL_PDL", "1")
        assert importlib.reload(pdl).PDL_LAUNCH == {"launch_pdl": True}
    finally:
        monkeypatch.undo()
        importlib.reload(pdl)
