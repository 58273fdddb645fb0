"""The GPU smoke kit's install step as it meets a bare GPU machine (Python 3.12, no network): the carried wheels
install with ``--no-index`` — megatron-core from its sdist, its C++ helper built for 3.12 by the machine's own
pybind11 with ``--no-build-isolation`` — and the peer's accelerate/peft are the carried ones, not the machine's
(built for transformers 5, they would be imported in front of the carried transformers 4.48). Run on an H100 on
2026-11-26 the same step worked; this keeps it working on CPU."""

from __future__ import annotations

import json
import subprocess

import pytest

from nemo_factuality.testing.paths import REPO_ROOT

pytestmark = pytest.mark.slow


def _pins() -> dict[str, str]:
    lines = (REPO_ROOT / "requirements" / "gpu_smoke.txt").read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    return {name.split("[")[0].lower().replace("_", "-"): version for name, version in (p.split("==") for p in pins)}


@pytest.fixture(scope="module")
def carried(tmp_path_factory):
    res = subprocess.run(["bash", "tools/setup_gpu_smoke_wheels.sh"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=600)
    if res.returncode == 3:
        pytest.skip(res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr[-3000:]
    wheels, venv = res.stdout.split()[-2:]
    site = tmp_path_factory.mktemp("smoke_site")
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(site), "NF_SMOKE_WHEELS": wheels, "NF_SMOKE_SITE": str(site),
           "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run(["bash", "tools/gpu_smoke.sh", "--install-only"], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]
    return venv, site


def test_every_carried_pin_installs_offline_at_its_version(carried):
    venv, site = carried
    code = ("import importlib.metadata as m, json, sys; sys.path.insert(0, sys.argv[1]); "
            "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version "
            "for d in m.distributions(path=[sys.argv[1]])}))")
    out = subprocess.run([f"{venv}/bin/python", "-c", code, str(site)], capture_output=True, text=True, check=True)
    installed = json.loads(out.stdout)
    assert {k: installed.get(k) for k in _pins()} == _pins()


def test_megatron_core_helper_is_built_for_the_machines_python(carried):
    _, site = carried
    helpers = list((site / "megatron" / "core" / "datasets").glob("helpers_cpp.cpython-312-*.so"))
    assert helpers, sorted(p.name for p in (site / "megatron" / "core" / "datasets").iterdir())


def test_the_peer_imports_the_carried_accelerate_and_peft_first(carried):
    venv, site = carried
    code = "import accelerate, peft, transformers; print(accelerate.__version__, peft.__version__, transformers.__version__)"
    out = subprocess.run([f"{venv}/bin/python", "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    # importing peft needs torch, which this CPU venv lacks (the GPU machine has it): the versions are read instead
    versions = out.stdout.split() if out.returncode == 0 else None
    pins = _pins()
    if versions is None:
        assert "torch" in out.stderr, out.stderr[-2000:]
        for name in ("accelerate", "peft", "transformers"):
            init = (site / name / "__init__.py").read_text()
            assert f'__version__ = "{pins[name]}"' in init, name
    else:
        assert versions == [pins["accelerate"], pins["peft"], pins["transformers"]]
